"""A transformer written in JAX's explicit-sharding style, as a user brings it, and the
plain loop its author trains it with. Nothing here imports jaxdist.

The model names its own mesh axes: ``batch`` (the axes its rows are split over), ``fsdp``
(where it stores a weight's first dimension) and ``tp`` (tensor parallelism: heads and
the MLP's width). Its weights carry those names as ``out_sharding`` metadata; its forward
pass gathers each weight over ``fsdp`` with ``jax.reshard`` before use and states every
activation's layout with ``out_sharding=``. Grouped-query attention (``HEADS`` query
heads sharing ``KV_HEADS`` key/value heads), RMSNorm, rotary position embeddings, a
SwiGLU MLP, an untied head.

``plain_loop`` is its author's training: ``jax.make_mesh`` with Explicit axes of these
names, the model built under ``jax.set_mesh`` (flax shards each weight as it is made),
``jax.jit`` of an optax SGD step, batches ``device_put`` with their rows over ``batch``.

Shapes: B rows, T positions, D ``D_MODEL``, H ``HEADS``, K ``KV_HEADS``, G = H / K, E
head size D / H, F ``D_MLP``, V ``VOCAB``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

VOCAB, SEQ, D_MODEL, HEADS, KV_HEADS, D_MLP, LAYERS = 64, 8, 32, 4, 2, 64, 2
ROWS, STEPS, LR = 16, 10, 0.5
E = D_MODEL // HEADS


def _param(rngs, shape, names, scale=None):
    scale = 1.0 / np.sqrt(shape[0]) if scale is None else scale
    return nnx.Param(jax.random.normal(rngs.params(), shape) * scale, out_sharding=names)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, fsdp: str, tp: str):
        self.fsdp, self.tp = fsdp, tp
        self.norm1 = nnx.Param(jnp.ones((D_MODEL,)), out_sharding=(None,))
        self.wq = _param(rngs, (D_MODEL, HEADS, E), (fsdp, tp, None))
        self.wk = _param(rngs, (D_MODEL, KV_HEADS, E), (fsdp, tp, None))
        self.wv = _param(rngs, (D_MODEL, KV_HEADS, E), (fsdp, tp, None))
        self.wo = _param(rngs, (HEADS, E, D_MODEL), (tp, None, fsdp), 1.0 / np.sqrt(D_MODEL))
        self.norm2 = nnx.Param(jnp.ones((D_MODEL,)), out_sharding=(None,))
        self.w_gate = _param(rngs, (D_MODEL, D_MLP), (fsdp, tp))
        self.w_up = _param(rngs, (D_MODEL, D_MLP), (fsdp, tp))
        self.w_down = _param(rngs, (D_MLP, D_MODEL), (tp, fsdp))

    def __call__(self, x, rows):  # x (B, T, D), rows: the batch's axes
        tp = self.tp
        x = x + self.attention(rms_norm(x, self.norm1[...]), rows)
        h = rms_norm(x, self.norm2[...])
        gate = jnp.einsum(
            "btd,df->btf", h, self.used(self.w_gate, None, tp), out_sharding=P(rows, None, tp)
        )
        up = jnp.einsum(
            "btd,df->btf", h, self.used(self.w_up, None, tp), out_sharding=P(rows, None, tp)
        )
        return x + jnp.einsum(
            "btf,fd->btd",
            jax.nn.silu(gate) * up,
            self.used(self.w_down, tp, None),
            out_sharding=P(rows, None, None),
        )

    def used(self, weight, *spec):
        """The weight gathered over fsdp: its layout for the matmul."""
        return jax.reshard(weight[...], P(*spec))

    def attention(self, x, rows):
        tp, b, t = self.tp, x.shape[0], x.shape[1]
        q = jnp.einsum(
            "btd,dhe->bthe",
            x,
            self.used(self.wq, None, tp, None),
            out_sharding=P(rows, None, tp, None),
        )
        k = jnp.einsum(
            "btd,dke->btke",
            x,
            self.used(self.wk, None, tp, None),
            out_sharding=P(rows, None, tp, None),
        )
        v = jnp.einsum(
            "btd,dke->btke",
            x,
            self.used(self.wv, None, tp, None),
            out_sharding=P(rows, None, tp, None),
        )
        q, k = rope(q), rope(k)
        # grouped query heads: head h of G per key head k is h = k G + g
        q = q.reshape(
            b, t, KV_HEADS, HEADS // KV_HEADS, E, out_sharding=P(rows, None, tp, None, None)
        )
        scores = jnp.einsum(
            "btkge,bske->bkgts", q, k, out_sharding=P(rows, tp, None, None, None)
        ) / np.sqrt(E)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        out = jnp.einsum(
            "bkgts,bske->btkge", weights, v, out_sharding=P(rows, None, tp, None, None)
        )
        out = out.reshape(b, t, HEADS, E, out_sharding=P(rows, None, tp, None))
        return jnp.einsum(
            "bthe,hed->btd",
            out,
            self.used(self.wo, tp, None, None),
            out_sharding=P(rows, None, None),
        )


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, base=10000.0):
    """Rotary embedding of (B, T, heads, E): pairs (i, i + E/2) rotated by position."""
    t, half = x.shape[1], x.shape[-1] // 2
    freq = base ** (-jnp.arange(half) / half)
    angle = jnp.arange(t)[:, None] * freq[None]  # (T, E/2)
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class ExplicitLM(nnx.Module):
    """tokens (B, T) -> logits (B, T, V). ``rows``: the mesh axes the batch's rows are
    split over; ``fsdp``, ``tp``: this model's names for its two weight axes."""

    def __init__(self, rngs: nnx.Rngs, rows=("data", "fsdp"), fsdp="fsdp", tp="tp", vocab=VOCAB):
        self.rows, self.fsdp, self.tp = tuple(rows), fsdp, tp
        self.embed = _param(rngs, (vocab, D_MODEL), (None, fsdp), 0.5)
        self.blocks = nnx.List([Block(rngs, fsdp, tp) for _ in range(LAYERS)])
        self.norm = nnx.Param(jnp.ones((D_MODEL,)), out_sharding=(None,))
        self.head = _param(rngs, (D_MODEL, vocab), (fsdp, tp))

    def __call__(self, tokens):
        rows = self.rows
        table = jax.reshard(self.embed[...], P())
        x = table.at[tokens].get(out_sharding=P(rows, None, None))
        for block in self.blocks:
            x = block(x, rows)
        x = rms_norm(x, self.norm[...])
        logits = jnp.einsum(
            "btd,dv->btv",
            x,
            jax.reshard(self.head[...], P(None, self.tp)),
            out_sharding=P(rows, None, self.tp),
        )
        return jax.reshard(logits, P(rows, None, None))


