"""Flax's own building blocks, written as Flax's documentation writes them (tests/
flax_blocks.py, no jaxdist code), train under every layout as a plain one-device optax
loop trains them: after 5 SGD steps the losses, the parameters and the batch statistics
agree to a relative error < 1e-5 under data=8, data=4,model=2, fsdp=8 and
data=2,fsdp=2,model=2, and, for the two models whose blocks are stacked (Linen's
``nn.scan`` over ``nn.remat``, NNX's ``nnx.vmap``/``nnx.scan``), data=4,stage=2: each
stage holds half of the stacked "layers" axis (the models' own scans run them; jaxdist's
GPipe schedule is for its ``Stack``). The Linen model comes through ``jaxdist.as_nnx``,
which keeps Flax's logical names outside a mesh.

BatchNorm with three Dropouts: gspmd computes what one device computes on the global
batch, with the key of jaxdist's RNG contract (``jaxdist.parallel.step``): at step k every
stream restarts from ``fold_in(key(seed), k)``, as flax's ``nnx.reseed`` restarts it.

Each model is built once and each reference run once, shared by the layouts: the cost is
one compiled step per layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np
import optax
import pytest
from flax import linen, nnx

import flax_blocks as fb
import jaxdist
from helpers import relative_error

SEED = 3  # the dropout keys' base: jaxdist's seed=, the reference's reseed
LAYOUTS = {
    "data=8": dict(data=8),
    "data=4,model=2": dict(data=4, model=2),
    "fsdp=8": dict(data=1, fsdp=8),
    "data=2,fsdp=2,model=2": dict(data=2, fsdp=2, model=2),
    "data=4,stage=2": dict(data=4, stage=2),  # the stacked models only
}
FLAT_LAYOUTS = [name for name in LAYOUTS if "stage" not in name]
# Where the probed kernels must land: layers -> stage, embed -> fsdp, mlp and heads ->
# model, mesh axes of size 1 dropped. A stacked (L, D, F) MLP kernel named ("layers",
# "embed", "mlp"); a stacked (L, D, H, K) attention kernel whose 2 names ("embed",
# "heads") were given to its flat (D, H*K) init and "layers" put in front by nnx.vmap
# (K unsharded); an unstacked (D, F) kernel named ("embed", "mlp").
STACKED_MLP = {
    "data=8": (None, None, None),
    "data=4,model=2": (None, None, "model"),
    "fsdp=8": (None, "fsdp", None),
    "data=2,fsdp=2,model=2": (None, "fsdp", "model"),
    "data=4,stage=2": ("stage", None, None),
}
STACKED_QUERY = {
    "data=8": (None, None, None, None),
    "data=4,model=2": (None, None, "model", None),
    "fsdp=8": (None, "fsdp", None, None),
    "data=2,fsdp=2,model=2": (None, "fsdp", "model", None),
    "data=4,stage=2": ("stage", None, None, None),
}
FLAT_MLP = {"data=8": (None, None), "data=4,model=2": (None, "model"),
            "fsdp=8": ("fsdp", None), "data=2,fsdp=2,model=2": ("fsdp", "model")}  # fmt: skip
LINEN = "linen/"  # jaxdist's bridge holds the Linen module as the attribute "linen"


@dataclass(frozen=True)
class Case:
    model: nnx.Module  # built once; jaxdist never changes the model it is given
    loss: object
    batches: list
    probe: str  # a parameter whose layout is checked against specs
    specs: dict  # layout -> the probe's planned PartitionSpec, one entry per dimension
    seed: int | None = None  # with dropout: jaxdist's seed, the reference's reseed
    linen: linen.Module | None = None  # the Linen module the bridged model holds


@functools.cache
def case(name: str) -> Case:
    if name == "linen":  # jaxdist.as_nnx, as its docstring shows: example rows (1, T)
        tokens = fb.token_batches()
        model = jaxdist.as_nnx(fb.LinenScanLM(), tokens[0]["ids"][:1, :-1])
        probe = LINEN + "blocks/Dense_0/kernel"
        return Case(model, fb.lm_loss, tokens, probe, STACKED_MLP, linen=fb.LinenScanLM())
    if name == "nnx":
        model = fb.build(fb.NNXScanLM)
        probe = "blocks/attention/query/kernel"
        return Case(model, fb.lm_loss, fb.token_batches(), probe, STACKED_QUERY)
    assert name == "batchnorm", name
    model = fb.build(fb.BatchNormMLP)
    return Case(model, fb.class_loss, fb.class_batches(), "linear2/kernel", FLAT_MLP, seed=SEED)


def by_name(tree) -> dict:
    """An nnx.State's leaves by path ("blocks/up/kernel")."""
    return {"/".join(map(str, p)): leaf for p, leaf in nnx.to_flat_state(tree)}


