"""The seeds' toy: split a list across workers, each doubles its part, combine.

Command:   python experiments/split_data.py
Hardware:  any; 4 CPU devices are emulated when no accelerator is present.
Expected:  both ways print [20, 40, 60, 80, 100, 120, 140, 160] and the sum 720.

The list 10, 20, ..., 80 has 8 numbers; 4 workers (devices) get 2 each.
"""

from __future__ import annotations

import contextlib

import jax

WORKERS = 4


def numbers():
    import jax.numpy as jnp

    return jnp.arange(10, 81, 10, dtype=jnp.int32)  # [10, 20, ..., 80]: 8 numbers


def with_pmap(devices):
    """pmap: the data carries the worker axis explicitly, (8,) -> (4 workers, 2)."""
    parts = numbers().reshape(len(devices), -1)  # (4, 2): worker w holds parts[w]

    def work(part):  # runs once per worker on its (2,) slice
        doubled = 2 * part
        return doubled, jax.lax.psum(doubled.sum(), "workers")  # combine: a sum over workers

    doubled, total = jax.pmap(work, axis_name="workers", devices=devices)(parts)
    return doubled.reshape(-1).tolist(), int(total[0])  # (4, 2) -> (8,) in worker order


def with_shard_map(devices):
    """shard_map: one global (8,) array; the mesh splits it into 4 blocks of 2."""
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("workers",))

    def work(part):  # part: this worker's (2,) block
        doubled = 2 * part
        return doubled, jax.lax.psum(doubled.sum(), "workers")

    run = jax.shard_map(work, mesh=mesh, in_specs=P("workers"), out_specs=(P("workers"), P()))
    doubled, total = jax.jit(run)(numbers())
    return doubled.tolist(), int(total)


def main() -> None:
    # Emulate 4 CPU devices; if the backend is already up (a test imported us), use its devices.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", WORKERS)
    devices = jax.devices()[:WORKERS]
    print("input:    ", numbers().tolist())
    print("pmap:     ", *with_pmap(devices))
    print("shard_map:", *with_shard_map(devices))


if __name__ == "__main__":
    main()
