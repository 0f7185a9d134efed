"""A small decoder-only transformer over bytes: tokens (B, T) int32 -> logits (B, T, vocab)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, *, dtype, attention=None, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.n_heads = n_heads
        self.attention = attention  # None: JAX picks (cuDNN when it can); "cudnn"; "xla"
        self.ln1 = nnx.LayerNorm(d_model, **kw)
        self.qkv = nnx.Linear(d_model, 3 * d_model, **kw)
        self.proj = nnx.Linear(d_model, d_model, **kw)
        self.ln2 = nnx.LayerNorm(d_model, **kw)
        self.fc = nnx.Linear(d_model, 4 * d_model, **kw)
        self.out = nnx.Linear(4 * d_model, d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, D)
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)  # 3 x (B, T, D)
        heads = lambda a: a.reshape(b, t, self.n_heads, d // self.n_heads)  # noqa: E731
        # (B, T, H, D/H); cuDNN's fused flash attention on GPU (bf16), plain XLA on CPU.
        att = jax.nn.dot_product_attention(
            heads(q), heads(k), heads(v), is_causal=True, implementation=self.attention
        )
        x = x + self.proj(att.reshape(b, t, d))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


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
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.dtype = dtype
        self.tok = nnx.Embed(vocab_size, d_model, **kw)
        self.pos = nnx.Embed(seq_len, d_model, **kw)
        self.blocks = nnx.List(
            [
                Block(d_model, n_heads, dtype=dtype, attention=attention, rngs=rngs)
                for _ in range(n_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, **kw)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (B, T) -> (B, T, vocab)
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(jnp.arange(t))[None]
        for block in self.blocks:
            x = block(x)
        # Output head tied to the token embedding: (B, T, D) @ (D, vocab).
        return self.tok.attend(self.ln_f(x))
