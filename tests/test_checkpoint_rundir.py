"""A run directory is never replaced silently: an earlier run there is resumed, refused
(``--resume never``, no checkpoint, another run id) or replaced only with ``--overwrite``;
a restart of the same run (the same run id) before its first checkpoint trains afresh.
The reference is the uninterrupted run's own files (tests/finished_runs.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from finished_runs import FIRST, STEPS, config, final_params
from helpers import metrics_of
from jaxdist.train.config import ConfigError
from jaxdist.train.trainer import train


def run_as(monkeypatch, launcher_id: str | None) -> None:
    """The run ids this process's runs get: ``jaxdist.launch``'s, or none."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if launcher_id is None:
        monkeypatch.delenv("JAXDIST_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("JAXDIST_RUN_ID", launcher_id)


def test_an_earlier_run_is_never_replaced_silently(tmp_path, finished, monkeypatch):
    _, run_dir = finished(tmp_path)
    run_as(monkeypatch, None)
    with pytest.raises(
        ConfigError, match="has checkpoints .newest: step 20. and --resume is never"
    ):
        train(config(run_dir, resume="never"), quiet=True)
    shutil.rmtree(run_dir / "checkpoints")  # an earlier run with nothing to resume from
    before = (run_dir / "metrics.jsonl").read_text()
    for other in (None, "another-run"):  # no run id, or another run's
        run_as(monkeypatch, other)
        with pytest.raises(ConfigError, match="holds an earlier run .metrics.jsonl, config.yaml."):
            train(config(run_dir), quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == before  # untouched
    fresh = train(config(run_dir, overwrite=True), quiet=True)
    assert fresh.begin.step == 0
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, STEPS + 1))


def test_a_restart_of_the_same_run_before_its_first_checkpoint_trains_afresh(
    tmp_path, finished, monkeypatch, capsys
):
    """The launcher's restart or a requeued job (the same run id) after a crash before
    the first checkpoint: not refused, trained again from step 0 in the same directory."""
    full, run_dir = finished(tmp_path)
    shutil.rmtree(run_dir / "checkpoints")  # what an attempt that saved nothing leaves
    run_as(monkeypatch, FIRST)
    capsys.readouterr()
    again = train(config(run_dir), quiet=True)
    out = capsys.readouterr().out
    assert again.begin.step == 0
    assert (
        f"note: restarting run {FIRST} in {run_dir} from step 0: an earlier attempt reached "
        f"step {STEPS} and saved no checkpoint"
    ) in out, out
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, STEPS + 1))  # replaced
    goodput = json.loads((run_dir / "goodput.json").read_text())  # both attempts counted
    assert len(goodput["attempts"]) == 2 and goodput["recomputed_s"] > 0, goodput
    got = final_params(again)
    for name in full.params:
        np.testing.assert_array_equal(got[name], full.params[name], err_msg=name)
