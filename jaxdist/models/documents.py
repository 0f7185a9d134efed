"""Document masking for packed token windows (``--document-mask``, ``--reset-positions``).

jaxdist's token files concatenate documents, each ended by an end-of-document id (EOS:
a tokenizer's ``eos_id`` in the sidecar, ``EOT`` = 256 for bytes), and a training window
cuts across them. With a document mask a token attends only to earlier tokens of its own
document. A token's *segment* is the number of EOS strictly before it in the window: the
EOS itself ends its document (it belongs to the one it closes). ``--reset-positions``
restarts positions (the GPT's learned table, the Llama's RoPE) at 0 at each document.

The segment ids and positions are per row (B, T), so they travel with the activations
through every runner of a stack (scan, pipeline stages and their microbatches, fsdp's
layer gathers), as an MoE model's ``Routed`` aux does: the blocks pass a ``Packed``
(the activations, which may themselves be a ``Routed``, and the two (B, T) arrays).

The loss (``jaxdist.losses``) drops the positions whose *input* is an EOS: their target
is the first token of the next document, which nothing of that document precedes
(Megatron's ``eod_mask_loss``); a cut position counts 0 in the mean over all
positions, so the loss is the same sum of rows on any split of the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

__all__ = ["Packed", "document_positions", "kept_targets", "segment_ids", "unpack"]


@struct.dataclass
class Packed:
    """What a document-masked model's blocks pass each other: the activations ``x``
    ((B, T, D), or an MoE model's ``Routed``), each position's ``segments`` and
    ``positions`` (B, T) int32."""

    x: Any
    segments: jax.Array
    positions: jax.Array


def segment_ids(tokens: jax.Array, eos_id: int) -> jax.Array:
    """(B, T) ids -> (B, T) int32: the number of ``eos_id`` strictly before each position."""
    ends = (tokens == eos_id).astype(jnp.int32)
    return jnp.cumsum(ends, axis=1) - ends


def document_positions(segments: jax.Array) -> jax.Array:
    """(B, T) segment ids -> (B, T) int32: each position's offset in its document (0 at
    its first token, or at the window's start for the document the window cuts)."""
    t = jnp.arange(segments.shape[1], dtype=jnp.int32)[None]
    first = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )
    start = lax.cummax(jnp.where(first, t, 0), axis=1)
    return t - start


def pack(x, tokens: jax.Array, eos_id: int, reset_positions: bool) -> Packed:
    """``x`` with ``tokens``' (B, T) segment ids and positions (0..T-1, or per document)."""
    segments = segment_ids(tokens, eos_id)
    if reset_positions:
        positions = document_positions(segments)
    else:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return Packed(x, segments, positions)


def unpack(x) -> tuple[Any, jax.Array | None, jax.Array | None]:
    """(the activations, segments, positions): the last two None where ``x`` is no
    ``Packed``."""
    if isinstance(x, Packed):
        return x.x, x.segments, x.positions
    return x, None, None


def repack(like, x):
    """``x`` in ``like``'s ``Packed`` (where ``like`` is one), else ``x``."""
    return like.replace(x=x) if isinstance(like, Packed) else x


def kept_targets(inputs: jax.Array, eos_id: int | None) -> jax.Array | None:
    """(B, T) float32: 1 where the next-token target is predicted, 0 where the input is
    an EOS (its target begins the next document); None where no document mask."""
    if eos_id is None:
        return None
    return (inputs != eos_id).astype(jnp.float32)


def same_segment(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """(B, Tq), (B, Tk) -> (B, 1, Tq, Tk) bool: where query and key share a document."""
    return (q_segments[:, :, None] == k_segments[:, None, :])[:, None]
