"""``python -m jaxdist.export``: a run's newest good checkpoint's parameters as safetensors.

The checkpoint is read on this host's CPU (any layout and process count it was saved
from: a checkpoint names its arrays, a stack's layers one by one), verified as a resume
verifies it, and its parameters and batch statistics are renamed and reshaped by the
weight map read backwards. The map's ``config_json``, filled from the run's settings,
is written beside them: with the shipped ``gpt2`` map the folder is one that
``transformers.GPT2LMHeadModel.from_pretrained`` loads; with ``llama``, ``qwen2``,
``qwen3`` or ``mistral`` (a ``--model llama`` run) one that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. A map's ``requires`` that
the run's settings break (a Qwen2 export of a model without q, k, v biases) is refused
before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.weights import files, rearrange
from jaxdist.weights.weight_map import WeightMap, check_requires, fill_config, resolve

KINDS = ("params", "batch_stats")  # what the file carries of the state


@dataclass
class Exported:
    step: int
    files: list[Path]
    tensors: int
    bytes: int


def export_run(
    run_dir: Path, out: Path, weight_map: WeightMap, settings: Callable[[dict], dict], *,
    step: int | None = None, max_shard_bytes: int = 5 * 10**9,
) -> Exported:  # fmt: skip
    """Writes ``out`` (a new or empty folder) from ``run_dir``'s checkpoint ``step``
    (default: the newest that passes its fingerprints). ``settings(meta)``: the model
    settings the map may name, from the checkpoint's record of its run."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; name a new one")
    found, arrays, meta = read_checkpoint(Path(run_dir), step)
    names = settings(meta)
    check_requires(weight_map, names, "the run's model")
    tensors = {}
    for full, array in arrays.items():
        kind, _, name = full.partition("/")
        if kind in KINDS:
            for source, value in to_source(name, np.asarray(array), weight_map, names):
                if source in tensors:
                    raise ConfigError(f"{weight_map.name}: two parameters write {source}")
                tensors[source] = value
    extra = {}
    if weight_map.config_json:
        config = fill_config(weight_map.config_json, names)
        extra["config.json"] = json.dumps(config, indent=2) + "\n"
    written = files.write(tensors, Path(out), max_shard_bytes, extra)
    total = sum(t.nbytes for t in tensors.values())
    return Exported(found, written, len(tensors), total)


def to_source(name: str, array: np.ndarray, weight_map: WeightMap, names: dict):
    """A parameter's (name, array) pairs in the file's form, by the first rule that names
    it: one pair, or under ``stack`` one per slice of axis 0 (an (E, D, F) parameter:
    E tensors)."""
    for rule in weight_map.rules:
        if rule.source_name(name, 0) is None:
            continue
        if rule.stack:
            return [(rule.source_name(name, j), _to_file(rule, name, a, names))
                    for j, a in enumerate(array)]  # fmt: skip
        return [(rule.source_name(name), _to_file(rule, name, array, names))]
    raise ConfigError(f"{weight_map.name}: no rule names the parameter {name}")


def _to_file(rule, name: str, array: np.ndarray, names: dict) -> np.ndarray:
    """One tensor in the file's layout: the rule's rearrange read backwards."""
    if rule.groups:
        sizes = {k: resolve(v, names, f"{rule.model} sizes") for k, v in rule.sizes.items()}
        right, left = rule.groups[1], rule.groups[0]
        return rearrange.apply(array, right, left, sizes, f"{name} ({rule.rearrange})")
    if rule.pad_rows is not None:  # the model's padding rows are not the file's
        return array[: resolve(rule.pad_rows, names, f"{rule.model} pad_rows")]
    return array


def read_checkpoint(run_dir: Path, step: int | None = None) -> tuple[int, dict, dict]:
    """(step, {name: array}, meta) of ``run_dir``'s checkpoint ``step`` (default: the
    newest that passes its fingerprints), read onto this host's first CPU device, every
    array by its checkpoint name (``params/blocks/0/q/kernel``); ConfigError for a folder
    without checkpoints or without that step."""
    import jax

    from jaxdist.checkpoint import Checkpointer, run_directory

    directory = run_dir / run_directory.CHECKPOINTS
    if not directory.is_dir():
        raise ConfigError(f"{run_dir}: no checkpoints folder; is it a run directory?")
    reader = Checkpointer(directory)
    try:
        steps = reader.steps()
        if not steps or (step is not None and step not in steps):
            held = ", ".join(map(str, steps)) or "none"
            which = "no checkpoint" if step is None else f"no checkpoint of step {step}"
            raise ConfigError(f"{directory}: {which} (held: {held})")
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        tree = reader.read_meta(step or steps[0])["tree"]
        target = {
            name: jax.ShapeDtypeStruct(tuple(shape), _dtype(dtype), sharding=cpu)
            for name, (shape, dtype) in tree.items()
        }
        return reader.restore(target, step)
    finally:
        reader.close()


def _dtype(name: str):
    import jax

    if name.startswith("key<"):  # a typed PRNG key array (the RNG state): "key<fry>"
        for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
            dtype = jax.random.key(0, impl=impl).dtype
            if str(dtype) == name:
                return dtype
        raise ConfigError(f"a checkpoint array of dtype {name}, which this JAX does not make")
    return np.dtype(name)
