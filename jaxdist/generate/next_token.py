"""The next token from a row's logits: greedy, or sampled with a temperature, top-k and
top-p (nucleus), applied in that order, as transformers' warpers apply them.

``choose(logits, key, sampling)`` takes (B, V) logits and gives (B,) ids. Sampling draws
with the Gumbel-max trick: ``argmax(logits / T + g)`` with g Gumbel noise is a draw from
``softmax(logits / T)``, and a masked-out token (-inf) can never win. The noise is one
(V,) draw per key, the same for every row: a row's token depends on its own logits and
the key only, never on the other prompts of its batch, so a prompt batched with others
samples what it samples alone (and a prompt given twice in one batch samples the same
text twice: another ``--seed`` gives another sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; frozen and hashable: a static part of the step."""

    temperature: float = 0.0  # 0: greedy (the most likely token)
    top_k: int = 0  # >0: only the k most likely tokens may be drawn
    top_p: float = 1.0  # <1: only the smallest set of most likely tokens holding p

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature}: give 0 (greedy) or more")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: give 0 (all tokens) or more")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: give a probability in (0, 1]")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            raise ConfigError(
                f"--top-k {self.top_k} / --top-p {self.top_p} with --temperature 0: greedy "
                "takes the most likely token, so they would change nothing; give a temperature"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choose(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """(B, V) logits -> (B,) int32 ids, as ``sampling`` says (``key``: this step's)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits / sampling.temperature
    if sampling.top_k:
        z = jnp.where(top_k_mask(z, sampling.top_k), z, -jnp.inf)
    if sampling.top_p < 1:
        z = jnp.where(top_p_mask(z, sampling.top_p), z, -jnp.inf)
    noise = jax.random.gumbel(key, z.shape[-1:], jnp.float32)  # (V,): every row alike
    return jnp.argmax(z + noise[None], axis=-1).astype(jnp.int32)


def top_k_mask(z: jax.Array, k: int) -> jax.Array:
    """(B, V) bool: True at each row's k largest entries (exactly k: ties by index)."""
    k = min(k, z.shape[-1])
    _, index = lax.top_k(z, k)  # (B, k)
    rows = jnp.arange(z.shape[0])[:, None]
    return jnp.zeros(z.shape, bool).at[rows, index].set(True)


def top_p_mask(z: jax.Array, p: float) -> jax.Array:
    """(B, V) bool: True at the smallest set of each row's most likely tokens whose
    probabilities (softmax of ``z``) sum to ``p`` or more; the most likely always."""
    probs = jax.nn.softmax(z, axis=-1)
    order = jnp.argsort(-probs, axis=-1, stable=True)  # (B, V): most likely first
    ranked = jnp.take_along_axis(probs, order, axis=-1)
    # the mass of the tokens ranked before each one (B, V): kept while that is short of p
    total = jnp.cumsum(ranked, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(total[:, :1]), total[:, :-1]], axis=-1)
    keep = before < p
    rows = jnp.arange(z.shape[0])[:, None]
    return jnp.zeros(z.shape, bool).at[rows, order].set(keep)
