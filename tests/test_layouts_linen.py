"""A user's Linen model, annotated only with Flax's logical axis names, trains the same on
every mesh layout as on one device: jaxdist reads the annotations through flax's bridge
and lays the parameters out by them, and the layout must change where arrays live, never
what is computed."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import linen, nnx, traverse_util

import jaxdist
from helpers import relative_error
from linen_lm import LinenLM

VOCAB, SEQ, D_MODEL, LAYERS, HEADS, D_MLP = 64, 16, 64, 2, 8, 256
STEPS, G, LR = 5, 16, 0.5
LAYOUTS = {
    "data=4,model=2": dict(data=4, model=2),
    "data=2,fsdp=2,model=2": dict(data=2, fsdp=2, model=2),
    "fsdp=8": dict(data=1, fsdp=8),
    "model=8": dict(data=1, model=8),
}
# Where the first MLP kernel ("embed", "mlp") must land: embed -> fsdp, mlp -> model, and
# mesh axes of size 1 dropped.
MLP_IN_AXES = {
    "data=4,model=2": (None, "model"),
    "data=2,fsdp=2,model=2": ("fsdp", "model"),
    "fsdp=8": ("fsdp", None),
    "model=8": (None, "model"),
}
# jaxdist wraps the bridged Linen module as the attribute "linen", so every parameter path
# starts with it; the rest is the Linen params tree's own path.
PREFIX = "linen/"


def build(scan_layers=False):
    return LinenLM(VOCAB, SEQ, D_MODEL, LAYERS, HEADS, D_MLP, scan_layers=scan_layers)


def batches():
    """Counting sequences mod VOCAB from random starts: learnable, so five steps move the
    loss and the comparisons have something to compare. "ids", not "tokens": the batch is
    the user's dict, its keys the user's names."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, VOCAB, (STEPS, G, 1))
    ids = (starts + np.arange(SEQ + 1)) % VOCAB
    return [{"ids": rows.astype(np.int32)} for rows in ids]


def cross_entropy(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def loss_fn(model, batch):
    ids = batch["ids"]
    return cross_entropy(model(ids[:, :-1]), ids)


def linen_names(params):
    """jaxdist's parameter names -> the Linen tree's ("linen/block_0/out/kernel" ->
    "block_0/out/kernel"). plain_loop then asserts the key sets equal, so a renaming in the
    bridge fails loudly rather than leaving nothing compared."""
    assert all(name.startswith(PREFIX) for name in params), sorted(params)
    return {name.removeprefix(PREFIX): value for name, value in params.items()}


def train_on(sizes, scan_layers=False):
    """(initial params, losses, final params, dp, final state) of jaxdist on ``sizes``."""
    mesh = jaxdist.make_mesh(**sizes)
    example = batches()[0]["ids"][:1, :-1]
    dp = jaxdist.DataParallel(
        build(scan_layers), optax.sgd(LR), loss_fn, mesh=mesh, example_input=example
    )
    state = dp.init_state()
    initial, losses = linen_names(dp.host_params(state)), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    return initial, losses, linen_names(dp.host_params(state)), dp, state


def plain_loop(initial, scan_layers=False):
    """One device, Linen's init/apply, jax.grad and optax only: no jaxdist.

    It starts from jaxdist's initial values because the bridge draws its init key from
    an ``nnx.Rngs`` in its own way; what is compared is the five steps, not key plumbing.
    The Linen tree from ``module.init`` fixes the names and shapes those values must fit.
    """
    module = build(scan_layers)
    example = batches()[0]["ids"][:1, :-1]
    # Only the tree's names and shapes are needed, so nothing is run to get them.
    boxed = jax.eval_shape(module.init, {"params": jax.random.key(0)}, example)["params"]
    flat = traverse_util.flatten_dict(linen.unbox(boxed), sep="/")
    assert flat.keys() == initial.keys(), (sorted(flat), sorted(initial))
    for name, leaf in flat.items():
        assert leaf.shape == initial[name].shape, name
    return sgd_loop(module, {k: initial[k] for k in flat})


def sgd_loop(module, initial: dict):
    """Five optax SGD steps of a Linen ``module`` on one device from ``initial`` (flat
    names -> arrays): (losses, final params by flat name). Flax, JAX and optax only."""
    device = jax.devices()[0]
    params = jax.device_put(traverse_util.unflatten_dict(initial, sep="/"), device)
    tx = optax.sgd(LR)

    @jax.jit
    def step(params, opt_state, ids):
        def loss(p):
            return cross_entropy(module.apply({"params": p}, ids[:, :-1]), ids)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = tx.init(params), []
    for batch in batches():
        params, opt_state, value = step(params, opt_state, jax.device_put(batch["ids"], device))
        losses.append(float(value))
    final = traverse_util.flatten_dict(jax.device_get(params), sep="/")
    return losses, {name: np.asarray(value) for name, value in final.items()}


def assert_same_training(got, want, what):
    (got_losses, got_params), (want_losses, want_params) = got, want
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, err_msg=what)
    assert got_params.keys() == want_params.keys(), what
    for name, value in want_params.items():
        assert relative_error(got_params[name], value) < 1e-5, (what, name)


