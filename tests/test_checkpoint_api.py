"""Checkpoints in a user's own loop, on the public API only (``DataParallel.save``,
``wait_for_saves``, ``restore``): saving is asynchronous, and a loop restored from a
checkpoint ends bit for bit as the loop that was never stopped."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from ckpt_models import BatchNormDropoutMLP
from flax import nnx

import jaxdist

FEATURES, CLASSES, BATCH = 12, 5, 16


def loss_fn(model, batch, rngs):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


@pytest.fixture(scope="module")
def dp() -> jaxdist.DataParallel:
    """One program for the module: a restarted process would build the same one, and
    each compilation costs seconds here."""
    model = BatchNormDropoutMLP(SimpleNamespace(in_features=FEATURES, num_classes=CLASSES),
                                nnx.Rngs(0))  # fmt: skip
    mesh = jaxdist.make_mesh()
    return jaxdist.DataParallel(model, optax.adam(1e-2), loss_fn, mesh=mesh, strategy="gspmd")


def batch_at(step: int) -> dict[str, np.ndarray]:
    """The global batch of ``step``: a function of the step, as the trainer's sampler."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, CLASSES, BATCH).astype(np.int32)}


def train_steps(dp, state, first: int, last: int):
    for step in range(first, last + 1):
        state, metrics = dp.step(state, jaxdist.shard_batch(batch_at(step), dp.mesh))
        dp.check(metrics, step)
    return state


def host_state(dp, state) -> dict[str, np.ndarray]:
    """Params and BatchNorm statistics as numpy."""
    stats = jax.tree.leaves(dp.unreplicate(state).batch_stats)
    return {**dp.host_params(state), **{f"stats/{i}": np.asarray(s) for i, s in enumerate(stats)}}


def test_a_custom_loop_restored_from_a_checkpoint_ends_bit_for_bit(tmp_path, dp):
    state = train_steps(dp, dp.init_state(), 1, 3)
    dp.save(state, tmp_path / "ckpt", extra={"next_step": 4})  # step 3
    state = train_steps(dp, state, 4, 6)  # the state changes while the save runs
    dp.wait_for_saves()
    want = host_state(dp, state)

    restored, extra = dp.restore(tmp_path / "ckpt")  # read back from the disk
    assert extra == {"next_step": 4}
    assert int(jax.device_get(restored.step)) == 3
    got = host_state(dp, train_steps(dp, restored, extra["next_step"], 6))
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_save_returns_before_the_checkpoint_is_on_disk_and_wait_completes_it(
    tmp_path, monkeypatch, dp
):
    """orbax's background thread renames a step's temporary directory to ``<step>`` once
    its files are written. Holding that rename back makes the check exact, not a race: a
    save that waited for the disk would wait here (10 s) and find ``0`` done below."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    release, commit = threading.Event(), async_checkpointer._on_commit_callback

    def held_commit(*args, **kwargs):
        release.wait(timeout=10)
        return commit(*args, **kwargs)

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", held_commit)
    state = dp.init_state()
    folder = tmp_path / "ckpt"
    dp.save(state, folder)
    while_saving = sorted(p.name for p in folder.iterdir())
    release.set()
    assert "0" not in while_saving, while_saving
    dp.wait_for_saves()
    assert sorted(p.name for p in folder.iterdir()) == ["0"]
    restored, _ = dp.restore(folder)
    want = dp.host_params(state)
    for name, value in dp.host_params(restored).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
