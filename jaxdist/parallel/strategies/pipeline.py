"""Pipeline stages: a model's ``Stack`` of L identical blocks split over the ``stage``
mesh axis (the stacked "layers" axis maps to ``stage``: stage s holds layers
[s L/S, (s + 1) L/S)), run on one of three schedules (``Pipeline.schedule``):

- ``gpipe``: the batch is cut into M microbatches. At tick t, stage s runs its layers on
  microbatch t - s and hands the result to stage s + 1 (``ppermute``); after M + S - 1
  ticks the last stage has every microbatch. Each stage idles S - 1 of the ticks: the
  bubble is (S - 1) / (M + S - 1), e.g. S = 2, M = 8: 1/9 = 11%. The backward pass is
  what ``jax.grad`` makes of this loop, the sends turned around: it keeps every tick's
  activations, M + S - 1 microbatches' worth per stage.
- ``1f1b``: the same forward ticks, keeping only each stage's input per microbatch; the
  backward pass runs one forward and one backward per tick on each stage
  (``pipeline_1f1b``): one microbatch's activations alive per stage, F run twice.
- ``interleaved``: V chunks of L / (S V) layers per device, chunk c on device c mod S;
  each microbatch goes round the ring V times (``pipeline_interleaved``): bubble
  (S - 1) / (V M + S - 1).

Microbatch j runs the layers with each of their RNG keys folded with j (the RNG contract of
``jaxdist.parallel.step``): dropout draws a mask per microbatch, not one for all of them,
and the same masks under every schedule.

Only the stack is pipelined; embeddings, the head and the loss run on every stage (they
are replicated over ``stage``), and XLA splits them over the other axes as usual.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError, ModelError
from jaxdist.models.stack import scan_layers
from jaxdist.parallel.step import split_microbatches
from jaxdist.parallel.strategies.stage_values import (
    STAGE,
    from_stage,
    index_tree,
    join_microbatches,
    put_where,
    varying_over_stage,
    where_tree,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# At most this many microbatches per stage: GPipe (Huang et al., 2019) finds the bubble
# negligible from M >= 4 S on, and more only shrinks each microbatch's matmuls. It was the
# fixed default, so a run whose rows it divides keeps the schedule it had.
PER_STAGE = 4


def auto_microbatches(stages: int, rows: int) -> tuple[int, str]:
    """(M, why): the largest M <= ``PER_STAGE`` x ``stages`` that divides ``rows``, the
    rows each pipeline replica holds per step (global batch / batch shards / grad-accum)."""
    cap = PER_STAGE * stages
    m = max(k for k in range(1, min(cap, rows) + 1) if rows % k == 0)
    return m, (
        f"M chosen: the largest count <= {cap} ({PER_STAGE} per stage) dividing the {rows} "
        "rows each pipeline replica holds per step"
    )


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The share of a stage's time spent idle: (S - 1) / (V M + S - 1); V = 1 but for the
    interleaved schedule, whose ticks each run 1/V of a stage's layers."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def gpipe(apply, stacked, x, *, mesh: Mesh, microbatches: int):
    """``scan_layers(apply, stacked, x)``, computed by the stages of ``mesh`` in a GPipe
    schedule. ``stacked``: (L, ...) leaves split over ``stage``; ``x``: (B, ...)."""
    stages = mesh.shape[STAGE]

    def per_stage(local, x):  # local: this stage's L/S layers; x: the whole batch
        return forward_ticks(apply, local, x, stages, microbatches)[0]

    return on_stages(per_stage, mesh, (P(STAGE), P()), P())(stacked, x)


def forward_ticks(apply, local, x, stages: int, m: int, keep_inputs: bool = False):
    """Per stage, the GPipe forward ticks: (the stack's output (B, ...), the same on every
    stage; with ``keep_inputs`` this stage's input for each microbatch (M, B/M, ...))."""
    stage, last = lax.axis_index(STAGE), stages - 1
    inputs = split_microbatches(x, m)  # (M, B/M, ...): rows i, i + M, ...

    def tick(carry, t):
        received, outputs, kept = carry
        # Stage 0 starts microbatch t; the others work on what they were sent.
        first = index_tree(inputs, jnp.minimum(t, m - 1))
        h = where_tree(stage == 0, first, received)
        index = jnp.clip(t - stage, 0, m - 1)
        if keep_inputs:  # only inside the schedule's M ticks: the rest would overwrite
            inside = (t >= stage) & (t - stage < m)
            kept = put_where(kept, index, h, inside)
        y = scan_layers(apply, microbatch_streams(local, index), h)
        done = t - last  # the microbatch the last stage finishes at this tick
        outputs = put_where(outputs, jnp.maximum(done, 0), y, (stage == last) & (done >= 0))
        return (lax.ppermute(y, STAGE, forward_pairs(stages)), outputs, kept), None

    zeros = varying_over_stage(jax.tree.map(jnp.zeros_like, inputs))
    kept = zeros if keep_inputs else None
    start = (jax.tree.map(lambda a: a[0], zeros), zeros, kept)
    (_, outputs, kept), _ = lax.scan(tick, start, jnp.arange(m + last))
    # Every stage gets the last stage's outputs: the rest of the model runs everywhere.
    return join_microbatches(from_stage(last, outputs)), kept


def forward_pairs(stages: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(stages - 1)]  # stage s sends to s + 1


def on_stages(per_stage, mesh: Mesh, in_specs, out_specs):
    """``per_stage`` as a function of global arrays, manual over ``stage`` only. Inside
    another shard_map (the per-replica region over the batch axes) the mesh is the one it
    left: the context's, with those axes already manual; and its per-device autodiff
    (``check_vma=False``) holds here too. Typed, the experts' all-to-all over a manual
    expert axis would make the stage carry vary over expert, and the scan's types differ."""
    context = jax.sharding.get_abstract_mesh()
    nested = not context.empty and bool(context.manual_axes)
    return jax.shard_map(
        per_stage,
        mesh=context if nested else mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset({STAGE}),
        check_vma=not nested,
    )


def in_f32_on_cpu(run):
    """``run(apply, stacked, x, **kw)`` with the activations crossing stages in float32
    on CPU: XLA:CPU's compiler aborts (AllReducePromotion: "Invalid binary instruction
    opcode copy") on the bf16 schedule once a model axis splits it too. The layers still
    compute in ``x``'s dtype."""

    @functools.wraps(run)
    def wrapped(apply, stacked, x, *, mesh: Mesh, **kw):
        dtypes = [a.dtype for a in jax.tree.leaves(x)]
        if all(d == jnp.float32 for d in dtypes) or mesh.devices.flat[0].platform != "cpu":
            return run(apply, stacked, x, mesh=mesh, **kw)
        treedef = jax.tree.structure(x)

        def cast(tree, back=False):  # each leaf to float32, or back to x's leaf's dtype
            leaves = jax.tree.leaves(tree)
            to = dtypes if back else [jnp.float32] * len(dtypes)
            cast_leaves = [a.astype(d) for a, d in zip(leaves, to, strict=True)]
            return jax.tree.unflatten(treedef, cast_leaves)

        def apply_f32(layer, h):
            return cast(apply(layer, cast(h, back=True)))

        return cast(run(apply_f32, stacked, cast(x), mesh=mesh, **kw), back=True)

    return wrapped


gpipe = in_f32_on_cpu(gpipe)


def microbatch_streams(stacked, index):
    """The layers' RNG streams as microbatch ``index`` of the schedule uses them: every
    key folded with ``index`` (the RNG contract of ``jaxdist.parallel.step``), so that
    microbatches draw their own dropout masks rather than one mask each."""

    def fold(variable):
        if not isinstance(variable, nnx.RngKey):
            return variable
        keys = variable.get_value()  # (layers,): fold_in takes one key at a time
        return variable.replace(jax.vmap(lambda k: jax.random.fold_in(k, index))(keys))

    return jax.tree.map(fold, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The stage axis of a mesh, as a model's layers use it."""

    stages: int
    microbatches: int  # 0: the stacked layers are split over stages but not scheduled
    why: str = ""  # how the count was chosen, when it was (auto_microbatches)
    schedule: str = "gpipe"  # gpipe | 1f1b | interleaved
    virtual: int = 1  # interleaved: layer chunks per device

    def describe(self) -> str:
        if not self.microbatches:
            return (
                f"stage={self.stages}: the model's stacked layers are split over {self.stages} "
                "stages, but it runs them with its own scan (no jaxdist Stack), so XLA moves "
                "each layer's weights to the batch: memory is split, the stages do not overlap"
            )
        s, m, v = self.stages, self.microbatches, self.virtual
        bubble = bubble_fraction(s, m, v)
        how = {
            "gpipe": "GPipe",
            "1f1b": "1F1B: the backward pass runs one forward and one backward a tick, one "
            "microbatch's activations alive per stage, the forward run twice",
            "interleaved": f"interleaved: {v} chunks of layers per device, each microbatch "
            f"{v} times round the stages",
        }[self.schedule]
        formula = f"(S-1)/(M+S-1) = {s - 1}/{m + s - 1}"
        if self.schedule == "interleaved":
            formula = f"(S-1)/(V*M+S-1) = {s - 1}/{v * m + s - 1}"
        return (
            f"pipeline: {s} stages x {m} microbatches ({how}), bubble {formula} = {bubble:.1%}"
            + (f" ({self.why})" if self.why else "")
        )

    def check_rows(self, global_rows: int, batch_shards: int, grad_accum: int) -> None:
        """Each device's rows of a loss call split into the microbatches."""
        per_device = global_rows // (batch_shards * grad_accum)
        if per_device % self.microbatches:
            raise ConfigError(
                f"pipeline: {per_device} rows per device per step (global batch {global_rows} "
                f"/ {batch_shards} batch shards / grad-accum {grad_accum}) do not split into "
                f"{self.microbatches} microbatches; use --microbatches dividing it (the "
                "command's default, 0, picks the largest up to 4 per stage that does), or a "
                "larger batch"
            )

    def check_layers(self, layers: int) -> None:
        """The interleaved schedule cuts a stack of ``layers`` into S x V equal chunks."""
        chunks = self.stages * self.virtual
        if self.schedule == "interleaved" and layers % chunks:
            raise ConfigError(
                f"--pipeline-schedule interleaved: {layers} layers do not split into "
                f"{self.stages} stages x {self.virtual} virtual stages = {chunks} equal chunks; "
                "use --virtual-stages V with L divisible by S x V, or another schedule"
            )


def plan(
    mesh: Mesh,
    has_stack: bool,
    stacked: list[str],
    microbatches: int,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
) -> Pipeline | None:
    """How the ``stage`` axis is used, or None without one; a model with nothing to split
    is an error. ``microbatches``: 0 = 4 per stage."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    stages = mesh.shape.get(STAGE, 1)
    if stages == 1:
        return None
    if not stacked:
        raise ModelError(
            f"the mesh has stage={stages} but the model has no stack of identical blocks to "
            "split into stages (no parameter with a leading 'layers' axis): build its blocks "
            "with jaxdist.models.stack.Stack (the built-in GPT does with --mesh stage=S), or "
            "drop stage from --mesh"
        )
    if schedule != "gpipe" and not has_stack:
        raise ConfigError(
            f"--pipeline-schedule {schedule}: the model runs its stacked layers with its own "
            "scan (no jaxdist.models.stack.Stack), so no schedule runs them; build the "
            "blocks with Stack, or leave the schedule at gpipe"
        )
    virtual = virtual_stages if schedule == "interleaved" else 1
    m = (microbatches or PER_STAGE * stages) if has_stack else 0
    if schedule == "interleaved":
        _check_interleaved(stages, m, virtual)
    return Pipeline(stages, m, schedule=schedule, virtual=virtual)


def _check_interleaved(stages: int, m: int, virtual: int) -> None:
    if virtual < 1:
        raise ConfigError(f"--virtual-stages {virtual}: at least 1 chunk of layers per device")
    if m < stages:
        # Device 0 starts microbatch j's pass v + 1 at tick j + (v + 1) M, and device S - 1
        # hands it back at the end of tick j + v M + S - 1: M ticks >= S are needed.
        raise ConfigError(
            f"--pipeline-schedule interleaved: {m} microbatches are fewer than the {stages} "
            f"stages; a microbatch comes back to stage 0 for its next pass S = {stages} "
            f"ticks after it left, but stage 0 wants it M = {m} ticks after: use "
            f"--microbatches >= {stages} (or the gpipe or 1f1b schedule)"
        )
