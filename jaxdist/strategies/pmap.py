"""pmap: state copied with a leading device axis (N, ...); ``jax.pmap`` over ``data``;
gradients and metrics averaged with ``lax.pmean``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.sharding import DATA, shard_batch
from jaxdist.strategies import Wired, scalars


def wire(make_step, mesh) -> Wired:
    n_local = mesh.local_mesh.size  # this process's devices: pmap's leading axis
    step = jax.pmap(
        make_step(mean_over_replicas=lambda tree: lax.pmean(tree, DATA)),
        axis_name=DATA,
        devices=list(mesh.devices.flat),
        donate_argnums=0,
    )
    stacked = NamedSharding(mesh, P(DATA))

    def put_state(state):
        # (...) -> (N, ...): one copy per device, as pmap expects.
        copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (mesh.size, *jnp.shape(x))), state)
        return jax.device_put(copies, stacked)

    def put_batch(host_batch):
        # (rows, ...) -> (n_local, rows / n_local, ...): the device axis leads.
        split = jax.tree.map(lambda x: x.reshape(n_local, -1, *x.shape[1:]), host_batch)
        return shard_batch(split, mesh)

    return Wired(
        step=step,
        put_state=put_state,
        put_batch=put_batch,
        get_state=lambda state: jax.tree.map(lambda x: x[0], state),
        get_metrics=lambda metrics: scalars(jax.tree.map(lambda x: x[0], metrics)),
    )
