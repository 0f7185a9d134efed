"""A run's language model read from its checkpoint, scoring continuations of contexts.

The model is built as the run built it (its checkpoint's config: ``--model`` and every
model flag, the data's vocabulary), unscanned whatever the run's layout (a checkpoint
names a stack's layers one by one, as the unscanned model does), in eval mode, on this
host's first device, and every parameter and batch statistic is the checkpoint's: one it
lacks, or one of the checkpoint's the model has no place for, is an error listing them.
The tokenizer is ``tokenizer=`` (a ``tokenizer.json`` or a folder), else the one the
run's training data records (``jaxdist.data.tokenizer.for_token_file``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.errors import ConfigError, JaxdistError
from jaxdist.train import config as config_lib
from jaxdist.train.build_model import build_model
from jaxdist.weights import read_checkpoint

__all__ = ["RunModel", "load_run"]

KINDS = {"params": nnx.Param, "batch_stats": nnx.BatchStat}  # the checkpoint's names


@dataclasses.dataclass
class RunModel:
    graphdef: object
    state: object
    tokenizer: tokenizer_lib.TextTokenizer
    step: int  # the checkpoint's
    max_length: int  # tokens the model reads at once: the run's --seq-len unless given

    def __post_init__(self):
        graphdef = self.graphdef

        def score(state, inputs, targets):  # (B, T) each -> each target's log p, greedy
            logits = nnx.merge(graphdef, state)(inputs).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return picked, logits.argmax(-1) == targets

        self._score = jax.jit(score)

    def loglikelihood(
        self, pairs: list[tuple[list[int], list[int]]], batch_size: int = 8
    ) -> list[tuple[float, bool]]:
        """For each (context ids, continuation ids): log p(continuation | context), and
        whether each continuation token is the model's most likely. The context is cut
        from the left to fit ``max_length``; rows are right-padded (the model is causal)
        to a length of a multiple of 64 and batches to ``batch_size`` rows, so that a
        few shapes compile."""
        out = []
        for first in range(0, len(pairs), batch_size):
            chunk = pairs[first : first + batch_size]
            rows = [self._window(context, continuation) for context, continuation in chunk]
            width = min(-(-max(len(r) - 1 for r in rows) // 64) * 64, self.max_length)
            tokens = np.zeros((batch_size, width + 1), np.int32)
            for i, row in enumerate(rows):
                tokens[i, : len(row)] = row
            picked, greedy = map(np.asarray, self._score(self.state, tokens[:, :-1], tokens[:, 1:]))
            for i, ((_, continuation), row) in enumerate(zip(chunk, rows, strict=True)):
                span = slice(len(row) - 1 - len(continuation), len(row) - 1)
                out.append((float(picked[i, span].sum()), bool(greedy[i, span].all())))
        return out

    def _window(self, context: list[int], continuation: list[int]) -> list[int]:
        if not continuation or len(continuation) > self.max_length:
            raise ConfigError(
                f"a continuation of {len(continuation)} tokens: the model reads 1 to "
                f"{self.max_length} (max_length) at once"
            )
        return (list(context) + list(continuation))[-(self.max_length + 1) :]


def load_run(
    run_dir, step: int | None = None, tokenizer=None, max_length: int | None = None
) -> RunModel:
    """``run_dir``'s model at checkpoint ``step`` (default: the newest good one)."""
    found, arrays, meta = read_checkpoint(Path(run_dir), step)
    model_section = {**meta["config"]["model"], "model_from_config": "", "init_from": ""}
    cfg = config_lib.from_dict({"model": model_section}).model
    vocab = cfg.vocab_size or meta.get("data", {}).get("vocab_size", 0)
    cfg = dataclasses.replace(cfg, vocab_size=vocab, scan_layers=False, remat="none")
    model, task = build_model(cfg, meta["config"].get("train", {}).get("seed", 0))
    if task != "lm" or not isinstance(model, nnx.Module):
        raise ConfigError(
            f"{run_dir}: --model {cfg.name} is not an NNX language model (tokens -> "
            "logits); export it (python -m jaxdist.export) and score the folder instead"
        )
    model.eval()
    fill(model, arrays, run_dir)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, jax.devices()[0])
    return RunModel(graphdef, state, _tokenizer(tokenizer, meta, run_dir), found,
                    int(max_length or cfg.seq_len))  # fmt: skip


def fill(model: nnx.Module, arrays: dict, run_dir) -> None:
    """The model's parameters and batch statistics set to the checkpoint's, by name."""
    used, missing, misfit = set(), [], []
    for kind, variable in KINDS.items():
        flat = []
        for path, var in nnx.to_flat_state(nnx.state(model, variable)):
            name = "/".join([kind, *map(str, path)])
            value = arrays.get(name)
            if value is None:
                missing.append(name)
            elif tuple(value.shape) != tuple(var.get_value().shape):
                misfit.append(f"{name} {tuple(value.shape)} (model {var.get_value().shape})")
            else:
                used.add(name)
                flat.append((path, var.replace(jnp.asarray(value, var.get_value().dtype))))
        nnx.update(model, nnx.from_flat_state(flat))
    unused = sorted(n for n in arrays if n.split("/")[0] in KINDS and n not in used)
    if missing or misfit or unused:
        said = [f"{what}: {', '.join(names[:6])}" for what, names in
                (("not in the checkpoint", missing), ("other shapes", misfit),
                 ("not in the model", unused)) if names]  # fmt: skip
        raise ConfigError(f"{run_dir}: the checkpoint is not this model's; " + "; ".join(said))


def _tokenizer(given, meta: dict, run_dir) -> tokenizer_lib.TextTokenizer:
    if given:
        return tokenizer_lib.load(given)
    data = meta.get("data", {}).get("files", {}).get("train", {}).get("path", "")
    try:
        if not data or not Path(data).exists():
            raise JaxdistError(f"its training data {data or '(not a token file)'} is not here")
        return tokenizer_lib.for_token_file(data)
    except JaxdistError as err:
        raise ConfigError(f"{run_dir}: no tokenizer: {err}; give tokenizer=PATH") from err
