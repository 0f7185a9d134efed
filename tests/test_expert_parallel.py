"""The ``expert`` mesh axis and a MoE's experts split over it
(``jaxdist.models.expert_parallel``): the same numbers as the unsplit block (output,
dropped count, gradients w.r.t. the input and every parameter, within 1e-5 in float32),
the all_to_alls in the compiled program, each device holding 1/N of the expert kernels,
and the axis accepted, refused or reported where the mesh machinery meets it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist
from jaxdist.errors import ConfigError
from jaxdist.models.moe import MoE
from jaxdist.parallel import strategies
from jaxdist.parallel.device_mesh import BATCH_AXES, batch_blocks_by_process, parse_mesh
from jaxdist.parallel.hlo import read_program
from jaxdist.parallel.layout import state_shardings

B, T, D, F, E, K = 8, 8, 16, 8, 4, 2
TOL = 1e-5
MESHES = {"expert4_data2": dict(expert=4, data=2), "expert2_fsdp2": dict(expert=2, fsdp=2, data=2)}
MODES = {"dropless": {}, "capacity": dict(capacity_factor=0.75), "shared": dict(n_shared=1)}


def build(**settings) -> MoE:
    with nnx.use_eager_sharding(False):
        return MoE(D, F, E, K, rngs=nnx.Rngs(0), **settings)


def inputs():
    kx, kp = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (B, T, D)), jax.random.normal(kp, (B, T, D))


def objective_of(graphdef, probe):
    def objective(state, x):
        y, aux = nnx.merge(graphdef, state)(x)
        loss = jnp.sum(y * probe) + 0.1 * aux.load_balance_loss.mean() + 0.01 * aux.z_loss.mean()
        return loss, (y, aux.dropped)

    return jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)


def on_mesh(fn, mesh):
    """``fn`` jitted with ``mesh`` ambient, as jaxdist's step runs it."""

    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return jax.jit(traced)


def placed(state, x, mesh):
    """The parameters as jaxdist's layout places them; the rows as ``shard_batch`` does."""
    rows = NamedSharding(mesh, P(BATCH_AXES))
    return jax.device_put(state, state_shardings(state, mesh)), jax.device_put(x, rows)


def all_to_alls(compiled, n_devices=8):
    return [c for c in read_program(compiled.as_text(), n_devices).collectives
            if c.kind == "all-to-all"]  # fmt: skip


