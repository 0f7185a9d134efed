"""Layout as a parameter: the same GPT on every mesh layout computes what data
parallelism computes, which is what one device computes; sharded layouts hold 1/N of the
state per device and compile to the collectives they should; bad layouts are errors."""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from helpers import relative_error
from jaxdist.layout import LayoutError, state_shardings
from jaxdist.models.gpt import GPT
from jaxdist.sharding import DeviceCountError, data_parallel_rank, mesh_devices
from jaxdist.train import main

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
    """One device, optax and jax.grad only: no jaxdist."""
    graphdef, params = nnx.split(model(), nnx.Param)
    tx = optax.sgd(0.5)
    opt_state, losses = tx.init(params), []

    def loss(p, tokens):
        return loss_fn(nnx.merge(graphdef, p), {"tokens": tokens})

    for batch in data():
        tokens = jax.device_put(batch["tokens"], jax.devices()[0])
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
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
    got = state_shardings(abstract, mesh, logical_rules={"embed": None, "heads": "fsdp"})
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
    mesh = jaxdist.make_mesh(**sizes)
    model = lambda: build(d_model, 8, vocab)  # noqa: E731
    dp = jaxdist.DataParallel(model, optax.adam(1e-3), loss_fn, mesh=mesh)
    state = dp.init_state()
    batch = jaxdist.shard_batch(batches(vocab)[0], mesh)
    memory = dp.lower(state, batch).compile().memory_analysis()
    batch_bytes = batch["tokens"].addressable_shards[0].data.nbytes
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    init = dp.lower_init().compile().memory_analysis()
    return memory.argument_size_in_bytes - batch_bytes, total, init.output_size_in_bytes


@pytest.mark.parametrize("sharded", ["fsdp=8", "model=8"])
def test_sharded_state_is_an_eighth_per_device(sharded):
    """Params + Adam state per device (the step's arguments less the batch, from
    ``memory_analysis``, per device): at most 1/8 of the replicated figure + 10%; the
    init program's output too, so init never holds a whole copy."""
    replicated, replicated_total, _ = state_bytes_per_device(LAYOUTS["data=8"])
    state, total, init_out = state_bytes_per_device(LAYOUTS[sharded])
    assert state <= replicated / 8 * 1.1, (state, replicated)
    assert init_out <= replicated / 8 * 1.1, (init_out, replicated)
    assert total < replicated_total * 0.6, (total, replicated_total)  # temps: gathers


def fake_devices(processes, per_process):
    return [
        SimpleNamespace(id=i, process_index=i // per_process, platform="cpu")
        for i in range(processes * per_process)
    ]


@pytest.mark.parametrize("sizes", [dict(model=4), dict(fsdp=2, model=2), dict(stage=2, model=2)])
def test_model_groups_stay_inside_one_process(sizes):
    array = mesh_devices({"data": -1, **sizes}, fake_devices(4, 4))
    groups = array.reshape(-1, array.shape[-1])  # the innermost axis: model
    for group in groups:
        assert len({d.process_index for d in group}) == 1


def fake_mesh(array):
    names = ("data", "stage", "fsdp", "model")
    return SimpleNamespace(
        devices=array, axis_names=names, shape=dict(zip(names, array.shape, strict=True))
    )


def test_data_parallel_rank_is_shared_by_a_model_group():
    # 2 processes x 4 devices, model=4: each process is one replica, its own rows.
    mesh = fake_mesh(mesh_devices({"data": 2, "model": 4}, fake_devices(2, 4)))
    assert [data_parallel_rank(mesh, p) for p in (0, 1)] == [(0, 2), (1, 2)]
    # model=8 spans both processes: one replica, both load the same rows.
    mesh = fake_mesh(mesh_devices({"data": 1, "model": 8}, fake_devices(2, 4)))
    assert [data_parallel_rank(mesh, p) for p in (0, 1)] == [(0, 1), (0, 1)]
    a = jaxdist.DistributedSampler(64, 16, mesh=mesh, seed=1)
    assert (a.process_index, a.process_count) == (0, 1) and len(a.indices(0)) == 16
    # 4 processes x 2 devices, data=2, model=4: processes 0, 1 share rank 0.
    mesh = fake_mesh(mesh_devices({"data": 2, "model": 4}, fake_devices(4, 2)))
    assert [data_parallel_rank(mesh, p)[0] for p in range(4)] == [0, 0, 1, 1]


def test_mesh_sizes():
    mesh = jaxdist.make_mesh(data=2, fsdp=2, model=2)
    assert mesh.axis_names == ("data", "stage", "fsdp", "model")
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "model": 2}
    assert jaxdist.make_mesh(model=2).shape["data"] == 4
    assert jaxdist.make_mesh(data=4).size == 4  # data alone: the first 4 devices
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(DeviceCountError, match="6 devices but 8"):
        jaxdist.make_mesh(data=3, model=2)


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


def test_pipeline_run_states_its_bubble_first(capsys, tmp_path):
    args = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--steps", "2"]
    args += ["--global-batch-size", "32", "--mesh", "data=4,stage=2", "--run-dir", str(tmp_path)]
    assert main(args) == 0
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("jaxdist:"))
    assert "pipeline: 2 stages x 8 microbatches (GPipe), bubble (S-1)/(M+S-1) = 1/9" in first
