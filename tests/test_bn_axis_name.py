"""BatchNorm that names an axis (``axis_name="batch"``, as Flax's ImageNet example does)
trains unchanged under every strategy, against plain Linen / NNX loops.

References (no jaxdist code): the same model with ``axis_name=None`` trained with
``jax.grad`` and SGD on the global batch (global statistics: gspmd, and SyncBatchNorm under
pmap/shard_map), or on each device's rows with gradients and statistics averaged (plain
BatchNorm under pmap/shard_map, as PyTorch DDP). Initial values are the model's own."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import linen, nnx

import jaxdist
from helpers import relative_error

LR, STEPS, DEVICES, AXIS = 0.2, 3, 8, "batch"


class LinenBN(linen.Module):
    axis_name: str | None = AXIS

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(8, use_bias=False)(x)  # BatchNorm cancels a bias: its grad is noise
        x = linen.BatchNorm(not train, momentum=0.8, axis_name=self.axis_name)(x)
        return linen.Dense(3)(linen.relu(x))


class NNXBN(nnx.Module):
    def __init__(self, rngs, axis_name=AXIS):
        self.dense = nnx.Linear(5, 8, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.8, axis_name=axis_name, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.dense(x))))


def batch(step):
    rng = np.random.default_rng([5, step])
    x = rng.normal(size=(32, 5)).astype(np.float32) * (1 + step) + np.arange(32)[:, None] / 8
    return {"x": x.astype(np.float32), "y": rng.integers(0, 3, 32).astype(np.int32)}


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def loss_fn(model, b):
    return ce(model(b["x"]), b["y"])


def train(kind, strategy, devices, sync=False):
    mesh = jaxdist.make_mesh(data=devices)
    model = LinenBN() if kind == "linen" else NNXBN(nnx.Rngs(0))
    dp = jaxdist.DataParallel(
        model,
        optax.sgd(LR),
        loss_fn,
        mesh=mesh,
        strategy=strategy,
        sync_batch_stats=sync,
        example_input=batch(0)["x"][:1],
    )
    state = dp.init_state()
    one = dp.unreplicate(state)  # copied before the step donates it
    start = jax.tree.map(np.array, (one.params, one.batch_stats))
    for step in range(STEPS):
        state, _ = dp.step(state, jaxdist.shard_batch(batch(step), mesh))
    return dp, start, dp.unreplicate(state)


def reference(kind, start, per_device: bool):
    """Plain loop from ``start``'s values: Linen ``apply(..., mutable=['batch_stats'])`` or
    NNX split/merge, a model without axis name, SGD."""
    if kind == "linen":
        module = LinenBN(axis_name=None)
        params, stats = (unflatten(without_wrapper(tree)) for tree in start)

        def loss(p, s, rows):
            logits, new = module.apply(
                {"params": p, "batch_stats": s}, rows["x"], train=True, mutable=["batch_stats"]
            )
            return ce(logits, rows["y"]), new["batch_stats"]
    else:
        graphdef = nnx.split(NNXBN(nnx.Rngs(0), axis_name=None), nnx.Param, nnx.BatchStat)[0]
        params, stats = start

        def loss(p, s, rows):
            model = nnx.merge(graphdef, p, s, copy=True)
            return ce(model(rows["x"]), rows["y"]), nnx.state(model, nnx.BatchStat)

    grad = jax.jit(jax.grad(loss, has_aux=True))
    for step in range(STEPS):
        b = batch(step)
        if per_device:
            blocks = [jax.tree.map(lambda x, d=d: x[d * 4 : (d + 1) * 4], b) for d in range(8)]
            outs = [grad(params, stats, rows) for rows in blocks]
            grads, stats = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *outs)
        else:
            grads, stats = grad(params, stats, b)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return params, stats


def without_wrapper(tree) -> dict:
    """{"Dense_0/kernel": array}: paths below jaxdist's Linen wrapper attribute."""
    return {
        "/".join(map(str, p[1:])): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)
    }


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return out


def assert_close(got, want):
    got = [np.asarray(x) for x in jax.tree.leaves(got)]
    want = [np.asarray(x) for x in jax.tree.leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5


CASES = [
    # (strategy, devices, sync, reference on each device's rows?)
    ("gspmd", 1, False, False),
    ("gspmd", 8, False, False),
    ("pmap", 8, True, False),
    ("shard_map", 8, True, False),
    ("pmap", 8, False, True),
    ("shard_map", 8, False, True),
]


@pytest.mark.parametrize("strategy, devices, sync, local", CASES)
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_named_batchnorm_axis_is_bound_by_jaxdist(kind, strategy, devices, sync, local):
    dp, start, end = train(kind, strategy, devices, sync)
    want_params, want_stats = reference(kind, start, per_device=local)
    assert_close(end.params, want_params)
    assert_close(end.batch_stats, want_stats)
    meaning = dp.axis_bindings[AXIS]
    assert ("data axis" in meaning) == (sync and strategy != "gspmd"), meaning
