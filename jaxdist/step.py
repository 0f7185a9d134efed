"""The one pure training step, shared by every strategy.

``train_step(state, batch) -> (state, metrics)`` sees the rows of one replica (pmap,
shard_map) or the whole global batch (gspmd). Cross-replica averaging goes through
``mean_over_replicas``, which is ``lax.pmean`` over ``data`` in the first two and the
identity under gspmd (where the loss is already the global mean and XLA inserts the
all-reduce of the gradient).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.adapt import split_model
from jaxdist.errors import ModelError
from jaxdist.replicas import mean_over_replicas, step_key, sum_over_replicas


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # nnx.Param, float32 master weights
    batch_stats: nnx.State  # nnx.BatchStat: running statistics, averaged over replicas
    rng_state: nnx.State  # the model's RNG streams; reseeded every step, never updated
    opt_state: optax.OptState


def init_state(model: nnx.Module, tx: optax.GradientTransformation):
    graphdef, params, stats, rngs = split_model(model)
    state = TrainState(jnp.zeros((), jnp.int32), params, stats, rngs, tx.init(params))
    return graphdef, state


def split_microbatches(batch, k: int):
    """(B, ...) -> (k, B/k, ...) with microbatch i = rows i, i+k, i+2k, ...

    Strided, not blocked: under gspmd the global batch is sharded on its first axis in
    contiguous blocks of B/N rows, and a strided split keeps every microbatch's rows on
    the device that already holds them (blocked would need an all-to-all)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def normalize_loss_fn(loss_fn: Callable) -> Callable:
    """``loss_fn(model, batch[, rngs]) -> loss | (loss, aux)`` as ``(model, batch, rngs)
    -> (loss, aux)``, checking that the loss is a scalar."""
    try:
        takes_rngs = len(inspect.signature(loss_fn).parameters) >= 3
    except (TypeError, ValueError):
        takes_rngs = True
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def call(model, batch, rngs):
        out = loss_fn(model, batch, rngs) if takes_rngs else loss_fn(model, batch)
        loss, aux = out if isinstance(out, tuple) else (out, {})
        if jnp.shape(loss) != ():
            raise ModelError(
                f"loss function {name} must return a scalar loss (or (loss, aux)), "
                f"got an array of shape {jnp.shape(loss)}; take the mean over the batch"
            )
        return loss, aux

    return call


def reseeded(rng_state: nnx.State, key: jax.Array) -> nnx.State:
    """Every RNG stream of the model restarts from ``key`` (count 0) for this step, as
    ``nnx.reseed(model, **{stream: key})`` would; done on the state, before merging,
    because NNX forbids mutating a stream from inside ``jax.grad``."""

    def reset(var):
        if isinstance(var, nnx.RngKey):  # nnx.reseed stores Rngs(key)() = fold_in(key, 0)
            return var.replace(jax.random.fold_in(key, 0))
        if isinstance(var, nnx.RngCount):
            return var.replace(jnp.zeros_like(var.get_value()))
        return var

    return jax.tree.map(reset, rng_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    grad_accum: int = 1,
    seed: int = 0,
    schedule: optax.Schedule | None = None,
):
    loss_fn = normalize_loss_fn(loss_fn)

    def loss_of(params, stats, rng_state, batch, key):
        # copy=True: fresh Variables at this trace level, so BatchNorm may update them
        # inside jax.grad (sharing the caller's Variables raises TraceContextError).
        model = nnx.merge(graphdef, params, stats, reseeded(rng_state, key), copy=True)
        loss, aux = loss_fn(model, batch, nnx.Rngs(key))
        return loss, (aux, nnx.state(model, nnx.BatchStat))

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def grads_and_loss(state, batch, key):
        if grad_accum == 1:
            (loss, (aux, stats)), grads = grad_fn(
                state.params, state.batch_stats, state.rng_state, batch, key
            )
            return loss, aux, stats, grads

        def one(carry, index_and_mb):  # adds one microbatch's grads; stats carried in order
            stats, total = carry
            index, mb = index_and_mb
            (loss, (aux, stats)), grads = grad_fn(
                state.params, stats, state.rng_state, mb, jax.random.fold_in(key, index)
            )
            return (stats, jax.tree.map(jnp.add, total, (loss, aux, grads))), None

        micro = split_microbatches(batch, grad_accum)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(
            grad_fn, state.params, state.batch_stats, state.rng_state, first, key
        )
        (loss, (aux, _)), grads = shapes
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss, aux, grads))
        (stats, total), _ = jax.lax.scan(
            one, (state.batch_stats, zeros), (jnp.arange(grad_accum), micro)
        )
        # Equal-size microbatches: the mean of their means is the mean over the batch.
        loss, aux, grads = jax.tree.map(lambda x: x / grad_accum, total)
        return loss, aux, stats, grads

    def train_step(state: TrainState, batch):
        key = step_key(seed, state.step)
        loss, aux, stats, grads = grads_and_loss(state, batch, key)
        # Replicas agree on the global-batch gradient; running statistics are averaged too.
        loss, aux, stats, grads = mean_over_replicas((loss, aux, stats, grads))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        if isinstance(aux, dict):
            metrics.update(aux)
        new_state = TrainState(state.step + 1, params, stats, state.rng_state, opt_state)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, eval_fn: Callable):
    """``eval_step(state, batch) -> sums``: ``eval_fn(model, batch) -> {name: (B,)}``
    per-example values, summed with ``batch["mask"]`` as weights (0 on padding rows), plus
    ``count`` = the number of real rows; summed over replicas. Means are sums / count, so
    padding never counts, whatever the device count."""

    def eval_step(state: TrainState, batch):
        model = nnx.merge(graphdef, state.params, state.batch_stats, state.rng_state, copy=True)
        model.eval()  # dropout off, BatchNorm on running statistics
        mask = batch["mask"]  # (B,) 1.0 real, 0.0 padding
        per_example = eval_fn(model, {k: v for k, v in batch.items() if k != "mask"})
        sums = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in per_example.items()}
        sums["count"] = jnp.sum(mask)
        return sum_over_replicas(sums)

    return eval_step
