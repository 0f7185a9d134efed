"""The per-token reference of ``tests/test_moe.py``, written without jaxdist: the
router's probabilities (softmax or sigmoid written out), each token's top-k experts
picked by numpy, each chosen expert's SwiGLU applied in turn and summed with the routing
weights (and the shared experts); in capacity mode, per sequence in position order, an
expert's pairs past its C-th dropped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.models.moe import capacity

D, F, E, K, B, T = 16, 32, 4, 2, 2, 8
LB, Z = 0.3, 0.1  # the aux losses' weights in the differentiated objective


def scores_of(logits, router):
    """softmax or sigmoid, written out; -> (scores the top-k picks from, probabilities)."""
    if router == "softmax":
        z = jnp.exp(logits - jnp.max(logits))
        return z / jnp.sum(z), z / jnp.sum(z)
    s = 1.0 / (1.0 + jnp.exp(-logits))
    return s, s / jnp.sum(s)


def choices(params, x, router, cf=0.0, latest_first=False):
    """numpy: each token's top-k experts (B, T, K) and whether each pair is kept: with a
    capacity factor, per sequence in position order (reversed: ``latest_first``), an
    expert keeps its first C pairs."""
    x, w = np.asarray(x), np.asarray(params["router"])
    t_len = x.shape[1]
    experts = np.zeros((x.shape[0], t_len, K), np.int64)
    for b in range(x.shape[0]):
        for t in range(t_len):
            scores, _ = scores_of(jnp.asarray(x[b, t] @ w), router)
            experts[b, t] = np.argsort(-np.asarray(scores), kind="stable")[:K]
    keep = np.ones(experts.shape, bool)
    if cf:
        c = capacity(cf, t_len, K, E)
        for b in range(x.shape[0]):
            taken = np.zeros(E, int)
            for t in reversed(range(t_len)) if latest_first else range(t_len):
                for j in range(K):
                    e = experts[b, t, j]
                    keep[b, t, j] = taken[e] < c
                    taken[e] += keep[b, t, j]
    return experts, keep


def swiglu(x, gate, up, down):
    g = x @ gate
    return ((g / (1.0 + jnp.exp(-g))) * (x @ up)) @ down


def reference(params, x, experts, keep, router, norm_topk=True, route_scale=1.0, **_):
    """-> (y (B, T, D), load-balancing loss (B,), z-loss (B,)), differentiable in params
    and x; the losses per sequence, as the module defines them."""
    rows, all_logits, all_probs = [], [], []
    at = jnp.asarray  # array indices: eager ops compiled once, not once per index
    d = x.shape[-1]
    tokens = x.reshape(-1, d)
    pairs = zip(experts.reshape(-1, K), keep.reshape(-1, K), strict=True)
    for n, (chosen, kept) in enumerate(pairs):
        xt = tokens[at(n)]
        logits = xt @ params["router"]
        scores, probs = scores_of(logits, router)
        w = scores[at(chosen)]
        if norm_topk:
            w = w / jnp.sum(w)
        w = w * route_scale
        y = jnp.zeros(d)
        for j, e in enumerate(chosen):
            if kept[j]:
                e = at(e)
                y = y + w[at(j)] * swiglu(xt, params["gate"][e], params["up"][e], params["down"][e])
        if "shared/gate/kernel" in params:
            y = y + swiglu(
                xt, params["shared/gate/kernel"], params["shared/up/kernel"],
                params["shared/down/kernel"],
            )  # fmt: skip
        rows.append(y)
        all_logits.append(logits)
        all_probs.append(probs)
    b = x.shape[0]
    logits = jnp.stack(all_logits).reshape(b, -1, E)
    probs = jnp.stack(all_probs).reshape(b, -1, E)
    share = np.stack([np.bincount(row, minlength=E) for row in experts.reshape(b, -1)])
    share = share / experts[0].size  # (B, E): of each row's T*k pairs
    lb = E * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)  # (B,)
    top = jnp.max(logits, axis=-1, keepdims=True)
    lse = top[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))  # (B, T)
    return jnp.stack(rows).reshape(x.shape), lb, jnp.mean(lse**2, axis=-1)


def reference_run(params, x, probe, experts, keep, settings):
    """The reference's (y, lb, z) and its gradients of the objective ``block_run`` takes."""

    def objective(params, x):
        y, lb, z = reference(params, x, experts, keep, **settings)
        return jnp.sum(y * probe) + LB * jnp.mean(lb) + Z * jnp.mean(z), (y, lb, z)

    (g_params, g_x), outputs = jax.grad(objective, argnums=(0, 1), has_aux=True)(params, x)
    return outputs, g_params, g_x
