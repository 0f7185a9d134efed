"""Sequence parallelism: a ``seq`` mesh axis splits each sequence, and the activations
(B, T, D) along T, over devices; ``jaxdist.attention`` runs ring or gather attention
over it. References: ``jax.nn.dot_product_attention`` (attention), data=8 and a plain
one-device flax/optax loop (training), the seq=1 program's own ``memory_analysis``.

SGD, not Adam: the key bias's true gradient is zero (a constant added to every key does
not move a softmax), so Adam would blow each layout's rounding noise there up to a
full step of a different sign; SGD also shows a gradient summed too often or too rarely
over seq."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist
from helpers import relative_error
from jaxdist.losses import next_token_loss
from jaxdist.models.attention import attention
from jaxdist.models.gpt import GPT
from jaxdist.parallel.device_mesh import mesh_devices, parse_mesh
from jaxdist.plan import candidates as cands
from jaxdist.plan import targets
from jaxdist.train.config import parse_args
from jaxdist.train.trainer import train

T, ROWS, STEPS = 32, 8, 3  # sequence length, global batch rows, optimizer steps


def model(seq_attention="ring"):
    return GPT(260, T, 32, 2, 4, seq_attention=seq_attention, rngs=nnx.Rngs(0))


def batches():
    rng = np.random.default_rng(0)  # (B, T + 1): inputs and the shifted targets
    return [{"tokens": rng.integers(0, 257, (ROWS, T + 1)).astype(np.int32)} for _ in range(STEPS)]


def tx():
    return optax.sgd(0.5)


def qkv(mesh=None):
    rng = np.random.default_rng(1)
    arrays = [rng.normal(size=(2, T, 3, 8)).astype(np.float32) for _ in range(3)]  # (B,T,H,Dh)
    if mesh is None:
        return arrays
    return [jax.device_put(x, NamedSharding(mesh, P())) for x in arrays]


def under(mesh, fn):
    """``fn`` jitted with ``mesh`` ambient, as jaxdist's step runs it."""

    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return jax.jit(traced)


@pytest.mark.parametrize("way, causal", [("ring", True), ("gather", True), ("ring", False)])
def test_attention_equals_jax_on_4_devices(way, causal):
    mesh = jaxdist.make_mesh(seq=4, devices=jax.devices()[:4])
    q, k, v = qkv(mesh)
    fn = under(mesh, lambda q, k, v: attention(q, k, v, causal=causal, seq_attention=way))
    want = jax.nn.dot_product_attention(*qkv(), is_causal=causal)
    np.testing.assert_allclose(fn(q, k, v), want, atol=1e-5)
    # the way it says: blocks passed round (ring) or keys and values gathered
    text = fn.lower(q, k, v).as_text()
    assert ("collective_permute" in text) == (way == "ring"), way
    assert ("all_gather" in text) == (way == "gather"), way
    # without a mesh it is jax's own call, bit for bit
    plain = attention(*qkv(), causal=causal, seq_attention=way)
    assert np.array_equal(plain, want)


def test_the_mesh_splits_the_sequence_and_keeps_seq_inside_a_process():
    assert parse_mesh("data=2,seq=4") == {"data": 2, "seq": 4}
    fake = [
        SimpleNamespace(id=i, process_index=i // 4, platform="cpu", device_kind="cpu")
        for i in range(8)
    ]
    array = mesh_devices({"data": 2, "seq": 4}, fake)  # (data, stage, fsdp, model, seq, expert)
    for group in array.reshape(2, 4):
        assert len({d.process_index for d in group}) == 1  # a seq group: one process
    array = mesh_devices({"data": 2, "model": 2, "seq": 2}, fake)
    assert [d.id for d in array[0, 0, 0, :, 0, 0]] == [0, 1]  # model innermost
    assert [d.id for d in array[0, 0, 0, 0, :, 0]] == [0, 2]  # then seq
    mesh = jaxdist.make_mesh(data=2, seq=4)
    split = jaxdist.shard_batch({"a": np.zeros((8, T), np.int32), "b": np.zeros((8, T + 1))}, mesh)
    assert split["a"].sharding.spec == P(("data", "fsdp"), "seq")
    assert split["a"].addressable_shards[0].data.shape == (4, T // 4)
    assert split["b"].sharding.spec == P(("data", "fsdp"))  # 33 columns: whole over seq


def jaxdist_run(mesh, seq_attention="ring", strategy="gspmd"):
    """(losses, host params, compiled step's memory analysis, parameter shardings)."""
    dp = jaxdist.DataParallel(
        lambda: model(seq_attention), tx(), next_token_loss, mesh=mesh, strategy=strategy
    )
    state, losses = dp.init_state(), []
    first = jaxdist.shard_batch(batches()[0], mesh)
    memory = dp.program(first).compile().memory_analysis()  # the steps below reuse it
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    specs = [x.sharding for x in jax.tree.leaves(state.unpack().params)]
    return losses, dp.host_params(state), memory, specs


def plain_loop():
    """One device, plain flax + optax, jax.nn.dot_product_attention (no mesh)."""
    graphdef, params = nnx.split(model(), nnx.Param)
    opt, opt_state = tx(), tx().init(params)

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches():
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch["tokens"]))
        losses.append(float(loss))
    flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}
    return losses, flat


