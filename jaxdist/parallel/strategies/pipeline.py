"""Pipeline stages: a model's ``Stack`` of L identical blocks split over the ``stage``
mesh axis (the stacked "layers" axis maps to ``stage``: stage s holds layers
[s L/S, (s + 1) L/S)) and run on a GPipe schedule.

The batch is cut into M microbatches. At tick t, stage s runs its layers on microbatch
t - s and hands the result to stage s + 1 (``ppermute``); after M + S - 1 ticks the last
stage has every microbatch. Each stage idles S - 1 of the ticks: the bubble fraction is
(S - 1) / (M + S - 1), e.g. S = 2, M = 8: 1/9 = 11%. The backward pass is what ``jax.grad``
makes of this loop: the same schedule reversed, the sends turned around.

Microbatch j runs the layers with each of their RNG keys folded with j (the RNG contract of
``jaxdist.parallel.step``): dropout draws a mask per microbatch, not one for all of them.

Only the stack is pipelined; embeddings, the head and the loss run on every stage (they
are replicated over ``stage``), and XLA splits them over the other axes as usual.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError, ModelError
from jaxdist.models.stack import scan_layers
from jaxdist.parallel.step import split_microbatches

STAGE = "stage"
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


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of ticks a stage idles in a GPipe schedule: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def gpipe(apply, stacked, x, *, mesh: Mesh, microbatches: int):
    """``scan_layers(apply, stacked, x)``, computed by the stages of ``mesh`` in a GPipe
    schedule. ``stacked``: (L, ...) leaves split over ``stage``; ``x``: (B, ...)."""
    if x.dtype != jnp.float32 and mesh.devices.flat[0].platform == "cpu":
        # XLA:CPU's compiler aborts (AllReducePromotion: "Invalid binary instruction
        # opcode copy") on the bf16 schedule once a model axis splits it too: on CPU
        # the activations cross stages in float32; the layers still compute in bf16.
        dtype = x.dtype

        def apply_f32(layer, h):
            return apply(layer, h.astype(dtype)).astype(jnp.float32)

        y = gpipe(apply_f32, stacked, x.astype(jnp.float32), mesh=mesh, microbatches=microbatches)
        return y.astype(dtype)
    stages, m = mesh.shape[STAGE], microbatches
    last = stages - 1
    forward = [(s, s + 1) for s in range(last)]  # stage s sends to s + 1

    def per_stage(local, x):  # local: this stage's L/S layers; x: the whole batch
        stage = lax.axis_index(STAGE)
        inputs = split_microbatches(x, m)  # (M, B/M, ...): rows i, i + M, ...
        varying = _varying_over_stage

        def tick(carry, t):
            received, outputs = carry
            # Stage 0 starts microbatch t; the others work on what they were sent.
            first = lax.dynamic_index_in_dim(inputs, jnp.minimum(t, m - 1), keepdims=False)
            layers = microbatch_streams(local, jnp.clip(t - stage, 0, m - 1))
            y = scan_layers(apply, layers, jnp.where(stage == 0, first, received))
            done = t - last  # the microbatch the last stage finishes at this tick
            put = lax.dynamic_update_index_in_dim(outputs, y, jnp.maximum(done, 0), 0)
            outputs = jnp.where((stage == last) & (done >= 0), put, outputs)
            return (lax.ppermute(y, STAGE, forward), outputs), None

        start = (varying(jnp.zeros_like(inputs[0])), varying(jnp.zeros_like(inputs)))
        (_, outputs), _ = lax.scan(tick, start, jnp.arange(m + last))
        # Every stage gets the last stage's outputs: the rest of the model runs everywhere.
        outputs = lax.psum(jnp.where(stage == last, outputs, 0), STAGE)
        return join_microbatches(outputs)

    # Inside another shard_map (over the batch axes) the mesh is the one it left: the
    # context's, with those axes already manual.
    context = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
        per_stage,
        mesh=context if not context.empty and context.manual_axes else mesh,
        in_specs=(P(STAGE), P()),
        out_specs=P(),
        axis_names=frozenset({STAGE}),
    )(stacked, x)


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


def _varying_over_stage(x):
    """``x`` typed as differing across stages (as the scan's carry becomes once stages
    send to each other): ``lax.pcast`` in this JAX, ``lax.pvary`` in older ones."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, STAGE, to="varying")
    return lax.pvary(x, STAGE)


def join_microbatches(x):
    """(M, B/M, ...) -> (B, ...): the inverse of ``split_microbatches``."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


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
        bubble = bubble_fraction(self.stages, self.microbatches)
        return (
            f"pipeline: {self.stages} stages x {self.microbatches} microbatches (GPipe), "
            f"bubble (S-1)/(M+S-1) = {self.stages - 1}/{self.microbatches + self.stages - 1} "
            f"= {bubble:.1%}" + (f" ({self.why})" if self.why else "")
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
    virtual = virtual_stages if schedule == "interleaved" else 1
    m = (microbatches or 4 * stages) if has_stack else 0
    return Pipeline(stages, m, schedule=schedule, virtual=virtual)
