"""What the pipeline schedules do with the values a stack passes between layers: a
pytree of (B, ...) leaves (a plain (B, T, D), or an MoE model's ``Routed``: (B, T, D)
and per-row aux), moved, selected and stored leaf by leaf, inside the stages' shard_map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

STAGE = "stage"


def put_where(buffer, index, value, condition):
    """``buffer[index] = value`` where ``condition``; one slot read and written, not a
    select over the whole (M, ...) buffer."""

    def put(buffer, value):
        old = lax.dynamic_index_in_dim(buffer, index, keepdims=False)
        return lax.dynamic_update_index_in_dim(buffer, jnp.where(condition, value, old), index, 0)

    return jax.tree.map(put, buffer, value)


def index_tree(tree, index):
    """``tree[index]`` of every (M, ...) leaf."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def where_tree(condition, a, b):
    return jax.tree.map(lambda x, y: jnp.where(condition, x, y), a, b)


def from_stage(source: int, tree):
    """Every stage gets stage ``source``'s ``tree``."""
    stage = lax.axis_index(STAGE)
    return lax.psum(jax.tree.map(lambda a: jnp.where(stage == source, a, 0), tree), STAGE)


def varying_over_stage(x):
    """``x`` typed as differing across stages (as the scan's carry becomes once stages
    send to each other): ``lax.pcast`` in this JAX, ``lax.pvary`` in older ones."""
    if hasattr(lax, "pcast"):
        return jax.tree.map(lambda a: lax.pcast(a, STAGE, to="varying"), x)
    return jax.tree.map(lambda a: lax.pvary(a, STAGE), x)


def join_microbatches(x):
    """(M, B/M, ...) -> (B, ...) of every leaf: the inverse of ``split_microbatches``."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:]), x)
