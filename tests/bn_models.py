"""Small test models with BatchNorm and dropout: one NNX, one Linen."""

from __future__ import annotations

import numpy as np
import optax
from flax import linen, nnx

NUM_CLASSES = 3


class NNXCNN(nnx.Module):
    """(B, 8, 8, 1) images -> (B, 3) logits, with BatchNorm and Dropout."""

    def __init__(self, rngs: nnx.Rngs):
        # No conv bias: BatchNorm cancels it, so its gradient is rounding noise.
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=7))  # its own RNG stream
        self.head = nnx.Linear(8 * 8 * 4, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn(self.conv(x))))
        return self.head(x.reshape(x.shape[0], -1))


class LinenCNN(linen.Module):
    """The same network in Linen: params, a 'batch_stats' collection and dropout."""

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Conv(4, (3, 3), use_bias=False)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        x = linen.Dropout(0.3, deterministic=not train)(linen.relu(x))
        return linen.Dense(NUM_CLASSES)(x.reshape(x.shape[0], -1))


def images(step: int, size: int = 32):
    rng = np.random.default_rng([11, step])
    x = rng.normal(size=(size, 8, 8, 1)).astype(np.float32) + np.float32(step % 3)
    return {"x": x, "y": rng.integers(0, NUM_CLASSES, size).astype(np.int32)}


def loss_fn(model, batch, rngs):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
