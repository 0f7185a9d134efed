"""Linen models leave training mode: evaluation and merged models call the module with its
eval flag, as ``module.apply(variables, x, train=False)`` does in plain Linen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import jaxdist

CLASSES = 3


class WithTrain(linen.Module):
    """flax's own BatchNorm and Dropout, switched by ``train``."""

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(16)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        x = linen.Dropout(0.5, deterministic=not train)(linen.relu(x))
        return linen.Dense(CLASSES)(x)


class WithDeterministic(linen.Module):
    """The flag the other way round, and required (no default)."""

    @linen.compact
    def __call__(self, x, deterministic: bool):
        x = linen.BatchNorm(use_running_average=deterministic, momentum=0.8)(linen.Dense(16)(x))
        return linen.Dense(CLASSES)(linen.Dropout(0.5, deterministic=deterministic)(x))


class WithOwnFlag(linen.Module):
    """A flag of the user's own name, True in eval."""

    @linen.compact
    def __call__(self, x, inference: bool = False):
        x = linen.BatchNorm(use_running_average=inference, momentum=0.8)(linen.Dense(16)(x))
        return linen.Dense(CLASSES)(linen.Dropout(0.5, deterministic=inference)(x))


def batch(step: int, rows: int = 32):
    rng = np.random.default_rng([3, step])
    x = rng.normal(size=(rows, 6)).astype(np.float32) + step % 2
    return {"x": x, "y": rng.integers(0, CLASSES, rows).astype(np.int32)}


def loss_fn(model, b):
    logits = model(b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), logits


def eval_fn(model, b):
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"])}


def train(module, **kwargs):
    mesh = jaxdist.make_mesh(data=8)
    dp = jaxdist.DataParallel(
        module,
        optax.sgd(0.1),
        loss_fn,
        mesh=mesh,
        example_input=batch(0)["x"][:1],
        eval_fn=eval_fn,
        **kwargs,
    )
    state = dp.init_state()
    for step in range(3):
        state, _ = dp.step(state, jaxdist.shard_batch(batch(step), mesh))
    return dp, state, mesh


def linen_variables(dp, state) -> dict:
    """The trained state as Linen's {'params': ..., 'batch_stats': ...} nested dicts."""
    one = dp.unreplicate(state)
    return {"params": nested(one.params), "batch_stats": nested(one.batch_stats)}


def nested(tree) -> dict:
    out: dict = {}
    for path, var in nnx.to_flat_state(tree):
        *parents, leaf = [str(k) for k in path][1:]  # [1:]: LinenModel's "linen" attribute
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = np.asarray(var.get_value())
    return out


@pytest.mark.parametrize(
    "module, flag, kwargs",
    [
        (WithTrain(), {"train": False}, {}),
        (WithDeterministic(), {"deterministic": True}, {}),
        (WithOwnFlag(), {"inference": True}, {"linen_train_arg": "!inference"}),
    ],
)
def test_merged_and_evaluated_linen_models_are_in_eval_mode(module, flag, kwargs):
    dp, state, mesh = train(module, **kwargs)
    variables = linen_variables(dp, state)
    x = batch(7)["x"]
    want = module.apply(variables, x, **flag)  # plain Linen in eval mode

    merged = dp.merge(state)
    first, second = np.asarray(merged(x)), np.asarray(merged(x))
    np.testing.assert_array_equal(first, second)  # dropout off
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-6)
    # Calling the merged model changed no running statistic.
    after = nested(nnx.state(merged, nnx.BatchStat))
    jax.tree.map(np.testing.assert_array_equal, after, variables["batch_stats"])

    # evaluate: per-example losses of the eval-mode model, whatever else is in the batch.
    eval_rows = {**batch(7), "mask": np.ones(32, np.float32)}
    sums = dp.evaluate(state, jaxdist.shard_batch(eval_rows, mesh))
    ref = optax.softmax_cross_entropy_with_integer_labels(want, batch(7)["y"])
    np.testing.assert_allclose(sums["loss"], float(jnp.sum(ref)), rtol=1e-5)


class HardWiredBatchNorm(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.BatchNorm(use_running_average=False)(linen.Dense(4)(x))


class HardWiredDropout(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dropout(0.5, deterministic=False)(linen.Dense(4)(x))


class NoModeNeeded(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(CLASSES)(x)


@pytest.mark.parametrize("module", [HardWiredBatchNorm(), HardWiredDropout()])
def test_linen_model_without_a_mode_flag_is_an_error_saying_what_to_pass(module):
    with pytest.raises(jaxdist.ModelError, match="linen_train_arg"):
        jaxdist.DataParallel(module, optax.sgd(0.1), loss_fn, example_input=batch(0)["x"][:1])


def test_linen_model_needing_no_mode_trains():
    dp, state, _ = train(NoModeNeeded())
    assert np.isfinite(
        dp.metrics(dp.step(state, jaxdist.shard_batch(batch(4), dp.mesh))[1])["loss"]
    )
