"""A small decoder-only transformer over bytes: tokens (B, T) int32 -> logits (B, T, vocab).

Parameters carry logical axis names (``nnx.with_partitioning``), Megatron-style: qkv and
fc column-parallel (embed, heads/mlp), proj and out row-parallel (heads/mlp, embed), the
token embedding (vocab, embed). They change nothing by themselves: ``jaxdist.parallel.layout``
maps them to mesh axes (a data-only mesh replicates everything). The model is built with
flax's eager sharding off, so it can be built anywhere, with or without a mesh.

The token embedding has ``padded_vocab(vocab_size, pad_vocab_to)`` rows, a multiple of 128
by default (257 -> 384, GPT-2's 50257 -> 50304), as GPT-2 and Megatron training code pads
it: a ``model`` axis of any power of two up to 128 divides the vocabulary, the tied matmul
gets an aligned width. The padded rows are never looked up (the data check keeps ids below
``vocab_size``) and are sliced off the logits, which stay (B, T, vocab_size).

For generation, ``init_cache`` and ``cached_features`` run the same blocks on new tokens
at explicit positions over a KV cache (``jaxdist.models.kv_cache``; ``jaxdist.generate``
drives them): the position table is the longest sequence the model reads (``context``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_bias_init, default_embed_init, default_kernel_init

from jaxdist.models import documents, kv_cache, stack
from jaxdist.models.attention import attention as split_attention
from jaxdist.models.stack import check_remat


def _linear(d_in: int, d_out: int, axes: tuple[str, str], **kw) -> nnx.Linear:
    """``nnx.Linear`` with the default initialisers, annotated: kernel ``axes``, bias the
    output axis."""
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.with_partitioning(default_kernel_init, axes),
        bias_init=nnx.with_partitioning(default_bias_init, (axes[1],)),
        **kw,
    )


def _layer_norm(d: int, **kw) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        d,
        epsilon=kw.pop("eps", 1e-6),  # flax's default; GPT-2's is 1e-5
        scale_init=nnx.with_partitioning(initializers.ones_init(), ("norm",)),
        bias_init=nnx.with_partitioning(initializers.zeros_init(), ("norm",)),
        **kw,
    )


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (0 or 1: unchanged)."""
    if multiple <= 1:
        return vocab_size
    return -(-vocab_size // multiple) * multiple


def _embed(axes: tuple[str, str]):
    return nnx.with_partitioning(default_embed_init, axes)


def _dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout | None:
    """GPT-2's dropout (on the embeddings and on each residual branch), or None at rate 0:
    the model then has no RNG stream, so its state is what it was before dropout existed."""
    return nnx.Dropout(rate, rngs=rngs) if rate else None


def _drop(layer: nnx.Dropout | None, x: jax.Array) -> jax.Array:
    return x if layer is None else layer(x)


class Block(nnx.Module):
    def __init__(
        self, d_model: int, n_heads: int, *, dtype, attention=None, dropout=0.0,
        seq_attention="ring", layer_norm_eps=1e-6, rngs: nnx.Rngs,
    ):  # fmt: skip
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        norm = dict(kw, eps=layer_norm_eps)
        self.n_heads = n_heads
        self.seq_attention = seq_attention  # under a seq mesh axis: ring or gather
        # two layers of one stream: nnx.reseed gives each its own key, so their masks differ
        self.drop_att, self.drop_mlp = _dropout(dropout, rngs), _dropout(dropout, rngs)
        self.attention = attention  # None: JAX picks (cuDNN when it can); "cudnn"; "xla"
        self.ln1 = _layer_norm(d_model, **norm)
        self.qkv = _linear(d_model, 3 * d_model, ("embed", "heads"), **kw)  # column-parallel
        self.proj = _linear(d_model, d_model, ("heads", "embed"), **kw)  # row-parallel
        self.ln2 = _layer_norm(d_model, **norm)
        self.fc = _linear(d_model, 4 * d_model, ("embed", "mlp"), **kw)  # column-parallel
        self.out = _linear(4 * d_model, d_model, ("mlp", "embed"), **kw)  # row-parallel

    def __call__(self, x):  # (B, T, D) -> (B, T, D), or a ``documents.Packed``
        h, segments, _ = documents.unpack(x)
        q, k, v = self._qkv(h)
        # cuDNN's fused flash attention on GPU (bf16), plain XLA on CPU; split over a seq
        # mesh axis, the keys and values travel (jaxdist.models.attention).
        att = split_attention(
            q, k, v, causal=True, seq_attention=self.seq_attention,
            implementation=self.attention, segment_ids=segments,
        )  # fmt: skip
        return documents.repack(x, self._rest(h, att))

    def cached(self, x: jax.Array, cache: dict, start: jax.Array):
        """``x`` (B, T, D) at positions ``start`` (B,) onwards, attending to the cache's
        earlier keys too -> ((B, T, D), the cache with these T written; kv_cache)."""
        q, k, v = self._qkv(x)
        att, cache = kv_cache.attend(q, k, v, cache, start)
        return self._rest(x, att), cache

    def _qkv(self, x: jax.Array):  # (B, T, D) -> 3 x (B, T, H, D/H)
        b, t, d = x.shape
        # (B, T, H, 3, D/H): each head's q, k and v are adjacent columns, so splitting the
        # columns over `model` gives each device whole heads and no data moves.
        qkv = self.qkv(self.ln1(x)).reshape(b, t, self.n_heads, 3, d // self.n_heads)
        return tuple(qkv[:, :, :, i] for i in range(3))

    def _rest(self, x: jax.Array, att: jax.Array) -> jax.Array:
        """The block after attention: (B, T, D) and heads (B, T, H, D/H) -> (B, T, D)."""
        x = x + _drop(self.drop_att, self.proj(att.reshape(x.shape)))
        return x + _drop(self.drop_mlp, self.out(jax.nn.gelu(self.fc(self.ln2(x)))))


class GPT(nnx.Module):
    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        dtype=jnp.float32,
        attention: str | None = None,
        scan_layers: bool = False,
        remat: str = "none",
        pad_vocab_to: int = 128,
        dropout: float = 0.0,
        seq_attention: str = "ring",
        layer_norm_eps: float = 1e-6,
        document_eos: int | None = None,  # --document-mask: each document its own
        reset_positions: bool = False,  # with document_eos: positions from 0 per document
        rngs: nnx.Rngs,
    ):
        check_remat(remat)
        self.remat = remat
        self.document_eos, self.reset_positions = document_eos, reset_positions
        self.vocab_size = vocab_size  # the real vocabulary: the logits' width
        self.context = seq_len  # the position table's rows: the longest sequence it reads
        self.cache_shape = (n_heads, d_model // n_heads, dtype)  # a KV cache's K, Dh, dtype
        with nnx.use_eager_sharding(False):  # names only; jaxdist.parallel.layout places them
            kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
            rows = padded_vocab(vocab_size, pad_vocab_to)  # >= vocab_size, see the docstring
            self.tok = nnx.Embed(rows, d_model, embedding_init=_embed(("vocab", "embed")), **kw)
            self.pos = nnx.Embed(seq_len, d_model, embedding_init=_embed(("length", "embed")), **kw)

            self.drop = _dropout(dropout, rngs)  # on the embeddings, (B, T, D)

            def block(rngs):
                return Block(
                    d_model, n_heads, dtype=dtype, attention=attention, dropout=dropout,
                    seq_attention=seq_attention, layer_norm_eps=layer_norm_eps, rngs=rngs,
                )  # fmt: skip

            self.blocks = stack.blocks(block, n_layers, rngs=rngs, remat=remat, scan=scan_layers)
            self.ln_f = _layer_norm(d_model, eps=layer_norm_eps, **kw)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, vocab)
        return self.head(self.features(tokens))

    def features(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, D)
        """The final LayerNorm's output: what the head turns into logits (and what
        ``jaxdist.losses.make_fused_next_token_loss`` takes, never forming the logits)."""
        t = tokens.shape[1]
        if self.document_eos is None:
            x = _drop(self.drop, self.tok(tokens) + self.pos(jnp.arange(t))[None])
            return self.ln_f(stack.run_blocks(self.blocks, x, self.remat))
        # packed documents (jaxdist.models.documents): the segment ids ride with x
        packed = documents.pack(None, tokens, self.document_eos, self.reset_positions)
        x = _drop(self.drop, self.tok(tokens) + self.pos(packed.positions))
        x = stack.run_blocks(self.blocks, packed.replace(x=x), self.remat).x
        return self.ln_f(x)

    def init_cache(self, batch: int, length: int):
        """An empty KV cache of ``length`` positions for ``batch`` rows
        (``jaxdist.models.kv_cache``: (B, S, H, D/H) keys and values per layer)."""
        return kv_cache.empty(self.blocks, batch, length, *self.cache_shape)

    def cached_features(self, tokens: jax.Array, cache, start: jax.Array):
        """``features`` of ``tokens`` (B, T) at positions ``start`` (B,) onwards, each
        row attending to its cache's earlier positions -> ((B, T, D), the new cache)."""
        positions = kv_cache.positions(start, tokens.shape[1])  # (B, T)
        x = _drop(self.drop, self.tok(tokens) + self.pos(positions))
        x, cache = kv_cache.run(self.blocks, x, cache, start)
        return self.ln_f(x), cache

    def head(self, h: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, vocab)
        # Output head tied to the token embedding: (B, T, D) @ (D, padded vocab), then the
        # padded columns cut off. Sliced rather than masked to a large negative value: the
        # logits keep their width (B, T, vocab_size), so next_token_loss, the eval's
        # bits per byte, argmax and any user loss (a one-hot of vocab_size classes) see
        # exactly the model they saw before padding, and no padded id can take probability
        # mass or be sampled. The matmul still covers the padded rows (their columns are
        # computed, then dropped), which is why jaxdist.flops counts them in N; their
        # gradient is zero. Where `model` splits the vocabulary, the cut makes the shards
        # uneven: XLA moves under 128 logit columns per device (a collective-permute).
        return self.tok.attend(h)[..., : self.vocab_size]
