"""A checkpoint saved from a sharded layout (data=4,model=2: the GPT's columns and rows
split over model; fsdp=8: every large array split 8 ways) holds the state itself: restored
on data=8 it is the saver's state, array by array, bit for bit, and the training that
follows on data=8 equals the saver's own next step."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from jaxdist.losses import next_token_loss
from jaxdist.models import GPT

VOCAB, SEQ = 64, 16


def make_dp(mesh: str) -> jaxdist.Parallel:
    sizes = dict(part.split("=") for part in mesh.split(","))
    return jaxdist.Parallel(
        lambda: GPT(VOCAB, SEQ, 32, 2, 4, attention="xla", rngs=nnx.Rngs(0)),
        # SGD with momentum: optimizer state to save, and no Adam normalisation that turns
        # rounding in a near-zero gradient into a large step on another layout
        optax.sgd(0.1, momentum=0.9),
        next_token_loss,
        mesh=jaxdist.make_mesh(**{k: int(v) for k, v in sizes.items()}),
    )


def batch(step: int, dp) -> dict:
    tokens = np.random.default_rng(step).integers(0, VOCAB, (16, SEQ + 1), dtype=np.int32)
    return jaxdist.shard_batch({"tokens": tokens}, dp.mesh)


def host_state(dp, state) -> dict[str, np.ndarray]:
    one = dp.unreplicate(state)
    return {
        jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path((one.params, one.opt_state))
    }


@pytest.mark.parametrize("mesh", ["data=4,model=2", "fsdp=8", "data=2,fsdp=2,model=2"])
def test_a_sharded_checkpoint_restores_on_data_parallel(tmp_path, mesh):
    saver = make_dp(mesh)
    state = saver.init_state()
    for step in (1, 2):
        state, _ = saver.step(state, batch(step, saver))
    sharded = [x for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated]
    assert sharded, "the layout under test shards nothing"
    saver.save(state, tmp_path / "ckpt")
    saver.wait_for_saves()
    want = host_state(saver, state)
    state, _ = saver.step(state, batch(3, saver))
    want_next = saver.host_params(state)

    reader = make_dp("data=8")
    restored, _ = reader.restore(tmp_path / "ckpt")
    got = host_state(reader, restored)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    restored, _ = reader.step(restored, batch(3, reader))
    for name, value in reader.host_params(restored).items():
        np.testing.assert_allclose(value, want_next[name], rtol=2e-5, atol=1e-6, err_msg=name)
