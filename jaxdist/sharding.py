"""The mesh, and the one seam between host numpy and global device arrays."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"  # the mesh axis that batches are split over


class DeviceCountError(ValueError):
    pass


def make_mesh(num_devices: int = 0) -> Mesh:
    """A 1-D ``data`` mesh over the first ``num_devices`` devices (0: all of them).

    Built from ``Mesh`` directly with Auto axes: ``jax.make_mesh`` silently drops devices
    that do not fit its shape and defaults to Explicit axes, under which the grad-accum
    reshape of a sharded batch fails at trace time."""
    devices = jax.devices()
    if num_devices > len(devices):
        raise DeviceCountError(
            f"{num_devices} devices requested but only {len(devices)} exist "
            f"({devices[0].platform}); use --cpu-devices {num_devices} to emulate CPU devices"
        )
    chosen = devices[: num_devices or len(devices)]
    return Mesh(np.array(chosen), (DATA,), axis_types=(AxisType.Auto,))


BATCH_SPEC = P(DATA)


def shard_batch(host_batch, mesh: Mesh, spec: P = BATCH_SPEC):
    """Host-local numpy (this process's rows) -> global jax.Array sharded by ``spec``.

    With P processes each holding G/P rows, the result has G rows, split over the mesh's
    data axis. Shapes: x (G/P, ...) per process -> (G, ...) global."""
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), host_batch)


def replicate(tree, mesh: Mesh):
    """A full copy of ``tree`` on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
