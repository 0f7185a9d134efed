"""The one pure training step, shared by every strategy.

``train_step(state, batch) -> (state, metrics)`` sees the rows of one replica (pmap,
shard_map) or the whole global batch (gspmd). Cross-replica averaging goes through
``mean_over_replicas``, which is ``lax.pmean`` over the data axis in the first two and
the identity under gspmd (where the loss is already the global mean and XLA inserts the
all-reduce of the gradient).

RNG contract: at optimizer step k, the key is ``fold_in(key(seed), k)``. Where the gradient
is computed per replica (pmap, shard_map, and gspmd's per-replica path: grad-accum, fsdp or
stage axes, ``strategies.wants_per_replica``), replica r then folds in r, its position over
the batch axes (data, fsdp, expert; expert fastest), which is also the block of global-batch
rows it holds: ``fold_in(.., r)``. Elsewhere under gspmd one key serves the global batch,
and the masks are the 1-device masks. With grad-accum, microbatch i (rows i, i+K, ...) folds
in i: ``fold_in(.., i)``. The model sees what flax's own ``nnx.reseed(model,
policy="match_shape", **{stream: key for each RNG stream})`` gives: every stream restarts
from that key, and streams of one name (e.g. several ``nnx.Dropout`` layers) get
``fold_in(key, 0)``, ``fold_in(key, 1)``, ... in graph order, so their masks differ (a
``Stack``'s stacked stream splits its key into one per layer). Inside a pipelined ``Stack``
(a stage axis), microbatch j of the GPipe schedule (rows j, j+M, ... of the rows the loss
sees) runs the layers with every RNG key folded with j (``pipeline.microbatch_streams``), so
no two microbatches share a mask. ``tests/dropout_contract.py`` is this contract as a plain
loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.models import stack
from jaxdist.parallel import step_checks
from jaxdist.parallel.bound_axes import bind_trivially
from jaxdist.parallel.collectives import mean_over_replicas, step_key, sum_over_replicas
from jaxdist.parallel.device_mesh import DATA
from jaxdist.parallel.user_loss import normalize_loss_fn


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # nnx.Param, float32 master weights
    batch_stats: nnx.State  # nnx.BatchStat: running statistics, averaged over replicas
    rng_state: nnx.State  # the model's RNG streams; reseeded every step, never updated
    opt_state: optax.OptState


def new_state(params, stats, rngs, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, stats, rngs, tx.init(params))


@dataclass(frozen=True)
class StepOptions:
    """How the step is built; everything but the model, loss and optimizer."""

    grad_accum: int = 1
    seed: int = 0
    schedule: optax.Schedule | None = None
    nan_policy: str = "halt"  # "halt": report, the loop stops; "skip": keep the old state
    batch_check: Callable | None = None  # batch -> (B,) bool, True for a valid row
    axis_name: str = DATA  # the per-device data axis under pmap/shard_map
    trivial_axes: tuple[str, ...] = field(default=())  # model axis names bound to size 1
    # gspmd with fsdp: params -> the layout they are used in (jaxdist.parallel.layout.gathered)
    use_params: Callable | None = None
    # how the model's layer stacks run (jaxdist.models.stack.runner): the pipeline's
    # GPipe schedule under a stage axis; None: a scan
    stack_runner: Callable | None = None
    # grads -> the optimizer state's layout, split over data (zero, ZeRO)
    shard_grads: Callable | None = None
    # host offload (jaxdist.parallel.offload): params / optimizer state, kept in host
    # memory between steps -> device memory inside the step
    params_in: Callable | None = None
    opt_state_in: Callable | None = None
    offload_activations: bool = False  # the blocks' saved matmul outputs in host memory
    # an explicit-style model's view of the mesh (jaxdist.parallel.explicit_view); None: none
    explicit_view: object = None


def split_microbatches(batch, k: int):
    """(B, ...) -> (k, B/k, ...) with microbatch i = rows i, i+k, i+2k, ...

    Strided, not blocked: under gspmd the global batch is sharded on its first axis in
    contiguous blocks of B/N rows, and a strided split keeps every microbatch's rows on
    the device that already holds them (blocked would need an all-to-all)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def reseeded(graphdef: nnx.GraphDef, params, stats, rng_state, key: jax.Array) -> nnx.State:
    """The model's RNG state after flax's ``nnx.reseed`` of every stream with ``key``.
    Done on a merged copy, outside ``jax.grad`` (NNX forbids mutating a stream there)."""
    model = nnx.merge(graphdef, params, stats, rng_state, copy=True)
    tags = {var.tag for _, var in nnx.to_flat_state(rng_state)}
    if tags:
        nnx.reseed(model, policy="match_shape", **dict.fromkeys(tags, key))
    return nnx.state(model, nnx.RngState)


