"""Built-in synthetic data, deterministic by seed: a classification set labelled by a
random linear teacher (``--data synthetic``, the MLP's default) and a byte corpus from
a tiny grammar (``--data grammar``, quick to learn)."""

from __future__ import annotations

import numpy as np

from jaxdist.errors import JaxdistError

Batch = dict[str, np.ndarray]


class TeacherClassification:
    """``num_examples`` rows of x ~ N(0, 1), (in_features,), labelled by the argmax of a
    fixed random linear teacher: learnable, and deterministic by seed."""

    def __init__(
        self, num_examples: int, in_features: int, num_classes: int, seed: int, split: int = 0
    ):
        rng = np.random.default_rng([seed, 0])
        teacher = rng.normal(size=(in_features, num_classes)).astype(np.float32)
        if split:  # held-out rows: the same teacher, inputs from another stream
            rng = np.random.default_rng([seed, 0, split])
        self.x = rng.normal(size=(num_examples, in_features)).astype(np.float32)
        self.y = np.argmax(self.x @ teacher, axis=-1).astype(np.int32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices) -> Batch:
        return {"x": self.x[indices], "y": self.y[indices]}


_SUBJECTS = ["the robot", "a small cat", "my old friend", "the engineer", "every student"]
_VERBS = ["paints", "carries", "counts", "builds", "finds", "sorts"]
_ADJECTIVES = ["red", "heavy", "quiet", "tiny", "bright", "broken"]
_OBJECTS = ["boxes", "stones", "letters", "gears", "apples", "kites"]


def grammar_corpus(num_sentences: int = 20_000, seed: int = 1234) -> bytes:
    """A built-in byte corpus from a tiny grammar: local structure a small model learns
    quickly (loss falls from ln 257 = 5.5 towards 0.3 nat/byte)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(num_sentences):
        n = int(rng.integers(2, 10))
        lines.append(
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {n} "
            f"{rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}."
        )
    return "\n".join(lines).encode()


class ByteWindows:
    """Example i is the window of seq_len + 1 bytes starting at byte i: tokens (T + 1,)."""

    def __init__(self, seq_len: int, corpus: bytes | None = None):
        self.tokens = np.frombuffer(corpus or grammar_corpus(), dtype=np.uint8)
        self.seq_len = seq_len
        if len(self.tokens) <= seq_len + 1:
            raise JaxdistError(
                f"sequence length {seq_len} needs at least {seq_len + 2} bytes; the corpus has "
                f"{len(self.tokens)}"
            )

    def __len__(self) -> int:
        return len(self.tokens) - self.seq_len

    def __getitem__(self, indices) -> Batch:
        windows = np.asarray(indices)[:, None] + np.arange(self.seq_len + 1)  # (B, T + 1)
        return {"tokens": self.tokens[windows].astype(np.int32)}