@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
@pytest.mark.parametrize("layout", MESHES, ids=list(MESHES))
def test_split_experts_give_the_unsplit_numbers(layout, mode):
    model = build(**MODES[mode])
    graphdef, state = nnx.split(model)
    x, probe = inputs()
    grads = objective_of(graphdef, probe)
    (loss0, (y0, dropped0)), (g0, dx0) = jax.jit(grads)(state, x)
    mesh = jaxdist.make_mesh(**MESHES[layout])
    split = on_mesh(grads, mesh)
    args = placed(state, x, mesh)
    assert all_to_alls(split.lower(*args).compile())  # the split path ran, not the unsplit
    (loss1, (y1, dropped1)), (g1, dx1) = split(*args)
    np.testing.assert_allclose(y1, y0, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(loss1, loss0, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(dx1, dx0, rtol=TOL, atol=TOL)
    flat0, flat1 = nnx.to_flat_state(g0), nnx.to_flat_state(g1)
    assert [p for p, _ in flat0] == [p for p, _ in flat1]
    for (path, a), (_, b) in zip(flat0, flat1, strict=True):
        np.testing.assert_allclose(b.get_value(), a.get_value(), rtol=TOL, atol=TOL,
                                   err_msg="/".join(map(str, path)))  # fmt: skip
    np.testing.assert_array_equal(dropped1, dropped0)  # per row: the same pairs dropped
    if mode == "capacity":
        assert dropped0.sum() > 0  # C = 3 of the 4 pairs an expert gets on average


@pytest.mark.parametrize(
    "mode, forward, with_grad",
    [("dropless", 3, 5), ("capacity", 2, 4)],
    ids=["dropless", "capacity"],
)
def test_the_compiled_program_exchanges_rows_with_all_to_alls(mode, forward, with_grad):
    """Dropless: rows out, expert ids out, results back (and the two row exchanges again
    backwards); capacity: buffers out and back. Each within an expert group of 4."""
    model = build(**MODES[mode])
    graphdef, state = nnx.split(model)
    x, probe = inputs()
    mesh = jaxdist.make_mesh(expert=4, data=2)
    args = placed(state, x, mesh)
    call = on_mesh(lambda s, x: nnx.merge(graphdef, s)(x), mesh)
    fwd = all_to_alls(call.lower(*args).compile())
    both = all_to_alls(on_mesh(objective_of(graphdef, probe), mesh).lower(*args).compile())
    assert (len(fwd), len(both)) == (forward, with_grad)
    for c in both:
        assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.count == 1
    rows = B // 8 * T  # tokens per device; E/N = 1 expert each, so m = min(k, 1) = 1
    # dropless: (N, rows*m, D) float32; capacity: (b, E, C, D), C = ceil(.75*8*2/4) = 3
    sent = 4 * rows * D * 4 if mode == "dropless" else B // 8 * E * 3 * D * 4
    assert max(c.bytes for c in both) == pytest.approx(sent * 3 / 4)  # (n-1)/n leaves


def test_each_device_holds_a_quarter_of_the_expert_kernels():
    model = build()
    _, state = nnx.split(model)
    mesh = jaxdist.make_mesh(expert=4, data=2)
    params = jax.device_put(state, state_shardings(state, mesh))
    for name in ("gate", "up", "down"):
        array = getattr(params, name).get_value()
        total = array.size * array.dtype.itemsize
        for shard in array.addressable_shards:
            assert shard.data.nbytes <= total / 4 * 1.1, (name, shard.data.shape)
        assert array.sharding.spec[0] == "expert"
    router = params.router.get_value()  # not an expert's: a whole copy on every device
    assert router.addressable_shards[0].data.nbytes == router.size * 4


def test_make_mesh_and_mesh_flag_take_expert():
    mesh = jaxdist.make_mesh(expert=4, data=2)
    assert dict(mesh.shape)["expert"] == 4 and dict(mesh.shape)["data"] == 2
    assert parse_mesh("expert=4,data=2") == {"expert": 4, "data": 2}
    # expert innermost on the devices: a group is 4 neighbouring devices
    assert [d.id for d in mesh.devices.reshape(2, 4)[0]] == [0, 1, 2, 3]
    assert jaxdist.parallel.device_mesh.batch_shards(mesh) == 8  # rows over data x expert
    assert batch_blocks_by_process(mesh) == {0: tuple(range(8))}


@pytest.mark.parametrize("sizes", [dict(data=2, expert=4), dict(fsdp=2, expert=2, data=2)])
def test_two_processes_load_contiguous_rows_with_expert_inside(sizes):
    """2 processes x 4 devices: an expert group inside a process, so each process's
    devices hold one contiguous half of the rows (its data-parallel rank)."""
    from types import SimpleNamespace

    from jaxdist.parallel.device_mesh import AXES, data_parallel_rank, mesh_devices

    devices = [SimpleNamespace(id=i, process_index=i // 4, platform="cpu", device_kind="cpu",
                               slice_index=0, coords=None) for i in range(8)]  # fmt: skip
    placed = mesh_devices(sizes, devices)
    shape = dict(zip(AXES, placed.shape, strict=True))
    mesh = SimpleNamespace(axis_names=AXES, devices=placed, shape=shape)
    assert batch_blocks_by_process(mesh) == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    assert [data_parallel_rank(mesh, p) for p in (0, 1)] == [(0, 2), (1, 2)]


def test_pmap_refuses_an_expert_axis():
    with pytest.raises(ConfigError, match="expert=2.*--strategy gspmd"):
        strategies.layout("pmap", jaxdist.make_mesh(expert=2, data=4))


def test_a_dense_model_on_an_expert_axis_is_said(capsys):
    from jaxdist.losses import classification_loss
    from jaxdist.models import MLP

    model = MLP(12, 32, 2, 5, rngs=nnx.Rngs(0))
    mesh = jaxdist.make_mesh(expert=2, data=4)
    dp = jaxdist.Parallel(model, optax.sgd(0.1), classification_loss, mesh=mesh)
    out = capsys.readouterr().out
    assert re.search(r"jaxdist: warning: --mesh expert=2 splits no parameter", out), out
    assert any("expert=2" in n for n in dp.notices)


class Tiny(nnx.Module):
    """A MoE between two dense layers (their weights replicated over expert)."""

    def __init__(self, rngs, **settings):
        self.inp = nnx.Linear(D, D, rngs=rngs)
        with nnx.use_eager_sharding(False):
            self.moe = MoE(D, F, E, K, rngs=rngs, **settings)

    def __call__(self, x):
        y, aux = self.moe(self.inp(x))
        return y, aux


def tiny_loss(model, batch):
    y, aux = model(batch["x"])  # aux per row: the batch's mean is the same on any split
    loss = jnp.mean(jnp.square(y - batch["y"])) + 0.1 * jnp.mean(aux.load_balance_loss)
    return loss, {"dropped": jnp.mean(aux.dropped)}


STEPS = {
    "gspmd_expert4_data2": ("gspmd", dict(expert=4, data=2)),
    "gspmd_expert2_fsdp2": ("gspmd", dict(expert=2, fsdp=2, data=2)),  # its per-replica path
    "shard_map_expert4_data2": ("shard_map", dict(expert=4, data=2)),
}


@pytest.mark.parametrize("strategy, sizes", STEPS.values(), ids=list(STEPS))
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_a_step_is_the_one_device_step(strategy, sizes, mode):
    """The trainer's step, both strategies that take expert: one SGD step's parameters
    and metrics equal the one-device step's (per replica: each replica's expert gradients
    summed over its group by the all_to_alls, averaged by hand)."""
    x, y = inputs()
    batch = {"x": np.asarray(x), "y": np.asarray(y)}

    def one_step(mesh, strategy):
        model = Tiny(nnx.Rngs(0), **MODES[mode])
        dp = jaxdist.Parallel(model, optax.sgd(0.5), tiny_loss, mesh=mesh, strategy=strategy)
        state, metrics = dp.step(dp.init_state(), jaxdist.shard_batch(batch, mesh))
        out = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state.params)}
        return {**out, **{k: metrics[k] for k in ("loss", "dropped")}}

    want = one_step(jaxdist.make_mesh(data=1), "gspmd")
    got = one_step(jaxdist.make_mesh(**sizes), strategy)
    assert want.keys() == got.keys()
    assert (want["dropped"] > 0) == (mode == "capacity")
    moved = [k for k in want if not np.allclose(want[k], got[k], rtol=TOL, atol=TOL)]
    assert not moved, moved


