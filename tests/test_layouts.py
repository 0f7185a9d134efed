"""Layout as a parameter: the same GPT on every mesh layout computes what data
parallelism computes, which is what one device computes; sharded layouts hold 1/N of the
state per device and compile to the collectives they should; bad layouts are errors."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from helpers import relative_error
from jaxdist.models.gpt import GPT
from jaxdist.parallel.layout import LayoutError, path_name, state_shardings
from jaxdist.train.trainer import main

VOCAB, SEQ, LAYERS, STEPS, G = 64, 16, 2, 5, 16
LAYOUTS = {
    "data=8": dict(data=8),
    "data=4,model=2": dict(data=4, model=2),
    "data=2,fsdp=2,model=2": dict(data=2, fsdp=2, model=2),
    "fsdp=8": dict(data=1, fsdp=8),
    "model=8": dict(data=1, model=8),
}


def build(d_model=64, heads=8, vocab=VOCAB):
    return GPT(vocab, SEQ, d_model, LAYERS, heads, attention="xla", rngs=nnx.Rngs(0))


def loss_fn(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def batches(vocab=VOCAB):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, vocab, (G, SEQ + 1), dtype=np.int32)} for _ in range(STEPS)]


def train_on(sizes, strategy="gspmd", model=build, data=batches, **options):
    """jaxdist on the mesh ``sizes``: (losses, host params, dp, final state)."""
    mesh = jaxdist.make_mesh(**sizes)
    dp = jaxdist.DataParallel(
        model, optax.sgd(0.5), loss_fn, mesh=mesh, strategy=strategy, **options
    )
    state, losses = dp.init_state(), []
    for batch in data():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    return losses, dp.host_params(state), dp, state


def plain_loop(model=build, data=batches):
    """One device, optax and jax.grad only: no jaxdist. The step is jitted because
    dispatching it op by op took most of this file's time."""
    graphdef, params = nnx.split(model(), nnx.Param)
    tx = optax.sgd(0.5)
    opt_state, losses = tx.init(params), []

    def loss(p, tokens):
        return loss_fn(nnx.merge(graphdef, p), {"tokens": tokens})

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for batch in data():
        tokens = jax.device_put(batch["tokens"], jax.devices()[0])
        params, opt_state, value = step(params, opt_state, tokens)
        losses.append(float(value))
    flat = nnx.to_flat_state(params)
    return losses, {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}


@pytest.fixture(scope="module")
def data_parallel():
    losses, params, _, _ = train_on(LAYOUTS["data=8"])
    return losses, params


def test_data_parallel_equals_a_plain_single_device_loop(data_parallel):
    losses, params = data_parallel
    want_losses, want = plain_loop()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert params.keys() == want.keys()
    for name in want:
        assert relative_error(params[name], want[name]) < 1e-5, name


CASES = [(k, "gspmd") for k in LAYOUTS if k != "data=8"]
CASES += [("data=2,fsdp=2,model=2", "shard_map"), ("fsdp=8", "shard_map")]


@pytest.mark.parametrize("layout, strategy", CASES)
def test_every_layout_equals_data_parallel(layout, strategy, data_parallel):
    losses, params, dp, state = train_on(LAYOUTS[layout], strategy)
    np.testing.assert_allclose(losses, data_parallel[0], rtol=1e-5)
    for name, want in data_parallel[1].items():
        assert relative_error(params[name], want) < 1e-5, (layout, name)
    # The layout really is sharded: the model-parallel kernel is split over the mesh.
    fc = state.params["blocks"][0]["fc"]["kernel"].get_value()
    assert fc.sharding.shard_shape(fc.shape) != fc.shape
    if (layout, strategy) == ("data=2,fsdp=2,model=2", "gspmd"):  # once: fsdp and model
        assert_merge_gathers(dp.merge(state), params)


