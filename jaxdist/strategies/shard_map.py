"""shard_map: ``jax.jit(jax.shard_map(step))``; batch ``P("data")``, state ``P()``.

The step runs per device on its rows and averages with ``lax.pmean`` over ``data``.
``check_vma=False`` keeps per-device autodiff (as pmap): with the default
``check_vma=True``, the gradient of replicated params comes back already summed over
devices, and pmean-ing it again would give N times the 1-device gradient."""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec as P

from jaxdist.sharding import BATCH_SPEC, replicate
from jaxdist.strategies import Wired, scalars


def wire(train_step, mesh) -> Wired:
    mapped = jax.shard_map(
        train_step, mesh=mesh, in_specs=(P(), BATCH_SPEC), out_specs=(P(), P()), check_vma=False
    )
    step = jax.jit(mapped, donate_argnums=0)
    return Wired(
        step=step,
        lower=step.lower,
        put_state=partial(replicate, mesh=mesh),
        get_state=lambda state: state,
        get_metrics=scalars,
    )
