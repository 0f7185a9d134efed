"""The plain-JAX reference for bench_gpt.py: the same GPT as jaxdist's ``--model gpt``,
written as functions of a params dict, trained by one ``jax.jit`` step with optax AdamW.
No jaxdist code: what a careful user would write by hand on one device.

Params use the layout of ``nnx.to_pure_dict`` of jaxdist's GPT (so both can start from
the same weights): {"tok": {"embedding"}, "pos": {"embedding"}, "blocks": {0: {"ln1",
"qkv", "proj", "ln2", "fc", "out"}, ...}, "ln_f"}.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax


def layer_norm(x, p, eps=1e-6):  # statistics in float32, as flax does
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def linear(x, p):
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)


def block(x, p, n_heads: int, attention: str | None):
    b, t, d = x.shape
    qkv = linear(layer_norm(x, p["ln1"]), p["qkv"]).reshape(b, t, n_heads, 3, d // n_heads)
    heads = [qkv[:, :, :, i] for i in range(3)]  # q, k, v: (B, T, H, D/H), per-head columns
    att = jax.nn.dot_product_attention(*heads, is_causal=True, implementation=attention)
    x = x + linear(att.reshape(b, t, d), p["proj"])
    return x + linear(jax.nn.gelu(linear(layer_norm(x, p["ln2"]), p["fc"])), p["out"])


def forward(params, tokens, *, n_heads: int, dtype, attention: str | None = None):
    """tokens (B, T) int32 -> logits (B, T, vocab) float32."""
    t = tokens.shape[1]
    embedding = params["tok"]["embedding"].astype(dtype)  # (V, D), tied with the head
    x = embedding[tokens] + params["pos"]["embedding"].astype(dtype)[:t][None]
    for i in sorted(params["blocks"]):
        x = block(x, params["blocks"][i], n_heads, attention)
    return (layer_norm(x, params["ln_f"]) @ embedding.T).astype(jnp.float32)


def loss_fn(params, tokens, **model):
    """Mean next-token cross-entropy of tokens (B, T + 1)."""
    logits = forward(params, tokens[:, :-1], **model)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_optimizer(lr: float, weight_decay: float = 0.01, clip_norm: float = 1.0):
    return optax.chain(
        optax.clip_by_global_norm(clip_norm), optax.adamw(lr, weight_decay=weight_decay)
    )


def make_step(tx, donate: bool = True, loss=None, **model):
    """``step(params, opt_state, tokens) -> (params, opt_state, loss)``, params and
    optimizer state donated (updated in place) unless ``donate`` is False. ``loss``:
    ``loss(params, tokens, **model)``, by default this GPT's (``peer_plain_jax_llama``
    passes the Llama's)."""

    @partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(params, opt_state, tokens):
        loss_value, grads = jax.value_and_grad(loss or loss_fn)(params, tokens, **model)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_value

    return step
