"""pmap: state copied with a leading device axis (N, ...); ``jax.pmap`` over the data
axis; gradients, metrics and batch statistics averaged with ``lax.pmean``."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from jaxdist.sharding import BATCH_SPEC


def wire(build, mesh, axis_name):
    """``build(None) -> (train_step, eval_step)`` -> two jitted programs on global
    batches (``strategies.layout`` refuses axes beyond data)."""
    train_step, eval_step = build(None)
    n, devices = mesh.size, list(mesh.devices.flat)
    pstep = jax.pmap(train_step, axis_name=axis_name, devices=devices, donate_argnums=0)
    peval = jax.pmap(eval_step, axis_name=axis_name, devices=devices)

    def by_device(batch):  # (G, ...) -> (N, G/N, ...): device d's rows become row d
        reshaped = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        return jax.lax.with_sharding_constraint(reshaped, NamedSharding(mesh, BATCH_SPEC))

    step = jax.jit(lambda state, batch: pstep(state, by_device(batch)), donate_argnums=0)
    evaluate = jax.jit(lambda state, batch: peval(state, by_device(batch)))
    return step, evaluate
