"""Mixed precision and gradient accumulation, against references written here without
jaxdist: plain ``jax.grad`` through ``nnx.split``/``nnx.merge``, plain Linen ``apply``,
plain optax.

- bfloat16 compute keeps float32 master weights, gradients and optimizer state, and the
  step is the plain AdamW step on the model's own gradients.
- ``grad_accum`` with BatchNorm computes what the documented 1-device loop computes:
  strided microbatches (each device's contiguous rows first, under pmap and shard_map),
  running statistics carried through the microbatches in order, gradients averaged over
  microbatches (and devices), statistics averaged over devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bn_models import images
from flax import linen, nnx, traverse_util

import jaxdist
from helpers import relative_error
from jaxdist.config import ModelConfig
from jaxdist.models import build_model

DEVICES, SEED = 8, 3
STRATEGIES = ["gspmd", "shard_map", "pmap"]


def named_leaves(tree) -> dict[str, object]:
    """An nnx.State or a nested dict -> {"a/b/c": leaf}."""
    pure = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
    leaves = jax.tree_util.tree_leaves_with_path(pure)
    return {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in leaves}


def flat(tree) -> dict[str, np.ndarray]:
    """An nnx.State or a nested dict -> {"a/b/c": float64 numpy}."""
    return {k: np.asarray(v, np.float64) for k, v in named_leaves(tree).items()}


# --- bfloat16 compute, float32 state ---------------------------------------------------

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


# --- gradient accumulation with BatchNorm ----------------------------------------------

ACCUM, STEPS, SGD_LR = 2, 3, 0.1


class NNXBatchNormCNN(nnx.Module):
    """(B, 8, 8, 1) -> (B, 3) with BatchNorm and no dropout (masks would tie the
    reference to jaxdist's RNG contract)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 4, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        return self.head(x.reshape(x.shape[0], -1))


class LinenBatchNormCNN(linen.Module):
    """The same network in Linen."""

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Conv(4, (3, 3), use_bias=False)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return linen.Dense(3)(linen.relu(x).reshape(x.shape[0], -1))


def cnn(kind: str) -> nnx.Module:
    if kind == "nnx":
        return NNXBatchNormCNN(nnx.Rngs(SEED))
    return jaxdist.as_nnx(LinenBatchNormCNN(), images(0)["x"][:1], seed=SEED)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def linen_names(bridged: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    """The bridged model's variables under Linen's own paths ("Conv_0/kernel"), whatever
    prefix the bridge adds ("linen/Conv_0/kernel")."""
    out = {}
    for name in names:
        hits = [k for k in bridged if k == name or k.endswith("/" + name)]
        assert len(hits) == 1, (name, list(bridged))
        out[name] = bridged[hits[0]]
    return out


def linen_tree(bridged: dict[str, np.ndarray], like) -> dict:
    """A nested Linen variable dict shaped ``like``, filled from the bridged model."""
    values = linen_names(bridged, named_leaves(like))
    return traverse_util.unflatten_dict(
        {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}, sep="/"
    )


def plain_grad_fn(kind: str):
    """(initial params, initial batch statistics, grad_fn) with
    ``grad_fn(params, stats, batch) -> (grads, new_stats)`` in train mode: plain NNX, or
    plain Linen ``apply`` on the bridged model's initial variables."""
    model = cnn(kind)
    if kind == "nnx":
        model.train()
        graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

        def loss(p, s, batch):
            m = nnx.merge(graphdef, p, s, copy=True)
            return cross_entropy(m(batch["x"]), batch["y"]), nnx.state(m, nnx.BatchStat)

        return params, stats, jax.jit(jax.grad(loss, has_aux=True))

    # The weights jaxdist starts from, under Linen's own names; from here on, Linen alone.
    module = LinenBatchNormCNN()
    shapes = jax.eval_shape(module.init, jax.random.key(0), images(0)["x"][:1])
    params = linen_tree(flat(nnx.state(model, nnx.Param)), shapes["params"])
    stats = linen_tree(flat(nnx.state(model, nnx.BatchStat)), shapes["batch_stats"])

    def loss(p, s, batch):
        logits, new = module.apply(
            {"params": p, "batch_stats": s}, batch["x"], train=True, mutable=["batch_stats"]
        )
        return cross_entropy(logits, batch["y"]), new["batch_stats"]

    return params, stats, jax.jit(jax.grad(loss, has_aux=True))


def mean_of(trees):
    return jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *trees)


def plain_accumulation(kind: str, strategy: str):
    """3 SGD steps of the documented grad-accum semantics, one device, no jaxdist."""
    params, stats, grad_fn = plain_grad_fn(kind)
    tx = optax.sgd(SGD_LR)
    opt_state = tx.init(params)
    for step in range(STEPS):
        batch = images(step)
        if strategy == "gspmd":  # one replica: the global batch
            replicas = [batch]
        else:  # device d: its contiguous block of rows
            rows = len(batch["x"]) // DEVICES
            replicas = [
                {k: v[d * rows : (d + 1) * rows] for k, v in batch.items()} for d in range(DEVICES)
            ]
        replica_grads, replica_stats = [], []
        for rows_of_replica in replicas:
            s, micro_grads = stats, []
            for i in range(ACCUM):  # microbatch i: rows i, i + ACCUM, i + 2 ACCUM, ...
                micro = {k: v[i::ACCUM] for k, v in rows_of_replica.items()}
                g, s = grad_fn(params, s, micro)  # statistics carried in order
                micro_grads.append(g)
            replica_grads.append(mean_of(micro_grads))
            replica_stats.append(s)
        grads, stats = mean_of(replica_grads), mean_of(replica_stats)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_grad_accum_with_batchnorm_equals_the_plain_loop(kind, strategy):
    mesh = jaxdist.make_mesh(data=DEVICES)

    def loss_fn(model, batch):
        return cross_entropy(model(batch["x"]), batch["y"])

    dp = jaxdist.DataParallel(
        cnn(kind), optax.sgd(SGD_LR), loss_fn, mesh=mesh, strategy=strategy, grad_accum=ACCUM
    )
    state = dp.init_state()
    for step in range(STEPS):
        state, _ = dp.step(state, jaxdist.shard_batch(images(step), mesh))
    one = dp.unreplicate(state)

    want_params, want_stats = plain_accumulation(kind, strategy)
    for got, want in [(one.params, want_params), (one.batch_stats, want_stats)]:
        got, want = flat(got), flat(want)
        if kind == "linen":
            got = linen_names(got, want)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # The running statistics moved (from mean 0): the comparison covers their updates.
    (mean,) = [v for k, v in flat(want_stats).items() if k.endswith("mean")]
    assert np.abs(mean).max() > 0.1
