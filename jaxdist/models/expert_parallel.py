"""The routed experts of a ``MoE`` split over the ``expert`` mesh axis: ``routed(moe, x,
weights, experts)``.

Expert parallelism gives each of the N devices of an expert group E/N of the E experts
(the (E, D, F) and (E, F, D) kernels split on dim 0) and B/N of the batch's rows. Routing
(the router's logits, top-k, the aux losses) is computed before, by ``MoE`` itself, on
global arrays: the compiler splits it by rows like any other per-token layer. Here,
inside a ``jax.shard_map`` manual over the axes that split the rows (data, fsdp, expert:
the batch's own layout, so entering moves no row; ``model``, ``seq`` and ``stage`` stay
with the compiler, as ``jaxdist.models.attention`` leaves all but ``seq`` to it), each
device:

1. puts each of its (token, choice) pairs' rows in a send buffer per destination, the
   device that owns the pair's expert (expert e lives on device e // (E/N));
2. exchanges the buffers with one ``lax.all_to_all``: it now holds the rows that every
   device routed to its E/N experts;
3. runs its experts on them;
4. sends the results back with a second ``all_to_all`` to where the rows came from, and
   combines each token's k results with its routing weights, as ``MoE`` does unsplit.

The gradient runs the same way backwards (an all_to_all's transpose is an all_to_all).
The shared expert is not here: ``MoE`` applies it to every token, outside the exchange.
``MoE.__call__`` takes this path when the ambient mesh (``jax.sharding.get_abstract_mesh()``,
which jaxdist's step sets) has ``expert`` > 1; inside a ``shard_map`` already manual over
expert (jaxdist's shard_map strategy) the local part runs as it is. N must divide E, and
data x fsdp x expert the rows B (a ``ConfigError`` names the numbers).

Bytes on the wire. Ideally a device sends each of its tokens' k pairs once,
k D elements per token (a ragged all-to-all): k D x bytes out and k D x bytes back in
the forward pass, ``2 k D x bytes`` per token each way, and as much again backwards;
(N - 1)/N of it leaves the device. XLA:CPU has no ``ragged_all_to_all`` ("UNIMPLEMENTED:
HLO opcode ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), so the exchange
here is a plain all_to_all of static buffers, one per destination, sized for the worst
case:

With n the tokens a device holds (b rows of T):

- dropless (``capacity_factor=0``): a destination can receive every pair of my tokens
  that its E/N experts could take, at most m = min(k, E/N) per token (a token's k experts
  are distinct), so each of the N buffers holds n m rows: N n m D elements each way
  instead of n k D, N m / k times the ideal (e.g. E=8, k=2, N=4: m=2, 4x; E=4, k=2,
  N=4: m=1, 2x), plus one all_to_all of n m N int32 expert ids. Correct for any routing,
  wasteful when balanced: the price of static shapes.
- capacity (c > 0): the same per-sequence queue as unsplit ``MoE`` (each expert takes at
  most C = ceil(c T k / E) pairs of a sequence, by position, the same pairs dropped and
  counted), so the buffers are the unsplit (b, E, C, D) capacity buffer cut by
  destination: b E C D elements each way, about c times the ideal n k D.

A ``ragged_all_to_all`` path (GPU) is not offered: it is not proven here to compile for a
GPU target, and this module's exchange is the one that is tested.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError

EXPERT = "expert"  # the mesh axis (jaxdist.parallel.device_mesh.AXES)
ROW_AXES = ("data", "fsdp")  # the batch axes outside expert (device_mesh.BATCH_AXES)


def expert_split() -> int:
    """The ambient mesh's ``expert`` size (1 without a mesh or without the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(EXPERT, 1)


