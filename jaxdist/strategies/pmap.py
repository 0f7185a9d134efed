"""pmap: state copied with a leading device axis (N, ...); ``jax.pmap`` over ``data``;
gradients, metrics and batch statistics averaged with ``lax.pmean``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxdist.sharding import BATCH_SPEC, DATA
from jaxdist.strategies import Wired, scalars


def wire(train_step, eval_step, mesh) -> Wired:
    n = mesh.size
    stacked = NamedSharding(mesh, BATCH_SPEC)  # leading axis split over devices
    devices = list(mesh.devices.flat)
    pstep = jax.pmap(train_step, axis_name=DATA, devices=devices, donate_argnums=0)
    peval = jax.pmap(eval_step, axis_name=DATA, devices=devices)

    # (G, ...) -> (N, G/N, ...): each device's block of rows becomes its row; no data moves.
    by_device = jax.jit(
        lambda batch: jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch),
        out_shardings=stacked,
    )

    def put_state(state):
        # (...) -> (N, ...): one copy per device, as pmap expects.
        copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), state)
        return jax.device_put(copies, stacked)

    return Wired(
        step=lambda state, batch: pstep(state, by_device(batch)),
        lower=lambda state, batch: pstep.lower(state, by_device(batch)),
        put_state=put_state,
        # Device 0's copy, read from this process's first device (pmap keeps N copies).
        get_state=lambda state: jax.tree.map(lambda x: x.addressable_data(0)[0], state),
        get_metrics=scalars,
        evaluate=lambda state, batch: peval(state, by_device(batch)),
    )
