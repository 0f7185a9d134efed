"""pmap: state copied with a leading device axis (N, ...); ``jax.pmap`` over the data
axis; gradients, metrics and batch statistics averaged with ``lax.pmean``."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from jaxdist.parallel.device_mesh import BATCH_SPEC


def wire(build, mesh, axis_name):
    """``build(None) -> (train_step, eval_step)`` -> the two programs on global batches
    (``strategies.layout`` refuses axes beyond data)."""
    train_step, eval_step = build(None)
    n, devices = mesh.size, list(mesh.devices.flat)

    # (G, ...) -> (N, G/N, ...): each device's block of rows becomes its row; no data moves.
    by_device = jax.jit(
        lambda batch: jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch),
        out_shardings=NamedSharding(mesh, BATCH_SPEC),
    )
    pstep = jax.pmap(train_step, axis_name=axis_name, devices=devices, donate_argnums=0)
    peval = jax.pmap(eval_step, axis_name=axis_name, devices=devices)
    return OnDevices(pstep, by_device), OnDevices(peval, by_device)


class OnDevices:
    """A pmapped function of (state, global batch): the batch split by device first. Not
    inside ``jax.jit``: pmap under jit fails once the devices span several processes."""

    def __init__(self, pmapped, by_device):
        self.pmapped, self.by_device = pmapped, by_device

    def __call__(self, state, batch):
        return self.pmapped(state, self.by_device(batch))

    def lower(self, state, batch) -> jax.stages.Lowered:
        return self.pmapped.lower(state, jax.eval_shape(self.by_device, batch))
