"""``--shard-optimizer`` (ZeRO-1): AdamW's moments split over ``data`` while the
parameters stay whole on every replica. The same numbers as data=8 and as a plain
one-device optax loop; 1/8 of the optimizer's bytes per device in the compiled program;
on the GPU compiler one reduce-scatter and one all-gather of the parameters' bytes a
step in place of the gradient's all-reduce."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import adamw_reference
import jaxdist
from adamw_reference import loss_fn, tx
from helpers import relative_error
from jaxdist.parallel.hlo import read_program
from jaxdist.plan import Options
from test_plan import GPT, gpu_compiler_ready, param_bytes

STEPS, ROWS = 5, 32


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(64, 256, rngs=rngs)  # kernels >= 1024 elements: split
        self.b = nnx.Linear(256, 256, rngs=rngs)
        self.c = nnx.Linear(256, 10, rngs=rngs)  # (256, 10): 2560 elements, 8 divides 256

    def __call__(self, x):
        return self.c(nnx.relu(self.b(nnx.relu(self.a(x)))))


def batches():
    return adamw_reference.batches(STEPS, ROWS)


def jaxdist_run(shard_optimizer: bool, mesh_shape=None, **options):
    mesh = jaxdist.make_mesh(**(mesh_shape or {"data": 8}))
    dp = jaxdist.DataParallel(
        lambda: MLP(nnx.Rngs(0)), tx(), loss_fn, mesh=mesh, shard_optimizer=shard_optimizer,
        **options,
    )  # fmt: skip
    state, losses = dp.init_state(), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return losses, dp.host_params(state), dp, state


def plain_loop():
    """One device, plain flax + optax."""
    return adamw_reference.plain_loop(lambda: MLP(nnx.Rngs(0)), STEPS)


@pytest.fixture(scope="module")
def data_parallel():
    return jaxdist_run(False)


@pytest.fixture(scope="module")
def plain():
    return plain_loop()


@pytest.mark.parametrize(
    "options",
    [{}, {"grad_accum": 2}, {"strategy": "shard_map"}, {"mesh_shape": {"data": 2, "fsdp": 4}}],
    ids=["gspmd", "accum", "shard_map", "fsdp"],
)
def test_the_same_numbers_as_data_parallel_and_a_plain_loop(options, data_parallel, plain):
    losses, params, _, _ = jaxdist_run(True, **options)
    want_losses, want, _, _ = data_parallel
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for name, value in want.items():
        assert relative_error(params[name], value) < 1e-6, name
    plain_losses, plain_params = plain
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for name, value in plain_params.items():
        assert relative_error(params[name], value) < 1e-5, name


def test_each_device_holds_an_eighth_of_the_optimizer_state(data_parallel):
    _, _, dp, state = jaxdist_run(True)
    _, _, whole_dp, whole_state = data_parallel
    moments = jax.tree.leaves(state.unpack().opt_state)
    total = sum(x.nbytes for x in moments)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in moments)
    assert per_device <= total / 8 * 1.1, (per_device, total)
    # the compiled step's arguments: the moments' 7/8 gone, the parameters still whole
    batch = jaxdist.shard_batch(batches()[0], dp.mesh)
    split = dp.program(batch).compile().memory_analysis().argument_size_in_bytes
    whole = whole_dp.program(batch).compile().memory_analysis().argument_size_in_bytes
    assert whole - split >= 0.9 * total * 7 / 8, (whole, split, total)
    params = jax.tree.leaves(state.unpack().params)
    assert all(x.sharding.is_fully_replicated for x in params)


@pytest.mark.skipif(not gpu_compiler_ready(), reason="no GPU compiler (the README's test command)")
def test_the_gpu_step_reduce_scatters_and_all_gathers_instead_of_all_reducing():
    flags = [*GPT, "--mesh", "data=8", "--grad-accum", "1", "--remat", "none"]
    one = Options(budget_s=0, workers=1)
    (split,) = jaxdist.plan([*flags, "--shard-optimizer"], "1x8:H100-80GB", one).candidates
    (whole,) = jaxdist.plan([*flags, "--shard-optimizer", "false"], "1x8:H100-80GB", one).candidates
    zero, ddp = split.measured["by_kind"], whole.measured["by_kind"]
    gradient = ddp["all-reduce"]  # data parallel: every gradient byte (the tied embedding twice)
    assert set(ddp) == {"all-reduce"} and gradient > param_bytes(GPT)
    # every gradient byte reduced once: scattered (7/8 of it sent), or, for the arrays too
    # small to split (biases, norms) and the loss's scalars, all-reduced
    scattered = zero["reduce-scatter"] / (7 / 8)
    assert scattered + zero["all-reduce"] == pytest.approx(gradient, rel=0.001)
    assert zero["all-reduce"] < 0.02 * gradient
    # the parameters come back whole: received 7/8 of them (at least)
    assert param_bytes(GPT) * 7 / 8 * 0.95 <= zero["all-gather"] <= gradient * 7 / 8


@pytest.mark.parametrize(
    "options", [{"grad_accum": 2}, {"strategy": "shard_map"}], ids=["accum", "shard_map"]
)
def test_the_per_replica_gradient_is_reduce_scattered_not_all_reduced(options):
    """Under grad-accum and shard_map the gradient is reduced inside the per-replica
    region: there each split gradient is one psum_scatter over data (no all-reduce then a
    slice), so even CPU's compiled step shows it."""
    mesh = jaxdist.make_mesh(data=8)
    dp = jaxdist.DataParallel(
        lambda: MLP(nnx.Rngs(0)), tx(), loss_fn, mesh=mesh, shard_optimizer=True, **options
    )
    text = dp.program(jaxdist.shard_batch(batches()[0], mesh)).compile().as_text()
    by_kind = read_program(text, 8).bytes_by_kind()
    kernels = 4 * (64 * 256 + 256 * 256 + 256 * 10)  # bytes of the three split gradients
    assert by_kind["reduce-scatter"] == pytest.approx(kernels * 7 / 8, rel=0.01), by_kind
    assert by_kind["all-gather"] == pytest.approx(kernels * 7 / 8, rel=0.01), by_kind
    # all that is all-reduced: the biases (522 floats, under the split size) and scalars
    assert by_kind["all-reduce"] < 4 * 600, by_kind


def test_pmap_refuses_it():
    with pytest.raises(jaxdist.ConfigError, match="--shard-optimizer: pmap"):
        jaxdist.DataParallel(
            lambda: MLP(nnx.Rngs(0)), tx(), loss_fn, strategy="pmap", shard_optimizer=True
        )


def test_the_command_line_flag_splits_the_trainers_optimizer_state():
    from jaxdist.train.config import parse_args
    from jaxdist.train.trainer import train

    flags = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--d-model", "64"]
    flags += ["--steps", "2", "--global-batch-size", "16", "--shard-optimizer"]
    run = train(parse_args(flags), write=False, quiet=True)
    moments = [x for x in jax.tree.leaves(run.state.unpack().opt_state) if x.size >= 1024]
    assert moments and all("data" in str(x.sharding.spec) for x in moments)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(run.state.unpack().params))
