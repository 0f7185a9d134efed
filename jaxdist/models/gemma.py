"""Gemma 2: the Llama decoder with Gemma's differences (``--model gemma``).

The blocks are the Llama's (grouped-query attention, RoPE, a gated MLP) with:

- RMSNorm scaling by ``1 + w`` (w starts at 0), computed in float32 and cast back after
  the scaling (Hugging Face stores w, read as it is);
- four norms per block: before and after attention, before and after the MLP; the
  residual adds the post-norm's output;
- the MLP gated by GELU (tanh approximation): ``down(gelu(gate(x)) * up(x))``;
- attention logits scaled by ``1 / sqrt(query_scale_dim)`` (Hugging Face's
  ``query_pre_attn_scalar``; head_dim where 0) and soft-capped, ``c tanh(s / c)``, before
  the mask (``attn_softcap`` c; 0: none);
- layers of two kinds: every ``global_layer_every``-th layer (layer i with (i + 1) % N
  == 0: Gemma 2's odd layers at N = 2) attends to every earlier position, the others to
  the ``sliding_window`` latest. One ``Stack`` holds them all (the kinds travel beside
  the stacked parameters: ``jaxdist.models.stack``), so ``--scan-layers`` and pipeline
  stages apply as to the Llama;
- the embedding scaled by sqrt(d_model) (in the compute dtype), the logits soft-capped
  by ``final_softcap`` (Gemma 2's 30).

Attention is XLA's, written here: no fused kernel soft-caps its logits (cuDNN's is
refused by name). Under a ``seq`` mesh axis it runs the all-to-all way
(``jaxdist.models.attention.over_heads``: each device attends H/S heads over the whole
sequence, soft-caps and windows as unsplit); the ring and gather paths compute plain
softmax attention and are refused by name.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from jaxdist.errors import ConfigError
from jaxdist.models import kv_cache
from jaxdist.models.attention import SEQ, over_heads
from jaxdist.models.llama import Llama, LlamaBlock, _drop

GLOBAL, SLIDING = 0, 1  # a layer's kind


class OffsetRMSNorm(nnx.Module):
    """x / rms(x) * (1 + scale) over the last axis, in float32; scale (D,) starts at 0."""

    def __init__(self, d: int, *, epsilon: float, dtype=None, param_dtype=jnp.float32, rngs=None):
        del rngs  # nothing random: the scale starts at 0
        init = nnx.with_partitioning(initializers.zeros_init(), ("norm",))
        self.scale = nnx.Param(init(jax.random.key(0), (d,), param_dtype))
        self.epsilon, self.dtype = epsilon, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(mean_square + self.epsilon) * (1.0 + self.scale[...])
        return y.astype(self.dtype or x.dtype)


def offset_rms_norm(d: int, eps: float, **kw) -> OffsetRMSNorm:
    return OffsetRMSNorm(d, epsilon=eps, **kw)


def layer_kinds(n_layers: int, global_every: int, window: int) -> tuple[int, ...]:
    """Each layer's kind: GLOBAL where (i + 1) % global_every == 0 or there is no
    window, else SLIDING; ``global_every`` 0: every layer slides (where W > 0)."""

    def kind(i: int) -> int:
        if not window or (global_every and (i + 1) % global_every == 0):
            return GLOBAL
        return SLIDING

    return tuple(kind(i) for i in range(n_layers))


def visible(behind: jax.Array, window: int, kind) -> jax.Array:
    """Where a query may see a key ``behind`` positions earlier (an int array): causal,
    and within ``window`` for a SLIDING layer (``kind`` an int or a traced scalar)."""
    mask = behind >= 0
    if window:
        mask = mask & ((kind == GLOBAL) | (behind < window))
    return mask


def softcapped_attention(q, k, v, mask, *, scale: float, softcap: float):
    """q (B, T, H, Dh) over k, v (B, S, K, Dh), mask broadcasting to (B, 1, T, S) ->
    (B, T, H, Dh): softmax(c tanh(q.k scale / c)) v in float32, query head h reading
    key/value head h // (H / K) (transformers' repeat_kv order)."""
    b, t, h, dh = q.shape
    groups = h // k.shape[2]
    q = q.reshape(b, t, k.shape[2], groups, dh)  # (B, T, K, G, Dh)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(mask[:, :, None], logits, -jnp.inf)  # (B, K, G, T, S)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h, dh).astype(q.dtype)


