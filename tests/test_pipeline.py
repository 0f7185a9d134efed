"""Pipeline stages, stacked layers and activation checkpointing on the built-in GPT.

- The stacked GPT (``--scan-layers``: blocks held as (L, ...) parameters, run by one
  scan) trained by jaxdist equals a plain single-device optax loop, and so does the
  unscanned GPT given the same initial values.
- ``stage=2`` splits the stack over two stages (the "layers" axis of each kernel is split
  over ``stage``) and runs a GPipe schedule; it gives the losses and params of the
  data-parallel run, also with grad-accum and under shard_map.
- ``remat`` changes memory (from the compiled program), not results (``full`` here,
  ``block`` in test_layouts_cli.py).
- ``stage`` on a model without a stack is an error naming the way out.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
import test_layouts as layouts
from helpers import relative_error
from jaxdist.errors import ConfigError, ModelError
from jaxdist.models.gpt import GPT
from jaxdist.parallel.strategies.pipeline import bubble_fraction
from test_layouts import SEQ, VOCAB, loss_fn

G, STEPS, LAYERS = 32, 5, 4


def stacked(remat="none", d_model=64):
    return GPT(
        VOCAB, SEQ, d_model, LAYERS, 8, attention="xla", scan_layers=True, remat=remat,
        rngs=nnx.Rngs(0),
    )  # fmt: skip


def batches():
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, VOCAB, (G, SEQ + 1), dtype=np.int32)} for _ in range(STEPS)]


def train_on(sizes, **options):
    return layouts.train_on(sizes, model=stacked, data=batches, **options)


def plain_loop():
    return layouts.plain_loop(model=stacked, data=batches)


@pytest.fixture(scope="module")
def data_parallel():
    losses, params, _, _ = train_on(dict(data=8))
    return losses, params


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        assert relative_error(got[1][name], value) < 1e-5, name


def test_stacked_gpt_equals_a_plain_loop(data_parallel):
    losses, params = plain_loop()
    assert params["blocks/layers/fc/kernel"].shape == (LAYERS, 64, 256)  # one stacked kernel
    assert_same(data_parallel, (losses, params))


def test_remat_inside_the_stack_equals_the_plain_loop():
    """Checkpointed blocks in the stack's scan (recomputed in the backward pass: "block"
    keeps only the matmul outputs) train as the plain loop over the un-checkpointed stack
    does. ("full" is checked on unscanned blocks below.)"""
    got = layouts.train_on(dict(data=8), model=lambda: stacked("block"), data=batches)[:2]
    assert_same(got, plain_loop())


def unscanned_copy(remat="none"):
    """The unscanned GPT (a list of blocks) holding the stacked GPT's initial values,
    copied layer i of each stacked array to block i: the two draw the same values
    (tests/test_initial_state_layouts.py checks that), and the copy keeps this reference
    independent of that."""
    source = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(stacked()))}
    model = GPT(VOCAB, SEQ, 64, LAYERS, 8, attention="xla", remat=remat, rngs=nnx.Rngs(1))
    target = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(target):
        if path[0] == "blocks":  # ("blocks", i, ...) <- ("blocks", "layers", ...)[i]
            var.set_value(source[("blocks", "layers", *path[2:])][path[1]])
        else:
            var.set_value(source[path])
    nnx.update(model, target)
    return model


def test_scanned_layers_compute_what_unscanned_blocks_do(data_parallel):
    """``--scan-layers`` changes how the blocks are held and compiled, not the numbers: a
    plain loop over the unscanned GPT from the same values trains as the stack does. Its
    blocks are checkpointed with ``remat="full"`` (``call_block``: each recomputed in the
    backward pass), which must change nothing either."""
    losses, params = layouts.plain_loop(model=lambda: unscanned_copy("full"), data=batches)
    names = {n.split("/", 2)[2] for n in params if n.startswith("blocks/")}  # "fc/kernel"
    for name in names:  # back to the stacked names: layer i of blocks/layers/...
        params[f"blocks/layers/{name}"] = np.stack([params.pop(f"blocks/{i}/{name}")
                                                    for i in range(LAYERS)])  # fmt: skip
    assert_same((losses, params), data_parallel)


@pytest.mark.parametrize(
    "sizes, kw",
    [
        (dict(data=4, stage=2), {}),
        (dict(data=4, stage=2), dict(grad_accum=2, microbatches=2)),
        (dict(data=2, stage=2, model=2), {}),
        (dict(data=4, stage=2), dict(strategy="shard_map")),
    ],
    ids=["data4-stage2", "grad-accum-2", "data2-stage2-model2", "shard_map"],
)
def test_pipeline_equals_data_parallel(sizes, kw, data_parallel):
    losses, params, dp, state = train_on(sizes, **kw)
    assert_same((losses, params), data_parallel)
    assert dp.pipeline.stages == 2 and dp.pipeline.microbatches == kw.get("microbatches", 8)
    kernel = state.params["blocks"]["layers"]["fc"]["kernel"].get_value()  # (L, D, 4D)
    assert kernel.sharding.shard_shape(kernel.shape)[0] == LAYERS // 2  # 2 layers a stage


def test_bubble_fraction():
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(1, 5) == 0


def temp_bytes(remat, **sizes):
    mesh = jaxdist.make_mesh(**(sizes or {"data": 1}))
    dp = jaxdist.DataParallel(lambda: stacked(remat, 128), optax.sgd(0.5), loss_fn, mesh=mesh)
    tokens = jax.ShapeDtypeStruct((G, 4 * SEQ + 1), np.int32)
    return dp.program({"tokens": tokens}).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("sizes", [{"data": 1}, {"fsdp": 8}], ids=["one device", "fsdp=8"])
def test_remat_keeps_fewer_activations(sizes):
    """The compiled step's temporaries shrink with remat, under fsdp too, whose scan
    gathers each layer inside a checkpoint of its own: that checkpoint once overruled the
    block's, and fsdp kept every activation whatever --remat said (the 100B GPT's
    attention scores for all 80 layers: 1.4 TiB per device). That remat changes no
    number: "full" in test_scanned_layers_compute_what_unscanned_blocks_do, "block" in
    test_layouts_cli.py."""
    none, block, full = (temp_bytes(r, **sizes) for r in ("none", "block", "full"))
    # Kept per block: every activation > its matmul outputs > only its input.
    assert none > 1.5 * block and block > full, (none, block, full)


def test_stage_without_a_stack_is_an_error():
    unstacked = lambda: GPT(VOCAB, SEQ, 64, LAYERS, 8, attention="xla", rngs=nnx.Rngs(0))  # noqa: E731
    with pytest.raises(ModelError, match="no stack of identical blocks"):
        jaxdist.DataParallel(unstacked, optax.sgd(0.1), loss_fn, mesh=jaxdist.make_mesh(stage=2))


def test_fsdp_over_a_stack_equals_data_parallel(data_parallel):
    """fsdp gathers the stacked layers one at a time inside the scan (and reduce-scatters
    their gradients there): the same numbers as data parallelism, with grad-accum too."""
    assert_same(train_on(dict(data=1, fsdp=8))[:2], data_parallel)
    # with each block's --remat full inside the scan's per-layer checkpoint: the same
    full = lambda: stacked("full")  # noqa: E731
    got = layouts.train_on(dict(data=2, fsdp=4), model=full, data=batches, grad_accum=2)
    assert_same(got[:2], data_parallel)


def test_rows_that_do_not_split_into_microbatches_are_an_error():
    """32 rows / 4 batch shards = 8 rows per device: 3 microbatches cannot take them."""
    dp = jaxdist.DataParallel(
        stacked, optax.sgd(0.1), loss_fn, mesh=jaxdist.make_mesh(data=4, stage=2), microbatches=3
    )
    tokens = jax.ShapeDtypeStruct((G, SEQ + 1), np.int32)
    with pytest.raises(ConfigError, match="8 rows per device per step .* into 3 microbatches"):
        dp.program({"tokens": tokens})
