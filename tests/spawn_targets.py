"""Module-level functions for ``jaxdist.spawn`` in tests/test_spawn.py: spawned processes
import them by module and name."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jaxdist

N, GLOBAL_BATCH, IN, HIDDEN, OUT = 256, 32, 6, 16, 3


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def dataset() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, IN)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, OUT, N).astype(np.int32)}


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train(rank: int, steps: int, lr: float) -> tuple[int, dict[str, np.ndarray]]:
    """A custom loop, the same code for any number of processes: (process index, params)."""
    mesh = jaxdist.make_mesh()
    dp = jaxdist.DataParallel(MLP(nnx.Rngs(0)), optax.sgd(lr), loss_fn, mesh=mesh)
    state = dp.init_state()
    data = dataset()
    sampler = jaxdist.DistributedSampler(N, GLOBAL_BATCH, seed=1)
    for step in range(steps):
        rows = sampler.indices(step)  # this process's share of the global batch
        batch = jaxdist.shard_batch({k: v[rows] for k, v in data.items()}, mesh)
        state, _ = dp.step(state, batch)
    return jax.process_index(), dp.host_params(state)


def plain_sgd(steps: int, lr: float) -> dict[str, np.ndarray]:
    """The same training on one device with plain optax: whole global batches."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = optax.sgd(lr)
    opt_state, data = tx.init(params), dataset()
    sampler = jaxdist.DistributedSampler(N, GLOBAL_BATCH, seed=1, process_index=0, process_count=1)

    def loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch)

    for step in range(steps):
        rows = sampler.indices(step)
        grads = jax.grad(loss)(params, {k: v[rows] for k, v in data.items()})
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    flat = nnx.to_flat_state(params)
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))


def fail_on(rank: int, bad_rank: int, pid_dir: str) -> None:
    """Rank ``bad_rank`` raises; the others wait for ever (in Python, after initialize)."""
    record_pid(pid_dir, rank)
    if rank == bad_rank:
        while len(list(Path(pid_dir).iterdir())) < jax.process_count():
            time.sleep(0.05)  # every pid recorded first
        raise ValueError(f"rank {rank} gives up")
    time.sleep(600)


def wait_for_ever(rank: int, pid_dir: str) -> None:
    record_pid(pid_dir, rank)
    time.sleep(600)


def exit_on(rank: int, bad_rank: int, pid_dir: str) -> None:
    """Rank ``bad_rank`` calls ``sys.exit(3)`` once every pid is recorded; the others wait
    for ever (in Python, after initialize)."""
    record_pid(pid_dir, rank)
    if rank == bad_rank:
        while len(list(Path(pid_dir).iterdir())) < jax.process_count():
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(600)


def save_barrier_failure(rank: int, directory: str) -> tuple[str, float]:
    """Checkpoint 10's barriers between 2 processes: process 1's write fails (its error
    rises through a ``finally`` that meets a barrier, as in orbax's finalizing thread);
    process 0 waits at a barrier process 1 never reaches. Returns (the error each
    raised, the seconds it waited)."""
    import errno

    from jaxdist.checkpoint.outcome import SaveBarrier

    barrier = SaveBarrier(Path(directory), rank, 2)
    barrier.start(5)
    barrier(key="write_complete", timeout_ms=60_000)  # both arrive: it passes
    barrier.start(10)
    started = time.monotonic()
    try:
        if rank == 1:
            try:
                raise OSError(errno.ENOSPC, "No space left on device", f"{directory}/10/x")
            finally:
                barrier(key="finished", timeout_ms=60_000)
        barrier(key="write_complete", timeout_ms=60_000)
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - started
    return "passed", time.monotonic() - started