def make_loss(
    graphdef: nnx.GraphDef, loss_fn: Callable, trivial_axes=(), stack_runner=None,
    offload=False, explicit_view=None,
) -> Callable:  # fmt: skip
    """``(params, stats, rng_state, batch, key) -> (loss, (metrics, new_stats))``: pure,
    the model merged inside, its own axis names bound (see ``jaxdist.parallel.bound_axes``).
    ``offload``: the blocks' remat moves their saved activations to host memory.
    ``explicit_view``: the model runs on that explicit view of the mesh."""
    loss_fn = normalize_loss_fn(loss_fn)

    def loss_of(params, stats, rng_state, batch, key):
        with in_view(explicit_view):
            if explicit_view is not None:
                params, (stats, rng_state), batch, key = explicit_view.enter(
                    params, (stats, rng_state), batch, key
                )
            # copy=True: fresh Variables at this trace level, so BatchNorm may update them
            # inside jax.grad (sharing the caller's Variables raises TraceContextError).
            model = nnx.merge(graphdef, params, stats, rng_state, copy=True)
            with stack.runner(stack_runner), stack.offloading_activations(offload):
                loss, metrics = loss_fn(model, batch, nnx.Rngs(key))
            out = (loss, (metrics, nnx.state(model, nnx.BatchStat)))
        return out if explicit_view is None else explicit_view.leave(out)

    return bind_trivially(loss_of, trivial_axes)


def in_view(explicit_view):
    """``explicit_view.running()``, or nothing without one."""
    return contextlib.nullcontext() if explicit_view is None else explicit_view.running()


def make_grads(graphdef, loss_fn: Callable, options: StepOptions = StepOptions()) -> Callable:
    """``grads(params, stats, rng_state, step, batch) -> (loss, metrics, stats, grads)``:
    the mean over the rows it is given (one replica's, or the global batch under gspmd),
    over ``grad_accum`` microbatches; nothing is averaged across replicas here."""
    o = options
    loss = make_loss(
        graphdef, loss_fn, o.trivial_axes, o.stack_runner, o.offload_activations, o.explicit_view
    )
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def grads_at(params, stats, rng_state, batch, key):
        rng_state = reseeded(graphdef, params, stats, rng_state, key)
        params = o.use_params(params) if o.use_params else params
        (loss, (metrics, stats)), grads = grad_fn(params, stats, rng_state, batch, key)
        return loss, metrics, stats, grads

    def grads(params, stats, rng_state, step, batch):
        key = step_key(o.seed, step, o.axis_name)
        if o.grad_accum == 1:
            return grads_at(params, stats, rng_state, batch, key)

        def one(carry, index_and_mb):  # adds one microbatch's grads; stats carried in order
            stats, total = carry
            index, mb = index_and_mb
            key_i = jax.random.fold_in(key, index)
            loss, metrics, stats, g = grads_at(params, stats, rng_state, mb, key_i)
            return (stats, jax.tree.map(jnp.add, total, (loss, metrics, g))), None

        micro = split_microbatches(batch, o.grad_accum)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(grads_at, params, stats, rng_state, first, key)
        loss, metrics, _, g = shapes
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss, metrics, g))
        (stats, total), _ = jax.lax.scan(one, (stats, zeros), (jnp.arange(o.grad_accum), micro))
        # Equal-size microbatches: the mean of their means is the mean over the batch.
        loss, metrics, g = jax.tree.map(lambda x: x / o.grad_accum, total)
        return loss, metrics, stats, g

    return grads


