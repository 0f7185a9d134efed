"""A loss whose every step keeps the device busy for tens of milliseconds (a chain of
matrix products on the batch, whose result the loss adds times zero), as a big model's
step would, for tests/test_loop_overlap.py. Written without jaxdist, as a user's loss
(``--loss slow_device:loss``). A host callback would not do: XLA:CPU runs a program with
one synchronously, so its dispatch returns only when the step is over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

PRODUCTS = 24  # (256, 256) @ (256, 256) each: ~0.8 GFLOP a step, ~30 ms on 2 CPU cores


def busy(x):
    """A scalar from PRODUCTS dependent matrix products seeded by ``x``."""
    a = jnp.tanh(jnp.resize(x.astype(jnp.float32), (256, 256)))
    a = jax.lax.fori_loop(0, PRODUCTS, lambda i, a: jnp.tanh(a @ a) * 0.5, a)
    return jnp.sum(a)


def loss(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return losses.mean() + 0.0 * busy(batch["x"])
