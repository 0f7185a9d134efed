"""The one pure training step, shared by every strategy.

``train_step(state, batch) -> (state, metrics)`` sees the batch rows of one replica
(pmap, shard_map) or the whole global batch (gspmd). The only thing a strategy changes
is ``mean_over_replicas``: ``lax.pmean`` over the data axis for pmap and shard_map, the
identity for gspmd (where the loss is already the global mean and XLA inserts the
all-reduce of the gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # trainable (nnx.Param), float32 master weights
    rest: nnx.State  # other model variables (none for the built-in models)
    opt_state: optax.OptState


def init_state(model: nnx.Module, tx: optax.GradientTransformation):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = TrainState(jnp.zeros((), jnp.int32), params, rest, tx.init(params))
    return graphdef, state


def split_microbatches(batch, k: int):
    """(B, ...) -> (k, B/k, ...) with microbatch i = rows i, i+k, i+2k, ...

    Strided, not blocked: under gspmd the global batch is sharded on its first axis in
    contiguous blocks of B/N rows, and a strided split keeps every microbatch's rows on
    the device that already holds them (blocked would need an all-to-all)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grad_accum: int,
    mean_over_replicas: Callable = lambda tree: tree,
):
    def loss_of(params, rest, batch):
        loss, aux = loss_fn(nnx.merge(graphdef, params, rest), batch)
        return loss, aux

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def grads_and_loss(state, batch):
        if grad_accum == 1:
            return grad_fn(state.params, state.rest, batch)
        micro = split_microbatches(batch, grad_accum)

        def add(acc, mb):
            out = grad_fn(state.params, state.rest, mb)
            return jax.tree.map(jnp.add, acc, out), None

        first = jax.tree.map(lambda x: x[0], micro)
        rest = jax.tree.map(lambda x: x[1:], micro)
        total, _ = jax.lax.scan(add, grad_fn(state.params, state.rest, first), rest)
        # Equal-size microbatches: the mean of their means is the mean over the batch.
        return jax.tree.map(lambda x: x / grad_accum, total)

    def train_step(state: TrainState, batch):
        (loss, aux), grads = grads_and_loss(state, batch)
        loss, aux, grads = mean_over_replicas((loss, aux, grads))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
            **aux,
        }
        return TrainState(state.step + 1, params, state.rest, opt_state), metrics

    return train_step
