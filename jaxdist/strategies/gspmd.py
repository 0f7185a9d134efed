"""GSPMD: ``jax.jit`` with NamedShardings; batch split on ``data``, state replicated.

No hand-written collective: the loss is the mean over the global batch, so XLA's
partitioner inserts the all-reduce of the gradient itself. BatchNorm statistics are
those of the global batch, as on one device."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.sharding import BATCH_SPEC
from jaxdist.strategies import Wired


def wire(train_step, eval_step, mesh, axis_name) -> Wired:
    del axis_name  # no per-device axis: the step sees global arrays
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, BATCH_SPEC)
    step = jax.jit(
        train_step,
        in_shardings=(replicated, batch),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(eval_step, in_shardings=(replicated, batch), out_shardings=replicated)
    return Wired(step=step, lower=step.lower, evaluate=evaluate)
