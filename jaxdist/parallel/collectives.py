"""Code that runs inside the step and must be right under every strategy.

Under ``pmap`` and ``shard_map`` the step runs once per device with the mesh axis
``"data"`` bound; under ``gspmd`` it runs once over global arrays and no axis is bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.parallel.device_mesh import DATA


def replica_index(axis_name: str = DATA) -> jax.Array | None:
    """This device's position on ``data`` inside pmap/shard_map; None under gspmd."""
    try:
        return lax.axis_index(axis_name)
    except NameError:  # "unbound axis name": no per-device axis, values are global
        return None


def mean_over_replicas(tree, axis_name: str = DATA):
    """Averages every leaf over the data-parallel replicas: ``lax.pmean`` over ``data``
    under pmap and shard_map, the identity under gspmd (whose values are already global).
    PyTorch's ``all_reduce(t); t /= world_size``.

    Example, in a hand-written step::

        loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # this replica's rows
        loss, grads = jaxdist.mean_over_replicas((loss, grads))   # the global-batch values

    Warning: average the *gradients*, never differentiate an averaged loss.
    ``jax.grad(lambda p: mean_over_replicas(loss(p)))`` gives each replica its own local
    gradient under pmap and shard_map (pmean's transpose does not sum the cotangents back),
    so replicas silently drift apart. Integer leaves are averaged as float32.
    """
    if replica_index(axis_name) is None:
        return tree

    def mean(x):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        return lax.pmean(x, axis_name)

    return jax.tree.map(mean, tree)


def sum_over_replicas(tree, axis_name: str = DATA):
    """Sums every leaf over the data-parallel replicas: ``lax.psum`` over ``data`` under
    pmap and shard_map, the identity under gspmd. For counts and sums of masked values,
    e.g. evaluation (PyTorch's ``all_reduce(t)``)."""
    if replica_index(axis_name) is None:
        return tree
    return jax.tree.map(lambda x: lax.psum(x, axis_name), tree)


def min_over_replicas(tree, axis_name: str = DATA):
    """The minimum of every leaf over the replicas (``lax.pmin``); identity under gspmd."""
    if replica_index(axis_name) is None:
        return tree
    return jax.tree.map(lambda x: lax.pmin(x, axis_name), tree)


def step_key(seed: int, step, axis_name: str = DATA) -> jax.Array:
    """The random key of optimizer step ``step``: ``fold_in(key(seed), step)``, then
    ``fold_in(replica_index)`` where the step runs per replica (pmap, shard_map, gspmd's
    per-replica path; ``axis_name`` there is the batch axes (data, fsdp, expert), whose one
    index is the replica's block of rows) so that no two replicas share dropout masks.
    Under gspmd otherwise it is one key for the global batch: with JAX's partitionable
    threefry the masks equal the 1-device masks, whatever the device count."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    index = replica_index(axis_name)
    return key if index is None else jax.random.fold_in(key, index)
