"""The key/value cache of autoregressive decoding, written once for the GPT and the Llama.

A cache holds, per layer, the keys and values of every position written so far in arrays
of a fixed size, ``{"k": (B, S, K, Dh), "v": (B, S, K, Dh)}`` with S the longest sequence
it serves (prompt and new tokens): slot j of row b holds position j of row b. A call
writes T new positions at each row's slot ``start[b]`` (``lax.dynamic_update_slice``,
vmapped over the rows) and attends its T queries to every slot at or before their own
position and, with a window W, fewer than W positions before it: slots beyond a row's
position (a shorter prompt's padding, or nothing yet) are masked. The shapes never
depend on the position, so one compiled decode step serves a whole generation.

Rows of a batch may sit at different positions (prompts of different lengths, each
written from slot 0, each row decoding from its own length): a row attends to exactly
the keys it would see alone, at its own positions.

Blocks in an ``nnx.List`` take a list of per-layer dicts; a ``Stack`` takes one dict of
(L, B, S, K, Dh) arrays, scanned over beside its stacked parameters (``run``). A block
decodes with ``block.cached(x, layer_cache, start) -> (x, layer_cache)``. Models know
nothing of devices: where the cache lives is the caller's (``jaxdist.generate``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxdist.models.stack import Stack


def empty(blocks, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> object:
    """Zeros for ``blocks`` (a list or a ``Stack``): ``length`` slots of ``batch`` rows."""
    shape = (batch, length, kv_heads, head_dim)  # (B, S, K, Dh)
    if isinstance(blocks, Stack):  # one (L, B, S, K, Dh) array each, L the stack's depth
        depth = jax.tree.leaves(nnx.state(blocks.layers, nnx.Param))[0].shape[0]
        shape = (depth, *shape)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in blocks]


def positions(start: jax.Array, t: int) -> jax.Array:
    """(B, T) int32: the positions of T new tokens of each row, from ``start`` (B,)."""
    return start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def write(cache: dict, k, v, start: jax.Array) -> dict:
    """``k``, ``v`` (B, T, K, Dh) written into ``cache`` at slots ``start`` (B,)."""

    def put(into, new):  # one row: (S, K, Dh) <- (T, K, Dh) at slot s
        return jax.vmap(lambda c, n, s: lax.dynamic_update_slice(c, n, (s, 0, 0)))(
            into, new.astype(into.dtype), start
        )

    return {"k": put(cache["k"], k), "v": put(cache["v"], v)}


def behind(start: jax.Array, t: int, slots: int) -> jax.Array:
    """(B, T, S) int: how many positions slot j lies behind each of the T new queries
    (negative: ahead of it, not yet visible)."""
    return positions(start, t)[:, :, None] - jnp.arange(slots)[None, None]


def attend(q, k, v, cache: dict, start: jax.Array, window: int = 0):
    """``k``, ``v`` (B, T, K, Dh) written into ``cache`` at slots ``start`` (B,), then
    ``q`` (B, T, H, Dh) attended over the cache -> ((B, T, H, Dh), the new cache)."""
    cache = write(cache, k, v, start)
    distance = behind(start, q.shape[1], cache["k"].shape[1])  # (B, T, S)
    mask = distance >= 0
    if window:  # the W latest positions, the query's own included (the training mask's)
        mask = mask & (distance < window)
    # (B, 1, T, S): the same mask for every head; XLA's kernel, as training's on CPU
    att = jax.nn.dot_product_attention(
        q, cache["k"], cache["v"], mask=mask[:, None], implementation="xla"
    )
    return att, cache


def run(blocks, x: jax.Array, cache, start: jax.Array, kinds: tuple[int, ...] | None = None):
    """``x`` (B, T, D) through ``blocks`` in order, each reading and writing its layer's
    cache -> (x, the new cache). Layers with kinds (``jaxdist.models.stack``) decode with
    ``cached(..., kind=k)``: a Stack's own, an unscanned list's ``kinds``."""
    if isinstance(blocks, Stack):  # scanned: the carry is x, the per-layer caches are xs
        graphdef, stacked = nnx.split(blocks.layers)
        kinds = None if blocks.kinds is None else jnp.asarray(blocks.kinds, jnp.int32)

        def layer(h, xs):
            state, layer_cache, kind = xs
            kw = {} if kind is None else {"kind": kind}
            return nnx.merge(graphdef, state).cached(h, layer_cache, start, **kw)

        return lax.scan(layer, x, (stacked, cache, kinds))
    out = []
    for i, (block, layer_cache) in enumerate(zip(blocks, cache, strict=True)):
        kw = {} if kinds is None else {"kind": kinds[i]}
        x, layer_cache = block.cached(x, layer_cache, start, **kw)
        out.append(layer_cache)
    return x, out
