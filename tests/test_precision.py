"""Mixed precision, against a reference written here without jaxdist (plain ``jax.grad``
through ``nnx.split``/``nnx.merge``, plain optax): bfloat16 compute keeps float32 master
weights, gradients and optimizer state, and the step is the plain AdamW step on the
model's own gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from helpers import flat, relative_error
from jaxdist.train.build_model import build_model
from jaxdist.train.config import ModelConfig

DEVICES, SEED = 8, 3
STRATEGIES = ["gspmd", "shard_map", "pmap"]


LR = 1e-2
# Adam's first step is lr * g / (|g| + eps): with the default eps = 1e-8 it is +-lr
# whatever the gradient, and an element whose gradient is rounding noise (GPT's key bias:
# softmax ignores a constant shift of the scores) gets a random sign. An eps above that
# noise makes the step follow the gradient's size, so the comparison checks the gradient.
EPS = 1e-2


def small_config(name: str, dtype: str) -> ModelConfig:
    if name == "mlp":
        return ModelConfig(
            name="mlp", dtype=dtype, in_features=12, hidden=32, depth=2, num_classes=5
        )
    return ModelConfig(
        name="gpt",
        dtype=dtype,
        vocab_size=61,
        seq_len=8,
        d_model=32,
        n_layers=1,
        n_heads=4,
        attention="xla",
    )


def task_batch(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    if name == "mlp":
        x = rng.normal(size=(32, 12)).astype(np.float32)
        return {"x": x, "y": rng.integers(0, 5, 32).astype(np.int32)}
    return {"tokens": rng.integers(0, 61, (16, 9)).astype(np.int32)}


def task_loss(model, batch):
    """Cross-entropy in float32 over the model's (possibly bfloat16) logits."""
    if "tokens" in batch:
        logits, labels = model(batch["tokens"][:, :-1]), batch["tokens"][:, 1:]
    else:
        logits, labels = model(batch["x"]), batch["y"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return ce.mean()


@functools.cache
def plain_adamw_step(name: str, dtype: str):
    """(gradients, AdamW update) of one plain step on one device, no jaxdist."""
    model, _ = build_model(small_config(name, dtype), SEED)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return task_loss(nnx.merge(graphdef, p, rest), task_batch(name))

    grads = jax.jit(jax.grad(loss))(params)
    tx = optax.adamw(LR, eps=EPS)
    updates, _ = tx.update(grads, tx.init(params), params)
    return grads, updates


@functools.cache
def jaxdist_adamw_step(name: str, dtype: str, strategy: str):
    """(state after one step, its parameter change) of a DataParallel AdamW step."""
    mesh = jaxdist.make_mesh(data=DEVICES)
    model, _ = build_model(small_config(name, dtype), SEED)
    dp = jaxdist.DataParallel(
        model, optax.adamw(LR, eps=EPS), task_loss, mesh=mesh, strategy=strategy
    )
    state = dp.init_state()
    before = flat(dp.unreplicate(state).params)  # float64 copies: the step donates state
    state, _ = dp.step(state, jaxdist.shard_batch(task_batch(name), mesh))
    after = dp.unreplicate(state)
    return after, {k: v - before[k] for k, v in flat(after.params).items()}


def tree_error(got: dict, want: dict) -> float:
    """Relative error of the whole tree, all leaves as one vector."""
    assert got.keys() == want.keys()
    keys = sorted(want)
    return relative_error(
        np.concatenate([got[k].ravel() for k in keys]),
        np.concatenate([want[k].ravel() for k in keys]),
    )


# The strategies differ only in how they average gradients: each on the MLP, and the
# transformer (whose bfloat16 step takes seconds to compile on a CPU) on the default.
@pytest.mark.parametrize("name, strategy", [("mlp", s) for s in STRATEGIES] + [("gpt", "gspmd")])
def test_bfloat16_compute_keeps_float32_params_grads_and_adam_state(name, strategy):
    state, delta = jaxdist_adamw_step(name, "bfloat16", strategy)

    params = jax.tree.leaves(state.params)
    assert params and {x.dtype for x in params} == {jnp.dtype(jnp.float32)}

    def is_adam(s):
        return isinstance(s, optax.ScaleByAdamState)

    (adam,) = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(s)]
    want = jax.tree.map(lambda x: (x.shape, jnp.dtype(jnp.float32)), state.params)
    for moment in (adam.mu, adam.nu):  # float32, one per parameter
        assert jax.tree.map(lambda x: (x.shape, x.dtype), moment) == want
    assert jnp.issubdtype(adam.count.dtype, jnp.integer)

    # The plain gradient through the bfloat16 model is float32 (the parameters' dtype),
    # and jaxdist's step is AdamW on it, up to bfloat16 rounding: 8 devices sum the
    # gradient in another order than one does (measured: 0.06% to 0.25%).
    grads, updates = plain_adamw_step(name, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert tree_error(delta, flat(updates)) < 1e-2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_step_is_plain_adamw_and_differs_from_bfloat16(strategy):
    """The same step in float32 agrees with plain AdamW to float32 rounding (so the
    tolerance above is bfloat16's, not a loose check of the step), and differs from the
    bfloat16 step (so bfloat16 really computed: measured 0.8%)."""
    _, delta32 = jaxdist_adamw_step("mlp", "float32", strategy)
    _, updates32 = plain_adamw_step("mlp", "float32")
    want32 = flat(updates32)
    for key, value in delta32.items():
        assert relative_error(value, want32[key]) < 1e-4, key
    _, delta16 = jaxdist_adamw_step("mlp", "bfloat16", strategy)
    assert tree_error(delta16, delta32) > 1e-3
