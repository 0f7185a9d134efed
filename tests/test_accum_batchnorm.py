"""``grad_accum`` with BatchNorm, against references written here without jaxdist (plain
``jax.grad`` through ``nnx.split``/``nnx.merge``, plain Linen ``apply``, plain optax): it
computes what the documented 1-device loop computes: strided microbatches (each device's
contiguous rows first, under pmap and shard_map), running statistics carried through the
microbatches in order, gradients averaged over microbatches (and devices), statistics
averaged over devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bn_models import images
from flax import linen, nnx, traverse_util

import jaxdist
from helpers import flat, named_leaves

DEVICES, SEED = 8, 3
STRATEGIES = ["gspmd", "shard_map", "pmap"]


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
    assert_trains_as_the_plain_loop(dp, kind, strategy)


def test_a_linen_module_given_as_it_is_equals_the_plain_loop():
    """The Linen module itself (jaxdist bridges it, with eager sharding off): the batch
    statistics the bridge writes back once carried other pytree metadata than those it
    was built with, and grad-accum's scan over microbatches raised TypeError."""
    mesh = jaxdist.make_mesh(data=DEVICES)
    dp = jaxdist.DataParallel(
        LinenBatchNormCNN(),
        optax.sgd(SGD_LR),
        lambda model, batch: cross_entropy(model(batch["x"]), batch["y"]),
        mesh=mesh,
        grad_accum=ACCUM,
        seed=SEED,  # the initial values of cnn("linen"), which the plain loop starts from
        example_input=images(0)["x"][:1],
    )
    assert_trains_as_the_plain_loop(dp, "linen", "gspmd")


def assert_trains_as_the_plain_loop(dp, kind: str, strategy: str):
    state = dp.init_state()
    for step in range(STEPS):
        state, _ = dp.step(state, jaxdist.shard_batch(images(step), dp.mesh))
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
