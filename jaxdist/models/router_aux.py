"""What a mixture-of-experts call reports besides its output (``MoEAux``, per row), and
how an MoE model's blocks carry it with their activations (``Routed``);
``jaxdist.models.moe`` says what each quantity is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["MoEAux", "Routed", "aux_outputs"]


@struct.dataclass
class MoEAux:
    """What one MoE call reports besides its output, per row (a pytree: jit, scan and
    the pipelines carry it)."""

    load_balance_loss: jax.Array  # (B,) float32
    z_loss: jax.Array  # (B,) float32
    expert_share: jax.Array  # (B, E) float32, each row sums to 1
    dropped: jax.Array  # (B,) float32: pairs dropped (a count)

    @classmethod
    def zeros(cls, rows: int, n_experts: int) -> MoEAux:
        zero = jnp.zeros((rows,), jnp.float32)
        return cls(zero, zero, jnp.zeros((rows, n_experts), jnp.float32), zero)

    def __add__(self, other: MoEAux) -> MoEAux:
        return jax.tree.map(jnp.add, self, other)


@struct.dataclass
class Routed:
    """What an MoE model's blocks pass each other: the activations and the aux summed
    over the MoE layers so far (``MoEAux``, per row). One pytree, split by rows, so every
    runner of a ``Stack`` (scan, pipeline stages, micro-batches) carries both."""

    x: jax.Array  # (B, T, D)
    aux: MoEAux


def aux_outputs(logits, probs, experts, dropped) -> MoEAux:
    """The ``MoEAux`` of one call, per row: logits and probs (B, T, E), experts (B, T, k),
    dropped (B,)."""
    b, _, n_experts = logits.shape
    onehot = jax.nn.one_hot(experts.reshape(b, -1), n_experts, dtype=jnp.float32)
    share = jnp.mean(onehot, axis=1)  # (B, E): of the row's T*k pairs
    mean_prob = jnp.mean(probs, axis=1)  # (B, E)
    lse = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    return MoEAux(
        load_balance_loss=n_experts * jnp.sum(share * mean_prob, axis=-1),
        z_loss=jnp.mean(jnp.square(lse), axis=-1),
        expert_share=share,
        dropped=dropped,
    )
