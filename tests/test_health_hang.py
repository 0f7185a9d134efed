"""Hangs, through ``python -m jaxdist.launch`` with 2 processes x 4 CPU devices: one
process stops making progress (a stuck data read, an infinite loop in the user's data
source, a deadlocked callback in the user's loss, SIGSTOP) while the other waits in the
next collective. Within the step timeout plus a few seconds every process exits 77,
``hang-report.txt`` names process 1 and holds both processes' stacks (the frozen one's
cannot be read: it says so), ``failures.jsonl`` records it, and no process is left.
And no false alarm: a clean run of 200 steps with a slow first step and an evaluation
longer than the step timeout."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from group_helpers import MLP, gone_within
from helpers import alive, failures_of

TESTS = str(Path(__file__).parent)
STEP_TIMEOUT_S = 3


def train_args(run_dir: Path, *extra: str, devices: int = 4) -> list[str]:
    return [
        "--nproc", "2", "--cpu-devices-per-proc", str(devices), "--",
        sys.executable, "-m", "jaxdist.train", *MLP, "--run-dir", str(run_dir),
        "--step-timeout", str(STEP_TIMEOUT_S), "--log-every", "1", "--steps", "40",
        "--global-batch-size", "32", "--compile-cache", "off", *extra,
    ]  # fmt: skip


# (fault environment, extra flags, the (file, function) process 1's stacks must show)
SCENARIOS = {
    "stuck data read": (
        {"JAXDIST_FAULT": "stall-data@1:6"},
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
    "frozen process (SIGSTOP)": ({"JAXDIST_FAULT": "freeze@1:6"}, [], None),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_stalled_process_is_named_with_stacks(tmp_path, launcher, scenario):
    fault, flags, frame = SCENARIOS[scenario]
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": TESTS, **fault}
    run = launcher(*train_args(run_dir, *flags), env=env)
    run.wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the first step")
    pids = run.below()
    assert run.proc.wait(timeout=60) == 77, run.text()[-3000:]
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
    assert 0 < failure["detect_s"] < STEP_TIMEOUT_S + 10, failure
    assert gone_within(pids, 5), [p for p in pids if alive(p)]
    # Fault to exit: the deadline, a poll, the stacks collected, and the group ended.
    logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] < 8, logged  # no step after the stall completed


def test_no_false_alarm_with_a_slow_first_step_and_a_long_evaluation(tmp_path, launcher):
    """200 steps: a first step of 4 s, and an evaluation of 80 batches of 0.05 s, longer
    than the 3 s step timeout as a whole (each batch far shorter)."""
    run_dir = tmp_path / "run"
    flags = ["--steps", "200", "--eval-every", "200", "--log-every", "20"]
    flags += ["--data", "faulty_user:slow_eval_reads", "--loss", "faulty_user:slow_first_step"]
    run = launcher(*train_args(run_dir, *flags, devices=2), env={"PYTHONPATH": TESTS})
    started = time.monotonic()
    assert run.proc.wait(timeout=300) == 0, run.text()[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step_time_s"] > 4  # the first step was slower than the timeout
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [200]
    assert not (run_dir / "hang-report.txt").exists()
    assert not (run_dir / "failures.jsonl").exists()
    assert "hang" not in run.text()
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert goodput["eval_s"] > STEP_TIMEOUT_S, goodput  # the evaluation, as a whole
    print(f"200 steps in {time.monotonic() - started:.1f}s", file=sys.stderr)
