"""shard_map: ``jax.jit(jax.shard_map(step))``; batch ``P("data")``, state ``P()``.

The step runs per device on its rows and averages with ``lax.pmean`` over ``data``.
``check_vma=False`` keeps per-device autodiff (as pmap): with the default
``check_vma=False``, the gradient of replicated params comes back already summed over
devices, and pmean-ing it again would give N times the 1-device gradient."""

from __future__ import annotations

from functools import partial

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist.sharding import DATA, replicate, shard_batch
from jaxdist.strategies import Wired, scalars


def wire(make_step, mesh) -> Wired:
    per_device = make_step(mean_over_replicas=lambda tree: lax.pmean(tree, DATA))
    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=(P(), P()), check_vma=False
    )
    return Wired(
        step=jax.jit(mapped, donate_argnums=0),
        put_state=partial(replicate, mesh=mesh),
        put_batch=partial(shard_batch, mesh=mesh),
        get_state=lambda state: state,
        get_metrics=scalars,
    )
