"""What does agreeing on a checkpoint's outcome cost? (``jaxdist.checkpoint.outcome``)

Command:   python experiments/save_outcome_cost.py [--barriers 200] [--saves 10] [--mb 16]
Hardware:  any; 2 processes x 2 emulated CPU devices on one machine (``jaxdist.spawn``),
           the coordination service on process 0, a local disk.
Measures:  1) one barrier between the 2 processes: jaxdist's (a key per process on the
              coordination service's store, polled, and the failure key read) against
              JAX's own ``wait_at_barrier`` (what orbax uses by default), median of
              ``--barriers``;
           2) a whole checkpoint (save + wait until on disk) of ``--mb`` MB of float32
              arrays sharded over the 4 devices, median of ``--saves`` after one save each
              to warm up: a plain ``orbax.checkpoint.CheckpointManager`` with orbax's
              barriers, the same with jaxdist's, and ``jaxdist.checkpoint.Checkpointer``
              (jaxdist's barriers, plus the fingerprints and metadata it always writes).
Expected:  a jaxdist barrier within a few milliseconds (a handful of round trips of about
           0.1 ms, and a poll that starts at 2 ms); four of them per save: well under 1% of
           a save of any real model.
Measured:  2026-11-27, the 2-core CPU shared with other work: see docs/health.md
           ("A checkpoint fails everywhere or nowhere") for the figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def measure(rank: int, barriers: int, saves: int, mb: int, directory: str) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax._src import distributed

    from jaxdist.checkpoint import Checkpointer, orbax_items
    from jaxdist.checkpoint.outcome import SaveBarrier

    ours = SaveBarrier(Path(directory) / "barriers", rank, 2)
    ours.start(0)
    client = distributed.global_state.client
    timings = {"jaxdist barrier ms": [], "JAX barrier ms": []}
    for i in range(barriers):
        started = time.perf_counter()
        ours(key="cost", timeout_ms=60_000)
        timings["jaxdist barrier ms"].append(1e3 * (time.perf_counter() - started))
        started = time.perf_counter()
        client.wait_at_barrier(f"cost/{i}", 60_000)
        timings["JAX barrier ms"].append(1e3 * (time.perf_counter() - started))

    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    count = mb * 2**20 // 4 // 8  # 8 arrays
    arrays = {
        f"a{i}": jax.device_put(
            np.random.default_rng(i).normal(size=count).astype("float32"), sharding
        )  # fmt: skip
        for i in range(8)
    }

    def manager(name: str, barrier=None):
        return ocp.CheckpointManager(
            Path(directory) / name,
            item_handlers=orbax_items.handlers(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2,
                enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(barrier_sync_fn=barrier),
            ),
        )

    agreed = SaveBarrier(Path(directory) / "agreed", rank, 2)
    managers = {"orbax": manager("orbax"), "orbax + jaxdist barrier": manager("agreed", agreed)}
    checkpointer = Checkpointer(Path(directory) / "jaxdist", keep=2)
    for name in [*managers, "jaxdist Checkpointer"]:
        timings[f"{name} s"] = []
    for step in range(saves + 1):  # the first of each warms up
        for name, plain in managers.items():
            agreed.start(step)
            started = time.perf_counter()
            plain.save(step, args=orbax_items.save(arrays, {"step": step}))
            plain.wait_until_finished()
            if step:
                timings[f"{name} s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        checkpointer.save(step, arrays)
        checkpointer.wait()
        if step:
            timings["jaxdist Checkpointer s"].append(time.perf_counter() - started)
    checkpointer.close()
    for plain in managers.values():
        plain.close()
    return {name: statistics.median(values) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--barriers", type=int, default=200)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--mb", type=int, default=16)
    args = parser.parse_args()
    import jaxdist

    with tempfile.TemporaryDirectory() as directory:
        results = jaxdist.spawn(
            measure,
            args=(args.barriers, args.saves, args.mb, directory),
            nprocs=2,
            cpu_devices_per_proc=2,
            timeout=1800,
        )
    for name in results[0]:
        values = ", ".join(f"{r[name]:.3f}" for r in results)
        print(f"{name:30s} (median, process 0, 1): {values}")


if __name__ == "__main__":
    main()
