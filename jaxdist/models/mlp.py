"""A small MLP classifier: inputs (B, in_features) -> logits (B, num_classes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    def __init__(
        self,
        in_features: int,
        hidden: int,
        depth: int,
        num_classes: int,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        sizes = [in_features] + [hidden] * depth
        # param_dtype stays float32 (master weights); dtype is the compute dtype.
        self.layers = nnx.List(
            [
                nnx.Linear(a, b, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
                for a, b in zip(sizes[:-1], sizes[1:], strict=True)
            ]
        )
        self.head = nnx.Linear(hidden, num_classes, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, in_features) -> (B, num_classes)
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)
