"""A Llama-family decoder: tokens (B, T) int32 -> logits (B, T, vocab) (``--model llama``).

Each block is pre-norm: RMSNorm, attention with rotary positions (``jaxdist.models.rope``)
and grouped-query heads (H query heads share K key/value heads, K dividing H), RMSNorm,
a SwiGLU MLP ``down(silu(gate(x)) * up(x))``. The switches that make it one of the family:

- ``qk_norm`` (Qwen3): RMSNorm over each head's ``head_dim`` features of q and k, before RoPE;
- ``attention_bias``: ``"qkv"`` (Qwen2) or ``"qkvo"`` (Llama's ``attention_bias``);
- ``sliding_window`` W (Mistral): every layer attends to the W latest positions only;
- ``tie_embeddings``: the head is the token embedding, else a table of its own (Llama);
- ``head_dim``: where it is not d_model / n_heads (Qwen3); RoPE's ``rope_type`` and
  ``rope_theta`` (Llama 3's ``llama3`` scaling).

Parameters carry logical axis names as the GPT's do: q and o (embed, heads) and (heads,
embed), k and v (embed, kv_heads), gate and up (embed, mlp), down (mlp, embed), the
embedding and the untied head (vocab, embed), norms (norm); ``jaxdist.parallel.layout``
maps them to mesh axes. The blocks are an ``nnx.List`` or, with ``scan_layers``, one
``Stack`` (pipeline stages split it), with the same values either way. The vocabulary is
padded as the GPT's (``padded_vocab``) and its padding sliced off the logits.

Attention takes the positions of its tokens (``LlamaBlock.__call__(x, positions)``; the
stack passes none: 0..T-1, or a ``documents.Packed``'s). ``init_cache`` and
``cached_features`` generate over a KV cache (``jaxdist.models.kv_cache``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_embed_init, default_kernel_init

from jaxdist.models import documents, kv_cache, stack
from jaxdist.models.attention import attention as split_attention
from jaxdist.models.gpt import _drop, _dropout, padded_vocab  # as the GPT's
from jaxdist.models.moe import MoESettings
from jaxdist.models.rope import Rope
from jaxdist.models.router_aux import MoEAux, Routed
from jaxdist.models.stack import check_remat

BIASES = ("none", "qkv", "qkvo")


def _linear(d_in: int, d_out: int, axes: tuple[str, str], bias: bool, **kw) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        kernel_init=nnx.with_partitioning(default_kernel_init, axes),
        bias_init=nnx.with_partitioning(initializers.zeros_init(), (axes[1],)),
        **kw,
    )


def rms_norm(d: int, eps: float, **kw) -> nnx.RMSNorm:
    # mean of squares in float32 (flax promotes its statistics), scale (D,) replicated
    return nnx.RMSNorm(
        d, epsilon=eps, scale_init=nnx.with_partitioning(initializers.ones_init(), ("norm",)), **kw
    )


def _embed(rows: int, d: int, **kw) -> nnx.Embed:
    init = nnx.with_partitioning(default_embed_init, ("vocab", "embed"))
    return nnx.Embed(rows, d, embedding_init=init, **kw)


class LlamaBlock(nnx.Module):
    def __init__(
        self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int, *,
        rope: Rope, eps: float, qk_norm: bool, attention_bias: str, window: int, dtype,
        attention=None, seq_attention="ring", dropout=0.0, norm=None, moe=None,
        rngs: nnx.Rngs,
    ):  # fmt: skip
        if attention_bias not in BIASES:
            raise ValueError(f"attention_bias {attention_bias!r} is not one of {BIASES}")
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        norm = norm or rms_norm  # (d, eps, **kw) -> a norm over d features
        qkv_bias, o_bias = attention_bias != "none", attention_bias == "qkvo"
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope, self.window = rope, window
        self.attention, self.seq_attention = attention, seq_attention
        self.drop_att, self.drop_mlp = _dropout(dropout, rngs), _dropout(dropout, rngs)
        self.attn_norm = norm(d_model, eps, **kw)
        # q and o split whole heads over `model` (column- then row-parallel); k and v
        # split their K heads, where `model` divides K
        self.q = _linear(d_model, n_heads * head_dim, ("embed", "heads"), qkv_bias, **kw)
        self.k = _linear(d_model, n_kv_heads * head_dim, ("embed", "kv_heads"), qkv_bias, **kw)
        self.v = _linear(d_model, n_kv_heads * head_dim, ("embed", "kv_heads"), qkv_bias, **kw)
        self.o = _linear(n_heads * head_dim, d_model, ("heads", "embed"), o_bias, **kw)
        self.q_norm = norm(head_dim, eps, **kw) if qk_norm else None
        self.k_norm = norm(head_dim, eps, **kw) if qk_norm else None
        self.mlp_norm = norm(d_model, eps, **kw)
        # moe (an MoESettings): a mixture of experts in place of the SwiGLU
        self.moe = moe.block(d_model, ffn_dim, **kw) if moe is not None else None
        if moe is None:
            self.gate = _linear(d_model, ffn_dim, ("embed", "mlp"), False, **kw)
            self.up = _linear(d_model, ffn_dim, ("embed", "mlp"), False, **kw)
            self.down = _linear(ffn_dim, d_model, ("mlp", "embed"), False, **kw)

    def __call__(self, x, positions: jax.Array | None = None):
        """(B, T, D) -> (B, T, D), or an MoE model's ``Routed`` -> ``Routed`` (its aux
        plus this layer's); ``positions`` (B, T) or (1, T) int, default 0..T-1. Either
        in a ``documents.Packed``: attention within documents, at its positions."""
        inner, segments, packed_positions = documents.unpack(x)
        h = inner.x if isinstance(inner, Routed) else inner
        positions = packed_positions if positions is None else positions
        if positions is None:
            positions = jnp.arange(h.shape[1])[None]  # (1, T)
        q, k, v = self._qkv(h, positions)
        att = split_attention(
            q, k, v, causal=True, seq_attention=self.seq_attention,
            implementation=self.attention, window=self.window, segment_ids=segments,
        )  # fmt: skip
        return documents.repack(x, self._rest(inner, att))

    def cached(self, x: jax.Array, cache: dict, start: jax.Array):
        """``x`` (B, T, D) at positions ``start`` (B,) onwards, attending to the cache's
        earlier keys within the window -> ((B, T, D), the cache with these T written)."""
        q, k, v = self._qkv(x, kv_cache.positions(start, x.shape[1]))
        att, cache = kv_cache.attend(q, k, v, cache, start, self.window)
        return self._rest(x, att), cache

    def _qkv(self, x: jax.Array, positions: jax.Array):
        """(B, T, D) -> q (B, T, H, Dh), k and v (B, T, K, Dh), q and k rotated."""
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).reshape(b, t, self.n_heads, self.head_dim)  # (B, T, H, Dh)
        k = self.k(h).reshape(b, t, self.n_kv_heads, self.head_dim)  # (B, T, K, Dh)
        v = self.v(h).reshape(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: over Dh, per head and position
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, positions), self.rope(k, positions), v

    def _rest(self, x, att: jax.Array):
        """The block after attention: (B, T, D) (or ``Routed``) and heads (B, T, H, Dh)
        -> (B, T, D) (``Routed``). A plain (B, T, D) through an MoE drops its aux (the KV
        cache's generation: no loss to add it to)."""
        routed = x if isinstance(x, Routed) else None
        x = x.x if routed is not None else x
        b, t, _ = x.shape
        x = x + _drop(self.drop_att, self.o(att.reshape(b, t, self.n_heads * self.head_dim)))
        y, aux = self.mlp(self.mlp_norm(x))
        x = x + _drop(self.drop_mlp, y)
        return x if routed is None else Routed(x, routed.aux + aux)

    def mlp(self, h: jax.Array):
        """(B, T, D) -> ((B, T, D), the MoE's ``MoEAux`` or None)."""
        if self.moe is not None:
            return self.moe(h)
        return self.down(jax.nn.silu(self.gate(h)) * self.up(h)), None


class Llama(nnx.Module):
    """The decoder; ``block`` (a ``LlamaBlock`` subclass's constructor, with its own
    options bound) and ``kinds`` (one int per layer, each block called with its own:
    ``jaxdist.models.stack``) are how a family of the same shape builds on it (Gemma)."""

    # (d, eps, **kw) -> a norm over d features: the blocks' and the final one
    make_norm = staticmethod(rms_norm)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        n_kv_heads: int = 0,  # 0: n_heads (no grouping)
        head_dim: int = 0,  # 0: d_model // n_heads
        ffn_dim: int = 0,  # 0: 4 * d_model
        rms_norm_eps: float = 1e-6,
        rope: Rope | None = None,  # None: the default RoPE of theta 10000 at head_dim
        qk_norm: bool = False,
        attention_bias: str = "none",
        sliding_window: int = 0,  # 0: every earlier position
        tie_embeddings: bool = True,
        dtype=jnp.float32,
        attention: str | None = None,
        scan_layers: bool = False,
        remat: str = "none",
        pad_vocab_to: int = 128,
        dropout: float = 0.0,
        seq_attention: str = "ring",
        block=LlamaBlock,
        kinds: tuple[int, ...] | None = None,
        moe: MoESettings | None = None,  # experts in place of the SwiGLU (jaxdist.models.moe)
        document_eos: int | None = None,  # --document-mask (jaxdist.models.documents)
        reset_positions: bool = False,  # with document_eos: RoPE from 0 per document
        rngs: nnx.Rngs,
    ):
        check_remat(remat)
        self.document_eos, self.reset_positions = document_eos, reset_positions
        head_dim = head_dim or d_model // n_heads
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads {n_kv_heads} does not divide n_heads {n_heads}")
        rope = rope or Rope(head_dim)
        if rope.head_dim != head_dim:
            raise ValueError(f"rope is for head_dim {rope.head_dim}, the heads have {head_dim}")
        self.remat, self.kinds, self.moe = remat, kinds, moe
        dense = moe.dense_layers if moe is not None else n_layers
        if moe is not None and (kinds is not None or not 0 <= dense < n_layers):
            raise ValueError(f"moe: {dense} dense layers of {n_layers}, kinds {kinds}")
        self.vocab_size, self.cache_shape = vocab_size, (n_kv_heads, head_dim, dtype)
        with nnx.use_eager_sharding(False):  # names only; jaxdist.parallel.layout places them
            kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
            rows = padded_vocab(vocab_size, pad_vocab_to)
            self.tok = _embed(rows, d_model, **kw)
            self.drop = _dropout(dropout, rngs)  # on the embeddings, (B, T, D)

            def make_block(rngs, moe=None):
                return block(
                    d_model, n_heads, n_kv_heads, head_dim, ffn_dim or 4 * d_model, rope=rope,
                    eps=rms_norm_eps, qk_norm=qk_norm, attention_bias=attention_bias,
                    window=sliding_window, dtype=dtype, attention=attention,
                    seq_attention=seq_attention, dropout=dropout, norm=self.make_norm,
                    moe=moe, rngs=rngs,
                )  # fmt: skip

            def make_stack(make, n, kinds=None):
                return stack.blocks(make, n, rngs=rngs, remat=remat, scan=scan_layers, kinds=kinds)

            # MoE: the first D layers dense (a stack of their own), the rest with experts
            self.dense_blocks = make_stack(make_block, dense) if moe and dense else None
            if moe is None:
                self.blocks = make_stack(make_block, n_layers, kinds)
            else:
                self.blocks = make_stack(lambda rngs: make_block(rngs, moe), n_layers - dense)
                self.moe_layers = n_layers - dense
            self.norm = self.make_norm(d_model, rms_norm_eps, **kw)
            # untied: a table of the embedding's shape, (padded vocab, D), read as the
            # transpose of transformers' lm_head (vocab, D) and applied as tok is
            self.lm_head = None if tie_embeddings else _embed(rows, d_model, **kw)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, vocab)
        return self.head(self.features(tokens))

    def embed(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, D)
        return _drop(self.drop, self.tok(tokens))

    def features(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, D)
        """The final RMSNorm's output at positions 0..T-1: what the head reads (and what
        ``jaxdist.losses.make_fused_next_token_loss`` takes)."""
        x = self.embed(tokens)
        eos, reset = getattr(self, "document_eos", None), self.reset_positions
        packed = None if eos is None else documents.pack(None, tokens, eos, reset)

        def run(blocks, x, kinds=None):  # with the documents' ids riding along, if any
            if packed is None:
                return stack.run_blocks(blocks, x, self.remat, kinds)
            return stack.run_blocks(blocks, packed.replace(x=x), self.remat, kinds).x

        if self.moe is None:
            return self.norm(run(self.blocks, x, self.kinds))
        if self.dense_blocks is not None:
            x = run(self.dense_blocks, x)
        routed = run(self.blocks, Routed(x, MoEAux.zeros(x.shape[0], self.moe.n_experts)))
        # flax's way to hand a forward pass's by-product to the loss (what sow does):
        # read by auxiliary_loss, never part of the training state
        self.moe_aux = nnx.Intermediate(routed.aux)
        return self.norm(routed.x)

    def auxiliary_loss(self) -> tuple[jax.Array, dict]:
        """(what the training loss adds, metrics) for the last ``features`` (or call):
        with ``moe``, its load-balancing and z-losses (``MoESettings.loss_terms``); the
        default losses (``jaxdist.losses``) add it. Dense: (0, {})."""
        if self.moe is None:
            return jnp.zeros((), jnp.float32), {}
        return self.moe.loss_terms(self.moe_aux.get_value(), self.moe_layers)

    def init_cache(self, batch: int, length: int):
        """An empty KV cache of ``length`` positions for ``batch`` rows
        (``jaxdist.models.kv_cache``: (B, S, K, Dh) keys and values per layer); with
        MoE's dense first layers, one for each of the two stacks."""
        caches = [kv_cache.empty(b, batch, length, *self.cache_shape) for b in self._stacks()]
        return caches[0] if len(caches) == 1 else tuple(caches)

    def cached_features(self, tokens: jax.Array, cache, start: jax.Array):
        """``features`` of ``tokens`` (B, T) at positions ``start`` (B,) onwards (RoPE at
        those positions), each row attending to its cache's earlier positions ->
        ((B, T, D), the new cache)."""
        x = self.embed(tokens)
        if self.dense_blocks is None:
            x, cache = kv_cache.run(self.blocks, x, cache, start, self.kinds)
            return self.norm(x), cache
        x, dense = kv_cache.run(self.dense_blocks, x, cache[0], start)
        x, rest = kv_cache.run(self.blocks, x, cache[1], start)
        return self.norm(x), (dense, rest)

    def _stacks(self) -> list:
        return [self.blocks] if self.dense_blocks is None else [self.dense_blocks, self.blocks]

    def head(self, h: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, vocab)
        # (B, T, D) @ (D, padded vocab), the padded columns cut off (see the GPT's head)
        table = self.tok if self.lm_head is None else self.lm_head
        return table.attend(h)[..., : self.vocab_size]