def test_bf16_experts_beside_a_model_axis_sum_their_gradients_in_float32():
    """bf16 experts on expert=2,fsdp=2,model=2 (the matrix's MoE row): the kernels'
    gradients are summed over fsdp in float32, as every other gradient (a bf16 psum in a
    shard_map beside the auto model axis aborted XLA:CPU's compiler: "Invalid binary
    instruction opcode copy"), and equal the unsplit block's within bf16's precision."""
    graphdef, state = nnx.split(build(dtype=jnp.bfloat16, n_shared=1))
    x, probe = inputs()
    grads = objective_of(graphdef, probe)
    _, (g0, _) = jax.jit(grads)(state, x)
    mesh = jaxdist.make_mesh(expert=2, fsdp=2, model=2)
    split = on_mesh(grads, mesh)
    args = placed(state, x, mesh)
    text = split.lower(*args).compile().as_text()  # compiles: no abort
    reduced = [c for c in read_program(text, 8).collectives if c.kind == "all-reduce"]
    assert reduced and not re.search(r"bf16\[[\d,]*\]\{[\d,]*\} all-reduce", text)
    _, (g1, _) = split(*args)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g0), nnx.to_flat_state(g1), strict=True):
        scale = np.abs(a.get_value()).max()
        np.testing.assert_allclose(b.get_value(), a.get_value(), atol=3e-2 * scale,
                                   err_msg="/".join(map(str, path)))  # fmt: skip
