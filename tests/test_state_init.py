"""The initial state: made by one compiled program in the strategy's layout, from the
user's model without consuming it, and equal to the params flax alone builds."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist

WIDTH = 256  # 4 layers of 256 x 256 float32: 1 MiB of params, 3 MiB of state with Adam


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


def loss_fn(model, batch):
    return (model(batch["x"]) ** 2).mean()


def batch():
    return {"x": np.random.default_rng(0).normal(size=(16, WIDTH)).astype(np.float32)}


def nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("strategy", ["pmap", "shard_map", "gspmd"])
def test_users_model_survives_training_and_init_state_can_be_called_again(strategy):
    model = Wide(nnx.Rngs(0))
    before = {k: np.array(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}
    mesh = jaxdist.make_mesh(data=8)
    dp = jaxdist.DataParallel(model, optax.adam(1e-2), loss_fn, mesh=mesh, strategy=strategy)
    state = dp.init_state()
    for _ in range(2):  # donates the state it is given
        state, _ = dp.step(state, jaxdist.shard_batch(batch(), mesh))
    # The user's arrays are alive and unchanged...
    for path, var in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(var.get_value()), before[path])
    model(batch()["x"])
    # ... and a second initial state is the first one again.
    again = dp.unreplicate(dp.init_state())
    for path, var in nnx.to_flat_state(again.params):
        np.testing.assert_array_equal(np.asarray(var.get_value()), before[path])


@pytest.mark.parametrize("strategy", ["pmap", "gspmd"])
def test_init_never_holds_more_than_one_copy_per_device(strategy):
    """With pmap's 8 copies, device 0 holds its own copy only: the init program's bytes
    per device (arguments + outputs + temporaries - aliased) stay under 2 copies."""
    model = Wide(nnx.Rngs(0))
    mesh = jaxdist.make_mesh(data=8)
    dp = jaxdist.DataParallel(model, optax.adam(1e-2), loss_fn, mesh=mesh, strategy=strategy)
    one_copy = nbytes(dp.unreplicate(dp.init_state()))  # params + Adam's mu, nu: ~3 MiB
    assert one_copy > 3 * WIDTH * WIDTH * 4 * 4 * 0.9
    memory = dp.lower_init().compile().memory_analysis()
    per_device = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    assert per_device < 2 * one_copy, (per_device, one_copy)
    # Each device holds one copy of the state, and device 0 no more than the others.
    state = dp.init_state()
    on_device = {d: 0 for d in mesh.devices.flat}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            on_device[shard.device] += shard.data.nbytes
    assert set(on_device.values()) == {one_copy}


def flax_alone(seed: int) -> dict[str, np.ndarray]:
    """The params flax alone makes: ``Wide(nnx.Rngs(seed))`` built in one jitted program,
    as tests/test_initial_state_layouts.py builds the GPT (no jaxdist code)."""
    params = jax.jit(lambda: nnx.state(Wide(nnx.Rngs(seed)), nnx.Param))()
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def test_a_model_function_is_built_inside_the_program():
    """DataParallel(fn): the state is created on the devices; it holds what flax alone
    builds, as does the state of a model built eagerly and handed over."""
    mesh = jaxdist.make_mesh(data=8)
    tx = optax.adam(1e-2)
    eager = jaxdist.DataParallel(Wide(nnx.Rngs(3)), tx, loss_fn, mesh=mesh)
    lazy = jaxdist.DataParallel(lambda: Wide(nnx.Rngs(3)), tx, loss_fn, mesh=mesh)
    memory = lazy.lower_init().compile().memory_analysis()
    assert memory.argument_size_in_bytes == 0  # nothing comes from the host
    want = flax_alone(3)
    assert max(abs(v).max() for v in want.values()) > 0.1  # drawn, not zeros
    for dp in (lazy, eager):
        got = dp.host_params(dp.init_state())
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
