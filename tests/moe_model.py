"""A user's classifier with a mixture-of-experts block, for ``--model moe_model:build``:
inputs (B, in_features) viewed as T = 4 tokens of in_features / 4, one ``MoE`` of E = 4
experts (top-2), the tokens' mean, a linear head to num_classes."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxdist.models.moe import MoE

TOKENS, EXPERTS = 4, 4


class MoEClassifier(nnx.Module):
    def __init__(self, in_features: int, num_classes: int, rngs: nnx.Rngs):
        d = in_features // TOKENS
        self.moe = MoE(d, 2 * d, EXPERTS, 2, rngs=rngs)
        self.head = nnx.Linear(d, num_classes, rngs=rngs)

    def __call__(self, x):  # (B, in_features) -> (B, num_classes)
        h = x.reshape(x.shape[0], TOKENS, -1)
        y, _ = self.moe(h)
        return self.head(jnp.mean(y, axis=1))


def build(config, rngs: nnx.Rngs):
    return MoEClassifier(config.in_features, config.num_classes, rngs)
