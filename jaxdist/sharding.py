"""The mesh, and the one seam between host numpy and global device arrays."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.errors import JaxdistError

DATA = "data"  # the mesh axis that batches are split over
BATCH_SPEC = P(DATA)


class DeviceCountError(JaxdistError):
    pass


def make_mesh(data: int = -1, *, devices=None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over the first ``data`` devices (-1: all).

    Example::

        mesh = jaxdist.make_mesh()        # every device: Mesh('data': 8)
        mesh = jaxdist.make_mesh(data=4)  # the first 4 devices

    Built from ``Mesh`` with Auto axes: ``jax.make_mesh`` silently drops devices that do
    not fit its shape, and its default Explicit axes reject the grad-accum reshape of a
    sharded batch at trace time."""
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices) if data == -1 else data
    if not 1 <= count <= len(devices):
        raise DeviceCountError(
            f"{count} devices requested but only {len(devices)} exist "
            f"({devices[0].platform}); use --cpu-devices {count} to emulate CPU devices"
        )
    return Mesh(np.array(devices[:count]), (DATA,), axis_types=(AxisType.Auto,))


def shard_batch(host_batch, mesh: Mesh | None = None, spec: P = BATCH_SPEC):
    """Host-local numpy (this process's rows) -> global ``jax.Array`` split over ``data``.

    With P processes each holding G/P rows, the result has G rows, each device holding
    G/N of them: x (G/P, ...) per process -> (G, ...) global. ``mesh`` defaults to all
    devices (``make_mesh()``). Works the same for every strategy.

    Example::

        batch = jaxdist.shard_batch({"x": x_np, "y": y_np}, mesh)  # x_np: (64, 32) numpy
    """
    mesh = make_mesh() if mesh is None else mesh
    local_devices = mesh.local_mesh.size
    for x in jax.tree.leaves(host_batch):
        if np.shape(x)[0] % local_devices:
            raise JaxdistError(
                f"a host batch of {np.shape(x)[0]} rows does not split over this process's "
                f"{local_devices} devices"
            )
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), host_batch)


def replicate(tree, mesh: Mesh):
    """A full copy of ``tree`` on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
