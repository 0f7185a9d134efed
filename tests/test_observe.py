"""What a run shows: TensorBoard files read back with TensorBoard's own reader, goodput
that adds up to the wall time measured here, the final summary table against the run's
files, the profiler's trace, and the errors for a bad --profile range. In-process runs of
a small MLP (about a second each), made once and shared with test_report and
test_observe_mfu (MFU); test_observe_resume resumes a run."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import re
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import metrics_of, small_config
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import main, train

EVAL_RUN = dict(steps=7, log_every=2, eval_every=3, eval_batch_size=16, num_devices=8)
PEAK_TFLOPS = 1e-3  # the plain run's --peak-tflops: a CPU has no peak of its own
RUNS: dict = {}  # made once per session: test_report and test_observe_mfu share them


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Two finished runs: 7 steps with evaluation and a profiled window, 4 without eval
    and with a peak (so with MFU). Returns (dirs, wall-clock seconds each took, measured
    here around train(), what each printed)."""
    if not RUNS:  # the fixture, imported by other modules, is one fixture per module
        RUNS["runs"] = _train_runs(tmp_path_factory.mktemp("runs"))
    return RUNS["runs"]


def _train_runs(root):
    dirs = {"eval": root / "with-eval", "plain": root / "no-eval"}
    configs = {
        "eval": small_config(**EVAL_RUN, run_dir=str(dirs["eval"]), profile="4:5"),
        "plain": small_config(
            steps=4, num_devices=2, run_dir=str(dirs["plain"]), peak_tflops=PEAK_TFLOPS
        ),
    }
    walls, printed = {}, {}
    for name, config in configs.items():
        with contextlib.redirect_stdout(io.StringIO()) as out:
            started = time.perf_counter()
            train(config, clock_start=started)
            walls[name] = time.perf_counter() - started
        printed[name] = out.getvalue()
    return dirs, walls, printed


def scalars(log_dir) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


# The rows of the final summary table of any classifier's run (an LM's says tokens).
SUMMARY = {
    "steps",
    "samples",
    "wall time (loop)",
    "first step (compile)",
    "step time, mean",
    "step time, p90",
    "throughput",
    "goodput",
    "checkpoints written",
    "final loss",
}


def summary_rows(printed: str) -> dict[str, str]:
    """The final summary table, the lines after ``done:``: label -> text."""
    table = printed.split("\ndone: ", 1)[1].splitlines()[1:]
    return dict(re.fullmatch(r"  (\S.*?) {2,}(\S.*)", row).groups() for row in table)


def expected_summary(run_dir, first_step: int = 1, batch: int = 16) -> dict[str, str]:
    """The summary's figures as the run's files fix them, for the attempt that started at
    ``first_step`` (wall time and p90 are left out: no file holds them)."""
    logged = [r for r in metrics_of(run_dir) if r["step"] >= first_step]
    goodput = json.loads((run_dir / "goodput.json").read_text())
    steps, timed_s = 0, 0.0  # the steps after the first, which compiles
    for before, r in zip(logged, logged[1:], strict=False):
        steps += r["step"] - before["step"]
        timed_s += r["step_time_s"] * (r["step"] - before["step"])
    last = logged[-1]
    rows = {
        "steps": str(last["step"]),
        "samples": f"{last['step'] * batch:,}",
        "first step (compile)": f"{goodput['attempts'][-1]['compile_s']:.1f} s",
        "step time, mean": f"{timed_s / steps * 1e3:.2f} ms",
        "throughput": f"{steps / timed_s * batch:,.0f} samples/s",
        "goodput": f"{goodput['goodput']:.1%}",
        "checkpoints written": str(goodput["attempts"][-1]["checkpoints"]),
        "final loss": f"{last['loss']:.4f}",
    }
    if "eval_loss" in last:
        rows["final eval loss"] = f"{last['eval_loss']:.4f}"
    return rows


def test_the_final_summary_table_shows_each_runs_figures(runs):
    dirs, _, printed = runs
    for name, extra in (("eval", {"final eval loss"}), ("plain", {"MFU"})):
        rows = summary_rows(printed[name])
        assert set(rows) == SUMMARY | extra, name
        assert expected_summary(dirs[name]).items() <= rows.items(), name
        assert rows["checkpoints written"] == "1"  # the last step's