def assert_merge_gathers(merged, params):
    """``merge`` of a sharded state: a module holding exactly ``host_params``, which
    computes what a plain one-device GPT given those values computes."""
    got = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(merged))}
    assert got.keys() >= params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
    graphdef, plain = nnx.split(build(), nnx.Param)
    plain = jax.tree_util.tree_map_with_path(  # the same tree holding params' values
        lambda path, _: jax.device_put(params[path_name(path)], jax.devices()[0]), plain
    )
    tokens = batches()[0]["tokens"][:2, :-1]
    # Jitted: run op by op, the two forward passes took seconds.
    got = nnx.jit(lambda model, tokens: model(tokens))(merged, tokens)
    want = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))(plain, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_state_shardings_follow_annotations_rules_and_fsdp_default():
    mesh = jaxdist.make_mesh(data=2, fsdp=2, model=2)
    dp = jaxdist.DataParallel(build, optax.adam(1e-3), loss_fn, mesh=mesh)
    specs = dp.state_sharding
    block = specs.params["blocks"][0]
    assert block["qkv"]["kernel"].spec == jax.P("fsdp", "model")  # (embed, heads)
    assert block["out"]["kernel"].spec == jax.P("model", "fsdp")  # (mlp, embed)
    assert specs.params["tok"]["embedding"].spec == jax.P("model", "fsdp")  # (vocab, embed)
    assert block["ln1"]["scale"].spec == jax.P()
    mu = specs.opt_state[0].mu["blocks"][0]["qkv"]["kernel"]  # Adam's mu follows its param
    assert mu.spec == jax.P("fsdp", "model")
    assert specs.step.spec == jax.P()
    # The model's annotations come first; the logical table can be overridden by name.
    rules = [(r"blocks/\d+/qkv/kernel$", (None, "fsdp"))]
    abstract = nnx.state(nnx.eval_shape(build), nnx.Param)
    got = state_shardings(abstract, mesh, rules)
    assert got["blocks"][0]["qkv"]["kernel"].spec == jax.P("fsdp", "model")
    got = state_shardings(abstract, mesh, axis_names={"embed": None, "heads": "fsdp"})
    assert got["blocks"][0]["qkv"]["kernel"].spec == jax.P(None, "fsdp")
    # Path rules place unannotated arrays; the rest under fsdp split their largest dim.
    plain = nnx.state(nnx.eval_shape(lambda: nnx.Linear(64, 128, rngs=nnx.Rngs(0))))
    got = state_shardings(plain, jaxdist.make_mesh(data=2, fsdp=4))
    assert got["kernel"].spec == jax.P(None, "fsdp") and got["bias"].spec == jax.P()
    got = state_shardings(plain, mesh, [(r"^kernel$", ("model", None)), ("bias", ("fsdp",))])
    assert got["kernel"].spec == jax.P("model", None) and got["bias"].spec == jax.P("fsdp")


def test_an_axis_that_does_not_divide_names_the_parameter():
    mesh = jaxdist.make_mesh(data=1, model=8)
    with pytest.raises(
        LayoutError, match=r"blocks/0/proj/kernel of shape \(36, 36\).*mesh axis model of size 8"
    ):
        jaxdist.DataParallel(lambda: build(36, 4), optax.sgd(0.1), loss_fn, mesh=mesh)


def state_bytes_per_device(sizes, d_model=128, vocab=256):
    """From the compiled programs alone (no state is made): per device, the step's
    arguments less the batch, its total, and the init program's output."""
    mesh = jaxdist.make_mesh(**sizes)
    model = lambda: build(d_model, 8, vocab)  # noqa: E731
    dp = jaxdist.DataParallel(model, optax.adam(1e-3), loss_fn, mesh=mesh)
    program = dp.program({"tokens": jax.ShapeDtypeStruct((G, SEQ + 1), np.int32)})
    memory = program.compile().memory_analysis()
    tokens = program.batch["tokens"]
    batch_bytes = np.prod(tokens.sharding.shard_shape(tokens.shape)) * tokens.dtype.itemsize
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    init = dp.lower_init().compile().memory_analysis()
    return memory.argument_size_in_bytes - batch_bytes, total, init.output_size_in_bytes


@pytest.fixture(scope="module")
def replicated_bytes():
    return state_bytes_per_device(LAYOUTS["data=8"])


@pytest.mark.parametrize("sharded", ["fsdp=8", "model=8"])
def test_sharded_state_is_an_eighth_per_device(sharded, replicated_bytes):
    """Params + Adam state per device (the step's arguments less the batch, from
    ``memory_analysis``, per device): at most 1/8 of the replicated figure + 10%; the
    init program's output too, so init never holds a whole copy."""
    replicated, replicated_total, _ = replicated_bytes
    state, total, init_out = state_bytes_per_device(LAYOUTS[sharded])
    assert state <= replicated / 8 * 1.1, (state, replicated)
    assert init_out <= replicated / 8 * 1.1, (init_out, replicated)
    assert total < replicated_total * 0.6, (total, replicated_total)  # temps: gathers


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "data=3,model=2"], "6 devices but 8"),
        (["--strategy", "pmap", "--mesh", "model=2"], "Use --strategy gspmd"),
        (
            ["--mesh", "model=8", "--d-model", "36", "--n-heads", "4"],
            r"blocks/0/proj/kernel of shape \(36, 36\)",
        ),
        (["--model", "mlp", "--data", "synthetic", "--mesh", "stage=2"], "no stack of identical"),
        (["--mesh", "data=4,stage=2", "--microbatches", "3"], r"4 rows per device .* 3 micro"),
    ],
)
def test_bad_layouts_exit_2(args, message, capsys, tmp_path):
    common = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--steps", "1"]
    rc = main([*common, "--global-batch-size", "16", "--run-dir", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(message, err), err
    assert not (tmp_path / "r").exists()
