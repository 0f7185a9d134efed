"""What the step takes from a user's loss function and model, and how it reports trouble:
non-finite steps (halt or skip), rows that fail the data check, metrics and rngs."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist

STRATEGIES = ["pmap", "shard_map", "gspmd"]


class TwoParams(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.ones((4,)))
        self.b = nnx.Param(jnp.full((4,), 0.5))


def two_param_loss(model, batch):
    # b's gradient is z's mean: NaN when z holds one, while a's stays finite.
    return jnp.mean((batch["x"] * model.a) ** 2) + jnp.mean(batch["z"] * model.b)


def batches(nan_step: int, steps: int = 4):
    rng = np.random.default_rng(1)
    out = []
    for step in range(steps):
        b = {k: rng.normal(size=(16, 4)).astype(np.float32) for k in ("x", "z")}
        if step == nan_step:
            b["z"][5, 2] = np.nan
        out.append(b)
    return out


def run(strategy, nan_policy, nan_step):
    mesh = jaxdist.make_mesh(data=8)
    dp = jaxdist.DataParallel(
        TwoParams(),
        optax.adam(0.1),
        two_param_loss,
        mesh=mesh,
        strategy=strategy,
        nan_policy=nan_policy,
    )
    state, skipped = dp.init_state(), []
    for step, b in enumerate(batches(nan_step), start=1):
        state, metrics = dp.step(state, jaxdist.shard_batch(b, mesh))
        if dp.check(metrics, step):
            skipped.append(step)
    return dp.host_params(state), skipped


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_policy_halt_names_the_step_and_the_parameter(strategy):
    with pytest.raises(jaxdist.NonFiniteError, match=r"step 3: .*gradient is b\b"):
        run(strategy, "halt", nan_step=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_policy_skip_leaves_params_and_optimizer_state_as_they_were(strategy):
    params, skipped = run(strategy, "skip", nan_step=2)
    assert skipped == [3]
    # Plain optax: the same loop without step 3's update (Adam's count not advanced).
    tx = optax.adam(0.1)
    p = {"a": jnp.ones((4,)), "b": jnp.full((4,), 0.5)}
    opt = tx.init(p)

    def loss(p, b):
        return jnp.mean((b["x"] * p["a"]) ** 2) + jnp.mean(b["z"] * p["b"])

    for step, b in enumerate(batches(nan_step=2), start=1):
        if step == 3:
            continue
        updates, opt = tx.update(jax.grad(loss)(p, b), opt, p)
        p = optax.apply_updates(p, updates)
    for name in ("a", "b"):
        np.testing.assert_allclose(params[name], p[name], rtol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_check_names_the_step_and_global_row(strategy):
    mesh = jaxdist.make_mesh(data=8)
    dp = jaxdist.DataParallel(
        TwoParams(),
        optax.sgd(0.1),
        two_param_loss,
        mesh=mesh,
        strategy=strategy,
        batch_check=lambda b: jnp.all(b["x"] < 100, axis=1),
    )
    state = dp.init_state()
    good = batches(nan_step=-1)
    for step, b in enumerate(good[:2], start=1):
        state, metrics = dp.step(state, jaxdist.shard_batch(b, mesh))
        assert dp.check(metrics, step) is False
    bad = {k: v.copy() for k, v in good[2].items()}
    bad["x"][13, 0] = bad["x"][9, 3] = 1000.0  # rows 9 and 13 (devices 4 and 6)
    state, metrics = dp.step(state, jaxdist.shard_batch(bad, mesh))
    with pytest.raises(jaxdist.BadBatchError, match=r"step 3: row 9 of the global batch"):
        dp.check(metrics, 3)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 7, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def tiny_batch():
    rng = np.random.default_rng(2)
    return {"x": rng.normal(size=(32, 3)).astype(np.float32), "y": rng.integers(0, 7, 32)}


def one_step(loss_fn, strategy="gspmd", model=None):
    mesh = jaxdist.make_mesh(data=8)
    model = model or Tiny(nnx.Rngs(0))
    dp = jaxdist.DataParallel(model, optax.sgd(0.1), loss_fn, mesh=mesh, strategy=strategy)
    batch = jaxdist.shard_batch(tiny_batch(), mesh)
    state, metrics = dp.step(dp.init_state(), batch)
    return dp, state, batch, dp.metrics(metrics)


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.parametrize("name", ["loss", "grad_norm", "lr"])
def test_aux_metrics_may_not_overwrite_jaxdists(name):
    def loss_fn(model, batch):
        loss = ce(model(batch["x"]), batch["y"])
        return loss, {name: loss * 2}

    with pytest.raises(jaxdist.ModelError, match=f"metrics named {name}"):
        one_step(loss_fn)


def test_rngs_are_passed_by_name_and_kind():
    seen = {}

    def keyword_only(model, batch, *, rngs):
        seen["keyword_only"] = isinstance(rngs, nnx.Rngs)
        return ce(model(batch["x"]), batch["y"])

    def defaulted_third(model, batch, weight=1.0):  # not an rngs parameter
        seen["defaulted_third"] = weight
        return weight * ce(model(batch["x"]), batch["y"])

    def positional(model, batch, rngs):
        seen["positional"] = isinstance(rngs, nnx.Rngs)
        return ce(model(batch["x"]), batch["y"])

    for fn in (keyword_only, defaulted_third, positional):
        one_step(fn)
    assert seen == {"keyword_only": True, "defaulted_third": 1.0, "positional": True}


def test_a_loss_returning_logits_has_them_neither_reported_nor_averaged():
    def with_logits(model, batch):
        logits = model(batch["x"])  # (B, 7)
        return ce(logits, batch["y"]), logits

    dp, state, batch, metrics = one_step(with_logits, strategy="shard_map")
    assert set(metrics) == {"loss", "grad_norm"}
    hlo = dp.lower(state, batch).compile().as_text()
    reduced = [line for line in hlo.splitlines() if "all-reduce(" in line]
    assert reduced and not [line for line in reduced if "f32[4,7]" in line]


def test_an_exception_in_the_users_loss_is_one_clear_error():
    def wrong_key(model, batch):
        return ce(model(batch["image"]), batch["y"])

    with pytest.raises(jaxdist.ModelError) as info:
        one_step(wrong_key)
    message = str(info.value)
    assert "wrong_key" in message and "KeyError" in message and "'image'" in message
    assert "x (32, 3) float32" in message  # the keys and shapes it was given


class Sowing(nnx.Module):
    """Keeps intermediates (``sow``) and a decoding cache: not training state."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 7, rngs=rngs)
        self.cache = nnx.Cache(jnp.zeros((2, 7)))

    def __call__(self, x):
        y = self.linear(x)
        self.sow(nnx.Intermediate, "features", y)
        return y


def test_intermediates_and_caches_are_dropped_with_a_note():
    model = Sowing(nnx.Rngs(0))
    model(tiny_batch()["x"])  # now holds an nnx.Intermediate too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp, state, _, metrics = one_step(lambda m, b: ce(m(b["x"]), b["y"]), model=model)
    notes = [str(w.message) for w in caught if "not training state" in str(w.message)]
    assert notes and "cache" in notes[0] and "features" in notes[0]
    assert np.isfinite(metrics["loss"])
    assert hasattr(model, "cache") and hasattr(model, "features")  # the user's model intact
