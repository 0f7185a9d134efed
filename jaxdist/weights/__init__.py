"""Weights in and out: safetensors files, renamed and reshaped by a weight map.

``--init-from PATH [--init-map MAP]`` starts a run from another trainer's weights
(``from_file.init_params``: each process reads only the regions its devices hold);
``python -m jaxdist.export RUN_DIR --out DIR [--map MAP]`` writes a run's newest good
checkpoint's parameters as safetensors (``export.export_run``), the map read backwards;
``read_checkpoint`` reads a run's checkpoint by name onto the CPU (``jaxdist.evaluate``).
``weight_map`` is the map (its docstring and ``maps/gpt2.yaml``: the format),
``rearrange`` the axis patterns, ``files`` the safetensors reader and writer,
``maps.hf_llama`` Hugging Face's config.json for the Llama family's maps.
"""

from jaxdist.weights.export import Exported, export_run, read_checkpoint
from jaxdist.weights.files import Reader, write
from jaxdist.weights.from_file import init_params, plan
from jaxdist.weights.weight_map import IDENTITY, Rule, WeightMap, load

__all__ = [
    "IDENTITY", "Exported", "Reader", "Rule", "WeightMap", "export_run", "init_params", "load",
    "plan", "read_checkpoint", "write",
]  # fmt: skip
