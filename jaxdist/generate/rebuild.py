"""The model ``python -m jaxdist.generate SOURCE`` generates with, rebuilt from where it
lives, with its context and its tokenizer. The command's side: it reads the trainer's
config and model registry (the library, ``jaxdist.generate.generator``, does not).

- A run directory (``checkpoints/`` in it): its newest good checkpoint (or ``--step``'s),
  read on the host and verified as ``python -m jaxdist.export`` reads it; the model built
  by the trainer's ``--model`` registry from the config the checkpoint recorded (its
  sizes, dtype, ``--scan-layers`` and Llama flags as trained, the vocabulary its data
  gave); the context is its ``--seq-len``. The tokenizer: the one its token file's
  sidecar records, else UTF-8 bytes for a vocabulary of 257 (the built-in data).
- A Hugging Face folder (``config.json`` and safetensors): ``gpt2`` with the GPT's sizes
  read from config.json, ``llama``, ``qwen2``, ``qwen3`` and ``mistral`` as
  ``--model-from-config`` reads them, each through its shipped map as ``--init-from``
  reads it (the same checks of config.json); the context is its ``n_positions`` or
  ``max_position_embeddings``; the tokenizer its ``tokenizer.json``, where it has one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxdist.checkpoint.run_directory import CHECKPOINTS
from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.data.text import BYTE_VOCAB, EOT
from jaxdist.errors import ConfigError, JaxdistError
from jaxdist.generate.generator import NEEDS
from jaxdist.parallel.layout import path_name
from jaxdist.parallel.saved_state import per_layer_names
from jaxdist.train import config as config_lib
from jaxdist.train.build_model import model_factory
from jaxdist.train.resume import model_settings
from jaxdist.weights import from_file, weight_map
from jaxdist.weights.export import read_checkpoint
from jaxdist.weights.files import Reader
from jaxdist.weights.maps import hf_llama

HF_FAMILIES = ("gpt2", *hf_llama.FAMILIES)
# transformers' GPT2Config defaults, for keys a config.json leaves out
GPT2_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
                 "n_head": 12, "layer_norm_epsilon": 1e-5, "n_inner": None}  # fmt: skip


@dataclasses.dataclass
class Rebuilt:
    model: nnx.Module
    what: str  # "gpt (2 layers, d_model 64) from runs/x, step 20": said before generating
    context: int | None  # the longest sequence it reads (prompt + new tokens)
    tokenizer: object | None  # encode(text) -> ids, decode(ids) -> text, eos_id
    notes: list[str] = dataclasses.field(default_factory=list)  # said before generating


# generation reads each prompt as one sequence: a model trained with --document-mask
# meets here what its training never showed it, attention across an EOS
DOCUMENTS = (
    "the run trained with --document-mask; generation does not mask documents: each "
    "prompt is one sequence, attending across any EOS ({eos}) inside it"
)


class ByteTokenizer:
    """The built-in data's ids: UTF-8 bytes 0..255, ``EOT`` (256) ending a document."""

    eos_id = EOT
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:  # EOT is no byte; a sequence cut mid-character: U+FFFD
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def rebuild(source: Path, step: int | None = None, tokenizer: str = "") -> Rebuilt:
    """The model of ``source`` (a run directory or a Hugging Face folder), filled with
    its weights; ``tokenizer``: a tokenizer.json (or a folder holding one) instead of
    the source's own."""
    if not source.is_dir():
        raise ConfigError(f"{source}: no such folder (give a run directory or a Hugging Face "
                          "folder with a config.json)")  # fmt: skip
    if (source / CHECKPOINTS).is_dir():
        rebuilt = _from_run(source, step)
    elif (source / "config.json").is_file():
        if step is not None:
            raise ConfigError(f"--step {step}: {source} is a Hugging Face folder, not a run")
        rebuilt = _from_hf(source)
    else:
        raise ConfigError(
            f"{source}: neither a run directory (no {CHECKPOINTS}/) nor a Hugging Face folder "
            "(no config.json)"
        )
    if tokenizer:
        rebuilt.tokenizer = tokenizer_lib.load(tokenizer)
    return rebuilt


def _from_run(run_dir: Path, step: int | None) -> Rebuilt:
    found, arrays, meta = read_checkpoint(run_dir, step)
    if "model" not in meta.get("config", {}):
        raise ConfigError(f"{run_dir}: its checkpoint records no trainer config to build from")
    names = model_settings(meta)
    tree = dict(meta["config"]["model"], vocab_size=names["vocab_size"])
    # the weights are the checkpoint's: a Hugging Face folder it started from is not read
    tree.update(model_from_config="", init_from="", init_map="")
    cfg = config_lib.from_dict({"model": tree}).model
    built = _build(cfg, f"{run_dir}: --model {cfg.name}")

    def read(name: str, shape: tuple) -> np.ndarray:
        if f"params/{name}" not in arrays:
            raise ConfigError(f"{run_dir}: step {found}'s checkpoint has no params/{name}")
        return np.asarray(arrays[f"params/{name}"])

    model = _fill(built, read, f"{run_dir} step {found}")
    rebuilt = Rebuilt(model, f"{_sizes(cfg)} from {run_dir}, step {found}", cfg.seq_len,
                      _run_tokenizer(meta, names["vocab_size"]))  # fmt: skip
    if cfg.document_mask:
        eos = f"id {cfg.document_eos_id}" if cfg.document_eos_id >= 0 else "the data's"
        rebuilt.notes.append(DOCUMENTS.format(eos=eos))
    return rebuilt