class Runs(dict):
    """Each run made the first time a test asks for it (a tier that selects fewer tests
    makes fewer runs), then kept for the module."""

    def __init__(self, makers: dict):
        super().__init__()
        self.makers = makers

    def __missing__(self, name):
        self[name] = self.makers[name]()
        return self[name]


@pytest.fixture(scope="module")
def runs():
    seq = jaxdist.make_mesh(data=2, seq=4)
    # seq=1 with the rows per device of data=2,seq=4 (4) and the same sequence: compiled only
    dp = jaxdist.DataParallel(model, tx(), next_token_loss, mesh=jaxdist.make_mesh(data=2))
    batch = {"tokens": jax.ShapeDtypeStruct((ROWS, T + 1), np.int32)}
    return Runs({
        "data=8": lambda: jaxdist_run(jaxdist.make_mesh(data=8)),
        "ring": lambda: jaxdist_run(seq, "ring"),
        "gather": lambda: jaxdist_run(seq, "gather"),
        "all-to-all": lambda: jaxdist_run(seq, "all-to-all"),  # 4 heads: 1 per seq device
        # per replica, nested
        "shard_map": lambda: jaxdist_run(seq, "gather", strategy="shard_map"),
        "plain": plain_loop,
        "seq=1": lambda: dp.program(batch).compile().memory_analysis(),
    })  # fmt: skip


ONE_WORKER = pytest.mark.xdist_group("sequence_parallel")  # the runs fixture made once


@ONE_WORKER
@pytest.mark.parametrize("way", ["ring", "gather", "all-to-all", "shard_map"])
def test_data2_seq4_trains_as_data8_and_a_plain_loop(runs, way):
    losses, params, _, shardings = runs[way]
    for reference in ("data=8", "plain"):
        want_losses, want = runs[reference][:2]
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        for name, value in want.items():
            assert relative_error(params[name], value) < 1e-5, (reference, name)
    assert all(s.is_fully_replicated for s in shardings)  # parameters whole on every device


@ONE_WORKER
@pytest.mark.parametrize("way", ["ring", "gather"])
def test_seq4_holds_a_quarter_of_the_activations_of_seq1(runs, way):
    """The same rows per device (4) and sequence: seq=4 keeps T/4 positions of each.
    Temp bytes less the parameters' gradient, which both hold whole: the activations."""
    gradient = sum(x.nbytes for x in runs["plain"][1].values())
    whole = runs["seq=1"].temp_size_in_bytes - gradient
    split = runs[way][2].temp_size_in_bytes - gradient
    # measured: ring 0.28 (each hop's K/V block kept for the backward), gather 0.23;
    # 1.0 when attention does not split (jax.nn.dot_product_attention in the model)
    assert 0.2 < split / whole < 0.32, (split, whole, gradient)


def test_refusals():
    def build(mesh, strategy="gspmd"):
        return jaxdist.DataParallel(model, tx(), next_token_loss, mesh=mesh, strategy=strategy)

    with pytest.raises(jaxdist.ConfigError, match="pmap: the mesh has axes beyond data.*seq=4"):
        build(jaxdist.make_mesh(data=2, seq=4), "pmap")
    mesh = jaxdist.make_mesh(data=2, seq=4)
    q = jax.ShapeDtypeStruct((2, 30, 3, 8), np.float32)
    with pytest.raises(jaxdist.ConfigError, match="30 positions does not split into 4"):
        under(mesh, lambda q: attention(q, q, q)).lower(q)
    with pytest.raises(jaxdist.ConfigError, match="'flash' is not one of ring, gather, all-to"):
        attention(q, q, q, seq_attention="flash")


def test_the_planner_enumerates_seq_for_the_gpt_inside_a_node():
    target = targets.parse_target("2x4:cpu")
    found = cands.meshes(target, seq_len=T)
    assert {m.seq for m in found} == {1, 2, 4}
    for m in found:
        assert m.data * m.fsdp * m.model * m.stage * m.seq == 8
        assert 4 % (m.model * m.seq) == 0 and (m.seq == 1 or m.stage == 1 or m.model == 1), m
    assert {"data=2,seq=4", "data=2,stage=2,seq=2"} <= {m.mesh for m in found}
    assert not [m for m in found if m.seq > 1 and m.stage > 1 and m.model > 1]  # refused
    assert {m.seq for m in cands.meshes(target, seq_len=6)} == {1, 2}  # 4 does not divide 6
    assert {m.seq for m in cands.meshes(target)} == {1}  # no sequence: no seq axis
    assert {m.seq for m in cands.meshes(target, {"model": 2}, seq_len=T)} == {1}  # not named


def test_the_command_line_trains_with_seq_gather():
    flags = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--d-model", "32"]
    flags += ["--n-heads", "2", "--n-layers", "2", "--global-batch-size", "8", "--steps", "3"]
    flags += ["--mesh", "data=2,seq=2", "--num-devices", "4", "--seq-attention", "gather"]
    flags += ["--log-every", "1"]
    run = train(parse_args(flags), write=False, quiet=True)
    assert dict(run.mesh.shape)["seq"] == 2 and run.mesh.size == 4
    losses = [r["loss"] for r in run.history if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)), run.history
    tokens = {"tokens": jax.ShapeDtypeStruct((8, 17), np.int32)}
    text = run.dp.program(tokens).lower().as_text()
    assert "all_gather" in text and "collective_permute" not in text  # gather, as asked
