"""``--wandb PROJECT[/RUN]`` (jaxdist/sinks/wandb_run.py), run offline and read back with
W&B's own reader of its run files (``wandb leet inspect --json``): the scalars
TensorBoard's files hold, at the same steps and under the same tags, with the values of
metrics.jsonl; the resolved config as the W&B run's config; a resumed run continuing
the same W&B run id with the steps after its checkpoint only; the W&B run ended as
finished, failed or preempted; a W&B error that leaves the run training; bad values and
a missing package as exit 2 before training.

Two in-process runs of a small MLP (about 2 s each): 6 steps with evaluation, then the
same run directory cut back to its step-2 checkpoint and resumed to step 8."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from finished_runs import interrupt_after
from helpers import metrics_of, small_config
from jaxdist.errors import ConfigError
from jaxdist.sinks import Sinks
from jaxdist.sinks.events import Started, Stopped
from jaxdist.sinks.tensorboard import tag
from jaxdist.sinks.wandb_run import ID_FILE, WandbRun
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import main, train
from test_observe import scalars

NEEDS = "--wandb's tests need pip install 'jaxdist[wandb]'"
RESTORED, FIRST_STEPS, RESUMED_STEPS = 2, 6, 8
W_AND_B_OWN = {"_step", "_runtime", "_timestamp"}  # history keys W&B adds to every row


def run_config(run_dir, steps: int):
    return small_config(
        steps=steps, log_every=2, eval_every=2, eval_batch_size=16, checkpoint_every=2,
        keep=10, num_devices=2, run_dir=str(run_dir), wandb="jaxdist-tests/mlp-a",
    )  # fmt: skip


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """W&B offline, silent, its user-wide files under a temporary directory; its
    background service stopped after the module."""
    wandb = pytest.importorskip("wandb", reason=NEEDS)
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.setenv("WANDB_ERROR_REPORTING", "false")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(home / name.lower()))
        wandb.teardown()  # W&B reads its settings once per process: from here on
        yield wandb
        wandb.teardown()


def wandb_records(folder) -> list[dict]:
    """The records of the one ``run-*.wandb`` in ``folder``, by W&B's own reader."""
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode and "No such command" in done.stderr:
        pytest.skip("reading W&B's run files needs wandb >= 0.31 (`wandb leet inspect`)")
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def one(records: list[dict], kind: str) -> dict:
    found = [r[kind] for r in records if r["type"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} records"
    return found[0]


def history(records: list[dict]) -> dict[int, dict]:
    """step -> the values logged at it, W&B's own keys left out."""
    rows = [r["history"] for r in records if r["type"] == "history"]
    return {
        int(row["step"]["num"]): {k: v for k, v in row["item"].items() if k not in W_AND_B_OWN}
        for row in rows
    }


def offline_runs(run_dir) -> list:
    return sorted((run_dir / "wandb").glob("offline-run-*"))  # named by start time


@pytest.fixture(scope="module")
def runs(offline, tmp_path_factory):
    """The first attempt's W&B records, metrics.jsonl and TensorBoard scalars, read before
    the resume; then the run dir after the resumed attempt."""
    run_dir = tmp_path_factory.mktemp("wandb-run") / "run"
    first_config = run_config(run_dir, FIRST_STEPS)
    train(first_config, quiet=True)
    (folder,) = offline_runs(run_dir)
    events = scalars(run_dir / "tb")
    tb = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    first = (wandb_records(folder), metrics_of(run_dir), tb, first_config)
    interrupt_after(run_dir, RESTORED)
    # W&B names a run's folder by its start, to the second: two attempts need two seconds
    time.sleep(1 - time.time() % 1)
    train(run_config(run_dir, RESUMED_STEPS), quiet=True)
    return run_dir, first


def test_wandb_gets_tensorboards_scalars_with_metrics_jsonl_values(runs):
    _, (records, logged, tb, _) = runs
    sent = history(records)
    assert sorted(sent) == [r["step"] for r in logged]  # every logged step, no other
    for record in logged:  # the values themselves, not float32 copies as in TensorBoard
        train = {tag(k): v for k, v in record.items() if k != "step" and k[:5] != "eval_"}
        held_out = {f"eval/{k[5:]}": v for k, v in record.items() if k[:5] == "eval_"}
        assert sent[record["step"]] == train | held_out, record["step"]
    assert "train/loss" in tb and "eval/loss" in tb and "perf/step_time_s" in tb
    from_wandb = {
        t: [(s, pytest.approx(v[t], rel=1e-6)) for s, v in sorted(sent.items()) if t in v]
        for t in {t for values in sent.values() for t in values}
    }
    assert from_wandb == tb  # the same tags, at the same steps, as TensorBoard's files


def test_the_wandb_run_holds_the_resolved_config_project_name_and_id(runs):
    run_dir, (records, _, _, config) = runs
    run = one(records, "run")
    sent = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert sent == json.loads(json.dumps(config_lib.to_dict(config)))
    assert sent["train"]["global_batch_size"] == 16 and sent["optim"]["lr"] == 0.05
    assert (run["project"], run["display_name"]) == ("jaxdist-tests", "mlp-a")
    kept = (run_dir / ID_FILE).read_text().strip()
    assert run["run_id"] == kept and len(kept) == 8
    assert one(records, "exit")["exit_code"] == 0  # finished: wandb.finish was called


def test_a_resumed_run_continues_the_same_wandb_run_after_its_checkpoint(runs):
    run_dir, (first_records, _, _, _) = runs
    folders = offline_runs(run_dir)
    assert len(folders) == 2
    records = wandb_records(folders[1])
    first, resumed = one(first_records, "run"), one(records, "run")
    kept = (run_dir / ID_FILE).read_text().strip()
    assert first["run_id"] == resumed["run_id"] == kept
    assert all(f.name.endswith("-" + kept) for f in folders)
    logged = metrics_of(run_dir)  # steps 1..2 kept at the resume, then the new ones
    after = [r for r in logged if r["step"] > RESTORED]
    sent = history(records)
    assert sorted(sent) == [r["step"] for r in after] and after[-1]["step"] == RESUMED_STEPS
    assert [sent[r["step"]]["train/loss"] for r in after] == [r["loss"] for r in after]
    assert one(records, "exit")["exit_code"] == 0


@pytest.mark.parametrize(
    ("stopped", "exit_code"),
    [(None, 1), (Stopped(1, early=True), 75)],
    ids=["failed", "preempted"],
)
def test_a_failed_or_preempted_run_ends_its_wandb_run(offline, tmp_path, stopped, exit_code):
    sinks = Sinks([WandbRun(tmp_path, "jaxdist-tests")], background=True)
    sinks.emit(Started(total_steps=4, config={"train": {"steps": 4}}))
    sinks.log(1, {"loss": 2.5})
    if stopped is not None:
        sinks.emit(stopped)
    sinks.close(failing=stopped is None)  # as the trainer closes its sinks
    records = wandb_records(*offline_runs(tmp_path))
    assert one(records, "exit")["exit_code"] == exit_code
    assert history(records) == {1: {"train/loss": 2.5}}
    assert any(r["type"] == "preempting" for r in records) == (stopped is not None)


def test_wandb_dir_set_by_the_user_holds_wandbs_files(offline, tmp_path, monkeypatch):
    """WANDB_DIR (a scratch disk, a quota) is where W&B's files go, as W&B itself does;
    the run directory keeps only the run id. Unset, they stay in RUN_DIR/wandb."""
    scratch = tmp_path / "scratch" / "not-yet"
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    sinks = Sinks([WandbRun(tmp_path / "run", "jaxdist-tests")], background=True)
    sinks.log(1, {"loss": 2.5})
    sinks.close()
    assert len(offline_runs(scratch)) == 1
    assert not (tmp_path / "run" / "wandb").exists()
    assert (tmp_path / "run" / ID_FILE).is_file()
    assert history(wandb_records(*offline_runs(scratch))) == {1: {"train/loss": 2.5}}


def test_a_wandb_error_leaves_the_run_training(offline, tmp_path, monkeypatch, capsys):
    calls = []

    def unreachable(**kwargs):
        calls.append(kwargs)
        raise offline.errors.CommError("Network is unreachable")

    monkeypatch.setattr(offline, "init", unreachable)
    sinks = Sinks([WandbRun(tmp_path / "run", "jaxdist-tests")], background=True)
    for step in (1, 2, 3):
        sinks.log(step, {"loss": 1.0})
    sinks.emit(Stopped(3))
    sinks.close()  # raises nothing: a sink's error would end the run
    assert len(calls) == 1  # tried once, then off
    assert "jaxdist: warning: W&B failed (CommError: Network is unreachable)" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("team/proj/run", "more than one '/'"),
        ("/run", "the project name is empty"),
        ("proj/", "the run name after '/' is empty"),
        ("my#proj", "W&B refuses # in a project name"),
        ("a:b?c", "W&B refuses : ? in a project name"),
        ("p" * 129, "has 129 characters; W&B takes at most 128"),
    ],
)
def test_bad_wandb_values_are_config_errors_naming_the_flag(value, said):
    with pytest.raises(ConfigError, match="--wandb") as raised:
        config_lib.parse_args(["--wandb", value])
    assert said in str(raised.value)


def test_a_bad_wandb_value_exits_2_before_anything_runs(tmp_path, capsys):
    assert main(["--run-dir", str(tmp_path / "run"), "--wandb", "team/proj/run"]) == 2
    err = capsys.readouterr().err
    assert "jaxdist: error: --wandb 'team/proj/run': more than one '/'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_wandb_missing_is_exit_2_at_setup(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    args = ["--model", "mlp", "--steps", "2", "--num-devices", "2", "--wandb", "proj"]
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "jaxdist: error: --wandb needs the wandb package: pip install 'jaxdist[wandb]'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()  # nothing trained
    config = config_lib.parse_args(args)  # without a run directory, no W&B: trains
    assert train(config, write=False, quiet=True).history[-1]["step"] == 2
