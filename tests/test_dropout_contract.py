"""Dropout follows jaxdist's documented RNG contract (jaxdist/parallel/step.py) on every
path of gspmd, checked against a plain flax/optax loop that follows it
(``dropout_contract.plain_loop``, no jaxdist code): 3 steps of a model with two Dropout
layers, float32, params and logged losses within rtol 1e-5.

- data=8 without grad-accum: one key for the global batch (the 1-device masks);
- data=8 with grad-accum 2 and fsdp=8 (gspmd's per-replica path, ``wants_per_replica``):
  replica r folds in r, microbatch i folds in i;
- stage=2,data=4: inside the pipelined ``Stack`` microbatch j of the GPipe schedule folds
  j into the layers' keys, so no two microbatches share a mask.

Each case also differs (> 1e-3) from the plain loop under the neighbouring rule, so the
comparison can tell the rules apart."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from dropout_contract import plain_loop, stack_by_microbatch
from helpers import relative_error
from jaxdist.models.stack import Stack

SEED, STEPS, G, F, W = 6, 3, 32, 8, 32
TX = optax.sgd(0.02)


class TwoDropouts(nnx.Module):
    """(B, F) -> (B,): two dropout layers of one stream, each its own mask."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(F, W, rngs=rngs)
        self.d1 = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(W, W, rngs=rngs)
        self.d2 = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(W, 1, rngs=rngs)

    def __call__(self, x):
        h = self.d1(nnx.relu(self.l1(x)))
        return self.head(self.d2(nnx.relu(self.l2(h))))[:, 0]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # Annotated (as replicated): a Stack adds the "layers" name the stage axis splits.
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None))
        bias = nnx.with_partitioning(nnx.initializers.zeros_init(), (None,))
        self.linear = nnx.Linear(W, W, kernel_init=kernel, bias_init=bias, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(nnx.relu(self.linear(x)))


class Piped(nnx.Module):
    """A dropout before a stack of two blocks with dropout: the stack splits into stages."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(F, W, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        with nnx.use_eager_sharding(False):  # names only, as the GPT's: no mesh needed
            self.blocks = Stack(Block, 2, rngs=rngs)
        self.head = nnx.Linear(W, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks(self.drop(self.inp(x))))[:, 0]


def mse(out, batch):
    return ((out - batch["y"]) ** 2).mean()


def loss_fn(model, batch):
    return mse(model(batch["x"]), batch)


def batches():
    rng = np.random.default_rng(2)
    return [
        {
            "x": rng.normal(size=(G, F)).astype(np.float32),
            "y": rng.normal(size=(G,)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def new(cls):
    """A fresh ``cls(nnx.Rngs(params=0, dropout=1))``."""
    return nnx.merge(*_built(cls))


@functools.cache
def _built(cls):
    """Its graph and state, made once, in one program: op by op, each initializer would
    compile on its own."""

    def build():
        return cls(nnx.Rngs(params=0, dropout=1))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    return graphdef, jax.jit(lambda: nnx.state(build()))()


def jaxdist_run(cls, sizes, **options):
    mesh = jaxdist.make_mesh(**sizes)
    dp = jaxdist.DataParallel(new(cls), TX, loss_fn, mesh=mesh, seed=SEED, **options)
    state, losses = dp.init_state(), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    return losses, dp.host_params(state)


@functools.cache  # a contract's loop serves one case as reference, another as neighbour
def plain(cls=TwoDropouts, loss=loss_fn, **contract):
    return plain_loop(new(cls), loss, batches(), TX, seed=SEED, **contract)


def max_error(got, want) -> float:
    assert got.keys() == want.keys()
    return max(relative_error(got[k], want[k]) for k in want)


def assert_follows(got, want, neighbour):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for name, value in want[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert max_error(got[1], neighbour[1]) > 1e-3  # the other rule trains elsewhere


@pytest.mark.parametrize(
    "sizes, grad_accum, contract, neighbour",
    [
        (dict(data=8), 1, dict(), dict(replicas=8)),
        (dict(data=8), 2, dict(replicas=8, grad_accum=2), dict(replicas=8)),
        (dict(data=1, fsdp=8), 1, dict(replicas=8), dict()),
    ],
    ids=["data8-global-key", "data8-grad-accum-2", "fsdp8"],
)
def test_gspmd_dropout_follows_the_contract(sizes, grad_accum, contract, neighbour):
    """gspmd's two paths: data=8 without grad-accum is one program over global arrays (one
    key); with grad-accum, and under fsdp, each replica computes its gradient itself."""
    got = jaxdist_run(TwoDropouts, sizes, grad_accum=grad_accum)
    assert_follows(got, plain(**contract), plain(**neighbour))


M = 4  # pipeline microbatches: 8 rows per data replica, 2 per microbatch


@functools.cache  # one function per rule: plain()'s cache key
def piped_loss(fold):
    def loss(model, batch):
        h = model.drop(model.inp(batch["x"]))
        h = stack_by_microbatch(model.blocks.layers, h, M, fold)
        return mse(model.head(h)[:, 0], batch)

    return loss


def test_pipelined_microbatches_draw_their_own_masks():
    """stage=2,data=4, 4 microbatches: the per-replica path (replica r folds in r), and in
    the stack microbatch j folds in j. Before that rule every microbatch of a replica drew
    the same masks, as the neighbouring loop does."""
    got = jaxdist_run(Piped, dict(data=4, stage=2), microbatches=M)
    want = plain(Piped, piped_loss(True), replicas=4)
    same_masks = plain(Piped, piped_loss(False), replicas=4)
    assert_follows(got, want, same_masks)