def arrays(state) -> dict[str, np.ndarray]:
    return {name: np.asarray(var.get_value()) for name, var in by_name(state).items()}


@functools.cache
def reference(name: str):
    """The plain loop's (losses, {name: final param or statistic}), once per model."""
    c = case(name)
    if c.linen is None:
        return fb.nnx_loop(c.model, c.loss, c.batches, seed=c.seed)
    # Linen: module.apply from the bridged model's initial values, by the Linen tree's names.
    initial = arrays(nnx.state(c.model, nnx.Param))
    initial = {k.removeprefix(LINEN): v for k, v in initial.items()}
    losses, final = fb.linen_loop(c.linen, initial, c.loss, c.batches)
    return losses, {LINEN + k: v for k, v in final.items()}


def check(name: str, layout: str):
    """jaxdist's 5 steps of model ``name`` on ``layout`` against the plain loop."""
    c, mesh = case(name), jaxdist.make_mesh(**LAYOUTS[layout])
    dp = jaxdist.Parallel(c.model, optax.sgd(fb.LR), c.loss, mesh=mesh, seed=c.seed or 0)
    state = dp.init_state()
    initial, losses = dp.host_params(state), []
    for batch in c.batches:
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    final = {**dp.host_params(state), **arrays(dp.unreplicate(state).batch_stats)}

    built = arrays(nnx.state(c.model, nnx.Param))
    assert initial.keys() == built.keys(), (sorted(initial), sorted(built))
    for key, value in built.items():  # jaxdist starts from the model as the user built it
        np.testing.assert_array_equal(initial[key], value, err_msg=key)
    # Every parameter moves, so that each comparison below means something; the LMs'
    # losses fall too (BatchNorm's differ too much by batch and mask for that in 5 steps).
    assert all(relative_error(final[k], v) > 1e-3 for k, v in initial.items()), layout
    assert c.seed is not None or losses[-1] < losses[0] - 0.1, losses

    want_losses, want = reference(name)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=layout)
    assert final.keys() == want.keys(), (sorted(final), sorted(want))
    for key, value in want.items():
        assert relative_error(final[key], value) < 1e-5, (layout, key)

    # The layout is real: planned as the annotations say, and the step's arrays lie so.
    planned = by_name(dp.state_sharding.params)[c.probe]
    probe = by_name(state.params)[c.probe].get_value()
    spec = tuple(planned.spec) + (None,) * (probe.ndim - len(planned.spec))
    assert spec == c.specs[layout], (layout, planned)
    assert probe.sharding.is_equivalent_to(planned, probe.ndim), (layout, probe.sharding)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_linen_scan_over_remat_blocks(layout):
    check("linen", layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nnx_attention_blocks_stacked_by_vmap_and_scan(layout):
    check("nnx", layout)


@pytest.mark.parametrize("layout", FLAT_LAYOUTS)
def test_batchnorm_and_three_dropouts_equal_one_device_on_the_global_batch(layout):
    check("batchnorm", layout)


def test_the_reference_dropouts_draw_masks_of_their_own():
    """The reference the BatchNorm model is held to has three different masks: after
    ``nnx.reseed`` each Dropout's stream starts from a key of its own."""
    model = nnx.clone(case("batchnorm").model)
    nnx.reseed(model, dropout=jax.random.fold_in(jax.random.key(SEED), 0))
    ones = np.ones((4, 32), np.float32)
    masks = [np.asarray(getattr(model, f"dropout{i}")(ones) != 0) for i in (1, 2, 3)]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])


def test_as_nnx_keeps_flax_logical_names_without_a_mesh():
    """``jaxdist.as_nnx`` of a Linen model annotated with ``nn.with_logical_partitioning``,
    outside any mesh: flax's eager sharding once refused its names ("embed" is no mesh
    axis); now the names are kept for the layout, the arrays placed nowhere yet."""
    model = case("linen").model
    kernel = by_name(nnx.state(model, nnx.Param))[LINEN + "blocks/Dense_0/kernel"]
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    assert kernel.get_value().shape == (fb.LAYERS, fb.D_MODEL, fb.D_MLP)
    assert len(kernel.get_value().devices()) == 1
