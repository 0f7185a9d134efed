"""shard_map on a data-only mesh compiles its step on the run's own mesh. JAX requires one
mesh across a program that holds a primitive needing its devices at lowering: cuDNN's
fused attention on a GPU (where ``--strategy shard_map`` once failed on every data-only
mesh: "mesh should be the same across the entire program", jax 0.11.2 on an H200) or,
on any machine, a host callback (``jax.pure_callback``) in the user's loss. Checked
against a plain single-device loop (jax.grad + optax, no jaxdist)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist

DEVICES, STEPS, LR = 4, 3, 0.1


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


SEEN = []  # the label arrays the host callback saw


def host_weight(labels) -> np.ndarray:
    """A loss weight computed on the host from the labels (here always 1)."""
    SEEN.append(np.asarray(labels))
    return np.float32(1.0)


def loss_with_callback(model, batch, rngs):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    weight = jax.pure_callback(host_weight, jax.ShapeDtypeStruct((), jnp.float32), batch["y"])
    return loss * weight


def batch_at(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"x": rng.normal(size=(16, 6)).astype(np.float32), "y": rng.integers(0, 3, 16)}


def reference_params():
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.sgd(LR)
    opt = tx.init(params)

    def loss(p, batch):
        logits = nnx.merge(graphdef, p)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    for step in range(STEPS):
        grads = jax.grad(loss)(params, jax.tree.map(jnp.asarray, batch_at(step)))
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return nnx.to_pure_dict(params)


@pytest.mark.parametrize("strategy", ["shard_map", "gspmd"])
def test_a_callback_in_the_loss_compiles_on_one_mesh(strategy):
    SEEN.clear()
    mesh = jaxdist.make_mesh(data=DEVICES)
    dp = jaxdist.DataParallel(
        MLP(nnx.Rngs(0)), optax.sgd(LR), loss_with_callback, mesh=mesh, strategy=strategy
    )
    state = dp.init_state()
    for step in range(STEPS):
        state, _ = dp.step(state, jaxdist.shard_batch(batch_at(step), mesh))
    got = jax.tree.leaves(dp.host_params(state))  # waits for the steps, so their callbacks
    assert SEEN, "the loss's callback never ran"
    want = jax.tree.leaves(reference_params())
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
