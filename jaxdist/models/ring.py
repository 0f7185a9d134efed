"""The ring of ``--seq-attention ring``: each device's queries against every key/value
block, the blocks passed round the ``seq`` group with ``lax.ppermute`` and folded into an
online softmax (a running max and sum per query, as flash attention does). Run inside a
``shard_map`` manual over seq (``jaxdist.models.attention``), on (B, T/S, heads, Dh)
blocks.

Causal attention without a window runs **balanced** (``balanced_ring``): device r's
contiguous positions are first exchanged so that it holds chunks r and 2S-1-r of the
sequence cut in 2S (the zig-zag order), every hop then costs every device the same
half block (C queries x 2C keys or 2C x C, C = T/2S), and the output goes back to the
contiguous order. Contiguous, device S-1 would attend S blocks while device 0 attends
one, and every step would wait for it. The exchange costs two ``ppermute``s of half
blocks for q, k, v and for the output; the sequence must cut into 2S equal chunks.
Non-causal attention is balanced as it is, and a window keeps the contiguous ring
(``contiguous_ring``), whose hops stop where the window ends.

Both count their work when asked (``work=True``): the (query, key) score entries each
device computed, executed branch by branch, which is how ``tests/test_ring_balance.py``
measures the balance.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

SEQ = "seq"  # the mesh axis (jaxdist.parallel.device_mesh.AXES)


def scores(q, k):
    """(B, Tq, H, Dh) x (B, Tk, H, Dh) -> (B, H, Tq, Tk) float32, scaled by 1/sqrt(Dh)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale


def causal_mask(tq: int, tk: int, q_start, k_start, window: int = 0):
    """(Tq, Tk): True where key position k_start + j is at or before q_start + i (and,
    with a window, fewer than ``window`` positions before it)."""
    q_pos = q_start + jnp.arange(tq)
    k_pos = k_start + jnp.arange(tk)
    behind = q_pos[:, None] - k_pos[None, :]  # how far each key is behind each query
    return (behind >= 0) & (behind < window) if window else behind >= 0


