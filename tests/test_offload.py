"""``--offload``: the optimizer state (and, under fsdp, the parameters) kept in host
memory between steps, the blocks' saved activations moved there by their remat policy.

The same numbers as without offload (1e-6) and as a plain one-device optax loop; the
compiled step's arguments in host memory are exactly the offloaded state's bytes, and the
device's drop by as much; checkpoints save and restore offloaded state; what this
platform cannot do is refused. On CPU jit lowers no move between memory kinds, so the
activation policy is checked where it acts, in the traced program (residuals typed
``<host>``), with the platform refusal lifted.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import adamw_reference
import jaxdist
from adamw_reference import loss_fn, tx
from helpers import relative_error, small_config
from jaxdist.losses import next_token_loss
from jaxdist.models import GPT, Stack
from jaxdist.models import stack as stack_lib
from jaxdist.parallel import offload

STEPS, ROWS = 3, 32
pytestmark = pytest.mark.xdist_group("offload")  # one worker: the references run once


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(64, 256, rngs=rngs)  # (64, 256): split by fsdp=4
        self.b = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):  # (B, 64) -> (B, 10)
        return self.b(nnx.relu(self.a(x)))


def batches():
    return adamw_reference.batches(STEPS, ROWS)


def jaxdist_run(mesh_axes: dict, **options):
    mesh = jaxdist.make_mesh(**mesh_axes)
    dp = jaxdist.DataParallel(lambda: MLP(nnx.Rngs(0)), tx(), loss_fn, mesh=mesh, **options)
    state, losses = dp.init_state(), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return losses, dp.host_params(state), dp, state


def plain_loop():
    """One device, plain flax + optax."""
    return adamw_reference.plain_loop(lambda: MLP(nnx.Rngs(0)), STEPS)


def assert_same(run, want, tolerance):
    losses, params = run[:2]
    np.testing.assert_allclose(losses, want[0], rtol=tolerance)
    assert params.keys() == want[1].keys()
    for name, value in want[1].items():
        assert relative_error(params[name], value) < tolerance, name


def kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def data_parallel():
    return jaxdist_run({"data": 8})


@pytest.fixture(scope="module")
def plain():
    return plain_loop()


@pytest.fixture(scope="module")
def fsdp_offloaded():
    """Both offloaded under fsdp, per replica, with grad-accum and the skip policy."""
    mesh_axes = {"data": 2, "fsdp": 4}
    return jaxdist_run(mesh_axes, offload="optimizer,params", grad_accum=2, nan_policy="skip")


def test_optimizer_offload_same_numbers_and_its_bytes_leave_the_device(data_parallel, plain):
    run = jaxdist_run({"data": 8}, offload=("optimizer",))
    assert_same(run, data_parallel, 1e-6)
    assert_same(run, plain, 1e-5)
    _, _, dp, state = run
    state = state.unpack()
    assert kinds(state.opt_state) == {"pinned_host"} and kinds(state.params) == {"device"}
    batch = jaxdist.shard_batch(batches()[0], dp.mesh)
    compiled = dp.program(batch).compile()
    placed = offload.argument_bytes(compiled)
    # every argument read from the entry layout: the parts add up to XLA's own total
    assert sum(placed.values()) == compiled.memory_analysis().argument_size_in_bytes
    moments = per_device_bytes(state.opt_state)  # AdamW's mu and nu: 8 bytes a parameter
    assert moments > 8 * 16_000
    rest = per_device_bytes(state) - moments + per_device_bytes(batch)  # params, step, rows
    assert placed == {"device": rest, "pinned_host": moments}
    # the step's new optimizer state leaves it through host placements
    lowered = dp.program(batch).lower().as_text()
    moves = re.findall(r'_xla_buffer_placement = "pinned_host"', lowered)
    assert len(moves) == len(jax.tree.leaves(state.opt_state))


def test_fsdp_params_and_optimizer_offload_same_numbers(fsdp_offloaded, data_parallel, plain):
    assert_same(fsdp_offloaded, data_parallel, 1e-6)
    assert_same(fsdp_offloaded, plain, 1e-5)
    _, _, dp, state = fsdp_offloaded
    state = state.unpack()
    assert kinds(state.params) == kinds(state.opt_state) == {"pinned_host"}
    compiled = dp.program(jaxdist.shard_batch(batches()[0], dp.mesh)).compile()
    held = per_device_bytes(state.params) + per_device_bytes(state.opt_state)
    assert offload.argument_bytes(compiled)["pinned_host"] == held


def test_shard_map_params_offload_same_numbers(data_parallel):
    run = jaxdist_run({"data": 2, "fsdp": 4}, offload=("params",), strategy="shard_map")
    assert_same(run, data_parallel, 1e-6)
    state = run[3].unpack()
    assert kinds(state.params) == {"pinned_host"} and kinds(state.opt_state) == {"device"}


def test_offloaded_state_saves_and_restores_in_host_memory(tmp_path, fsdp_offloaded):
    _, _, dp, state = fsdp_offloaded  # the last test to use it: its state is donated here
    dp.save(state, tmp_path)
    dp.wait_for_saves()
    restored, _ = dp.restore(tmp_path)
    saved = state.unpack()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert kinds(restored.params) == kinds(restored.opt_state) == {"pinned_host"}
    batch = jaxdist.shard_batch(batches()[0], dp.mesh)
    after_restore = float(dp.step(restored, batch)[1]["loss"])
    assert after_restore == float(dp.step(state, batch)[1]["loss"])


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, h):  # (B, 32) -> (B, 32); tanh's backward needs the matmul output
        return jnp.tanh(self.fc(h))


def test_the_activation_policy_moves_each_blocks_matmul_outputs_to_host():
    """``offloading_activations``: each block's matmul output is a residual in host
    memory ((8, 32) for each of 3 layers, stacked by the scan), the gradient unchanged; a
    plain ``jax.checkpoint`` with JAX's offloading policy is the reference."""
    graphdef, params = nnx.split(Stack(Block, 3, rngs=nnx.Rngs(0), remat="block"))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 32)), jnp.float32)

    def loss(params, offloaded):
        with stack_lib.offloading_activations(offloaded):
            return jnp.sum(nnx.merge(graphdef, params)(x) ** 2)

    grad = jax.grad(loss)
    with_host = str(jax.make_jaxpr(grad, static_argnums=1)(params, True))
    assert "f32<host>[3,8,32]" in with_host
    assert "<host>" not in str(jax.make_jaxpr(grad, static_argnums=1)(params, False))
    policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    fc = params["layers"]["fc"]
    weights = (fc["kernel"][...], fc["bias"][...])  # (3, 32, 32), (3, 32)

    def reference(weights):  # plain JAX: the same scan of tanh(h @ W + b)
        block = jax.checkpoint(lambda h, w: jnp.tanh(h @ w[0] + w[1]), policy=policy)
        return jnp.sum(jax.lax.scan(lambda h, w: (block(h, w), None), x, weights)[0] ** 2)

    got = jax.jit(grad, static_argnums=1)(params, True)["layers"]["fc"]["kernel"][...]
    assert relative_error(got, jax.jit(jax.grad(reference))(weights)[0]) < 1e-6