def build(rngs: nnx.Rngs, fsdp="fsdp", tp="tp", vocab=VOCAB) -> ExplicitLM:
    """The command line's factory (``--model explicit_model:build``); its rows over
    ``data`` and ``fsdp``."""
    return ExplicitLM(rngs, ("data", "fsdp"), fsdp, tp, vocab)


def loss(model, batch):
    tokens = batch["tokens"]  # (B, T + 1)
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def token_batches(steps=STEPS, rows=ROWS, seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"tokens": rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)} for _ in range(steps)
    ]


def plain_loop(shape: dict, batches, rows=("data", "fsdp"), seed=0, lr=LR):
    """The author's training: an Explicit mesh of ``shape`` ({name: size}, over the first
    devices), the model built under it, SGD. Returns (losses, {path: final param})."""
    names, sizes = tuple(shape), tuple(shape.values())
    devices = jax.devices()[: int(np.prod(sizes))]
    mesh = jax.make_mesh(
        sizes, names, axis_types=(AxisType.Explicit,) * len(names), devices=devices
    )
    with jax.set_mesh(mesh):
        model = ExplicitLM(nnx.Rngs(seed), rows, "fsdp", "tp")
        graphdef, params = nnx.split(model, nnx.Param)
        tx = optax.sgd(lr)
        opt = tx.init(params)

        @jax.jit
        def step(params, opt, batch):
            value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), batch))(params)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, value

        losses = []
        for batch in batches:
            batch = jax.device_put(batch, P(rows))
            params, opt, value = step(params, opt, batch)
            losses.append(float(value))
    final = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}
    return losses, final
