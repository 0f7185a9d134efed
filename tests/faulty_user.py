"""User code that misbehaves on one process, for the hang tests: written without jaxdist,
as a user's data source and loss would be. ``FAULTY_PROCESS`` (default 1) misbehaves
from its ``FAULTY_AT``-th training batch (``jaxdist-prefetch`` reads one per step).

``--data faulty_user:spinning``: the source's read loops for ever (user code that never
returns). ``--loss faulty_user:deadlocking``: a host callback in the loss waits for a lock
it already holds. ``--loss faulty_user:slow_first_step``: a first step that takes 4 s more, on every
process; ``--data faulty_user:slow_eval_reads``: held-out reads of 0.05 s each.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np
import optax

PROCESS = int(os.environ.get("JAXDIST_PROCESS_ID", "0"))
FAULTY = int(os.environ.get("FAULTY_PROCESS", "1")) == PROCESS
AT = int(os.environ.get("FAULTY_AT", "6"))


class Rows:
    """Classification rows: x (N, 12) float32, y (N,) int32 in [0, 5)."""

    def __init__(self, n: int, *, spin: bool = False, read_s: float = 0.0):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 12)).astype(np.float32)
        self.y = rng.integers(0, 5, size=n).astype(np.int32)
        self.spin, self.read_s = spin, read_s
        self.reads = 0  # by the prefetch thread: one per training step

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        if threading.current_thread().name == "jaxdist-prefetch":
            self.reads += 1
            while self.spin and FAULTY and self.reads >= AT:
                pass  # an infinite loop
        time.sleep(self.read_s)  # a slow store
        return {"x": self.x[indices], "y": self.y[indices]}


def spinning(split):
    return Rows(4096, spin=True) if split == "train" else Rows(512)


def slow_eval_reads(split):  # a held-out set read at 0.05 s a batch
    return Rows(4096) if split == "train" else Rows(2560, read_s=0.05)


_calls = {"n": 0}
_lock = threading.Lock()


def _count_and_maybe_deadlock(_):
    _calls["n"] += 1
    # Four local devices each call it once a step: block on the AT-th step's calls.
    if FAULTY and _calls["n"] > 4 * (AT - 1):
        with _lock:
            _lock.acquire()  # held already: waits for ever


def _sleep_first(_):
    _calls["n"] += 1
    if _calls["n"] == 1:
        time.sleep(4.0)


def _cross_entropy(model, batch):  # (B,)
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def deadlocking(model, batch):
    losses = _cross_entropy(model, batch)
    # partitioned: each device calls it on its own rows (else only one device would)
    jax.debug.callback(_count_and_maybe_deadlock, losses, partitioned=True)
    return losses.mean()


def slow_first_step(model, batch):
    losses = _cross_entropy(model, batch)
    jax.debug.callback(_sleep_first, losses, partitioned=True)
    return losses.mean()
