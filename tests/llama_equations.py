"""The built-in Llama's reference for the tests (test_llama.py, test_llama_trainer.py): the
Llama written out in jax.numpy from the equations (RMSNorm, RoPE in the rotate-half form
with Llama 3's frequency scaling, grouped-query attention with a sliding window, QK-norm,
SwiGLU), nothing imported from jaxdist, and the jaxdist model built with every switch
on, with the batches, optimizer and loss both sides train with."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.models.llama import Llama
from jaxdist.models.rope import Rope

VOCAB, T, D, LAYERS, HEADS, KV, HEAD_DIM, FFN, EPS = 100, 16, 32, 2, 4, 2, 16, 48, 1e-5
G, STEPS, LR = 8, 5, 3e-3
WINDOW = 6  # shorter than T: the window masks
LLAMA3 = dict(theta=500.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_positions=8)  # fmt: skip
# every switch on: GQA, head_dim != D / HEADS, QK-norm, all four biases, a window, untied
FULL = dict(n_kv_heads=KV, head_dim=HEAD_DIM, ffn_dim=FFN, rms_norm_eps=EPS, qk_norm=True,
            attention_bias="qkvo", sliding_window=WINDOW, tie_embeddings=False)  # fmt: skip


def build(scan_layers=False, rope=LLAMA3, **settings):
    settings = {**FULL, **settings}
    head_dim = settings["head_dim"] or D // HEADS
    return Llama(
        VOCAB, D, LAYERS, HEADS, rope=Rope(head_dim, **rope), scan_layers=scan_layers,
        attention="xla", rngs=nnx.Rngs(0), **settings,
    )  # fmt: skip


# --- the reference: the equations, in jax.numpy


def frequencies(head_dim, theta, rope_type="default", factor=1.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_positions=8192):  # fmt: skip
    """theta^(-2i/Dh); linear: / factor; llama3: long wavelengths / factor, short kept,
    the band between interpolated (Llama 3.1's scaling)."""
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    if rope_type == "linear":
        return freq / factor
    if rope_type == "llama3":
        wavelength = 2 * np.pi / freq
        smooth = (original_max_positions / wavelength - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        blended = (1 - smooth) * freq / factor + smooth * freq
        freq = np.where(wavelength > original_max_positions / low_freq_factor, freq / factor,
                        np.where(wavelength < original_max_positions / high_freq_factor, freq,
                                 blended))  # fmt: skip
    return freq


def rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x, angles):  # x (B, T, N, Dh); angles (T, Dh/2): pairs (i, i + Dh/2)
    half = x.shape[-1] // 2
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(p, tokens, s, rope, mlp=None, layers=LAYERS):
    """tokens (B, T) -> logits (B, T, VOCAB); ``p``: parameters by the model's names,
    ``s``: the settings (FULL's keys), ``rope``: the frequencies' settings. ``mlp(layer,
    h)``: what layer ``layer`` adds after its MLP norm (default: its SwiGLU)."""
    b, t = tokens.shape
    dh = s["head_dim"] or D // HEADS
    kv = s["n_kv_heads"] or HEADS
    angles = np.arange(t)[:, None] * frequencies(dh, **rope)[None]  # (T, Dh/2)
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    allowed = (j <= i) & ((i - j < s["sliding_window"]) if s["sliding_window"] else True)
    x = p["tok/embedding"][tokens]  # (B, T, D)

    def proj(name, h):
        out = h @ p[f"{name}/kernel"]
        return out + p[f"{name}/bias"] if f"{name}/bias" in p else out

    for layer in range(layers):
        pre = f"blocks/{layer}"
        h = rms_norm(x, p[f"{pre}/attn_norm/scale"], s["rms_norm_eps"])
        q = proj(f"{pre}/q", h).reshape(b, t, HEADS, dh)
        k = proj(f"{pre}/k", h).reshape(b, t, kv, dh)
        v = proj(f"{pre}/v", h).reshape(b, t, kv, dh)
        if s["qk_norm"]:
            q = rms_norm(q, p[f"{pre}/q_norm/scale"], s["rms_norm_eps"])
            k = rms_norm(k, p[f"{pre}/k_norm/scale"], s["rms_norm_eps"])
        q, k = rotate(q, angles), rotate(k, angles)
        group = HEADS // kv  # query head n reads key/value head n // group
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(dh)
        weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        att = jnp.einsum("bnqk,bknd->bqnd", weights, v).reshape(b, t, HEADS * dh)
        x = x + proj(f"{pre}/o", att)
        h = rms_norm(x, p[f"{pre}/mlp_norm/scale"], s["rms_norm_eps"])
        if mlp is not None:
            x = x + mlp(layer, h)
            continue
        x = x + proj(f"{pre}/down", jax.nn.silu(proj(f"{pre}/gate", h)) * proj(f"{pre}/up", h))
    h = rms_norm(x, p["norm/scale"], s["rms_norm_eps"])
    table = p["tok/embedding"] if s["tie_embeddings"] else p["lm_head/embedding"]
    return (h @ table.T)[..., :VOCAB]


def next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


def batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, (G, T + 1), dtype=np.int32)} for _ in range(STEPS)]


def tx():
    return optax.adamw(LR, weight_decay=0.1)


def initial_params(**settings) -> dict[str, np.ndarray]:
    model = build(**settings)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in flat}


def loss_fn(model, batch):
    tokens = batch["tokens"]
    return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
