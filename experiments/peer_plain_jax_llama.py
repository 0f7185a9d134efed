"""The plain-JAX reference for ``bench_gpt.py --model llama``: the same model as jaxdist's
``--model llama`` in the bench's shape (pre-norm RMSNorm blocks, rotate-half RoPE,
grouped-query attention, a SwiGLU MLP, the head tied to the embedding, no biases),
written as functions of a params dict. No jaxdist code: what a careful user would write
by hand on one device. Trained by ``peer_plain_jax.make_step(..., loss=loss_fn)``: the
same ``jax.jit`` step and optax AdamW as the GPT's reference.

Params use the layout of ``nnx.to_pure_dict`` of jaxdist's Llama (so both can start from
the same weights): {"tok": {"embedding"}, "blocks": {0: {"attn_norm", "q", "k", "v", "o",
"mlp_norm", "gate", "up", "down"}, ...}, "norm"}; each linear a {"kernel"} (in, out),
each norm a {"scale"}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def rms_norm(x, p, eps: float):  # the mean of squares in float32, as flax computes it
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * p["scale"]
    return y.astype(x.dtype)


def linear(x, p):
    return x @ p["kernel"].astype(x.dtype)


def rope(x, theta: float):
    """x (B, T, N, Dh) rotated by position t * theta^(-2i/Dh), pairs (i, i + Dh/2) (the
    rotate-half form); the angles in float32, cos and sin then in x's dtype."""
    t, dh = x.shape[1], x.shape[-1]
    freq = 1.0 / np.float32(theta) ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh))
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freq.astype(np.float32)  # (T, Dh/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]  # (1, T, 1, Dh)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = dh // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def block(x, p, *, n_heads: int, n_kv_heads: int, rope_theta: float, eps: float, attention):
    b, t, d = x.shape
    dh = d // n_heads
    h = rms_norm(x, p["attn_norm"], eps)
    q = rope(linear(h, p["q"]).reshape(b, t, n_heads, dh), rope_theta)
    k = rope(linear(h, p["k"]).reshape(b, t, n_kv_heads, dh), rope_theta)
    v = linear(h, p["v"]).reshape(b, t, n_kv_heads, dh)
    # K key/value heads for H query heads: query head n reads key/value head n // (H/K)
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
    x = x + linear(att.reshape(b, t, n_heads * dh), p["o"])
    h = rms_norm(x, p["mlp_norm"], eps)
    return x + linear(jax.nn.silu(linear(h, p["gate"])) * linear(h, p["up"]), p["down"])


def forward(params, tokens, *, n_heads: int, n_kv_heads: int, dtype, rope_theta: float,
            eps: float, attention: str | None = None):  # fmt: skip
    """tokens (B, T) int32 -> logits (B, T, vocab) float32."""
    embedding = params["tok"]["embedding"].astype(dtype)  # (V, D), tied with the head
    x = embedding[tokens]
    shape = dict(n_heads=n_heads, n_kv_heads=n_kv_heads, rope_theta=rope_theta, eps=eps)
    for i in sorted(params["blocks"]):
        x = block(x, params["blocks"][i], attention=attention, **shape)
    return (rms_norm(x, params["norm"], eps) @ embedding.T).astype(jnp.float32)


def loss_fn(params, tokens, **model):
    """Mean next-token cross-entropy of tokens (B, T + 1)."""
    logits = forward(params, tokens[:, :-1], **model)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
