"""Several dropout layers (three nnx.Dropout and nnx.MultiHeadAttention's own) against
plain flax: each layer draws its own mask, as after flax's ``nnx.reseed``.

The references use no jaxdist code: ``nnx.reseed(model, dropout=key)`` with the key of
jaxdist's documented contract (``fold_in(key(seed), step)``, then ``fold_in(.., device)``
under pmap/shard_map), ``jax.value_and_grad`` and optax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist

SEED, LR = 4, 0.1
TX = optax.sgd(LR)


class ThreeDropouts(nnx.Module):
    """(B, T, 8) -> (B, T): dropout after two MLP layers, in attention, after attention."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.d1 = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 16, rngs=rngs)
        self.d2 = nnx.Dropout(0.5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 16, dropout_rate=0.5, decode=False, rngs=rngs)
        self.d3 = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        h = self.d1(nnx.relu(self.l1(x)))
        h = self.d2(nnx.relu(self.l2(h)))
        return self.head(self.d3(self.attn(h)))[..., 0]


def fingerprint(y):
    """Which elements a dropout kept, as one exactly representable number."""
    return jnp.sum((y != 0) * jnp.arange(y.size).reshape(y.shape)).astype(jnp.float32)


def loss_fn(model, batch):
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    ones = jnp.ones((4, 16))  # each layer's next mask, as metrics
    return loss, {name: fingerprint(getattr(model, name)(ones)) for name in ("d1", "d2", "d3")}


def new_model():
    return ThreeDropouts(nnx.Rngs(params=0, dropout=1))


def batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(16, 5, 8)).astype(np.float32),
        "y": rng.normal(size=(16, 5)).astype(np.float32),
    }


def plain_flax_grads(rows, key, apply_sgd=False):
    """Plain flax after ``nnx.reseed(model, dropout=key)``: the params, and ((loss, masks),
    gradient), or with ``apply_sgd`` ((loss, masks), params after one SGD step)."""
    model = new_model()
    model.train()
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    return params, _reference(graphdef, apply_sgd)(params, other, rows, key)


@functools.cache
def _reference(graphdef, apply_sgd: bool):
    @jax.jit
    def step(params, other, rows, key):
        m = nnx.merge(graphdef, params, other)
        nnx.reseed(m, dropout=key)
        _, _, reseeded = nnx.split(m, nnx.Param, ...)

        def loss(p):
            return loss_fn(nnx.merge(graphdef, p, reseeded, copy=True), rows)

        out, g = jax.value_and_grad(loss, has_aux=True)(params)
        return out, (sgd(params, g) if apply_sgd else g)

    return step


def sgd(params, grads):
    updates, _ = TX.update(grads, TX.init(params), params)
    return optax.apply_updates(params, updates)


def flat(params) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def jaxdist_step(devices: int, strategy: str):
    mesh = jaxdist.make_mesh(data=devices)
    dp = jaxdist.DataParallel(new_model(), TX, loss_fn, mesh=mesh, strategy=strategy, seed=SEED)
    state, metrics = dp.step(dp.init_state(), jaxdist.shard_batch(batch(), mesh))
    return dp.host_params(state), dp.metrics(metrics)


def test_every_dropout_layer_draws_its_own_mask_as_in_plain_flax():
    key = jax.random.fold_in(jax.random.key(SEED), 0)  # step 0
    _, ((_, masks), updated) = plain_flax_grads(batch(), key, apply_sgd=True)
    want = flat(updated)
    masks = {k: float(v) for k, v in masks.items()}
    assert len(set(masks.values())) == 3  # plain flax: three different masks

    got, metrics = jaxdist_step(1, "gspmd")
    assert {k: metrics[k] for k in masks} == masks  # the same masks, exactly
    for name, value in want.items():  # and the same gradient, bit for bit, on 1 device
        np.testing.assert_array_equal(got[name], value, err_msg=name)

    got, metrics = jaxdist_step(8, "gspmd")  # partitionable threefry: the same masks
    assert {k: metrics[k] for k in masks} == masks
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("strategy", ["pmap", "shard_map"])
def test_per_device_masks_differ_across_devices_and_layers(strategy):
    key = jax.random.fold_in(jax.random.key(SEED), 0)
    rows = jax.tree.map(lambda x: x.reshape(8, 2, *x.shape[1:]), batch())  # device d: 2 rows
    per_device = [
        plain_flax_grads(jax.tree.map(lambda x, d=d: x[d], rows), jax.random.fold_in(key, d))
        for d in range(8)
    ]
    params = per_device[0][0]
    grads = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[g for _, (_, g) in per_device])
    masks = np.array([[float(m[k]) for k in ("d1", "d2", "d3")] for _, ((_, m), _) in per_device])
    assert len({tuple(m) for m in masks}) == 8  # every device its own masks
    assert all(len(set(m)) == 3 for m in masks)  # and every layer

    got, metrics = jaxdist_step(8, strategy)
    np.testing.assert_allclose(
        [metrics[k] for k in ("d1", "d2", "d3")], masks.mean(0), rtol=1e-6
    )  # the average over devices of each layer's fingerprint
    for name, value in flat(sgd(params, grads)).items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