class GemmaBlock(LlamaBlock):
    def __init__(self, d_model: int, *args, attn_softcap: float, query_scale_dim: int, **kw):
        super().__init__(d_model, *args, **kw)
        self.scale = 1.0 / math.sqrt(query_scale_dim or self.head_dim)
        self.softcap = attn_softcap
        norm = dict(dtype=kw["dtype"], param_dtype=jnp.float32)
        self.post_attn_norm = OffsetRMSNorm(d_model, epsilon=kw["eps"], **norm)
        self.post_mlp_norm = OffsetRMSNorm(d_model, epsilon=kw["eps"], **norm)

    def __call__(self, x, positions=None, kind=GLOBAL):
        """(B, T, D) -> (B, T, D); ``kind``: GLOBAL or SLIDING (the Stack's, per layer)."""
        t = x.shape[1]
        if positions is None:
            positions = jnp.arange(t)[None]  # (1, T)
        q, k, v = self._qkv(x, positions)
        self._check_seq()
        att = over_heads(self._whole, q, k, v, jnp.asarray(kind, jnp.int32))
        return self._rest(x, att)

    def _whole(self, q, k, v, kind):
        """Attention over whole sequences: q (B, T, H, Dh), k, v (B, T, K, Dh)."""
        t = q.shape[1]
        behind = jnp.arange(t)[:, None] - jnp.arange(t)[None]  # (T, T)
        mask = visible(behind, self.window, kind)[None, None]  # (1, 1, T, T)
        return softcapped_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)

    def _check_seq(self):
        mesh = jax.sharding.get_abstract_mesh()
        seq = 1 if mesh.empty else dict(mesh.shape).get(SEQ, 1)
        if seq > 1 and self.seq_attention != "all-to-all":
            raise ConfigError(
                f"--seq-attention {self.seq_attention} over seq={seq}: Gemma's soft-capped "
                "attention splits over seq the all-to-all way only (the ring and gather "
                "compute plain softmax attention); use --seq-attention all-to-all"
            )

    def cached(self, x, cache: dict, start, kind=GLOBAL):
        """As ``LlamaBlock.cached``, with this layer's kind of window."""
        q, k, v = self._qkv(x, kv_cache.positions(start, x.shape[1]))
        cache = kv_cache.write(cache, k, v, start)
        behind = kv_cache.behind(start, x.shape[1], cache["k"].shape[1])  # (B, T, S)
        mask = visible(behind, self.window, kind)[:, None]
        att = softcapped_attention(
            q, cache["k"], cache["v"], mask, scale=self.scale, softcap=self.softcap
        )
        return self._rest(x, att), cache

    def _rest(self, x, att):
        b, t, _ = x.shape
        out = self.o(att.reshape(b, t, self.n_heads * self.head_dim))
        x = x + _drop(self.drop_att, self.post_attn_norm(out))
        h = self.mlp_norm(x)
        mlp = self.down(jax.nn.gelu(self.gate(h), approximate=True) * self.up(h))
        return x + _drop(self.drop_mlp, self.post_mlp_norm(mlp))


class Gemma(Llama):
    """Gemma 2's decoder: tokens (B, T) int32 -> logits (B, T, vocab). The Llama's
    arguments (``qk_norm`` and ``attention_bias`` as well), and Gemma's own (the module)."""

    make_norm = staticmethod(offset_rms_norm)

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *,
                 attn_softcap: float = 0.0, final_softcap: float = 0.0,
                 query_scale_dim: int = 0, global_layer_every: int = 0,
                 sliding_window: int = 0, attention: str | None = None, **kw):  # fmt: skip
        if attention not in (None, "xla"):
            raise ValueError(
                f"attention {attention!r}: Gemma's soft-capped attention runs on XLA's "
                "kernel only (no fused kernel soft-caps its logits)"
            )
        block = functools.partial(
            GemmaBlock, attn_softcap=attn_softcap, query_scale_dim=query_scale_dim
        )
        kinds = layer_kinds(n_layers, global_layer_every, sliding_window)
        super().__init__(
            vocab_size, d_model, n_layers, n_heads, sliding_window=sliding_window,
            attention="xla", block=block, kinds=kinds, **kw,
        )  # fmt: skip
        self.embed_scale = math.sqrt(d_model)
        self.final_softcap = final_softcap

    def embed(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, D)
        x = self.tok(tokens)
        return _drop(self.drop, x * jnp.asarray(self.embed_scale, x.dtype))

    def head(self, h: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, vocab)
        logits = super().head(h)
        if self.final_softcap:
            logits = self.final_softcap * jnp.tanh(logits / self.final_softcap)
        return logits
