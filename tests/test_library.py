"""The public API with BatchNorm and dropout, against single-device loops written here:
plain jax.grad + optax, no jaxdist; the NNX class itself, and the Linen module through
Linen's own ``init``/``apply``. They follow jaxdist's documented RNG contract: at step k
every RNG stream is reseeded with fold_in(key(seed), k), under pmap/shard_map folded with
the device index d."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from bn_models import NNXCNN, LinenCNN, images, loss_fn
from flax import nnx

import jaxdist
from helpers import named_leaves, relative_error

SEED, STEPS, DEVICES, LR = 5, 5, 8, 0.1


def make_model(kind: str):
    if kind == "nnx":
        return NNXCNN(nnx.Rngs(SEED))
    return jaxdist.as_nnx(LinenCNN(), images(0)["x"][:1], seed=SEED)


def train_jaxdist(kind: str, strategy: str):
    mesh = jaxdist.make_mesh(data=DEVICES)
    dp = jaxdist.DataParallel(
        make_model(kind), optax.sgd(LR), loss_fn, mesh=mesh, strategy=strategy, seed=SEED
    )
    state = dp.init_state()
    for step in range(STEPS):
        state, _ = dp.step(state, jaxdist.shard_batch(images(step), mesh))
    return dp, state


@functools.cache  # every reference of a kind: one compiled gradient per batch shape
def nnx_parts():
    """(params, stats, grad(params, stats, rows, key) -> (grads, stats)), nnx.reseed-ed."""
    model = make_model("nnx")
    model.train()
    graphdef, params, stats, rngs = nnx.split(model, nnx.Param, nnx.BatchStat, nnx.RngState)
    streams = {v.tag for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngStream)}

    def grad(p, s, batch, key):
        m = nnx.merge(graphdef, p, s, rngs, copy=True)
        nnx.reseed(m, **dict.fromkeys(streams, key))  # outside jax.grad, as NNX requires
        reseeded = nnx.state(m, nnx.RngState)

        def loss(p):
            m = nnx.merge(graphdef, p, s, reseeded, copy=True)
            return loss_fn(m, batch, None), nnx.state(m, nnx.BatchStat)

        return jax.grad(loss, has_aux=True)(p)

    return params, stats, jax.jit(grad)


def drawn(key):
    """The key flax's bridge (behind ``as_nnx``) gives a Linen call from a stream keyed
    ``key``: its stream is ``fold_in(key, 0)`` (forked, or reseeded), the call draws
    ``fold_in(., 0)``."""
    return jax.random.fold_in(jax.random.fold_in(key, 0), 0)


@functools.cache
def linen_parts():
    """The same for the Linen module, with Linen's init and apply: initialised as
    ``as_nnx(module, seed=SEED)`` does (``nnx.Rngs(params=SEED, dropout=SEED + 1)``)."""
    module, first = LinenCNN(), images(0)["x"][:1]
    rngs = {"params": drawn(jax.random.key(SEED)), "dropout": drawn(jax.random.key(SEED + 1))}
    variables = module.init(rngs, first, train=True)

    def grad(params, stats, batch, key):
        def loss(p):
            variables, dropout = {"params": p, "batch_stats": stats}, {"dropout": drawn(key)}
            out = module.apply(variables, batch["x"], rngs=dropout, mutable=["batch_stats"])
            ce = optax.softmax_cross_entropy_with_integer_labels(out[0], batch["y"])
            return ce.mean(), out[1]["batch_stats"]

        return jax.grad(loss, has_aux=True)(params)

    return variables["params"], variables["batch_stats"], jax.jit(grad)


def reference(kind: str, per_device_keys: bool | None):
    """1-device loop. per_device_keys=None: one global batch (gspmd semantics); True/False:
    simulate 8 replicas on their own rows (with distinct / identical dropout keys),
    averaging their gradients and running statistics."""
    params, stats, grad = nnx_parts() if kind == "nnx" else linen_parts()
    tx, n = optax.sgd(LR), 1 if per_device_keys is None else DEVICES
    opt_state = tx.init(params)
    for step in range(STEPS):
        batch, key = images(step), jax.random.fold_in(jax.random.key(SEED), step)
        rows = len(batch["x"]) // n
        parts = [{k: v[d * rows : (d + 1) * rows] for k, v in batch.items()} for d in range(n)]
        keys = [jax.random.fold_in(key, d) if per_device_keys else key for d in range(n)]
        outs = [grad(params, stats, part, k) for part, k in zip(parts, keys, strict=True)]
        grads, stats = jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *outs)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats


def max_error(got, want) -> float:
    """By name: the bridge's "linen/Conv_0/kernel" is Linen's "Conv_0/kernel"."""
    got = {k.removeprefix("linen/"): v for k, v in named_leaves(got).items()}
    want = named_leaves(want)
    assert got.keys() == want.keys() and want
    return max(relative_error(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_gspmd_equals_one_device_with_global_batch_statistics(kind):
    dp, state = train_jaxdist(kind, "gspmd")
    params, stats = reference(kind, per_device_keys=None)
    one = dp.unreplicate(state)
    assert len(jax.tree.leaves(stats)) == 2  # mean and var of the one BatchNorm
    assert max_error(one.params, params) < 1e-5
    assert max_error(one.batch_stats, stats) < 1e-5


def replica_copies(strategy: str, tree):
    """Every device's own copy of each leaf: pmap's leading axis, or shard_map's buffers."""

    def copy(x, d):
        return np.asarray(x[d] if strategy == "pmap" else x.addressable_shards[d].data)

    return [jax.tree.map(lambda x, d=d: copy(x, d), tree) for d in range(DEVICES)]


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("strategy", ["pmap", "shard_map"])
def test_replicas_agree_and_average_their_statistics(kind, strategy):
    dp, state = train_jaxdist(kind, strategy)
    copies = replica_copies(strategy, (state.params, state.batch_stats))
    for other in copies[1:]:  # no drift: every replica holds the same numbers
        jax.tree.map(np.testing.assert_array_equal, copies[0], other)
    params, stats = reference(kind, per_device_keys=True)
    one = dp.unreplicate(state)
    assert max_error(one.params, params) < 1e-5
    assert max_error(one.batch_stats, stats) < 1e-5  # the mean of per-replica statistics
    # Dropout masks differ between devices: replicas that shared one key would have
    # trained to other params.
    same_key_params, _ = reference(kind, per_device_keys=False)
    assert max_error(one.params, same_key_params) > 1e-3