def test_tensorboard_holds_each_metric_at_the_logged_steps(runs):
    dirs = runs[0]
    events = scalars(dirs["eval"] / "tb")
    logged = [r["step"] for r in metrics_of(dirs["eval"])]
    assert logged == [1, 2, 3, 4, 6, 7]  # first, every 2nd, evaluations (3, 6) and last
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/skipped_steps"):
        assert [e.step for e in events.Scalars(tag)] == logged, tag
    for tag in ("perf/step_time_s", "perf/samples_per_s"):
        assert [e.step for e in events.Scalars(tag)] == logged, tag
    # data wait from the second logged step on: the first one's is part of compiling
    assert [e.step for e in events.Scalars("perf/data_wait_frac")] == logged[1:]
    for tag in ("eval/loss", "eval/accuracy"):
        assert [e.step for e in events.Scalars(tag)] == [3, 6, 7], tag
    losses = [r["loss"] for r in metrics_of(dirs["eval"])]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert "perf/mfu" not in tags and "perf/memory_gb" not in tags  # CPU: no peak, no stats
    config = events.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert '"eval_every": 3' in config and '"strategy": "gspmd"' in config


def test_a_resumed_run_continues_its_tensorboard_run_without_duplicate_steps(tmp_path):
    from tensorboard.summary.writer import event_file_writer

    from jaxdist.sinks import Resumed, Sinks, StepMetrics, TensorBoard

    # The two attempts' files, made within a second in one process, are numbered 9 and 10
    # by the writer's counter: by name, "...10" sorts before "...9" (the names' seconds
    # must tell them apart)
    event_file_writer._global_uid._value = 9
    first = Sinks([TensorBoard(tmp_path)])
    for step in range(1, 11):  # the earlier attempt logged 1..10, its checkpoint was 6
        first.emit(StepMetrics(step, {"loss": 1.0 * step}))
    first.close()
    second = Sinks([TensorBoard(tmp_path)])
    second.emit(Resumed(from_step=6, earlier_last_step=10))
    for step in range(7, 13):
        second.emit(StepMetrics(step, {"loss": 100.0 + step}))
    second.close()
    points = [(e.step, e.value) for e in scalars(tmp_path).Scalars("train/loss")]
    expected = [(s, 1.0 * s) for s in range(1, 7)] + [(s, 100.0 + s) for s in range(7, 13)]
    assert points == expected
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


def test_goodput_parts_add_up_to_the_wall_time_measured_around_the_run(runs):
    dirs, walls, _ = runs
    for name in ("eval", "plain"):
        goodput = json.loads((dirs[name] / "goodput.json").read_text())
        wall = walls[name]
        # The record is final at the Stopped event; closing TensorBoard's file and printing
        # the summary come after it, tens of ms on a loaded machine: 2% of this 1-2 s run.
        slack = 0.02 * wall + 0.05
        assert abs(goodput["wall_s"] - wall) < slack, name
        named = sum(
            v for k, v in goodput.items() if k.endswith("_s") and k not in ("wall_s", "other_s")
        )
        assert abs(named - wall) < slack, json.dumps(goodput)
        logged = metrics_of(dirs[name])
        # Productive time: the steps after the first, from metrics.jsonl's own step times
        # less their data waits.
        steps = [r["step"] for r in logged]
        busy = sum(
            (b - a) * (r["step_time_s"] - r["data_wait_s"])
            for a, b, r in zip(steps, steps[1:], logged[1:], strict=False)
        )
        assert goodput["productive_s"] == pytest.approx(busy, rel=1e-6)
        assert goodput["compile_s"] == pytest.approx(logged[0]["step_time_s"], rel=1e-6)
        assert goodput["goodput"] == pytest.approx(goodput["productive_s"] / goodput["wall_s"])
        assert goodput["eval_s"] > 0 if name == "eval" else goodput["eval_s"] == 0
        assert goodput["last_step"] == steps[-1] and len(goodput["attempts"]) == 1


