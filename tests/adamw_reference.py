"""A small classifier trained with AdamW as a plain flax + optax loop on one device: the
reference that the optimizer-state options (ZeRO-1, host offload) are held to. Batches
are (rows, 64) float32 inputs and labels in [0, 10)."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx


def loss_fn(model, batch):
    logits = model(batch["x"])  # (B, 10)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batches(steps: int, rows: int = 32) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(rows, 64)).astype(np.float32), "y": rng.integers(0, 10, rows)}
        for _ in range(steps)
    ]


def tx():
    return optax.adamw(1e-2, weight_decay=0.1)


def plain_loop(make_model, steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """(losses, params by path) after ``steps`` steps of ``make_model()`` on one device."""
    graphdef, params = nnx.split(make_model(), nnx.Param)
    opt, opt_state = tx(), tx().init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}
    return losses, flat
