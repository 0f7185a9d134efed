"""shard_map: ``jax.jit(jax.shard_map(step))``; batch split on the data axis, state ``P()``
(a mesh with fsdp, model or stage axes is refused: use gspmd).

The step runs per device on its rows and averages with ``lax.pmean`` over the data axis.
``check_vma=False`` keeps per-device autodiff (as pmap): with the default
``check_vma=True``, the gradient of replicated params comes back already summed over
devices, and pmean-ing it again would give N times the 1-device gradient."""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.strategies import Wired


def wire(train_step, eval_step, mesh, axis_name, state_sharding) -> Wired:
    del state_sharding  # replicated: strategies.layout refuses axes beyond data
    # The same devices in the same order, the data axis named as the step expects (the
    # model's own name under SyncBatchNorm): inputs need no resharding.
    mesh = Mesh(mesh.devices.reshape(-1), (axis_name,), axis_types=mesh.axis_types[:1])

    def per_device(fn, out_specs):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=(P(), P(axis_name)), out_specs=out_specs, check_vma=False
        )

    step = jax.jit(per_device(train_step, (P(), P())), donate_argnums=0)
    evaluate = jax.jit(per_device(eval_step, P()))  # sums are psum-ed: replicated
    return Wired(step=step, lower=step.lower, evaluate=evaluate)
