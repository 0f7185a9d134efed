"""Token ids and labels in range, from any source: a sampled check of every source at
setup (before anything compiles), and the same predicate as ``DataParallel``'s
``batch_check`` in every step, so that a bad row the sample missed stops the run, naming
the step and the row, instead of training on garbage: JAX raises nothing for an index
out of range (a gather clamps it or fills NaN, a one-hot of it is all zeros)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxdist.errors import ConfigError

SAMPLE_ROWS = 64  # random rows per source, plus the first and the last


@dataclass(frozen=True)
class Range:
    """Which batch entry holds ids or labels, and their bound: values in [0, limit)."""

    key: str  # "tokens" or the labels' name
    limit: int
    what: str  # "token id", "label"
    hint: str  # how to widen the bound

    def rows_ok(self, batch):
        """(B,) bool: True where every value of the row is in range; numpy or jax."""
        values = batch[self.key]
        ok = (values >= 0) & (values < self.limit)
        return ok.reshape(ok.shape[0], -1).all(axis=1)

    def applies(self, batch) -> bool:
        """Only integer entries are ids or labels; a user loss may read other names."""
        values = batch.get(self.key) if isinstance(batch, dict) else None
        return values is not None and np.issubdtype(np.asarray(values).dtype, np.integer)


def value_range(task: str, limit: int, labels: str) -> Range:
    """Token ids below the vocabulary (lm), or labels (under their name) below the number
    of classes."""
    if task == "lm":
        hint = "pass --vocab-size, or give the source a vocab_size attribute"
        return Range("tokens", limit, "token id", f"the vocabulary of {limit}; {hint}")
    hint = "pass --num-classes (or num_classes in --model-args)"
    return Range(labels, limit, "label", f"the {limit} classes (labels 0..{limit - 1}); {hint}")


def sample_indices(num_examples: int, count: int = SAMPLE_ROWS) -> np.ndarray:
    """Sorted example indices: the first, the last, and ``count`` random ones (fixed)."""
    picked = np.random.default_rng(0).choice(num_examples, min(count, num_examples), False)
    return np.unique(np.concatenate([[0, num_examples - 1], picked]))


def check_source(source, name: str, bound: Range) -> None:
    """ConfigError naming the source, the example and the value when a sampled row has a
    value outside ``bound``."""
    indices = sample_indices(len(source))
    batch = source[indices]
    if not bound.applies(batch):
        return
    values = np.asarray(batch[bound.key])
    ok = bound.rows_ok({bound.key: values})
    if ok.all():
        return
    row = int(np.argmin(ok))
    flat = values[row].reshape(-1)
    bad = flat[(flat < 0) | (flat >= bound.limit)][0]
    raise ConfigError(
        f"{name}: example {indices[row]} has {bound.what} {bad}, outside {bound.hint}"
    )


def batch_check(bound: Range, sample) -> Callable | None:
    """``DataParallel(batch_check=...)``: per row, every value in range; None when the
    batch has no such integer entry."""
    return bound.rows_ok if bound.applies(sample) else None
