"""The training loop keeps a step queued ahead of the devices: while the device runs step
k, the host has already dispatched step k + 1, whether every step is logged or every
tenth, with health checks on and a run directory written. A loop that waited for each
step before dispatching the next (reading its metrics at once, say) would leave the device
idle during all the host's per-step work; this test then fails.

The device work is made slow by the loss (``slow_device.py``, no jaxdist: ~30 ms a step).
``Parallel.step`` is spied on: when it returns with step k + 1 queued, is step k's result
still pending (``jax.Array.is_ready``)?"""

from __future__ import annotations

import json

import jax
import pytest

import jaxdist
from jaxdist.train.config import from_dict
from jaxdist.train.trainer import train

STEPS = 24


def config(run_dir, log_every: int):
    return from_dict(
        {
            "model": {
                "name": "mlp", "in_features": 12, "hidden": 24, "depth": 2, "num_classes": 5,
                "loss": "slow_device:loss",
            },
            "train": {
                "steps": STEPS, "global_batch_size": 8, "num_devices": 1,
                "log_every": log_every, "run_dir": str(run_dir),
            },
        }
    )  # fmt: skip


@pytest.mark.parametrize("log_every", [1, 10])
def test_the_next_step_is_dispatched_before_the_device_finishes_this_one(
    tmp_path, monkeypatch, log_every
):
    pending_at_next: list[bool] = []  # per step k >= 2: step k - 1 still running then
    previous: list = []

    def spy(self, state, batch):
        out = original(self, state, batch)
        if previous:
            pending_at_next.append(not all(x.is_ready() for x in jax.tree.leaves(previous[-1])))
        previous[:] = [out[1]]  # this step's metrics
        return out

    original = jaxdist.Parallel.step
    monkeypatch.setattr(jaxdist.Parallel, "step", spy)
    train(config(tmp_path / "run", log_every), quiet=True)
    assert len(pending_at_next) == STEPS - 1
    # Step 1 compiles and is timed alone, and its replica check compiles after it: the
    # loop waits for it. From step 2 on, step k + 1 is dispatched while step k runs.
    ahead = pending_at_next[1:]
    assert sum(ahead) >= len(ahead) - 1, ahead

    # Every logged record is there.
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [1, *range(log_every, STEPS + 1, log_every), STEPS]  # the last: always
    assert [r["step"] for r in records] == sorted(set(logged))
