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


def wire(train_step, eval_step, mesh) -> Wired:
    def per_device(fn, out_specs):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=(P(), BATCH_SPEC), out_specs=out_specs, check_vma=False
        )

    step = jax.jit(per_device(train_step, (P(), P())), donate_argnums=0)
    evaluate = jax.jit(per_device(eval_step, P()))  # sums are psum-ed: replicated
    return Wired(
        step=step,
        lower=step.lower,
        put_state=partial(replicate, mesh=mesh),
        get_state=lambda state: state,
        get_metrics=scalars,
        evaluate=evaluate,
    )
