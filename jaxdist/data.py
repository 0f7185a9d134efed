"""Synthetic, deterministic data. Loaders yield *host-local numpy*: this process's rows
of the global batch. ``jaxdist.sharding.shard_batch`` is the one seam to device arrays.

The global batch at step k depends only on (seed, k), so it is the same whatever the
device or process count: that is what makes N-device runs comparable to 1-device runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Batch = dict[str, np.ndarray]


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, *stream])


class TeacherClassification:
    """x ~ N(0, 1) of shape (in_features,); label = argmax of a fixed random linear teacher.
    Learnable (a linear boundary) and infinite: the batch of step k is drawn from (seed, k)."""

    def __init__(self, in_features: int, num_classes: int, seed: int):
        self.in_features = in_features
        teacher = _rng(seed, 0)
        self.w = teacher.normal(size=(in_features, num_classes)).astype(np.float32)
        self.seed = seed

    def global_batch(self, step: int, size: int) -> Batch:
        x = _rng(self.seed, 1, step).normal(size=(size, self.in_features)).astype(np.float32)
        return {"x": x, "y": np.argmax(x @ self.w, axis=-1).astype(np.int32)}


_SUBJECTS = ["the robot", "a small cat", "my old friend", "the engineer", "every student"]
_VERBS = ["paints", "carries", "counts", "builds", "finds", "sorts"]
_ADJECTIVES = ["red", "heavy", "quiet", "tiny", "bright", "broken"]
_OBJECTS = ["boxes", "stones", "letters", "gears", "apples", "kites"]


def grammar_corpus(num_sentences: int = 20_000, seed: int = 1234) -> bytes:
    """A built-in byte corpus from a tiny grammar: local structure a small model learns
    quickly (loss falls from ln 256 = 5.5 towards ~1 nat/byte)."""
    rng = _rng(seed)
    words = []
    for _ in range(num_sentences):
        n = int(rng.integers(2, 10))
        words.append(
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {n} "
            f"{rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}."
        )
    return "\n".join(words).encode()


class ByteLM:
    """Windows of seq_len + 1 bytes at offsets drawn from (seed, step): tokens (B, T + 1)."""

    def __init__(self, seq_len: int, seed: int, corpus: bytes | None = None):
        self.tokens = np.frombuffer(corpus or grammar_corpus(), dtype=np.uint8)
        self.seq_len = seq_len
        self.seed = seed
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(self.tokens)} bytes is shorter than seq_len + 1")

    def global_batch(self, step: int, size: int) -> Batch:
        starts = _rng(self.seed, 1, step).integers(0, len(self.tokens) - self.seq_len - 1, size)
        windows = starts[:, None] + np.arange(self.seq_len + 1)[None, :]  # (B, T + 1)
        return {"tokens": self.tokens[windows].astype(np.int32)}


def make_source(task: str, model_cfg, seed: int):
    if task == "lm":
        return ByteLM(model_cfg.seq_len, seed)
    return TeacherClassification(model_cfg.in_features, model_cfg.num_classes, seed)


def host_batches(
    source, global_batch_size: int, start_step: int, process_index: int, process_count: int
) -> Iterator[Batch]:
    """This process's contiguous share of each global batch: rows [p * G/P, (p + 1) * G/P)."""
    per_process = global_batch_size // process_count
    lo = process_index * per_process
    step = start_step
    while True:
        batch = source.global_batch(step, global_batch_size)
        yield {k: v[lo : lo + per_process] for k, v in batch.items()}
        step += 1
