"""What a user meets first, through the real commands: a report comparing a language
model with a classifier, a bad flag as one line, ``python -m jaxdist.data prepare``'s
held-out file by default, rerunning a run's ``config.yaml`` and no gloo chatter from
``python -m jaxdist.launch`` (the step in failure records: ``test_failure_records.py``).

Runs are in-process (``jaxdist.train.main`` on 2 of the suite's 8 devices, a second or
two each); the launcher and one bad flag run as the real commands."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import yaml

from helpers import launch, metrics_of, run_cli
from jaxdist.data.__main__ import main as data_main
from jaxdist.report import main as report_main
from jaxdist.train import config as config_lib
from jaxdist.train import main as train_main

COMMON = ["--num-devices", "2", "--log-every", "1", "--compile-cache", "off"]
GPT = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--d-model", "16"]
GPT += ["--n-heads", "2", "--n-layers", "1", "--global-batch-size", "8"]
MLP = ["--in-features", "8", "--hidden", "16", "--global-batch-size", "16"]


@pytest.fixture(autouse=True)
def no_run_id(monkeypatch):
    """Default run directories are named by the clock, not by a launcher's or SLURM's id."""
    monkeypatch.delenv("JAXDIST_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.fixture(scope="module")
def lm_and_classifier(tmp_path_factory):
    """A 6-step GPT run (tokens/s) and a 6-step MLP run (samples only), both finished."""
    root = tmp_path_factory.mktemp("front-door")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("JAXDIST_RUN_ID", raising=False)
        env.delenv("SLURM_JOB_ID", raising=False)
        for name, flags in (("gpt", GPT), ("mlp", MLP)):
            argv = [*COMMON, *flags, "--steps", "6", "--run-dir", str(root / name)]
            assert train_main(argv) == 0, name
    return root / "gpt", root / "mlp"


# 1. The report on a language model's run and a classifier's.


def test_report_compares_a_language_model_with_a_classifier(lm_and_classifier, tmp_path):
    gpt, mlp = lm_and_classifier
    assert "tokens_per_s" in metrics_of(gpt)[-1] and "tokens_per_s" not in metrics_of(mlp)[-1]
    out = tmp_path / "report.html"
    assert report_main([str(gpt), str(mlp), "--out", str(out)]) == 0
    page = out.read_text()
    charts = ("loss-step", "loss-seen", "throughput", "step-time", "goodput")
    assert sorted(p.name for p in tmp_path.glob("report-*.png")) == sorted(
        f"report-{c}.png" for c in charts
    )
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(charts)
    # each run's own throughput, a dash for the unit the other run does not have
    assert re.search(r"<tr><td>tokens/s</td><td>[\d,]+</td><td>-</td></tr>", page), page
    assert re.search(r"<tr><td>samples/s</td><td>-</td><td>[\d,]+</td></tr>", page), page
    assert "<td>model.name</td><td>gpt</td><td>mlp</td>" in page
    assert page.count("<td>6 of 6</td>") == 2


# 2. A bad flag: one line, exit 2, nothing written.


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--stepz", "3"],
            "jaxdist: error: unrecognized arguments: --stepz 3; did you mean --steps? "
            "(python -m jaxdist.train --help lists the flags)",
        ),
        (
            ["--no-such-flag"],
            "jaxdist: error: unrecognized arguments: --no-such-flag "
            "(python -m jaxdist.train --help lists the flags)",
        ),
        (
            ["--steps", "abc"],
            "jaxdist: error: argument --steps/--train.steps: invalid int value: 'abc'",
        ),
        (
            ["--strategy", "ddp"],
            "jaxdist: error: argument --strategy/--train.strategy: invalid choice: 'ddp' "
            "(choose from 'pmap', 'shard_map', 'gspmd')",
        ),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path, capsys, args, line):
    assert train_main([*args, "--run-dir", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line] and captured.out == ""
    assert not (tmp_path / "run").exists()


def test_the_command_prints_one_line_for_a_bad_flag_and_the_full_help(tmp_path):
    bad = run_cli("--global-batch-sise", "8", "--run-dir", str(tmp_path / "run"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "jaxdist: error: unrecognized arguments: --global-batch-sise 8; did you mean "
        "--global-batch-size? (python -m jaxdist.train --help lists the flags)"
    ]
    assert not (tmp_path / "run").exists()
    helped = run_cli("--help")
    assert helped.returncode == 0 and helped.stderr == ""
    assert helped.stdout.startswith("usage: python -m jaxdist.train")
    for flag in ("--global-batch-size", "--train.global_batch_size", "--no-tensorboard"):
        assert flag in helped.stdout


# 3. python -m jaxdist.data prepare holds out the trainer's share by default.


def test_prepare_writes_eval_bin_by_default_as_the_trainer_holds_out(tmp_path, capsys):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox. " * 20)
    out = tmp_path / "prepared"
    assert data_main(["prepare", str(folder), "--out", str(out)]) == 0
    for name in ("train.bin", "train.bin.json", "eval.bin", "eval.bin.json"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("train: 5 files,") and printed[0].endswith(f"-> {out}/train.bin")
    assert printed[1].startswith("eval: 1 files,") and printed[1].endswith(f"-> {out}/eval.bin")
    assert printed[2] == (
        f"next: python -m jaxdist.train --model gpt --data {out}/train.bin "
        f"--eval-data {out}/eval.bin --eval-every 200"
    )
    # the same default as the trainer's --eval-fraction, read from one place
    from jaxdist.data.text import EVAL_FRACTION

    assert config_lib.DataConfig().eval_fraction == EVAL_FRACTION == 0.02


def test_prepare_says_in_one_line_when_nothing_can_be_held_out(tmp_path, capsys):
    (tmp_path / "note.txt").write_text("too short")  # 2% of 9 bytes: not one byte
    out = tmp_path / "prepared"
    assert data_main(["prepare", str(tmp_path / "note.txt"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "train.bin.json"]
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("jaxdist")]
    assert notes == [
        "jaxdist: note: no eval.bin: too few files or too little text to hold out 0.02 of "
        "it (by file; a single file: its tail), so all of it is in train.bin; give more "
        "text, or train without --eval-data"
    ]


# 4. A run's config.yaml reruns as a new run; with --run-dir it continues the run.


def test_rerunning_a_runs_config_starts_a_new_run_and_run_dir_continues_it(
    lm_and_classifier, tmp_path, monkeypatch
):
    run = tmp_path / "A"
    shutil.copytree(lm_and_classifier[1], run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    monkeypatch.chdir(tmp_path)
    assert train_main(["--config", "A/config.yaml", "--steps", "4"]) == 0
    (new,) = (tmp_path / "runs").iterdir()  # runs/mlp-gspmd-<time>
    assert [r["step"] for r in metrics_of(new)] == [1, 2, 3, 4]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    saved = before["config.yaml"].decode()  # says how to continue its run instead
    assert saved.startswith("#") and f"--run-dir {lm_and_classifier[1]} to continue" in saved
    settings = yaml.safe_load(saved)
    settings["train"]["steps"] = 4
    assert yaml.safe_load((new / "config.yaml").read_text()) == settings  # only --steps
    assert settings["train"]["run_dir"] == "" and settings["train"]["overwrite"] is False
    # the same file with the run's directory continues that run from its checkpoint
    assert train_main(["--config", "A/config.yaml", "--run-dir", "A", "--steps", "8"]) == 0
    assert [r["step"] for r in metrics_of(run)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert metrics_of(run)[:6] == [json.loads(x) for x in before["metrics.jsonl"].splitlines()]
    assert (run / "checkpoints" / "8").is_dir()


def test_the_launcher_shows_no_gloo_lines(tmp_path):
    proc, _ = launch(
        *["--nproc", "2", "--cpu-devices-per-proc", "2", "--", sys.executable, "-m"],
        *["jaxdist.train", "--steps", "3", "--run-dir", str(tmp_path / "run"), *MLP],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[Gloo]" not in proc.stdout + proc.stderr
    assert "[rank 1] process 1/2: 2 local of 4 cpu devices" in proc.stdout
    assert [r["step"] for r in metrics_of(tmp_path / "run")] == [1, 3]


def test_gloo_lines_are_dropped_even_when_its_threads_interleave_them():
    from jaxdist.launch.rank_output import GlooLines

    gloo = GlooLines()
    lines = [
        b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
        b"ranks is : 1\n",
        # two threads at once, as seen from a 2-process run: one line, then the other's
        # newline alone
        b"[Gloo] Rank 2[Gloo] Rank  is connected to 33 is connected to 3 peer ranks.  peer "
        b"ranks. Expected number of connected peer ranks is : Expected number of connected "
        b"peer ranks is : 33\n",
        b"\n",
        b"\n",  # a blank line of the rank's own
        b"[Gloo] Rank 1 is NOT connected to: [0]\n",  # a missing peer: kept
        b"42\n",
        b"step 3/3  loss 2.3769\n",
    ]
    assert [gloo.drop(x) for x in lines] == [True, True, True, False, False, False, False]
