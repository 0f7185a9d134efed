"""The step in each failure record (``failures.jsonl``) is the step its message names:
a NaN, a bad label, an unreadable row, a replica bit flip, a preemption, through
``jaxdist.train.main`` on a user data module that makes each happen at a known step."""

from __future__ import annotations

import re
import signal
import sys

import pytest

import jaxdist
from helpers import failures_of
from jaxdist.data.row_checks import sample_indices
from jaxdist.train import main as train_main
from test_front_door import COMMON, MLP, no_run_id  # noqa: F401 (autouse)

N, G = 256, 16  # examples, global batch: 16 steps per epoch
USER = """
import os
import signal

import numpy as np

from jaxdist import JaxdistError

STEP_ROWS = {step_rows}  # step -> the examples of its global batch


class Rows:
    def __init__(self, nan_at=0, bad_label_at=0, unreadable_at=0, stop_at=0):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=({n}, 4)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int32)
        if nan_at:
            self.x[STEP_ROWS[nan_at][3], 1] = np.nan
        if bad_label_at:
            self.y[STEP_ROWS[bad_label_at]] = 7  # beyond the 2 classes
        self.unreadable = set(STEP_ROWS[unreadable_at]) if unreadable_at else set()
        self.stop = set(STEP_ROWS[stop_at]) if stop_at else set()

    def __len__(self):
        return {n}

    def __getitem__(self, indices):
        wanted = set(np.asarray(indices).tolist())
        if self.unreadable & wanted:
            raise JaxdistError("an example cannot be read")
        if self.stop & wanted:
            os.kill(os.getpid(), signal.SIGUSR1)  # a scheduler's stop signal, mid-run
        return {{"x": self.x[indices], "y": self.y[indices]}}


def nan(split):
    return Rows(nan_at=5) if split == "train" else None


def bad_label(split):
    return Rows(bad_label_at=3) if split == "train" else None


def unreadable(split):
    return Rows(unreadable_at=4) if split == "train" else None


def plain(split):
    return Rows() if split == "train" else None


def stop(split):
    return Rows(stop_at=3) if split == "train" else None
"""


@pytest.fixture
def user_data(tmp_path, monkeypatch):
    """``front_user:<factory>``: rows of 4 features; the ones of a chosen step go wrong.
    Steps 3 and 4 avoid the rows the setup check samples (it would refuse them first)."""
    sampler = jaxdist.DistributedSampler(N, G, seed=0, process_index=0, process_count=1)
    rows = {k: sampler.global_indices(k - 1).tolist() for k in (3, 4, 5)}
    sampled = set(sample_indices(N).tolist())
    for k in (3, 4):  # a label out of range, an unreadable row: never sampled at setup
        rows[k] = [i for i in rows[k] if i not in sampled][:1]
        assert rows[k], k
    (tmp_path / "front_user.py").write_text(USER.format(n=N, step_rows=rows))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "front_user", raising=False)
    return tmp_path


FLIP = {"JAXDIST_FAULT": "flip@0:3"}  # a bit of a parameter flips before step 3
FAILURES = [  # data, extra flags, environment, exit code, cause, step
    ("nan", [], {}, 1, "nonfinite", 5),
    ("bad_label", [], {}, 2, "bad_input", 3),
    ("unreadable", [], {}, 2, "bad_input", 4),
    ("plain", ["--check-replicas-every", "1"], FLIP, 79, "replica_divergence", 3),
]


@pytest.mark.parametrize("data, flags, env, code, cause, step", FAILURES)
def test_the_failure_record_holds_the_step_its_message_names(
    user_data, capsys, monkeypatch, data, flags, env, code, cause, step
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run_dir = user_data / "run"
    argv = ["--data", f"front_user:{data}", "--in-features", "4", "--num-classes", "2"]
    argv += [*COMMON, "--global-batch-size", str(G), "--steps", "8", "--run-dir", str(run_dir)]
    assert train_main([*argv, *flags]) == code
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"jaxdist: error: step {step}: "), line
    (record,) = failures_of(run_dir)
    assert (record["cause"], record["step"], record["exit_code"]) == (cause, step, code)
    assert record["message"] == line.removeprefix("jaxdist: error: ")


def test_a_preempted_run_records_the_step_it_stopped_after(user_data, capsys):
    run_dir = user_data / "run"
    argv = ["--data", "front_user:stop", "--in-features", "4", "--num-classes", "2"]
    argv += [*COMMON, "--global-batch-size", str(G), "--steps", "8", "--run-dir", str(run_dir)]
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert train_main(argv) == 75
    finally:
        signal.signal(signal.SIGUSR1, previous)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    stopped = int(re.match(r"jaxdist: stopped after step (\d+) on SIGUSR1", line).group(1))
    (record,) = failures_of(run_dir)
    assert (record["cause"], record["step"], record["exit_code"]) == ("preempted", stopped, 75)
    assert (run_dir / "checkpoints" / str(stopped)).is_dir()


# 6. No gloo connection lines from the launcher's ranks.
