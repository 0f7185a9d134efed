"""GSPMD: ``jax.jit`` with NamedShardings. Batch rows split over ("data", "fsdp"),
replicated over ``model`` and ``stage``; the state in the layout ``state_shardings``
decides (replicated on a data-only mesh), kept in and out of the step.

No hand-written collective: the loss is the mean over the global batch, so XLA's
partitioner inserts the all-reduce of the gradient itself (and, for sharded params, the
all-gathers, reduce-scatters and activation all-reduces). BatchNorm statistics are those
of the global batch, as on one device."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.sharding import batch_spec
from jaxdist.strategies import Wired


def wire(train_step, eval_step, mesh, axis_name, state_sharding) -> Wired:
    del axis_name  # no per-device axis: the step sees global arrays
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, batch_spec(mesh))
    step = jax.jit(
        train_step,
        in_shardings=(state_sharding, batch),
        out_shardings=(state_sharding, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(eval_step, in_shardings=(state_sharding, batch), out_shardings=replicated)
    return Wired(step=step, lower=step.lower, evaluate=evaluate)