def gpt():
    return GPT(61, 8, 32, 2, 4, attention="xla", scan_layers=True, remat="block", rngs=nnx.Rngs(0))


def test_activation_offload_reaches_the_stack_through_the_step(monkeypatch):
    """With CPU's refusal lifted: the step's traced program holds host residuals under
    fsdp's layer runner (its checkpoint joined with the block's policy), none without."""
    monkeypatch.setattr(offload, "MOVES_LOWERED", ("gpu", "tpu", "cpu"))

    def host_residuals(**options):
        mesh = jaxdist.make_mesh(data=2, fsdp=4)
        dp = jaxdist.DataParallel(gpt, tx(), next_token_loss, mesh=mesh, **options)
        program = dp.program(jaxdist.shard_batch({"tokens": np.zeros((16, 9), np.int32)}, mesh))
        return str(jax.make_jaxpr(program.fn)(program.state, program.batch)).count("f32<host>")

    assert host_residuals(offload=("activations",)) > 0 and host_residuals() == 0
    with pytest.raises(jaxdist.ConfigError, match="no jaxdist Stack"):
        jaxdist_run({"data": 8}, offload=("activations",))
    one_block = nnx.split(Block(nnx.Rngs(0)))[0]
    full = pytest.raises(jaxdist.ConfigError, match="remat full")
    with full, stack_lib.offloading_activations(True):
        stack_lib.block_apply(one_block, "full")


@pytest.mark.parametrize(
    "mesh_axes, options, message",
    [
        ({"data": 8}, {"offload": "optimizer,weights"}, "weights: not one of optimizer, params"),
        ({"data": 8}, {"offload": ("params",)}, "under fsdp only, and the mesh has fsdp=1"),
        ({"data": 8}, {"offload": ("optimizer",), "strategy": "pmap"}, "pmap keeps one"),
        ({"data": 8}, {"offload": ("activations",)}, f"on cpu \\(jax {jax.__version__}\\)"),
    ],
    ids=["unknown", "params-without-fsdp", "pmap", "activations-on-cpu"],
)
def test_what_cannot_be_offloaded_is_refused(mesh_axes, options, message):
    with pytest.raises(jaxdist.ConfigError, match=message):
        jaxdist.DataParallel(
            lambda: MLP(nnx.Rngs(0)), tx(), loss_fn, mesh=jaxdist.make_mesh(**mesh_axes), **options
        )


def test_the_command_line_flag_keeps_the_trainers_optimizer_state_in_host_memory():
    from jaxdist.train.trainer import train

    run = train(small_config(steps=2, offload="optimizer"), write=False, quiet=True)
    assert kinds(run.state.unpack().opt_state) == {"pinned_host"}
    assert kinds(run.state.unpack().params) == {"device"}
