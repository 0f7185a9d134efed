"""The 1F1B pipeline schedule: a stack's activations for one microbatch alive per stage
in the backward pass, instead of GPipe's M + S - 1 (S stages, M microbatches).

Only the stack is pipelined: the head and the loss run after it on every stage, so the
cotangent of microbatch 0's output exists only once all M microbatches have gone through
the whole forward pass. No backward step can start before the last forward step, as it
does in PipeDream's 1F1B; what the schedule can bound is what the forward keeps.

So ``one_f_one_b`` is a ``jax.custom_vjp`` around the pipelined stack:
- forward: GPipe's ticks (``pipeline.forward_ticks``), keeping only each stage's input
  for each microbatch, (M, B/M, ...) per stage: one layer's input per microbatch, not
  every layer's activations;
- backward: M + S - 1 ticks in which each stage takes one microbatch, runs its layers
  forward on the kept input (``jax.vjp``: 1 F) and at once backward (1 B) on the
  cotangent the next stage sent, sends the input's cotangent to the stage before it
  (``ppermute``) and adds the layers' gradient to its sum. One microbatch's activations
  are alive per stage at a time (at most S, as 1F1B promises; here 1).

Cost: F runs twice per microbatch (three times for the parts a block's ``--remat``
recomputes again); the bubble is GPipe's, (S - 1) / (M + S - 1), in both passes. A
forward schedule interleaved with the backward (PipeDream's order) would change
neither: it recomputes F as well, and holds up to S microbatches' activations.
Microbatch j's layers use keys folded with j in both passes, so dropout's masks are
GPipe's.

Against GPipe with ``--remat full`` (F twice too; each block's input kept for M + S - 1
microbatches): that keeps about as little when one microbatch's activations are large
(experiments/pipeline.py, GPT d_model 256, S = 4: temporaries 55 MiB against 1f1b's
85 MiB at M = 8, 52 against 57 at M = 16). 1f1b's share shrinks as B / M rows do; with
``--remat full`` as well it keeps the least (49 and 47 MiB, F three times).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.models.stack import scan_layers
from jaxdist.parallel.step import split_microbatches
from jaxdist.parallel.strategies.pipeline import (
    STAGE,
    forward_ticks,
    from_stage,
    in_f32_on_cpu,
    index_tree,
    join_microbatches,
    microbatch_streams,
    on_stages,
    put_where,
    where_tree,
)


@in_f32_on_cpu
def one_f_one_b(apply, stacked, x, *, mesh: Mesh, microbatches: int):
    """``scan_layers(apply, stacked, x)`` by the stages of ``mesh``, differentiable with
    the 1F1B backward pass. ``stacked``: (L, ...) leaves split over ``stage``; ``x``: (B, ...)."""
    stages, m = mesh.shape[STAGE], microbatches
    leaves, treedef = jax.tree.flatten(stacked)
    learned = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]

    def whole(params, others):  # the stack's state from its float and other leaves
        params, others = iter(params), iter(others)
        return jax.tree.unflatten(treedef, [next(params if f else others) for f in learned])

    def forward(params, others, x):
        def per_stage(params, others, x):
            return forward_ticks(apply, whole(params, others), x, stages, m, keep_inputs=True)

        return on_stages(per_stage, mesh, (P(STAGE), P(STAGE), P()), (P(), P(STAGE)))(
            params, others, x
        )

    def backward(params, others, kept, dy):
        def per_stage(params, others, kept, dy):
            run = stage_vjp(apply, lambda p: whole(p, others))
            return backward_ticks(run, params, kept, dy, stages, m)

        specs = (P(STAGE), P(STAGE), P(STAGE), P())
        return on_stages(per_stage, mesh, specs, (P(STAGE), P()))(params, others, kept, dy)

    @jax.custom_vjp
    def run(params, others, x):
        return forward(params, others, x)[0]

    def run_forward(params, others, x):
        y, kept = forward(params, others, x)  # kept: (S M, B/M, ...), M rows per stage
        return y, (params, others, kept)

    def run_backward(residuals, dy):
        params, others, kept = residuals
        d_params, dx = backward(params, others, kept, dy)
        # RNG keys and counters have no cotangent (float0: JAX's zero of an integer input)
        d_others = [np.zeros(o.shape, jax.dtypes.float0) for o in others]
        return d_params, d_others, dx

    run.defvjp(run_forward, run_backward)
    params = [leaf for leaf, f in zip(leaves, learned, strict=True) if f]
    others = [leaf for leaf, f in zip(leaves, learned, strict=True) if not f]
    return run(params, others, x)


def stage_vjp(apply, whole):
    """``(params, h, j) -> (y, vjp)``: this stage's layers on microbatch j's input ``h``,
    with j's RNG streams, and the function taking y's cotangent to (params', h')."""

    def run(params, h, index):
        def layers(params, h):
            return scan_layers(apply, microbatch_streams(whole(params), index), h)

        return jax.vjp(layers, params, h)

    return run


def backward_ticks(run, params, kept, dy, stages: int, m: int):
    """Per stage, the backward ticks: (the layers' gradient summed over microbatches, the
    input's cotangent (B, ...), the same on every stage). ``kept``: (M, B/M, ...), this
    stage's input per microbatch; ``dy``: (B, ...), the stack output's cotangent."""
    stage, last = lax.axis_index(STAGE), stages - 1
    cotangents = split_microbatches(dy, m)  # (M, B/M, ...), as the forward split x
    back = [(s + 1, s) for s in range(last)]  # stage s + 1 sends to s

    def tick(carry, t):
        received, grads, dx = carry
        # The last stage takes microbatches M-1, ..., 0 at ticks 0, ..., M-1 (the order
        # of GPipe's reversed ticks); stage s takes each one S-1-s ticks later.
        k = t - (last - stage)
        inside = (k >= 0) & (k < m)
        index = jnp.clip(m - 1 - k, 0, m - 1)
        h, mine = index_tree(kept, index), index_tree(cotangents, index)
        _, vjp = run(params, h, index)  # 1 F: the activations of this microbatch only
        d_params, d_h = vjp(where_tree(stage == last, mine, received))  # 1 B
        grads = jax.tree.map(lambda g, d: g + jnp.where(inside, d, 0), grads, d_params)
        dx = put_where(dx, index, d_h, (stage == 0) & inside)
        return (lax.ppermute(d_h, STAGE, back), grads, dx), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    dx = jax.tree.map(jnp.zeros_like, kept)  # varying, as kept is
    start = (jax.tree.map(lambda a: a[0], dx), zeros, dx)
    (_, grads, dx), _ = lax.scan(tick, start, jnp.arange(m + last))
    # Stage 0 holds the input's cotangent; every stage returns it, as it got x.
    return grads, join_microbatches(from_stage(0, dx))
