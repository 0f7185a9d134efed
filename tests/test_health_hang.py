"""Hangs, through ``python -m jaxdist.launch`` with 2 processes x 4 CPU devices: one
process stops making progress (a stuck data read, an infinite loop in the user's data
source, a deadlocked callback in the user's loss, SIGSTOP) while the other waits in the
next collective. Within the step timeout plus a few seconds every process exits 77,
``hang-report.txt`` names process 1 and holds both processes' stacks (the frozen one's
cannot be read: it says so), ``failures.jsonl`` records it, and no process is left.
And no false alarm: a clean run with a first step and an evaluation each longer than the
step timeout (every evaluation batch far shorter).

Margins a loaded 2-core machine cannot cross: in the hangs the fault comes at step 2, so
the 3 s step deadline times no healthy step (the first compiles, on the slow deadline);
the clean run's deadline is 4 s, where its healthy phases (30 steps, 45 evaluation
batches) take milliseconds; and the bounds on detection, exit and clean-up are generous,
never what a passing test waits for."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import jax
import pytest

import faulty_user
from group_helpers import MLP, gone_within
from helpers import alive, failures_of

TESTS = str(Path(__file__).parent)
STEP_TIMEOUT_S = 3  # the hangs': no healthy step is timed against it (FAULT_STEP)
FAULT_STEP = 2  # the first step compiles, on the slow deadline; the next one stalls
CLEAN_TIMEOUT_S = 4  # the clean run's, below its slow first step and its evaluation
SLOW_S = CLEAN_TIMEOUT_S + 0.5  # sleeps: their length is a lower bound, whatever the load


def train_args(run_dir: Path, *extra: str, devices: int = 4, timeout=STEP_TIMEOUT_S):
    return [
        "--nproc", "2", "--cpu-devices-per-proc", str(devices), "--",
        sys.executable, "-m", "jaxdist.train", *MLP, "--run-dir", str(run_dir),
        "--step-timeout", str(timeout), "--log-every", "1", "--steps", "40",
        "--global-batch-size", "32", "--compile-cache", "off", *extra,
    ]  # fmt: skip


# (fault environment, extra flags, the (file, function) process 1's stacks must show)
SCENARIOS = {
    "stuck data read": (
        {"JAXDIST_FAULT": f"stall-data@1:{FAULT_STEP}"},
        [],
        ("fault_injection.py", "_stalling"),
    ),
    "infinite loop in user code": (
        {},
        ["--data", "faulty_user:spinning"],
        ("faulty_user.py", "__getitem__"),
    ),
    "deadlocked user callback": (
        {},
        ["--loss", "faulty_user:deadlocking"],
        ("faulty_user.py", "_count_and_maybe_deadlock"),
    ),
    "frozen process (SIGSTOP)": ({"JAXDIST_FAULT": f"freeze@1:{FAULT_STEP}"}, [], None),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_stalled_process_is_named_with_stacks(tmp_path, launcher, scenario):
    fault, flags, frame = SCENARIOS[scenario]
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": TESTS, "FAULTY_AT": str(FAULT_STEP), **fault}
    run = launcher(*train_args(run_dir, *flags), env=env)
    run.wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 180, "the first step")
    pids = run.below()
    assert run.proc.wait(timeout=120) == 77, run.text()[-3000:]
    report = (run_dir / "hang-report.txt").read_text()
    culprit = report.splitlines()[2]
    assert culprit.startswith("culprit: process 1 "), report[:2000]
    stacks = report.split("--- stacks of process 1 ---")[1]
    assert "--- stacks of process 0 ---" in report
    if frame is None:  # frozen: it cannot answer, the others say so and name it
        assert "stopped reporting" in culprit and "frozen" in culprit, culprit
        assert "(none: the process did not answer)" in stacks
        assert "[launch] culprit: rank 1 is stopped" in run.text()
    else:  # a frame line: File ".../faulty_user.py", line 40, in __getitem__
        file, function = frame
        lines = stacks.splitlines()
        assert any(f'{file}", line' in x and x.endswith(f"in {function}") for x in lines), stacks
    (failure,) = failures_of(run_dir)
    assert (failure["cause"], failure["process"], failure["exit_code"]) == ("hang", 1, 77)
    assert 0 < failure["detect_s"] < STEP_TIMEOUT_S + 20, failure
    assert gone_within(pids, 15), [p for p in pids if alive(p)]
    # Fault to exit: the deadline, a poll, the stacks collected, and the group ended.
    logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] <= FAULT_STEP, logged  # no step after the stalled one completed


# The clean run's user code (``--loss test_health_hang:slow_first_step``, ``--data
# test_health_hang:slow_eval_reads``): faulty_user's, slower, to stay beyond its deadline.
def _sleep_first(_):
    faulty_user._calls["n"] += 1
    if faulty_user._calls["n"] == 1:
        time.sleep(SLOW_S)


def slow_first_step(model, batch):
    losses = faulty_user._cross_entropy(model, batch)
    jax.debug.callback(_sleep_first, losses, partitioned=True)
    return losses.mean()


EVAL_BATCHES, EVAL_READ_S = 45, 0.1  # SLOW_S in all, each read far below the deadline


def slow_eval_reads(split):
    rows = faulty_user.Rows(EVAL_BATCHES * 32, read_s=EVAL_READ_S)
    return faulty_user.Rows(4096) if split == "train" else rows


def test_no_false_alarm_with_a_slow_first_step_and_a_long_evaluation(tmp_path, launcher):
    """30 steps, the first of SLOW_S s, and an evaluation of 45 batches of 0.1 s: each
    longer than the 4 s step timeout (the evaluation as a whole, each batch far shorter)."""
    run_dir = tmp_path / "run"
    flags = ["--steps", "30", "--eval-every", "30", "--log-every", "10"]
    flags += ["--data", "test_health_hang:slow_eval_reads"]
    flags += ["--loss", "test_health_hang:slow_first_step"]
    args = train_args(run_dir, *flags, devices=2, timeout=CLEAN_TIMEOUT_S)
    run = launcher(*args, env={"PYTHONPATH": TESTS})
    started = time.monotonic()
    assert run.proc.wait(timeout=300) == 0, run.text()[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step_time_s"] > CLEAN_TIMEOUT_S  # the first step: past the deadline
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [30]
    assert not (run_dir / "hang-report.txt").exists()
    assert not (run_dir / "failures.jsonl").exists()
    assert not re.search(r"\bhang\b", run.text())  # "jaxdist: hang: ...", not this module
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert goodput["eval_s"] > CLEAN_TIMEOUT_S, goodput  # the evaluation, as a whole
    print(f"30 steps in {time.monotonic() - started:.1f}s", file=sys.stderr)
