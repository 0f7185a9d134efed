"""GSPMD: ``jax.jit`` with NamedShardings. Batch rows split over (data, fsdp, expert),
replicated over ``model`` and ``stage``; the state in the layout ``state_shardings``
decides (replicated on a data-only mesh), kept in and out of the step.

No hand-written collective: the loss is the mean over the global batch, so XLA's
partitioner inserts the all-reduce of the gradient itself (and, for sharded params, the
all-gathers and the activation all-reduces). BatchNorm statistics are those of the
global batch, as on one device.

With ``per_replica`` (``strategies.shard_map.PerReplica``) the gradient is computed per
replica and reduced once by hand, and only the rest of the step is partitioned by XLA:
the shard_map strategy, and gspmd where XLA alone would reduce too often (see
``strategies.wants_per_replica``)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.parallel.device_mesh import EXPERT, SEQ, batch_spec, traced_in


def wire(build, mesh, state_sharding, per_replica=None):
    """``build(per_replica) -> (train_step, eval_step)`` -> the two jitted programs."""
    train_step, eval_step = build(per_replica)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, batch_spec(mesh))
    if mesh.shape.get(SEQ, 1) > 1:
        # Each batch array in the layout shard_batch gave it (its sequence split over seq
        # where seq divides it), and the mesh ambient for jaxdist.attention.
        batch = None
    if mesh.shape.get(SEQ, 1) > 1 or mesh.shape.get(EXPERT, 1) > 1:
        # the mesh ambient for jaxdist.attention (seq) and a MoE's experts (expert_parallel)
        train_step, eval_step = traced_in(mesh, train_step), traced_in(mesh, eval_step)
    step = jax.jit(
        train_step,
        in_shardings=(state_sharding, batch),
        out_shardings=(state_sharding, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(eval_step, in_shardings=(state_sharding, batch), out_shardings=replicated)
    return step, evaluate