def test_a_resumed_run_counts_recomputed_steps_and_its_earlier_attempts(tmp_path):
    """Synthetic events on a clock of our own: the earlier attempt reached step 10, the
    checkpoint was step 6, so steps 7..10 are done again (7 while compiling)."""
    from jaxdist.sinks import (
        CheckpointSaved,
        Compiled,
        GoodputFile,
        Resumed,
        Sinks,
        Started,
        StepMetrics,
        Stopped,
        Terminal,
    )
    from jaxdist.sinks.goodput import earlier_last_step

    earlier = {"wall_s": 20.0, "productive_s": 12.0, "startup_s": 8.0, "last_step": 10}
    (tmp_path / "goodput.json").write_text(json.dumps({"attempts": [earlier], "last_step": 10}))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 10}\n{"step": 1')
    assert earlier_last_step(tmp_path) == 10  # read before metrics.jsonl is trimmed
    goodput = GoodputFile(tmp_path, clock_start=100.0)
    terminal = Terminal(goodput)
    sinks = Sinks([goodput, terminal])
    sinks.emit(Resumed(6, earlier_last_step(tmp_path), time_s=101.0))
    sinks.emit(Started(total_steps=12, first_step=7, time_s=102.0))
    sinks.emit(Compiled(7, 3.0, time_s=105.0))
    sinks.emit(StepMetrics(7, {"step": 7, "loss": 2.0}, 1, 3.0, 0.5, True, time_s=105.0))
    # steps 8..11 in 4 s, 0.4 s of it waiting for data: 0.9 s busy per step
    sinks.emit(StepMetrics(11, {"step": 11, "loss": 1.5}, 4, 4.0, 0.4, time_s=109.0))
    sinks.emit(CheckpointSaved(11, 0.5, time_s=109.5))
    sinks.emit(StepMetrics(12, {"step": 12, "loss": 1.0}, 1, 1.0, 0.0, time_s=110.5))
    sinks.emit(CheckpointSaved(12, 0.25, time_s=110.75))
    sinks.emit(Stopped(12, time_s=111.0))
    sinks.close()
    saved = json.loads((tmp_path / "goodput.json").read_text())
    this = saved["attempts"][1]
    assert this["wall_s"] == pytest.approx(11.0)
    assert this["startup_s"] == pytest.approx(2.0) and this["compile_s"] == pytest.approx(3.0)
    assert this["recomputed_s"] == pytest.approx(3 * 0.9)  # steps 8, 9 and 10
    assert this["productive_s"] == pytest.approx(0.9 + 1.0)  # steps 11 and 12
    assert this["data_wait_s"] == pytest.approx(0.4) and this["checkpoint_s"] == 0.75
    assert this["other_s"] == pytest.approx(11.0 - 2 - 3 - 2.7 - 1.9 - 0.4 - 0.75)
    assert saved["wall_s"] == pytest.approx(31.0)
    assert saved["goodput"] == pytest.approx((12.0 + 1.9) / 31.0)
    assert saved["checkpoints"] == 2 and saved["last_step"] == 12
    figures = terminal.summary.figures()
    assert figures["checkpoints"] == 2 and figures["goodput"] == pytest.approx(saved["goodput"])
    assert figures["step_time_mean_s"] == pytest.approx(5.0 / 5)


def test_profile_leaves_a_trace_of_the_window(runs):
    """Steps 4 and 5 (no evaluation in between: it would be most of the trace): the
    .xplane.pb for TensorBoard, and the .trace.json.gz (Chrome's JSON trace format, for
    Perfetto) with those two steps' executions of the training step, no more."""
    window = runs[0]["eval"] / "profile" / "plugins" / "profile"
    traces = list(window.glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    (trace,) = window.glob("*/*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = [e.get("name", "") for e in events]
    # one execution per step, besides one per device ("[3] ...Execute (jit_train_step)")
    steps = [x for x in names if x.endswith("Execute (jit_train_step)") and x[0] != "["]
    assert len(steps) == 2, sorted(set(names))[:50]


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        ("5:3", "--profile 5:3: needs 1 <= START <= STOP, got 5:3"),
        ("0:2", "--profile 0:2: needs 1 <= START <= STOP, got 0:2"),
        ("3:99", "--profile 3:99: step 99 is beyond the last step, 7 (--steps)"),
        ("3", "--profile '3': expected START:STOP"),
    ],
)
def test_a_bad_profile_range_is_exit_2_before_training(tmp_path, capsys, window, expected):
    args = ["--steps", "7", "--run-dir", str(tmp_path / "run"), "--profile", window]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"jaxdist: error: {expected}" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_tensorboard_flag_forms():
    assert config_lib.parse_args([]).train.tensorboard is True
    assert config_lib.parse_args(["--no-tensorboard"]).train.tensorboard is False
    assert config_lib.parse_args(["--tensorboard", "false"]).train.tensorboard is False
    assert config_lib.parse_args(["--no-tensorboard", "--tensorboard"]).train.tensorboard


def test_no_tensorboard_writes_no_event_files(tmp_path):
    train(small_config(steps=2, num_devices=2, run_dir=str(tmp_path), tensorboard=False))
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
    assert not math.isnan(json.loads((tmp_path / "goodput.json").read_text())["goodput"])
