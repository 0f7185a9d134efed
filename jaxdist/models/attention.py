"""Attention that runs split over the ``seq`` mesh axis: ``attention(q, k, v)``.

Sequence parallelism splits activations (B, T, D) along T over ``seq``: each of the S
devices of a seq group holds T/S positions of every row. Everything in a transformer
block but attention works on each position alone, so only attention must see the other
devices' keys and values. This function does that; a model opts in with one line::

    # before: att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    att = jaxdist.attention(q, k, v, causal=True)

q, k, v are (B, T, H, D/H), as ``jax.nn.dot_product_attention`` takes them; k and v may
have fewer heads K (grouped-query attention: K divides H, query head h reads key/value
head h // (H/K), as transformers' ``repeat_kv`` pairs them). ``window`` W > 0 (causal
only): each query attends to the W latest positions, itself included (Mistral's sliding
window; transformers' mask ``kv_idx > q_idx - W``). Without a mesh, or with seq = 1, it
*is* ``jax.nn.dot_product_attention`` (``implementation`` passed on; the window as its
``local_window_size=(W - 1, 0)``). Under a mesh with
seq = S > 1 (the ambient one: ``jax.sharding.get_abstract_mesh()``, which jaxdist's step
sets, and which ``jax.set_mesh`` or a ``shard_map`` set for a user's own code) it runs
inside a ``jax.shard_map`` manual over ``seq`` only; the batch, heads (``model``) and
any other axes stay with the compiler. Three ways (``seq_attention``):

- ``"gather"``: all-gather the keys and values over seq, (B, T/S, H, D/H) -> (B, T, ...),
  and attend each device's T/S queries to all T with the causal offset of its block:
  query i of device r sits at position r T/S + i. Simple; K and V whole on every device.
- ``"all-to-all"`` (DeepSpeed's Ulysses): one ``lax.all_to_all`` each turns q, k and v
  from T/S positions of every head into all T positions of H/S heads (K/S key/value
  heads), each device attends its heads over the whole sequence (``jax.nn.dot_product_
  attention``, causal and windowed as unsplit, with ``implementation`` passed on: a
  fused kernel applies), and one more turns the output back. Four all-to-alls of
  (B, T/S, heads, Dh) each, whatever S: less on the wire than the ring's S - 1 hops of
  K/V blocks once S > 2 or so. S must divide the key/value heads K (a ``ConfigError``
  names both); query head h keeps reading key/value head h // (H/K).
- ``"ring"`` (``jaxdist.models.ring``): the K/V blocks travel round the seq group with
  ``lax.ppermute``, S - 1 hops, and each device folds block after block into an online
  softmax (a running max and sum per query, as flash attention does): the forward pass
  holds two K/V blocks at a time (the backward pass keeps each hop's, as gather keeps
  all). The next block's send is issued before the current block's arithmetic, so the
  compiler may overlap them. Causal without a window it is balanced: the positions are
  exchanged into the zig-zag order first (device r holds chunks r and 2S-1-r of the
  sequence cut in 2S; T must divide by 2S) and back after, so every device computes
  the same half block per hop. With a window it stays in contiguous order: a block is
  masked where part of it is out of reach and not visited where all of it is (the ring
  stops after ceil((W - 1) / (T/S)) hops). Key/value blocks travel with their K heads;
  each hop repeats them to H for its arithmetic.

``segment_ids`` (B, T) int (``--document-mask``, ``jaxdist.models.documents``): a query
attends only to keys of its own segment as well. Unsplit and under all-to-all it is an
explicit (B, 1, T, T) boolean mask ANDed with the causal one and the window, on XLA's
path: ``jax.nn.dot_product_attention``'s cuDNN path takes no segment ids here (only
padding lengths), so ``implementation="cudnn"`` with them is a ``ConfigError``.
Under all-to-all each device all-gathers the ids over seq; under gather they are
gathered with the keys; round the ring they travel with their key/value block (and
the balanced ring reorders them into the zig-zag order with the positions).

T must divide by S (a ``ConfigError`` names both). In the ring and gather paths the
arithmetic is XLA's (float32 logits and softmax statistics, as
``jax.nn.dot_product_attention``'s XLA path): a fused kernel (``implementation="cudnn"``)
is used unsplit and under all-to-all only.

A model that calls ``jax.nn.dot_product_attention`` itself still trains under a seq
axis, with the same numbers, but nothing is split: XLA keeps its sequence whole over seq
(each of the S devices computes every position of its rows), and where the batch itself
arrives split along T (``shard_batch`` of (B, T) tokens) XLA all-gathers it first. Its
memory per device is what it would be without the seq axis.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.models.ring import SEQ, causal_mask, ring

WAYS = ("ring", "gather", "all-to-all")


def attention(q, k, v, *, causal: bool = True, seq_attention: str = "ring",
              implementation=None, window: int = 0, segment_ids=None):  # fmt: skip
    """Softmax attention of q (B, T, H, Dh) over k, v (B, T, K, Dh) -> (B, T, H, Dh),
    split over the ambient mesh's ``seq`` axis when it has one (see the module);
    ``segment_ids`` (B, T) int: within each segment only (None: across all)."""
    if seq_attention not in WAYS:
        raise ConfigError(f"seq_attention: {seq_attention!r} is not one of {', '.join(WAYS)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {k.shape[2]} key/value heads do not divide {q.shape[2]}")
    if window and not causal:
        raise ValueError(f"attention: a window ({window}) of earlier positions is causal only")
    if segment_ids is not None and implementation == "cudnn":
        raise ConfigError(
            "--document-mask with --attention cudnn: jax.nn.dot_product_attention's cuDNN "
            "path takes no segment ids; use --attention xla (or auto)"
        )
    whole = functools.partial(  # attention over whole sequences: jax's own
        _whole, causal=causal, window=window,
        implementation="xla" if segment_ids is not None else implementation,
    )  # fmt: skip
    mesh = jax.sharding.get_abstract_mesh()
    seq = 1 if mesh.empty else dict(mesh.shape).get(SEQ, 1)
    if seq == 1:
        return whole(q, k, v, segment_ids)
    if seq_attention == "all-to-all":
        if segment_ids is None:
            return over_heads(whole, q, k, v)
        return over_heads(whole, q, k, v, segments=segment_ids)
    t = q.shape[1]
    if seq_attention == "ring" and causal and not window and t % seq == 0 and t // seq % 2:
        raise ConfigError(
            f"attention over seq={seq}: the balanced causal ring cuts the sequence into "
            f"2 x {seq} chunks, which {t} positions do not make; use a sequence length "
            f"divisible by {2 * seq}, or --seq-attention gather or all-to-all"
        )
    way = ring if seq_attention == "ring" else _gather_local
    way = functools.partial(way, causal=causal, window=window)
    return _per_device(way, mesh, q, k, v, segments=segment_ids)


def _whole(q, k, v, segments=None, *, causal: bool, window: int, implementation):
    """``jax.nn.dot_product_attention`` over whole sequences, within segments if given."""
    mask = None if segments is None else same_segment(segments, segments)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, implementation=implementation,
        local_window_size=(window - 1, 0) if window else None,
    )  # fmt: skip


def same_segment(q_segments, k_segments):
    """(B, Tq), (B, Tk) int -> (B, 1, Tq, Tk) bool: where query and key share a segment."""
    return (q_segments[:, :, None] == k_segments[:, None, :])[:, None]


def over_heads(attend, q, k, v, *args, segments=None):
    """``attend(q, k, v, *args)``, attention over whole sequences (q (B, T, H, Dh), k, v
    (B, T, K, Dh) -> (B, T, H, Dh)), run under the ambient mesh's ``seq`` axis as the
    all-to-all way does: each device attends H/S heads over all T positions. Without a
    seq axis it is ``attend`` itself. A model whose attention is its own (Gemma's
    soft-capped logits) splits over seq with it; ``args`` reach ``attend`` whole."""
    mesh = jax.sharding.get_abstract_mesh()
    seq = 1 if mesh.empty else dict(mesh.shape).get(SEQ, 1)
    seg = () if segments is None else (segments,)
    if seq == 1:
        return attend(q, k, v, *args, *seg)
    _check_heads_split(k.shape[2], seq)

    def to_heads(x):  # (B, T/S, H, Dh) -> (B, T, H/S, Dh): heads out, positions in
        return lax.all_to_all(x, SEQ, split_axis=2, concat_axis=1, tiled=True)

    def local(q, k, v, *args, segments=None):
        seg = () if segments is None else (lax.all_gather(segments, SEQ, axis=1, tiled=True),)
        out = attend(to_heads(q), to_heads(k), to_heads(v), *args, *seg)  # (B, T, H/S, Dh)
        return lax.all_to_all(out, SEQ, split_axis=1, concat_axis=2, tiled=True)

    return _per_device(local, mesh, q, k, v, *args, segments=segments)


def _per_device(local, mesh, q, k, v, *args, segments=None):
    """``local(q, k, v, *args)`` on each device's T/S positions, inside a ``shard_map``
    manual over seq only (``args`` whole on every device); ``segments`` (B, T), split
    as q is, reach ``local`` as its keyword ``segments`` (where given)."""
    seq = dict(mesh.shape)[SEQ]
    if segments is not None:  # split over seq as the positions: one more input
        run = _per_device(
            lambda q, k, v, seg, *a: local(q, k, v, *a, segments=seg), mesh, q, k, v,
            _Split(segments), *args,
        )  # fmt: skip
        return run
    if SEQ in mesh.manual_axes:  # already per device (a user's shard_map over seq)
        return local(q, k, v, *(a.value if isinstance(a, _Split) else a for a in args))
    t = q.shape[1]
    if t % seq:
        raise ConfigError(
            f"attention over seq={seq}: the sequence of {t} positions does not split into "
            f"{seq} equal blocks; use a sequence length divisible by {seq}"
        )
    spec = P(None, SEQ)  # (B, T, H, Dh): T over seq; the rest left to the compiler
    specs = [spec if isinstance(a, _Split) else P() for a in args]
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, spec, spec, *specs), out_specs=spec,
        axis_names={SEQ},
    )  # fmt: skip
    return run(q, k, v, *(a.value if isinstance(a, _Split) else a for a in args))


class _Split:
    """An argument of ``_per_device`` split over seq as q is (a (B, T) array)."""

    def __init__(self, value):
        self.value = value


def _check_heads_split(kv_heads: int, seq: int) -> None:
    if kv_heads % seq:
        raise ConfigError(
            f"--seq-attention all-to-all over seq={seq}: the {kv_heads} key/value heads do "
            f"not split into {seq} equal groups; use ring or gather, or a seq size "
            f"dividing {kv_heads}"
        )


def _gather_local(q, k, v, segments=None, *, causal: bool, window: int = 0):
    """One device's T/S queries against all T keys, gathered over seq (with their
    segment ids, where given)."""
    k_all = lax.all_gather(k, SEQ, axis=1, tiled=True)  # (B, T, K, Dh)
    v_all = lax.all_gather(v, SEQ, axis=1, tiled=True)
    tq = q.shape[1]
    mask = None
    if causal:  # query i of device r is position r Tq + i
        start = lax.axis_index(SEQ) * tq
        mask = causal_mask(tq, k_all.shape[1], start, 0, window)[None, None]
    if segments is not None:
        same = same_segment(segments, lax.all_gather(segments, SEQ, axis=1, tiled=True))
        mask = same if mask is None else mask & same
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask, implementation="xla")