def _run_tokenizer(meta: dict, vocab: int):
    """The tokenizer the run's token file was prepared with, else bytes for 257 ids."""
    path = str(meta.get("config", {}).get("data", {}).get("path", ""))
    if path.endswith((".bin", ".npy")) and Path(path).is_file():
        with contextlib.suppress(JaxdistError):  # no tokenizer recorded: bytes or none
            return tokenizer_lib.for_token_file(path)
    return ByteTokenizer() if vocab == BYTE_VOCAB else None


def _from_hf(folder: Path) -> Rebuilt:
    config, path = hf_llama.read(folder, str(folder))
    family = config.get("model_type")
    if family not in HF_FAMILIES:
        raise ConfigError(
            f"{path}: model_type {family!r}: python -m jaxdist.generate decodes "
            f"{', '.join(HF_FAMILIES)}"
        )
    if family == "gpt2":
        cfg, context = _gpt2(config, path)
    else:
        # --model-from-config's translation, checks and class defaults, as the trainer's
        cfg = config_lib.from_dict({"model": {"model_from_config": str(folder)}}).model
        context = hf_llama.normalized(config, str(path))["max_position_embeddings"]
    built = _build(cfg, f"{folder}: {family}")
    names = model_settings({"config": {"model": dataclasses.asdict(cfg)}})
    wmap = weight_map.load(family)
    reader = Reader(folder, str(folder))
    weight_map.check_requires(wmap, names, "the model")
    from_file.check_config_json(reader, wmap, names)
    shapes = _named_shapes(built[1])
    sources = from_file.plan(reader, wmap, shapes, names)

    def read(name: str, shape: tuple) -> np.ndarray:
        return from_file.read(reader, sources[name], (), shape, names)

    model = _fill(built, read, str(folder))
    tokenizer = None
    if (folder / tokenizer_lib.FILE).is_file():
        tokenizer = tokenizer_lib.load(folder)
    elif cfg.vocab_size == BYTE_VOCAB:
        tokenizer = ByteTokenizer()
    return Rebuilt(model, f"{_sizes(cfg)} from {folder} ({family})", context, tokenizer)


def _gpt2(config: dict, path: Path):
    c = {**GPT2_DEFAULTS, **config}
    if c["n_inner"] not in (None, 4 * c["n_embd"]):
        raise ConfigError(f"{path}: n_inner {c['n_inner']}: the GPT's MLP is 4 x n_embd")
    model = dict(
        name="gpt", vocab_size=c["vocab_size"], seq_len=c["n_positions"], d_model=c["n_embd"],
        n_layers=c["n_layer"], n_heads=c["n_head"], layer_norm_eps=c["layer_norm_epsilon"],
    )  # fmt: skip
    return config_lib.from_dict({"model": model}).model, c["n_positions"]


def _build(cfg: config_lib.ModelConfig, what: str):
    """(the model's builder, the model built abstractly): its arrays shapes only, so no
    initialiser runs (eagerly, one compile per parameter: seconds), the weights read next."""
    if cfg.name == "mlp":
        raise ConfigError(f"{what} is a classifier: there is no text to generate")
    build = model_factory(cfg, 0)
    with contextlib.redirect_stdout(sys.stderr):  # --fp8's line: stdout is the completions
        model = nnx.eval_shape(build)
    missing = [name for name in NEEDS if not callable(getattr(model, name, None))]
    if missing:
        raise ConfigError(
            f"{what}: a {type(model).__name__} has no KV-cache decode path (no "
            f"{', '.join(missing)}); jaxdist generates with its built-in gpt and llama"
        )
    return build, model


def _sizes(cfg) -> str:
    return f"{cfg.name} ({cfg.n_layers} layers, d_model {cfg.d_model})"


def _named_shapes(model: nnx.Module) -> dict[str, tuple]:
    """Each parameter's name as checkpoints and maps name it (a stack's layers one by
    one: ``blocks/0/...``) -> its shape."""
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    names = [path_name(p) for p, _ in leaves]
    layers = per_layer_names(params, names)
    out = {}
    for name, (_, leaf) in zip(names, leaves, strict=True):
        for one in layers.get(name, [name]):
            out[one] = tuple(leaf.shape[1:] if name in layers else leaf.shape)
    return out


def _fill(built, read: Callable[[str, tuple], np.ndarray], where: str) -> nnx.Module:
    """The model of ``built`` (``_build``) with its parameters from ``read(name, shape)``,
    by the names of ``_named_shapes`` (a stack's layers read one by one and stacked);
    its other state (RNG streams of dropout, which generation does not use, fp8's
    statistics) as the builder makes it, in one compiled call."""
    build, model = built
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [path_name(p) for p, _ in leaves]
    layers = per_layer_names(params, names)
    values = []
    for name, (_, leaf) in zip(names, leaves, strict=True):
        if name in layers:
            value = np.stack([read(one, tuple(leaf.shape[1:])) for one in layers[name]])
        else:
            value = read(name, tuple(leaf.shape))
        if value.shape != leaf.shape:
            raise ConfigError(
                f"{where}: {name} is {list(value.shape)} there, the model has {list(leaf.shape)}"
            )
        values.append(jax.numpy.asarray(value, leaf.dtype))
    params = jax.tree_util.tree_unflatten(treedef, values)
    if jax.tree.leaves(rest):
        with contextlib.redirect_stdout(sys.stderr):
            rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()
    return nnx.merge(graphdef, params, rest)
