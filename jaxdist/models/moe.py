"""A mixture-of-experts feed-forward block: (B, T, D) -> ((B, T, D), ``MoEAux``).

It takes the place of a SwiGLU MLP (``LlamaBlock``'s ``down(silu(gate(x)) * up(x))``):
E routed experts, each a SwiGLU of width F, and optionally S shared experts that every
token goes through, DeepSeek's form (one SwiGLU of width S * F added unweighted;
Qwen2-MoE's sigmoid gate on its shared expert is not offered).

Routing, in float32 whatever ``dtype`` is (logits ``x @ router``, (D, E)):

- ``router="softmax"`` (Mixtral, Qwen-MoE): probabilities softmax over all E logits,
  each token's top-k of them; ``norm_topk`` divides the k weights by their sum (Mixtral
  always, Qwen2-MoE's ``norm_topk_prob``).
- ``router="sigmoid"`` (DeepSeek-V3's scores, without its bias correction and group
  limit): scores sigmoid(logits), the top-k scores, ``norm_topk`` as above.

Both then multiply the weights by ``route_scale`` (DeepSeek-V3's routed_scaling_factor).

Experts run in one of two ways:

- dropless (``capacity_factor=0``, the default): the N*k (token, choice) pairs are sorted
  by expert (stably: token order within an expert), each expert's rows multiplied by its
  weights with ``jax.lax.ragged_dot`` (group sizes: pairs per expert), the results put
  back in pair order and summed with the routing weights. No pair is dropped.
- capacity (``capacity_factor`` c > 0): within each sequence (the routing group) every
  expert takes at most C = ceil(c * T * k / E) pairs (at most T), served in token
  position order: a pair is dropped when its expert already took C pairs from earlier
  positions of the same sequence. A token's fate so depends only on its sequence up to
  itself: the same pairs drop whatever the batch split across devices or micro-batches,
  and no later token changes an earlier token's output (the block stays causal).
  Experts then run on static (B, E, C, D) buffers (batched matmuls, no ragged shapes);
  a dropped pair contributes zero (the token keeps its other choices).

Auxiliary quantities are returned, ``y, aux = moe(x)``, as an ``MoEAux`` pytree of
arrays rather than sown into ``nnx.Intermediate``: jaxdist drops Intermediate variables
from the training state (``jaxdist.models.adapt.DROPPED``), a block run by a ``Stack``
is merged and called inside ``jax.lax.scan`` where anything sown is lost, and a returned
pytree travels with the activations (``Routed``) through every runner of a stack.

Every quantity is **per sequence** (one value per row of the (B, T, D) input), so the
batch's mean is the same sum however its rows are split over devices, micro-batches or
pipeline stages (a balance over all B * T tokens of a call would change with the split):

- ``load_balance_loss`` (B,): E * sum_e f_e P_e over the row's T tokens (DeepSeek-V3's
  sequence-wise balance loss; Switch / Mixtral pool the same product over a whole batch),
  f_e the fraction of the row's T*k routed pairs that chose expert e (before any
  capacity drop), P_e the row's mean router probability of e (the sigmoid router: the
  mean of scores / their sum over E). 1 when balanced;
- ``z_loss`` (B,): the row's mean over tokens of logsumexp(logits)^2 (ST-MoE);
- ``expert_share`` (B, E): f_e per row, each row summing to 1;
- ``dropped`` (B,): the row's dropped pairs, a float32 count (0 when dropless; float so
  that a pipeline's backward pass carries it as it carries activations).

``MoEAux.zeros(B, E)`` starts a sum over layers: aux add leaf by leaf (``+``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from jaxdist.models import expert_parallel
from jaxdist.models.router_aux import MoEAux, aux_outputs

ROUTERS = ("softmax", "sigmoid")
# (E, in, out) kernels: lecun normal over `in` per expert (axis 0 a batch axis, not fan-in)
_EXPERT_INIT = initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """How a model's MoE layers are built and trained (``--moe-*``; the Llama's ``moe``)."""

    n_experts: int
    top_k: int = 2
    ffn_dim: int = 0  # each expert's width; 0: the model's dense MLP width
    n_shared: int = 0
    dense_layers: int = 0  # the first D layers keep a dense MLP
    router: str = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    capacity_factor: float = 0.0  # 0: dropless
    balance_coef: float = 0.01  # the load-balancing loss's weight in the training loss
    z_coef: float = 0.001  # the router z-loss's weight

    def block(self, d_model: int, ffn_dim: int, **kw) -> MoE:
        """The MoE of one layer, ``MoE(d_model, ffn_dim or this width, ...)``."""
        return MoE(
            d_model, self.ffn_dim or ffn_dim, self.n_experts, self.top_k, n_shared=self.n_shared,
            router=self.router, norm_topk=self.norm_topk, route_scale=self.route_scale,
            capacity_factor=self.capacity_factor, **kw,
        )  # fmt: skip

    def loss_terms(self, aux: MoEAux, layers: int) -> tuple[jax.Array, dict]:
        """(what the training loss adds, the metrics) from ``aux`` summed over ``layers``
        MoE layers: each loss the mean over rows and layers (so per sequence and layer),
        each expert's share of the routed pairs pooled over layers (``moe/share/e``: a
        mean over rows, the same however the rows are split), and their min and max (of
        the rows one replica sees, where a strategy averages metrics over replicas:
        shard_map, gspmd with stages, fsdp or grad-accum)."""
        balance = jnp.mean(aux.load_balance_loss) / layers
        z = jnp.mean(aux.z_loss) / layers
        share = jnp.mean(aux.expert_share, axis=0) / layers  # (E,), sums to 1
        metrics = {
            "moe/balance_loss": balance,
            "moe/z_loss": z,
            "moe/share_min": jnp.min(share),
            "moe/share_max": jnp.max(share),
            "moe/dropped_per_row": jnp.mean(aux.dropped),  # pairs, all layers together
            **{f"moe/share/{e}": share[e] for e in range(self.n_experts)},
        }
        return self.balance_coef * balance + self.z_coef * z, metrics


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``, (..., D) -> (..., D), named as Llama's MLP is."""

    def __init__(self, d_model: int, width: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        def linear(d_in, d_out, axes):
            init = nnx.with_partitioning(default_kernel_init, axes)
            return nnx.Linear(
                d_in, d_out, use_bias=False, kernel_init=init, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs,
            )  # fmt: skip

        self.gate = linear(d_model, width, ("embed", "mlp"))
        self.up = linear(d_model, width, ("embed", "mlp"))
        self.down = linear(width, d_model, ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class MoE(nnx.Module):
    """E experts of width ``ffn_dim``, each token routed to ``top_k`` of them (see the
    module). Built as ``LlamaBlock`` builds its MLP: ``MoE(d_model, ffn_dim, ...,
    dtype=, param_dtype=, rngs=)``; parameters ``router`` (D, E) ("embed", None),
    ``gate`` and ``up`` (E, D, F) ("expert", "embed", "mlp"), ``down`` (E, F, D)
    ("expert", "mlp", "embed"), and ``shared`` (a ``SwiGLU``) with ``n_shared``."""

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        *,
        n_shared: int = 0,
        router: str = "softmax",
        norm_topk: bool = True,
        route_scale: float = 1.0,
        capacity_factor: float = 0.0,  # 0: dropless
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if router not in ROUTERS:
            raise ValueError(f"router {router!r} is not one of {ROUTERS}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} is not between 1 and n_experts {n_experts}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor {capacity_factor} is negative (0: dropless)")
        self.n_experts, self.top_k, self.n_shared = n_experts, top_k, n_shared
        self.router_kind, self.norm_topk, self.route_scale = router, norm_topk, route_scale
        self.capacity_factor, self.dtype = capacity_factor, dtype

        def param(init, shape, axes):
            return nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape, param_dtype))

        e, d, f = n_experts, d_model, ffn_dim
        # replicated over experts: every device sees all E logits for its top-k
        self.router = param(default_kernel_init, (d, e), ("embed", None))
        self.gate = param(_EXPERT_INIT, (e, d, f), ("expert", "embed", "mlp"))
        self.up = param(_EXPERT_INIT, (e, d, f), ("expert", "embed", "mlp"))
        self.down = param(_EXPERT_INIT, (e, f, d), ("expert", "mlp", "embed"))
        self.shared = (
            SwiGLU(d, n_shared * f, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if n_shared
            else None
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux]:
        """(B, T, D) -> ((B, T, D) in ``dtype``, ``MoEAux``)."""
        logits = jnp.dot(x.astype(jnp.float32), self.router.get_value().astype(jnp.float32))
        weights, experts, probs = route(
            logits, self.top_k, self.router_kind, self.norm_topk, self.route_scale
        )
        h = x.astype(self.dtype)
        if expert_parallel.splits_rows():  # per device: the experts' rows, or the batch's
            y, dropped = expert_parallel.routed(self, h, weights, experts)
        elif self.capacity_factor:
            y, dropped = self._capacity(h, weights, experts)
        else:
            y, dropped = self._dropless(h, weights, experts), jnp.zeros(x.shape[:1], jnp.float32)
        y = y.astype(self.dtype)
        if self.shared is not None:
            y = y + self.shared(h)
        return y, aux_outputs(logits, probs, experts, dropped)

    def _kernels(self):
        return [w.get_value().astype(self.dtype) for w in (self.gate, self.up, self.down)]

    def _dropless(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """Every (token, choice) pair through its expert, grouped by a sort -> (B, T, D)."""
        b, t, d = x.shape
        k = self.top_k
        flat = experts.reshape(-1)  # (N*k,) pair p = token p // k, choice p % k
        order = jnp.argsort(flat, stable=True)  # pairs by expert, in token order within
        sizes = jnp.bincount(flat, length=self.n_experts).astype(jnp.int32)
        rows = x.reshape(b * t, d)[order // k]  # (N*k, D) grouped by expert
        gate, up, down = self._kernels()

        def grouped(lhs, rhs):
            return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=self.dtype)

        out = grouped(jax.nn.silu(grouped(rows, gate)) * grouped(rows, up), down)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
        out = out[inverse].reshape(b, t, k, d)  # back in pair order
        return jnp.einsum("btkd,btk->btd", out.astype(jnp.float32), weights)

    def _capacity(self, x: jax.Array, weights: jax.Array, experts: jax.Array):
        """At most C pairs per expert and sequence, by position -> ((B, T, D), dropped)."""
        b, t, d = x.shape
        k, e = self.top_k, self.n_experts
        c = capacity(self.capacity_factor, t, k, e)
        flat = experts.reshape(b, t * k)  # per sequence, pairs in position order
        onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)  # (B, T*k, E)
        # each pair's place in its expert's queue: the earlier pairs to that expert
        slot = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # (B, T*k)
        keep = slot < c
        seq = jnp.arange(b)[:, None]
        token = jnp.arange(t * k) // k
        buffer = jnp.zeros((b, e, c, d), x.dtype)
        buffer = buffer.at[seq, flat, slot].add(x[seq, token], mode="drop")  # kept pairs
        gate, up, down = self._kernels()
        hidden = jax.nn.silu(jnp.einsum("becd,edf->becf", buffer, gate))
        hidden = hidden * jnp.einsum("becd,edf->becf", buffer, up)
        out = jnp.einsum("becf,efd->becd", hidden, down)  # (B, E, C, D)
        pairs = out[seq, flat, jnp.minimum(slot, c - 1)]  # (B, T*k, D)
        pairs = jnp.where(keep[..., None], pairs, 0).reshape(b, t, k, d)
        y = jnp.einsum("btkd,btk->btd", pairs.astype(jnp.float32), weights)
        return y, jnp.sum(~keep, axis=-1).astype(jnp.float32)  # (B,)


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """C = ceil(capacity_factor * tokens * top_k / n_experts), at least 1, at most
    ``tokens`` (an expert takes at most one pair per token)."""
    exact = capacity_factor * tokens * top_k / n_experts
    return max(1, min(tokens, math.ceil(exact - 1e-9)))  # 1e-9: 1.1 * 10 is 11, not 12


def route(logits: jax.Array, top_k: int, router: str, norm_topk: bool, route_scale: float):
    """Logits (..., E) float32 -> (weights (..., k) float32, experts (..., k) int32,
    probabilities (..., E): what the load-balancing loss averages)."""
    if router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    weights, experts = jax.lax.top_k(scores, top_k)
    if norm_topk:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * route_scale, experts.astype(jnp.int32), probs