@pytest.mark.parametrize("strategy", ["pmap", "shard_map", "gspmd"])
def test_mean_over_replicas_in_a_hand_written_step(strategy):
    """A hand-written step (local grads, then mean_over_replicas) and DataParallel's own
    step both give the global-batch gradient, checked against float64 numpy: for the loss
    mean((x @ w)^2) it is 2 x^T (x w) / B, no jax involved."""
    mesh = jaxdist.make_mesh(data=DEVICES)
    w = np.linspace(-1, 1, 6, dtype=np.float32)
    batch = {"x": np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)}
    x64 = batch["x"].astype(np.float64)
    want = 2 * x64.T @ (x64 @ w.astype(np.float64)) / len(x64)
    # every replica sees G/N rows under pmap and shard_map, the global batch under gspmd
    rows_seen = 16 if strategy == "gspmd" else 16 // DEVICES

    def loss(w, b):
        assert b["x"].shape == (rows_seen, 6)  # at trace time
        return ((b["x"] @ w) ** 2).mean()

    def step(w, b):  # what a user writes: local grads, then the average over replicas
        return jaxdist.mean_over_replicas(jax.grad(loss)(w, b))

    sharded = jaxdist.shard_batch(batch, mesh)
    P = jax.sharding.PartitionSpec
    if strategy == "pmap":
        rows = jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), batch)
        copies = jax.pmap(step, axis_name="data", in_axes=(None, 0))(w, rows)
    elif strategy == "shard_map":
        per_device = jax.shard_map(
            lambda w, b: step(w, b)[None],  # every device's own result, stacked
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
            check_vma=False,
        )
        copies = jax.jit(per_device)(w, sharded)
    else:
        # The batch really is split over the 8 devices, 2 rows each, and the jitted step
        # runs on it as a global array: XLA adds the all-reduce of the partial gradients.
        assert len(sharded["x"].sharding.device_set) == DEVICES
        assert {s.data.shape for s in sharded["x"].addressable_shards} == {(2, 6)}
        hlo = jax.jit(step).lower(w, sharded).compile().as_text()
        assert "all-reduce" in hlo
        copies = jax.jit(step)(w, sharded)[None]
    assert len(copies) == (1 if strategy == "gspmd" else DEVICES)
    for got in np.asarray(copies):  # every replica holds the global-batch gradient
        np.testing.assert_allclose(got, want, rtol=1e-5)

    # DataParallel's own step: one SGD step with lr 1 moves w by exactly the gradient.
    class Linear(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(w.copy())

        def __call__(self, x):
            return x @ self.w

    square = lambda model, b: (model(b["x"]) ** 2).mean()  # noqa: E731
    dp = jaxdist.DataParallel(Linear(), optax.sgd(1.0), square, mesh=mesh, strategy=strategy)
    state = dp.init_state()
    before = np.array(dp.host_params(state)["w"], np.float64)  # a copy: step donates state
    np.testing.assert_array_equal(before, w)
    state, _ = dp.step(state, sharded)
    after = np.array(dp.host_params(state)["w"], np.float64)
    np.testing.assert_allclose(before - after, want, rtol=1e-5)


def test_gradient_of_averaged_loss_is_wrong_as_documented():
    """The docstring's warning holds: grad(mean_over_replicas(loss)) stays local."""
    w, xs = np.float32(2.0), np.arange(1, 9, dtype=np.float32)

    def wrong(w, x):
        return jax.grad(lambda w: jaxdist.mean_over_replicas((w * x) ** 2))(w)

    got = jax.pmap(wrong, axis_name="data", in_axes=(None, 0))(w, xs)
    assert np.allclose(got, 2 * w * xs**2)  # each replica's own gradient
    assert not np.allclose(got, np.mean(2 * w * xs**2))


def test_step_keys_differ_by_device_and_step():
    mesh, P = jaxdist.make_mesh(data=4), jax.sharding.PartitionSpec

    def keys(step):
        return jax.random.key_data(jaxdist.step_key(SEED, step))[None]

    per_device = jax.jit(jax.shard_map(keys, mesh=mesh, in_specs=P(), out_specs=P("data")))
    k0, k1 = np.asarray(per_device(0)), np.asarray(per_device(1))
    assert len({tuple(k) for k in k0}) == 4  # one key per device
    assert not set(map(tuple, k0)) & set(map(tuple, k1))  # never repeated across steps


def test_initialize_and_main_process_helpers(capsys):
    info = jaxdist.initialize()
    assert (info.process_index, info.process_count) == (0, 1)
    assert info.device_count == info.local_device_count == 8
    assert jaxdist.is_main_process()
    jaxdist.print_main("hello from rank 0")
    jaxdist.barrier("test")
    assert "hello from rank 0" in capsys.readouterr().out


def test_sampler_shares_partition_the_global_batch():
    whole = jaxdist.DistributedSampler(100, 16, seed=1, process_index=0, process_count=1)
    share = functools.partial(jaxdist.DistributedSampler, 100, 16, seed=1, process_count=4)
    shares = [share(process_index=p) for p in range(4)]
    seen = []
    for step in range(whole.steps_per_epoch):  # 6 steps of 16: 96 of 100 examples
        parts = np.concatenate([s.indices(step) for s in shares])
        np.testing.assert_array_equal(parts, whole.indices(step))
        seen += parts.tolist()
    assert len(seen) == len(set(seen)) == 96  # nothing repeated within the epoch
    assert not np.array_equal(whole.indices(6), whole.indices(0))  # epoch 2: new order


NOT_A_MODEL = "expected a flax.nnx.Module, a flax.linen.Module or a function returning one"


@pytest.mark.parametrize(
    "model, match",
    [("not a model", NOT_A_MODEL + ", got str"), (LinenCNN(), "needs an example_input")],
)
def test_bad_models_are_clear_errors(model, match):
    with pytest.raises(jaxdist.ModelError, match=match):
        jaxdist.DataParallel(model, optax.sgd(0.1), loss_fn)


def test_non_scalar_loss_is_a_clear_error():
    def per_example(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])

    mesh = jaxdist.make_mesh(data=2)
    dp = jaxdist.DataParallel(NNXCNN(nnx.Rngs(0)), optax.sgd(0.1), per_example, mesh=mesh)
    with pytest.raises(jaxdist.ModelError, match=r"scalar loss.*shape \(32,\)"):
        dp.step(dp.init_state(), jaxdist.shard_batch(images(0), mesh))


def test_unknown_model_state_is_a_clear_error():
    class RunningMean(nnx.Variable):
        pass

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones(3, np.float32))
            self.seen = RunningMean(np.zeros(3, np.float32))

        def __call__(self, x):
            return x * self.w

    with pytest.raises(jaxdist.ModelError, match=r"cannot find the batch statistics.*seen"):
        jaxdist.DataParallel(Model(), optax.sgd(0.1), loss_fn)