def splits_rows() -> bool:
    """Whether the ambient mesh splits the batch's rows (data, fsdp or expert > 1, and
    ``expert`` in it): then the dropless sort runs per device, in ``routed`` (with
    expert = 1 nothing is exchanged); unsplit, XLA would gather every row's expert ids to
    sort them on each device, and each device would run every token's experts. Under
    stages only per replica (expert manual: plain per-device code), as no shard_map
    lowers inside the stages' (``strategies.check_stage_nesting``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT not in mesh.axis_names:
        return False
    if dict(mesh.shape).get("stage", 1) > 1 and EXPERT not in mesh.manual_axes:
        return False  # gspmd's pipeline: the plain sort on the stage's rows
    return any(dict(mesh.shape).get(a, 1) > 1 for a in (*ROW_AXES, EXPERT))


def routed(moe, x: jax.Array, weights: jax.Array, experts: jax.Array):
    """The routed experts' output of ``MoE`` ``moe`` over the ambient mesh's expert axis:
    x (B, T, D) in ``moe.dtype``, weights (B, T, k) float32, experts (B, T, k) int32 ->
    ((B, T, D) float32, each row's dropped pairs (B,) float32), as ``MoE._capacity`` /
    ``_dropless``."""
    mesh = jax.sharding.get_abstract_mesh()
    n, e, b = dict(mesh.shape)[EXPERT], moe.n_experts, x.shape[0]
    if e % n:
        raise ConfigError(
            f"expert parallelism over expert={n}: {e} experts do not split into {n} equal "
            f"groups; use an expert size dividing {e}"
        )
    if moe.capacity_factor:
        from jaxdist.models.moe import capacity  # here: moe.py imports this module

        c = capacity(moe.capacity_factor, x.shape[1], moe.top_k, e)
        local = lambda *a: _capacity_local(*a, c=c, n=n, dtype=moe.dtype)  # noqa: E731
    else:
        local = lambda *a: _dropless_local(*a, n=n, dtype=moe.dtype)  # noqa: E731
    kernels = moe._kernels()  # gate, up (E, D, F); down (E, F, D)
    if EXPERT in mesh.manual_axes:  # already per replica: rows and kernels are local
        return local(x, weights, experts, *kernels)
    # Manual over every axis that splits rows: the batch arrives with rows over (data,
    # fsdp, expert), expert fastest, and in_specs of the same order move nothing. (Manual
    # over expert alone, Shardy wants expert outermost on the rows, and XLA gathers the
    # batch whole to reorder it; with fsdp the partitioner also fails a check.) Kernels
    # split over fsdp are gathered on entry, as fsdp gathers any weight before use.
    row_axes = tuple(a for a in (*ROW_AXES, EXPERT) if a in mesh.axis_names)
    row_axes = tuple(a for a in row_axes if a not in mesh.manual_axes)
    shards = math.prod(dict(mesh.shape)[a] for a in row_axes)
    if b % shards:
        raise ConfigError(
            f"expert parallelism: {b} rows do not split over {' x '.join(row_axes)} = "
            f"{shards} devices; use a batch divisible by {shards}"
        )

    # The kernels enter in their parameter dtype (float32), marked varying over the row
    # axes besides expert (they are the same on each: their gradients are summed over
    # them, a psum at the mark), then cast to moe.dtype: that psum is float32, as every
    # other gradient's reduction. Left to JAX, the mark falls on the bf16 cast, and a
    # bf16 psum inside a shard_map beside an auto axis (model) aborts XLA:CPU's
    # AllReducePromotion ("Invalid binary instruction opcode copy": its reducer ends in
    # a sharding annotation). In float32 this changes nothing.
    kernels = [w.get_value() for w in (moe.gate, moe.up, moe.down)]
    spread, run_local = tuple(a for a in row_axes if a != EXPERT), local

    def local(x, weights, experts, *kernels):
        kernels = [_varying(k, spread).astype(moe.dtype) for k in kernels]
        return run_local(x, weights, experts, *kernels)

    rows = P(row_axes)  # y (B, T, D) and dropped (B,) by rows, as the inputs
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(rows,) * 3 + (P(EXPERT),) * 3, out_specs=(rows, rows),
        axis_names=set(row_axes),
    )  # fmt: skip
    return run(x, weights, experts, *kernels)


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x``, the same on every device of ``axes``, marked varying over them (its
    gradient psum'd over them here): ``lax.pcast`` in this JAX, ``lax.pvary`` before."""
    if not axes:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


def _exchange(buffer: jax.Array) -> jax.Array:
    """(N, ...) per destination -> (N, ...) per source: block i goes to device i."""
    return lax.all_to_all(buffer, EXPERT, split_axis=0, concat_axis=0, tiled=True)


def _owner_of(experts: jax.Array, n: int, e: int):
    """Global expert ids -> (device that owns each, its index among that device's E/N)."""
    per = e // n
    return experts // per, experts % per


def _dropless_local(x, weights, experts, gate, up, down, *, n: int, dtype):
    """One device's rows x (b, T, D), routing (b, T, k), its E/N experts' kernels ->
    ((b, T, D) float32, (b,) zeros): every pair through its expert, none dropped."""
    b, t, d = x.shape
    k, per = experts.shape[-1], gate.shape[0]
    tokens, m = b * t, min(k, per)  # m: the most pairs of one token one device can take
    dest, local = _owner_of(experts.reshape(-1), n, per * n)  # (tokens*k,) pair p: token p//k
    onehot = jax.nn.one_hot(dest, n, dtype=jnp.int32)  # (tokens*k, N)
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # place in its buffer
    rows = x.reshape(tokens, d)[jnp.arange(tokens * k) // k]  # (tokens*k, D)
    send = jnp.zeros((n, tokens * m, d), x.dtype).at[dest, slot].set(rows)
    # each row's expert on its destination; per (an id no expert has) marks an empty slot
    ids = jnp.full((n, tokens * m), per, jnp.int32).at[dest, slot].set(local)
    recv = _exchange(send).reshape(n * tokens * m, d)  # every source's rows for my experts
    got = _exchange(ids).reshape(-1)
    order = jnp.argsort(got, stable=True)  # grouped by local expert, empty slots last
    sizes = jnp.bincount(got, length=per).astype(jnp.int32)  # empty slots not counted

    def grouped(lhs, rhs):
        return lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=dtype)

    grouped_rows = recv[order]
    out = grouped(jax.nn.silu(grouped(grouped_rows, gate)) * grouped(grouped_rows, up), down)
    out = jnp.zeros_like(out).at[order].set(out)  # back in received order
    back = _exchange(out.reshape(n, tokens * m, d))  # my rows' results, by destination
    pairs = back[dest, slot].reshape(b, t, k, d)
    y = jnp.einsum("btkd,btk->btd", pairs.astype(jnp.float32), weights)
    return y, jnp.zeros((b,), jnp.float32)


def _capacity_local(x, weights, experts, gate, up, down, *, c: int, n: int, dtype):
    """As ``MoE._capacity`` on one device's b whole sequences: the same (b, E, C, D)
    buffer (per sequence, an expert's pairs past its C-th dropped), cut by the device
    that owns each expert, exchanged, run, and sent back -> ((b, T, D) float32, each
    row's dropped pairs (b,) float32)."""
    b, t, d = x.shape
    k, per = experts.shape[-1], gate.shape[0]
    e = per * n
    flat = experts.reshape(b, t * k)  # per sequence, pairs in position order
    onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)  # (b, T*k, E)
    slot = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # (b, T*k)
    keep = slot < c
    seq, token = jnp.arange(b)[:, None], jnp.arange(t * k) // k
    buffer = jnp.zeros((b, e, c, d), x.dtype)
    buffer = buffer.at[seq, flat, slot].add(x[seq, token], mode="drop")  # kept pairs
    # (b, E, C, D) -> (N, b, E/N, C, D): block i holds the slots of device i's experts
    send = buffer.reshape(b, n, per, c, d).transpose(1, 0, 2, 3, 4)
    recv = _exchange(send)  # (N sources, b, E/N, C, D)
    hidden = jax.nn.silu(jnp.einsum("sbecd,edf->sbecf", recv, gate))
    hidden = hidden * jnp.einsum("sbecd,edf->sbecf", recv, up)
    out = jnp.einsum("sbecf,efd->sbecd", hidden, down).astype(x.dtype)
    out = _exchange(out).transpose(1, 0, 2, 3, 4).reshape(b, e, c, d)  # my buffer, run
    pairs = out[seq, flat, jnp.minimum(slot, c - 1)]  # (b, T*k, D)
    pairs = jnp.where(keep[..., None], pairs, 0).reshape(b, t, k, d)
    y = jnp.einsum("btkd,btk->btd", pairs.astype(jnp.float32), weights)
    return y, jnp.sum(~keep, axis=-1).astype(jnp.float32)
