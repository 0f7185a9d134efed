"""The health pieces on their own, without processes: the automatic step deadline, who
is named the culprit of a hang, where the coordination service binds, what a failure
record holds and where it goes, what a failing rank tells the launcher, and fault specs."""

from __future__ import annotations

import json
import threading

import pytest

from jaxdist.cluster import failures
from jaxdist.cluster.environment import ClusterSpec
from jaxdist.cluster.service import service_address
from jaxdist.errors import ConfigError
from jaxdist.health.deadlines import AUTO_FLOOR_S, WARMUP_STEPS, Deadlines
from jaxdist.health.fault_injection import Fault, Faults, parse
from jaxdist.health.hang_report import name_culprit
from jaxdist.health.watchdog import Watchdog


def test_the_automatic_step_deadline_is_20_median_steps_but_at_least_5_minutes(monkeypatch):
    watch = Watchdog(0, 1, Deadlines())
    assert watch.step_deadline_s() == AUTO_FLOOR_S  # before any step: the floor
    clock = [100.0]
    monkeypatch.setattr("jaxdist.health.watchdog.time.monotonic", lambda: clock[0])
    for step in range(1, WARMUP_STEPS + 4):  # 5 warm-up steps of 100 s, then 3 of 20 s
        clock[0] += 100.0 if step <= WARMUP_STEPS else 20.0
        watch.completed(step)
    assert watch.step_deadline_s() == 20 * 20.0  # counted, the 100 s steps would be the median
    fast = Watchdog(0, 1, Deadlines())
    for step in range(1, WARMUP_STEPS + 10):  # 1 s steps: 20 x 1 s is under the floor
        clock[0] += 1.0
        fast.completed(step)
    assert fast.step_deadline_s() == AUTO_FLOOR_S
    assert Watchdog(0, 1, Deadlines(step_s=7)).step_deadline_s() == 7
    slow = Watchdog(0, 1, Deadlines(step_s=7, slow_s=99))
    slow.phase("save", 3)
    assert slow.deadline_s() == 99  # a save is slow whatever the step deadline
    slow.phase("step", 4)
    assert slow.deadline_s() == 7


def record(process, phase, step, done):
    return {"process": process, "host": "h", "pid": 100 + process, "phase": phase,
            "step": step, "in_phase_s": 9.0, "done": done}  # fmt: skip


def stacks(user_frames=()):
    return {"text": "...", "user_frames": list(user_frames)}


def test_the_culprit_is_a_silent_process_first():
    records = {0: record(0, "step", 7, 6), 1: record(1, "step", 3, 2)}
    culprit, why = name_culprit(records, {0: stacks()}, silent={1: 12.5})
    assert culprit == 1 and "stopped reporting 12.5s ago" in why and "frozen" in why


def test_then_the_one_behind_that_is_not_waiting_for_its_devices():
    records = {0: record(0, "step", 7, 6), 1: record(1, "data", 7, 6), 2: record(2, "step", 7, 6)}
    found = {1: stacks(["/home/u/data.py:3 in read (thread jaxdist-prefetch)"])}
    culprit, why = name_culprit(records, found, silent={})
    assert culprit == 1 and "stuck in phase data of step 7" in why
    assert "user code at /home/u/data.py:3 in read" in why


def test_then_the_one_running_user_code():
    records = {i: record(i, "step", 7, 6) for i in range(3)}
    found = {0: stacks(), 1: stacks(), 2: stacks(["/home/u/loss.py:9 in callback (thread ?)"])}
    culprit, why = name_culprit(records, found, silent={})
    assert culprit == 2 and "in user code at /home/u/loss.py:9" in why


def test_else_it_says_no_process_stands_out():
    records = {i: record(i, "step", 7, 6) for i in range(2)}
    culprit, why = name_culprit(records, {0: stacks(), 1: stacks()}, silent={})
    assert culprit == 0 and why.startswith("no single process stands out")


JAX_BIND = {"JAX_COORDINATOR_BIND_ADDRESS": "x:5"}  # JAX's own variable, as the launcher sets


