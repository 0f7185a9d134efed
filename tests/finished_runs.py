"""Uninterrupted runs of the trainer with checkpoints, trained once per test session (the
``finished`` fixture of conftest.py) and copied for each test: the reference of
tests/test_checkpoint*.py (their own files: params, metrics.jsonl)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from helpers import metrics_of, small_config
from jaxdist.train.config import from_dict, to_dict
from jaxdist.train.loop import Run
from jaxdist.train.trainer import train

STEPS, EVERY, STOP = 20, 4, 12
FIRST = "first-run"  # the run id of the module's uninterrupted runs (jaxdist.launch's)


def config(run_dir: Path, model=None, *, data=None, optim=None, **train_flags):
    flags = {"steps": STEPS, "checkpoint_every": EVERY, "keep": 10, **train_flags}
    base = to_dict(small_config(**flags))
    base["train"].update(run_dir=str(run_dir), compile_cache="off")
    for section, values in (("model", model), ("data", data), ("optim", optim)):
        base[section].update(values or {})
    return from_dict(base)


def final_params(run) -> dict[str, np.ndarray]:
    return run.dp.host_params(run.state)


def interrupt_after(run_dir: Path, step: int) -> None:
    """What a run stopped after saving ``step`` leaves: no later checkpoint."""
    for path in (run_dir / "checkpoints").iterdir():
        if path.name.isdigit() and int(path.name) > step:
            shutil.rmtree(path)


@dataclass
class Finished:
    """An uninterrupted run: its final state, params and metrics.jsonl records."""

    run: Run
    run_dir: Path
    params: dict[str, np.ndarray]
    metrics: list[dict]


def finished_runs(tmp_path_factory):
    """The ``finished`` fixture: ``finished(tmp_path, model, data=..., **flags)`` gives
    the uninterrupted run of ``config(...)`` (trained at its first use, with run id
    FIRST) and a copy of its run directory in ``tmp_path / "run"`` for the test to
    change."""
    done: dict[str, Finished] = {}

    def copy(tmp_path: Path, model=None, **flags) -> tuple[Finished, Path]:
        key = json.dumps(to_dict(config(Path("run"), model, **flags)), sort_keys=True)
        if key not in done:
            run_dir = tmp_path_factory.mktemp("finished") / "run"
            with pytest.MonkeyPatch.context() as env:
                env.setenv("JAXDIST_RUN_ID", FIRST)
                env.delenv("SLURM_JOB_ID", raising=False)
                run = train(config(run_dir, model, **flags), quiet=True)
            done[key] = Finished(run, run_dir, final_params(run), metrics_of(run_dir))
        shutil.copytree(done[key].run_dir, tmp_path / "run")
        return done[key], tmp_path / "run"

    return copy