def fold(state, q, k, v, mask=None):
    """The online softmax: ``state`` = (running max (B, H, Tq), running sum (B, H, Tq),
    unnormalised output (B, Tq, H, Dh), float32) with one more K/V block folded in."""
    group = q.shape[2] // k.shape[2]  # query heads per key/value head (GQA)
    if group > 1:  # (B, Tk, K, Dh) -> (B, Tk, H, Dh): head h reads kv head h // group
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = scores(q, k)  # (B, H, Tq, Tk)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    block_max = logits.max(-1)
    if state is None:  # the first block (the diagonal one: every row has a key)
        top, rescale = block_max, None
    else:
        top = jnp.maximum(state[0], block_max)
        rescale = jnp.exp(state[0] - top)  # (B, H, Tq): the old terms at the new max
    p = jnp.exp(logits - top[..., None])
    total = p.sum(-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    if rescale is not None:
        total = total + state[1] * rescale
        out = out + state[2] * rescale.transpose(0, 2, 1)[..., None]
    return top, total, out


def ring(q, k, v, segments=None, *, causal: bool, window: int = 0, work: bool = False):
    """``--seq-attention ring`` on this device's block: balanced where causal without a
    window, else contiguous (the module). ``work``: also this device's score entries.
    ``segments`` (B, Tq) int: each position's document (``--document-mask``); they
    travel with their key/value block and each block's mask ANDs the same document."""
    if causal and not window:
        return balanced_ring(q, k, v, segments, work=work)
    return contiguous_ring(q, k, v, segments, causal=causal, window=window, work=work)


def _and(mask, q_segments, k_segments):
    """``mask`` (or none) and, with segment ids, same document: (B, 1, Tq, Tk) bool."""
    if q_segments is None:
        return mask
    same = (q_segments[:, :, None] == k_segments[:, None, :])[:, None]
    return same if mask is None else mask & same


def contiguous_ring(q, k, v, segments=None, *, causal: bool, window: int = 0, work=False):
    """One device's queries against every K/V block, the blocks passed round the ring:
    at hop s device r holds the block of device (r - s) mod S."""
    size, me = lax.axis_size(SEQ), lax.axis_index(SEQ)
    forward = [(i, (i + 1) % size) for i in range(size)]
    tq = q.shape[1]
    mask = causal_mask(tq, tq, 0, 0, window)[None, None] if causal else None
    # With a window, hops whose block lies wholly beyond it are never made: the nearest
    # key of hop s's block is s Tq - (Tq - 1) positions behind the farthest query.
    hops = min(size, -(-(window - 1) // tq) + 1) if window else size
    block = (k, v, segments)  # the segment ids (or None) travel with their keys
    arriving = lax.ppermute(block, SEQ, forward) if hops > 1 else None  # during hop 0
    state = fold(None, q, k, v, _and(mask, segments, segments))  # hop 0: the diagonal
    entries = jnp.int32(tq * tq)
    for hop in range(1, hops):
        k, v, k_seg = arriving
        if hop + 1 < hops:  # the next block's send, issued before this block's arithmetic
            arriving = lax.ppermute((k, v, k_seg), SEQ, forward)
        # hop s's keys sit exactly s Tq positions earlier than the diagonal's: a fixed mask
        far = causal_mask(tq, tq, hop * tq, 0, window)[None, None] if window else None
        far = _and(far, segments, k_seg)
        if causal:  # block (r - hop) mod S is earlier than r iff hop <= r; else skipped
            folded = functools.partial(fold, q=q, k=k, v=v, mask=far)
            state = lax.cond(hop <= me, folded, lambda s: s, state)
            entries += jnp.where(hop <= me, tq * tq, 0)
        else:
            state = fold(state, q, k, v, far)
            entries += tq * tq
    out = finish(state, q.dtype)
    return (out, entries) if work else out


def balanced_ring(q, k, v, segments=None, *, work: bool = False):
    """Causal ring attention in the zig-zag order: the same work on every device; the
    segment ids (or None) reordered as the positions are, and travelling with k, v."""
    size, me = lax.axis_size(SEQ), lax.axis_index(SEQ)
    c = q.shape[1] // 2  # a chunk: T / 2S positions
    forward = [(i, (i + 1) % size) for i in range(size)]
    q, k, v = to_zigzag(q), to_zigzag(k), to_zigzag(v)  # chunks me and 2S-1-me
    q_seg = k_seg = None if segments is None else to_zigzag(segments)
    arriving = lax.ppermute((k, v, k_seg), SEQ, forward) if size > 1 else None
    # hop 0, its own chunks: each causal within itself, the later one seeing the earlier
    pos = jnp.concatenate([me * c + jnp.arange(c), (2 * size - 1 - me) * c + jnp.arange(c)])
    diagonal = _and((pos[:, None] >= pos[None, :])[None, None], q_seg, k_seg)
    state = fold(None, q, k, v, diagonal)
    entries = jnp.int32(4 * c * c)
    for hop in range(1, size):
        k, v, k_seg = arriving
        if hop + 1 < size:
            arriving = lax.ppermute((k, v, k_seg), SEQ, forward)
        # the block of device r' = (me - hop) mod S: chunks r' and 2S-1-r'. Earlier
        # (r' < me): every query sees chunk r' and none sees 2S-1-r'. Later: only the
        # later query chunk sees them, both. C x 2C or 2C x C either way.
        segs = dict(q_seg=q_seg, k_seg=k_seg)
        early = functools.partial(_all_queries_first_keys, q=q, k=k, v=v, c=c, **segs)
        late = functools.partial(_late_queries_all_keys, q=q, k=k, v=v, c=c, **segs)
        state = lax.cond((me - hop) % size < me, early, late, state)
        entries += 2 * c * c
    out = from_zigzag(finish(state, q.dtype))
    return (out, entries) if work else out


def _all_queries_first_keys(state, q, k, v, c, q_seg=None, k_seg=None):
    mask = None if q_seg is None else _and(None, q_seg, k_seg[:, :c])
    return fold(state, q, k[:, :c], v[:, :c], mask)


def _late_queries_all_keys(state, q, k, v, c, q_seg=None, k_seg=None):
    top, total, out = state
    mask = None if q_seg is None else _and(None, q_seg[:, c:], k_seg)
    later = fold((top[..., c:], total[..., c:], out[:, c:]), q[:, c:], k, v, mask)
    return (
        jnp.concatenate([top[..., :c], later[0]], axis=-1),
        jnp.concatenate([total[..., :c], later[1]], axis=-1),
        jnp.concatenate([out[:, :c], later[2]], axis=1),
    )


def finish(state, dtype):
    """The online softmax's output: the unnormalised sum over the running sum."""
    _, total, out = state
    return (out / total.transpose(0, 2, 1)[..., None]).astype(dtype)


def _zigzag_pairs(size: int) -> tuple[list, list]:
    """The ppermutes taking device r's contiguous chunks 2r and 2r+1 (of the sequence cut
    in 2S) to where the zig-zag order keeps chunk j: device j if j < S, else 2S-1-j."""

    def home(j):
        return j if j < size else 2 * size - 1 - j

    return [(r, home(2 * r)) for r in range(size)], [(r, home(2 * r + 1)) for r in range(size)]


def to_zigzag(x):
    """(B, 2C, ...) this device's chunks 2r, 2r+1 -> (B, 2C, ...) chunks r, 2S-1-r."""
    size, c = lax.axis_size(SEQ), x.shape[1] // 2
    pairs_a, pairs_b = _zigzag_pairs(size)
    a = lax.ppermute(x[:, :c], SEQ, pairs_a)  # an even chunk: first on an even device
    b = lax.ppermute(x[:, c:], SEQ, pairs_b)
    even = lax.axis_index(SEQ) % 2 == 0
    return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], axis=1)


def from_zigzag(x):
    """The inverse of ``to_zigzag``."""
    size, c = lax.axis_size(SEQ), x.shape[1] // 2
    pairs_a, pairs_b = _zigzag_pairs(size)
    even = lax.axis_index(SEQ) % 2 == 0
    first, second = x[:, :c], x[:, c:]
    a = lax.ppermute(jnp.where(even, first, second), SEQ, [(d, r) for r, d in pairs_a])
    b = lax.ppermute(jnp.where(even, second, first), SEQ, [(d, r) for r, d in pairs_b])
    return jnp.concatenate([a, b], axis=1)
