"""Per-step health: non-finite losses and gradients, and rows the data check rejects.

Computed inside the step at the cost of what it already does (the gradient norm's
per-parameter sums of squares; one reduction per batch check), returned as one small int32
vector among the metrics (``health/status``: nonfinite, first non-finite leaf, first bad
row), which ``DataParallel.check`` reads on the host in one transfer a step.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.errors import JaxdistError
from jaxdist.parallel.collectives import min_over_replicas, replica_index
from jaxdist.parallel.host import host_value, scalars

NONFINITE = "health/nonfinite"  # 1: the loss or the gradient norm is NaN or infinite
NONFINITE_LEAF = "health/nonfinite_leaf"  # index of the first such gradient leaf, or -1
BAD_ROW = "health/bad_row"  # first global row the batch check rejected, or NO_ROW
NO_ROW = np.iinfo(np.int32).max
POLICIES = ("halt", "skip")
# What ``check`` reads on the host after a step: these three, as one (3,) int32 array.
STATUS = "health/status"
STATUS_FIELDS = (NONFINITE, NONFINITE_LEAF, BAD_ROW)


class NonFiniteError(RuntimeError):
    """The loss or gradient became NaN or infinite (``nan_policy="halt"``): exit code 1.
    ``step``: the step, which the failure record (``failures.jsonl``) holds."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class BadBatchError(JaxdistError):
    """A batch failed the data check (e.g. a token id beyond the vocabulary): exit code 2.
    ``step``: the step, as for NonFiniteError."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def grad_norm_and_health(loss, grads) -> tuple[jax.Array, dict]:
    """The global gradient norm, and whether it (or the loss) is finite, with the first
    non-finite gradient leaf (in ``jax.tree.leaves`` order)."""
    squares = jnp.stack(
        [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)]
    )  # (num_leaves,): NaN or inf where a leaf has one
    grad_norm = jnp.sqrt(jnp.sum(squares))
    bad_leaf = ~jnp.isfinite(squares)
    first = jnp.where(bad_leaf.any(), jnp.argmax(bad_leaf), -1).astype(jnp.int32)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return grad_norm, {NONFINITE: (~finite).astype(jnp.int32), NONFINITE_LEAF: first}


def keep_if(finite, new, old):
    """``new`` where the step was finite, else ``old`` (``nan_policy="skip"``)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def first_bad_row(batch, batch_check: Callable, axis_name: str) -> dict:
    """The first global row for which ``batch_check(batch)`` (a (B,) bool) is False. Under
    pmap/shard_map a device holds rows [d * B, (d + 1) * B) of the global batch."""
    ok = jnp.asarray(batch_check(batch)).reshape(-1)  # (B,) this replica's rows
    local = jnp.where(ok.all(), NO_ROW, jnp.argmin(ok)).astype(jnp.int32)
    index = replica_index(axis_name)
    if index is not None:
        offset = (index * ok.shape[0]).astype(jnp.int32)
        local = jnp.where(local == NO_ROW, NO_ROW, local + offset)
    return {BAD_ROW: min_over_replicas(local, axis_name)}


def status_vector(status: dict) -> jax.Array:
    """The step's health scalars as one (3,) int32 array (``STATUS_FIELDS`` order): the
    host reads it in one transfer instead of three."""
    fields = {BAD_ROW: jnp.int32(NO_ROW), **status}
    return jnp.stack([jnp.asarray(fields[k], jnp.int32) for k in STATUS_FIELDS])


def check_metrics(metrics: dict, step: int, leaf_paths: list[str], policy: str) -> bool:
    """``check`` of a step's metrics (device arrays): the status in one transfer, the loss
    and gradient norm read only for a failed step's message."""
    status = host_value(metrics[STATUS]).reshape(-1)[:3]  # pmap: device 0's copy
    values = dict(zip(STATUS_FIELDS, status.tolist(), strict=True))

    def read(name):
        return scalars({name: metrics[name]})[name] if name in metrics else None

    return check(values, step, leaf_paths, policy, read)


def check(values: dict, step: int, leaf_paths: list[str], policy: str, read=dict().get) -> bool:
    """Raises for a failed step (``values``: ``STATUS_FIELDS``; ``read(name)``: a metric
    for the message, read from the devices only then); returns True if its update was
    skipped."""
    bad_row = int(values.get(BAD_ROW, NO_ROW))
    if bad_row != NO_ROW:
        raise BadBatchError(
            f"step {step}: row {bad_row} of the global batch failed the data check (e.g. a "
            "token id outside the vocabulary or a label outside the classes)",
            step,
        )
    if not int(values.get(NONFINITE, 0)):
        return False
    if policy == "skip":
        return True
    leaf = int(values[NONFINITE_LEAF])
    where = (
        f"the first non-finite gradient is {leaf_paths[leaf]}"
        if leaf >= 0
        else "the gradient is finite, the loss is not"
    )
    raise NonFiniteError(
        f"step {step}: the loss or gradient norm is not finite (loss {read('loss')}, "
        f"grad_norm {read('grad_norm')}); {where}. --nan-policy skip skips such updates",
        step,
    )
