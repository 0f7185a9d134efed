"""The interleaved (circular) pipeline schedule: V virtual stages per device.

The stack's L layers are cut into S V chunks of L / (S V) layers; chunk c runs on device
c mod S, so a microbatch goes round the ring of S devices V times. At tick t, device s
runs iteration i = t - s: microbatch i mod M, on its pass i // M (chunk (i // M) S + s).
Device S - 1 sends each output round to device 0, which keeps it until that microbatch's
next pass, M ticks after its last one started: M >= S is needed (``pipeline.plan``
refuses fewer). V M + S - 1 ticks, each 1/V of a GPipe tick: the bubble is
(S - 1) / (V M + S - 1). The backward pass is what ``jax.grad`` makes of the ticks.

The stack is stored in logical order, split contiguously over ``stage``: device s holds
chunks s V, ..., s V + V - 1, not s, s + S, .... ``relaid`` permutes the chunks inside
the step (a reshape and a transpose of each (L, ...) array, which XLA turns into
collective permutes over ``stage``), and ``jax.grad`` permutes the gradient back. So the
model, its initial values and its checkpoints are the ones the other schedules have.
Cost per device and step: a second copy of its stage's weights (and of their gradient),
and ``moved_chunks`` of the S V chunks cross devices each way (S = 4, V = 2: 6 of 8).
Measured by experiments/pipeline.py (GPT d_model 256, 8 layers of 3 MiB, S = 4): a 6 MiB
copy per device, and XLA's collectives for the re-lay alone send 9 MiB per device, twice
the 18 MiB / 4 devices that must move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.models.stack import scan_layers
from jaxdist.parallel.step import split_microbatches
from jaxdist.parallel.strategies.pipeline import (
    STAGE,
    from_stage,
    in_f32_on_cpu,
    index_tree,
    join_microbatches,
    microbatch_streams,
    on_stages,
    put_where,
    varying_over_stage,
    where_tree,
)


@in_f32_on_cpu
def interleaved(apply, stacked, x, *, mesh: Mesh, microbatches: int, virtual: int):
    """``scan_layers(apply, stacked, x)`` by the stages of ``mesh``, ``virtual`` chunks of
    layers per device. ``stacked``: (L, ...) leaves split over ``stage``; ``x``: (B, ...)."""
    stages = mesh.shape[STAGE]

    def per_stage(local, x):  # local: (V L/(S V), ...), chunks s, s + S, ...
        return circular_ticks(apply, local, x, stages, microbatches, virtual)

    relaid = jax.tree.map(lambda a: relay(a, stages, virtual), stacked)
    return on_stages(per_stage, mesh, (P(STAGE), P()), P())(relaid, x)


def relay(layers, stages: int, virtual: int):
    """(L, ...) in logical order -> the order in which the devices' contiguous blocks
    hold chunks c = u S + s: device s's slot u (rows [(s V + u) k, (s V + u + 1) k))."""
    k = layers.shape[0] // (stages * virtual)  # layers per chunk
    chunks = layers.reshape(virtual, stages, k, *layers.shape[1:])  # [u, s]: chunk u S + s
    return jnp.swapaxes(chunks, 0, 1).reshape(layers.shape)


def moved_chunks(stages: int, virtual: int) -> int:
    """How many of the S V chunks ``relay`` moves to another device: chunk c is stored on
    device c // V and runs on device c mod S."""
    return sum(c // virtual != c % stages for c in range(stages * virtual))


def circular_ticks(apply, local, x, stages: int, m: int, virtual: int):
    """Per stage: the stack's output (B, ...), the same on every stage."""
    stage, last = lax.axis_index(STAGE), stages - 1
    inputs = split_microbatches(x, m)  # (M, B/M, ...): rows i, i + M, ...
    chunks = jax.tree.map(lambda a: a.reshape(virtual, -1, *a.shape[1:]), local)  # (V, k, ...)
    ring = [(s, (s + 1) % stages) for s in range(stages)]

    def tick(carry, t):
        received, waiting, outputs = carry
        i = jnp.maximum(t - stage, 0)  # this device's iteration
        index, turn = i % m, jnp.minimum(i // m, virtual - 1)  # microbatch, pass
        # Device 0 (iteration t) starts a microbatch's first pass from the input, later
        # passes from what came round the ring; the others work on what they were sent.
        # Indexed by t, the same on every stage: a stage-dependent index would make the
        # backward pass all-reduce the whole (M, B/M, ...) input's cotangent every tick.
        zero_index, zero_turn = t % m, t // m
        fresh, again = index_tree(inputs, zero_index), index_tree(waiting, zero_index)
        h = where_tree(stage == 0, where_tree(zero_turn == 0, fresh, again), received)
        chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, turn, keepdims=False), chunks)
        y = scan_layers(apply, microbatch_streams(chunk, index), h)
        final = (stage == last) & (t - stage >= (virtual - 1) * m) & (t - stage < virtual * m)
        outputs = put_where(outputs, index, y, final)
        sent = lax.ppermute(y, STAGE, ring)
        came = t - last  # device S - 1's iteration: what device 0 just received
        keep = (stage == 0) & (came >= 0) & (came < (virtual - 1) * m)
        waiting = put_where(waiting, jnp.maximum(came, 0) % m, sent, keep)
        return (sent, waiting, outputs), None

    zeros = varying_over_stage(jax.tree.map(jnp.zeros_like, inputs))
    start = (jax.tree.map(lambda a: a[0], zeros), zeros, zeros)
    (_, _, outputs), _ = lax.scan(tick, start, jnp.arange(virtual * m + last))
    return join_microbatches(from_stage(last, outputs))
