"""pmap: state copied with a leading device axis (N, ...); ``jax.pmap`` over the data
axis; gradients, metrics and batch statistics averaged with ``lax.pmean``."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from jaxdist.sharding import BATCH_SPEC
from jaxdist.strategies import Wired


def wire(train_step, eval_step, mesh, axis_name, state_sharding) -> Wired:
    del state_sharding  # (N, ...) copies; strategies.layout refuses axes beyond data
    n = mesh.size
    devices = list(mesh.devices.flat)
    pstep = jax.pmap(train_step, axis_name=axis_name, devices=devices, donate_argnums=0)
    peval = jax.pmap(eval_step, axis_name=axis_name, devices=devices)

    # (G, ...) -> (N, G/N, ...): each device's block of rows becomes its row; no data moves.
    by_device = jax.jit(
        lambda batch: jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch),
        out_shardings=NamedSharding(mesh, BATCH_SPEC),
    )
    return Wired(
        step=lambda state, batch: pstep(state, by_device(batch)),
        lower=lambda state, batch: pstep.lower(state, by_device(batch)),
        evaluate=lambda state, batch: peval(state, by_device(batch)),
    )
