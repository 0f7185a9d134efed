"""A run resumed by the real trainer, as a person watching it sees it: TensorBoard shows
each step once, goodput.json keeps both attempts and counts the steps done twice, and
the final summary table holds the resumed attempt's figures.

The earlier attempt trains steps 1..5 with a checkpoint every 2 steps; deleting the
checkpoints after step 2 stands for an attempt that reached step 5 but whose later
checkpoints were lost (as in tests/test_checkpoint.py). The resumed attempt, planned to
step 8, restores step 2, compiles with step 3, does steps 4 and 5 again, then 6..8."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from finished_runs import interrupt_after
from helpers import metrics_of, small_config
from jaxdist.train.trainer import train
from test_observe import SUMMARY, expected_summary, scalars, summary_rows

RESTORED, EARLIER_LAST, STEPS = 2, 5, 8


def config(run_dir, steps: int):
    return small_config(
        steps=steps, checkpoint_every=2, keep=10, num_devices=2, run_dir=str(run_dir)
    )


def busy_s(logged: list[dict], steps: range) -> float:
    """Seconds the steps in ``steps`` computed (not waiting for data), logged every step."""
    return sum(r["step_time_s"] - r["data_wait_s"] for r in logged if r["step"] in steps)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(run dir, the earlier attempt's records, what the resumed attempt printed)."""
    run_dir = tmp_path_factory.mktemp("resumed") / "run"
    train(config(run_dir, EARLIER_LAST), quiet=True)
    earlier = metrics_of(run_dir)
    interrupt_after(run_dir, RESTORED)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        train(config(run_dir, STEPS))
    return run_dir, earlier, out.getvalue()


def test_tensorboard_shows_each_step_once_with_the_resumed_attempts_points(resumed):
    run_dir, earlier, _ = resumed
    events = scalars(run_dir / "tb")
    logged = metrics_of(run_dir)  # trimmed to step 2 at the resume, then steps 3..8
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr")):
        points = [(e.step, e.value) for e in events.Scalars(tag)]
        assert points == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged], tag
    # The attempts' learning rates differ after the warm-up (a decay over 5 steps, then
    # over 8), so the points of steps 4 and 5 above are the resumed attempt's.
    for step in range(RESTORED + 2, EARLIER_LAST + 1):
        assert earlier[step - 1]["lr"] != pytest.approx(logged[step - 1]["lr"], rel=1e-3)
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2


def test_goodput_keeps_both_attempts_and_counts_the_steps_done_again(resumed):
    run_dir, earlier, _ = resumed
    goodput = json.loads((run_dir / "goodput.json").read_text())
    first, second = goodput["attempts"]
    assert first["last_step"] == EARLIER_LAST and second["last_step"] == STEPS
    assert first["recomputed_s"] == 0
    logged = metrics_of(run_dir)
    # step 3 compiles (compile_s); 4 and 5 were done before; 6..8 are new
    again = busy_s(logged, range(RESTORED + 2, EARLIER_LAST + 1))
    assert second["recomputed_s"] > 0
    assert second["recomputed_s"] == pytest.approx(again, rel=1e-6)
    assert second["productive_s"] == pytest.approx(
        busy_s(logged, range(EARLIER_LAST + 1, STEPS + 1)), rel=1e-6
    )
    assert goodput["recomputed_s"] == pytest.approx(second["recomputed_s"])
    productive = first["productive_s"] + second["productive_s"]
    assert first["productive_s"] == pytest.approx(busy_s(earlier, range(2, 6)), rel=1e-6)
    assert goodput["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"])
    assert goodput["goodput"] == pytest.approx(productive / goodput["wall_s"])


def test_the_summary_table_shows_the_resumed_attempt(resumed):
    run_dir, _, printed = resumed
    assert f"resumed from the checkpoint of step {RESTORED}" in printed
    scoped = summary_rows(printed)  # a resumed run's labels say what each figure covers
    assert scoped["steps (whole run)"] == "8" and scoped["samples (whole run)"] == "128"
    assert scoped["checkpoints written (this attempt)"] == "3"  # steps 4, 6 and 8
    assert "step time, mean (this attempt)" in scoped and "goodput (whole run)" in scoped
    assert "final loss" in scoped  # the last step's: no scope to say
    rows = {re.sub(r" \((whole run|this attempt)\)$", "", k): v for k, v in scoped.items()}
    assert set(rows) == SUMMARY
    assert expected_summary(run_dir, first_step=RESTORED + 1).items() <= rows.items()