@pytest.mark.parametrize(
    ("spec", "given", "env", "expected"),
    [
        (ClusterSpec("env", "127.0.0.1:29500", 2, 0), "", {}, "127.0.0.1:29500"),
        (ClusterSpec("torch-env", "localhost:1234", 2, 0), "", {}, "127.0.0.1:1234"),
        (ClusterSpec("flags", "127.0.0.1:5", 2, 0), "0.0.0.0:5", {}, "0.0.0.0:5"),  # given
        (
            ClusterSpec("env", "127.0.0.1:5", 2, 0),
            "",
            JAX_BIND,
            "x:5",
        ),
        (ClusterSpec("slurm", None, 8, 0), "", {}, ""),  # JAX picks the coordinator: its default
    ],
)
def test_the_service_binds_to_the_coordinator_address_given(
    monkeypatch, spec, given, env, expected
):
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert service_address(spec, given) in (expected, expected.replace("127.0.0.1", "[::1]"))


def test_a_failure_record_is_appended_but_bad_input_never_makes_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    failures.record(run_dir, failures.Failure("bad_input", "--lr nan"))
    assert not run_dir.exists()  # a run refused at set-up leaves nothing
    failures.record(run_dir, failures.Failure("hang", "stuck", process=1, detect_s=3.2))
    failures.record(run_dir, failures.Failure("corrupt_checkpoint", "12", recovered=True))
    first, second = failures.read(run_dir)
    assert (first["cause"], first["process"], first["exit_code"]) == ("hang", 1, 77)
    assert (second["exit_code"], second["recovered"]) == (None, True)
    assert set(first) >= {"cause", "message", "process", "host", "step", "detect_s", "time"}


def test_the_launcher_names_a_culprit_another_rank_named(tmp_path, monkeypatch):
    monkeypatch.setenv(failures.LAUNCHER_DIR, str(tmp_path))
    monkeypatch.setenv("JAXDIST_PROCESS_ID", "0")
    failures.tell_launcher(failures.Failure("hang", "process 1 froze", process=1))
    told = failures.from_launcher_dir(tmp_path)
    assert json.loads((tmp_path / "rank0.json").read_text())["process"] == 1
    line = failures.culprit_line(0, told, stopped=[])
    assert line == "culprit: rank 1, named by rank 0: process 1 froze"
    assert failures.culprit_line(1, {}, stopped=[1]).startswith("culprit: rank 1 is stopped")
    assert failures.culprit_line(1, {1: {"process": 1, "reported_by": 1}}, stopped=[]) == ""


def test_fault_specs(monkeypatch):
    assert parse("kill@1:5,program@0") == [Fault("kill", 1, 5), Fault("program", 0, 0)]
    with pytest.raises(ConfigError, match="KIND@PROCESS:STEP"):
        parse("explode@1:5")
    mine = Faults(parse("stall-data@1:3,flip@1:4,kill@0:2"), process_index=1)
    assert mine.stall_steps == {3} and set(mine.at_step) == {4} and not mine.program
    assert Faults([], 0).wrap_loss(len) is len  # nothing injected: the same function
    # KIND@PROCESS:STEP:RESTART: only in the group started for that restart
    restarts = parse("kill@1:10:0,kill@1:50:1,flip@1:7")
    assert restarts[1] == Fault("kill", 1, 50, 1) and restarts[2].restart is None
    assert set(Faults(restarts, 1, restart=0).at_step) == {10, 7}
    assert set(Faults(restarts, 1, restart=1).at_step) == {50, 7}
    assert set(Faults(restarts, 1, restart=2).at_step) == {7}
    monkeypatch.setenv("JAXDIST_FAULT", "kill@0:3:1")
    monkeypatch.setenv("JAXDIST_RESTART_COUNT", "1")
    assert set(Faults.from_env(0).at_step) == {3}
    with pytest.raises(ConfigError, match="RESTART"):
        parse("kill@1:5:x")


def test_user_code_is_code_outside_python_its_packages_and_all_of_jaxdist():
    """A hang's culprit is the process with a thread in user code: frames in any jaxdist
    folder (the loop in train/, the step in parallel/) are not user code."""
    import jaxdist.parallel.step
    import jaxdist.train.loop
    from jaxdist.health import hang_report

    for module in (jaxdist.train.loop, jaxdist.parallel.step, hang_report, threading):
        assert not hang_report._is_user_file(module.__file__), module.__file__
    assert hang_report._is_user_file(__file__)  # the tests are the user's code here
