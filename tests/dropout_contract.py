"""A plain flax/optax training loop that follows jaxdist's documented RNG contract (the
docstring of jaxdist/parallel/step.py), written without jaxdist: the reference of
tests/test_dropout_contract.py.

At optimizer step k the key is ``fold_in(key(seed), k)``. On a per-replica path (pmap,
shard_map, gspmd's ``wants_per_replica``) replica r, which holds rows [r B/R, (r+1) B/R)
of the global batch, folds in r; with grad-accum, microbatch i (rows i, i+K, ... of those
rows) folds in i. Every RNG stream of the model is then reseeded with that key by flax's
own ``nnx.reseed``, and the gradients of all (replica, microbatch) pieces are averaged.

Inside a pipelined ``Stack``, microbatch j of the schedule (rows j, j+M, ... of the rows a
loss call sees) runs the stack's layers in order with each RNG key of the layers folded
with j: ``stack_by_microbatch``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def plain_loop(model, loss, batches, tx, *, seed: int, replicas: int = 0, grad_accum: int = 1):
    """Trains ``model`` (eagerly built, consumed) on ``batches`` with ``loss(model, rows)``.
    ``replicas``: 0 for one global key (gspmd without a per-replica path), R for R
    replicas with their own keys. Returns (losses, {"a/b": params})."""
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tags = {v.tag for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngStream)}
    assert tags, "a model without RNG streams cannot test an RNG contract"

    def value_and_grad(params, rows, key):
        m = nnx.merge(graphdef, params, rest, copy=True)
        # Outside jax.grad: NNX does not let a stream be mutated under a transform.
        nnx.reseed(m, policy="match_shape", **dict.fromkeys(tags, key))
        _, _, reseeded = nnx.split(m, nnx.Param, ...)
        return jax.value_and_grad(
            lambda p: loss(nnx.merge(graphdef, p, reseeded, copy=True), rows)
        )(params)

    @jax.jit  # one program a step: every (replica, microbatch) piece at once, by vmap
    def step(params, opt_state, pieces, keys):
        values, grads = jax.vmap(value_and_grad, in_axes=(None, 0, 0))(params, pieces, keys)
        # Equal pieces: the mean of their means is the mean over the global batch.
        value, grads = jax.tree.map(lambda x: x.mean(0), (values, grads))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = tx.init(params), []
    for k, batch in enumerate(batches):
        key = jax.random.fold_in(jax.random.key(seed), k)
        size = len(next(iter(batch.values()))) // max(replicas, 1)
        pieces, keys = [], []
        for r in range(max(replicas, 1)):
            key_r = jax.random.fold_in(key, r) if replicas else key
            rows_r = {name: v[r * size : (r + 1) * size] for name, v in batch.items()}
            for i in range(grad_accum):
                keys.append(jax.random.fold_in(key_r, i) if grad_accum > 1 else key_r)
                pieces.append({name: v[i::grad_accum] for name, v in rows_r.items()})
        stacked = {name: np.stack([p[name] for p in pieces]) for name in batch}
        params, opt_state, value = step(params, opt_state, stacked, jnp.stack(keys))
        losses.append(float(value))
    flat = nnx.to_flat_state(params)
    return losses, {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}


def stack_by_microbatch(layers: nnx.Module, h: jax.Array, microbatches: int, fold=True):
    """What a pipelined stack computes: ``layers`` holds L blocks' state stacked on a
    leading axis (a ``Stack``'s ``layers``); microbatch j, rows j, j+M, ... of ``h``, goes
    through block 0, ..., L-1 with every RNG key of the blocks folded with j
    (``fold=False``: the rule before, every microbatch drawing the same masks)."""
    graphdef, state = nnx.split(layers)
    n = len(jax.tree.leaves(state)[0])

    def run(j, x):  # microbatch j through the blocks in order
        def keys_of(v):
            if fold and isinstance(v, nnx.RngKey):  # (L,) keys: one per layer
                return v.replace(jax.vmap(lambda k: jax.random.fold_in(k, j))(v.get_value()))
            return v

        folded = jax.tree.map(keys_of, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        for layer in range(n):
            x = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer: a[i], folded))(x)
        return x

    m = microbatches  # (B, ...) -> (M, B/M, ...), [j] = rows j, j+M, ...
    micro = jnp.swapaxes(h.reshape(h.shape[0] // m, m, *h.shape[1:]), 0, 1)
    out = jax.vmap(run)(jnp.arange(m), micro)  # one program for all microbatches
    return jnp.swapaxes(out, 0, 1).reshape(h.shape)