def make_train_step(
    graphdef, loss_fn: Callable, tx, options: StepOptions = StepOptions(), per_replica=None
):
    """``train_step(state, batch) -> (state, metrics)``. ``per_replica``: a strategy's
    wrapper that runs ``make_grads``' function once per replica (``shard_map`` over the
    batch axes) and returns global-batch values; without it the values are already global
    (gspmd) or are averaged here over the bound data axis (pmap)."""
    o = options
    grads_fn = make_grads(graphdef, loss_fn, o)
    if per_replica is not None:
        grads_fn = per_replica.grads(grads_fn)

    def train_step(state: TrainState, batch):
        params = o.params_in(state.params) if o.params_in else state.params
        loss, metrics, stats, grads = grads_fn(
            params, state.batch_stats, state.rng_state, state.step, batch
        )
        # Replicas agree on the global-batch gradient; running statistics are averaged too.
        loss, metrics, stats, grads = mean_over_replicas((loss, metrics, stats, grads), o.axis_name)
        grads = o.shard_grads(grads) if o.shard_grads else grads
        opt_state = o.opt_state_in(state.opt_state) if o.opt_state_in else state.opt_state
        before = (params, opt_state, state.batch_stats)  # in device memory, as the update
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm, status = step_checks.grad_norm_and_health(loss, grads)
        if o.nan_policy == "skip":  # a non-finite step leaves the state as it was
            finite = status[step_checks.NONFINITE] == 0
            new = (params, opt_state, stats)
            params, opt_state, stats = step_checks.keep_if(finite, new, before)
        if o.batch_check is not None:
            status.update(step_checks.first_bad_row(batch, o.batch_check, o.axis_name))
        metrics = {**metrics, "loss": loss, "grad_norm": grad_norm}
        metrics[step_checks.STATUS] = step_checks.status_vector(status)
        if o.schedule is not None:
            metrics["lr"] = o.schedule(state.step)
        new_state = TrainState(state.step + 1, params, stats, state.rng_state, opt_state)
        return new_state, metrics

    return train_step


def make_eval_step(
    graphdef: nnx.GraphDef, eval_fn: Callable, options: StepOptions, per_replica=None
):
    """``eval_step(state, batch) -> sums``: ``eval_fn(model, batch) -> {name: (B,)}``
    per-example values, summed with ``batch["mask"]`` as weights (0 on padding rows), plus
    ``count`` = the number of real rows; summed over replicas. Means are sums / count, so
    padding never counts, whatever the device count. ``graphdef`` is in eval mode."""

    def per_example(params, stats, rng_state, batch):
        island = options.explicit_view
        with in_view(island):
            if island is not None:
                key = jax.random.key(0)  # evaluation draws no randomness
                params, (stats, rng_state), batch, _ = island.enter(
                    params, (stats, rng_state), batch, key
                )
            model = nnx.merge(graphdef, params, stats, rng_state, copy=True)
            with stack.runner(options.stack_runner):
                values = eval_fn(model, batch)
        return values if island is None else island.leave(values)

    per_example = bind_trivially(per_example, options.trivial_axes)

    def sums(params, stats, rng_state, batch):
        mask = batch["mask"]  # (B,) 1.0 real, 0.0 padding
        rows = {k: v for k, v in batch.items() if k != "mask"}
        values = per_example(params, stats, rng_state, rows)
        totals = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in values.items()}
        totals["count"] = jnp.sum(mask)
        return sum_over_replicas(totals, options.axis_name)

    if per_replica is not None:
        sums = per_replica.sums(sums)

    def eval_step(state: TrainState, batch):
        params = options.params_in(state.params) if options.params_in else state.params
        return sums(params, state.batch_stats, state.rng_state, batch)

    return eval_step