def mesh_axes(sharding, ndim):
    """A NamedSharding's spec as one entry per dimension (a spec may omit trailing Nones)."""
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def flat_state(state):
    return {"/".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def data_parallel():
    initial, losses, params, _, _ = train_on(dict(data=8))
    # A run that barely moves would make every comparison below vacuous.
    assert losses[-1] < losses[0] - 0.1, losses
    return initial, losses, params


@pytest.fixture(scope="module")
def scanned_data_parallel():
    initial, losses, params, _, _ = train_on(dict(data=8), scan_layers=True)
    assert losses[-1] < losses[0] - 0.1, losses
    return initial, losses, params


def test_data_parallel_equals_a_plain_linen_loop(data_parallel):
    initial, losses, params = data_parallel
    assert_same_training((losses, params), plain_loop(initial), "data=8 vs plain Linen")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_data_parallel(layout, data_parallel):
    initial, losses, params, dp, state = train_on(LAYOUTS[layout])
    for name, value in data_parallel[0].items():  # same start, whatever the layout
        np.testing.assert_array_equal(initial[name], value, err_msg=name)
    assert_same_training((losses, params), data_parallel[1:], layout)

    # The layout is real: the annotated kernels are split over the mesh, as planned and
    # as the arrays the step returned actually lie.
    kernels = [x for x in jax.tree.leaves(state.params) if x.ndim >= 2]
    assert any(x.sharding.shard_shape(x.shape) != x.shape for x in kernels), layout
    name = PREFIX + "block_0/Dense_0/kernel"
    planned = flat_state(dp.state_sharding.params)[name]
    assert mesh_axes(planned, 2) == MLP_IN_AXES[layout], (layout, planned)
    kernel = flat_state(state.params)[name].get_value()
    assert kernel.sharding.is_equivalent_to(planned, 2), (layout, kernel.sharding)
    assert kernel.sharding.shard_shape(kernel.shape) != kernel.shape


def test_scanned_layers_data_parallel_equals_a_plain_linen_loop(scanned_data_parallel):
    initial, losses, params = scanned_data_parallel
    assert initial["blocks/Dense_0/kernel"].shape == (LAYERS, D_MODEL, D_MLP)
    want = plain_loop(initial, scan_layers=True)
    assert_same_training((losses, params), want, "scanned, data=8 vs plain Linen")


def test_scanned_layers_over_stages_equal_data_parallel(scanned_data_parallel):
    """The stacked "layers" axis maps to the mesh axis "stage": each stage holds its half
    of the blocks, and the step still computes what data parallelism does."""
    initial, losses, params, dp, state = train_on(dict(data=4, stage=2), scan_layers=True)
    assert_same_training((losses, params), scanned_data_parallel[1:], "scanned, data=4,stage=2")
    name = PREFIX + "blocks/Dense_0/kernel"
    planned = flat_state(dp.state_sharding.params)[name]
    assert mesh_axes(planned, 3) == ("stage", None, None), planned
    kernel = flat_state(state.params)[name].get_value()
    assert kernel.sharding.shard_shape(kernel.shape) == (LAYERS // 2, D_MODEL, D_MLP)
