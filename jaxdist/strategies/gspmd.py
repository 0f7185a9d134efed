"""GSPMD: ``jax.jit`` with NamedShardings; batch split on ``data``, state replicated.

No hand-written collective: the loss is the mean over the global batch, so XLA's
partitioner inserts the all-reduce of the gradient itself."""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.sharding import DATA, replicate, shard_batch
from jaxdist.strategies import Wired, scalars


def wire(make_step, mesh) -> Wired:
    replicated = NamedSharding(mesh, P())
    step = jax.jit(
        make_step(mean_over_replicas=lambda tree: tree),
        in_shardings=(replicated, NamedSharding(mesh, P(DATA))),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    return Wired(
        step=step,
        put_state=partial(replicate, mesh=mesh),
        put_batch=partial(shard_batch, mesh=mesh),
        get_state=lambda state: state,
        get_metrics=scalars,
    )
