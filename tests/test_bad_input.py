"""Bad input ends in exit code 2 and one line, ``jaxdist: error: ...``, naming the key or
file and the numbers: never a traceback, never a silent success, never a run directory.

In-process through ``jaxdist.train.main`` wherever the case fails before a step runs (a
traceback would then be an exception out of ``main``); in a subprocess where the process
itself could die (a truncated memory-mapped file: SIGBUS; tests/test_bad_token_files.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import numpy as np
import pytest

from helpers import small_config
from jaxdist.sinks import MetricsFile, StepMetrics
from jaxdist.train import config as config_lib
from jaxdist.train.config_checks import RANGES
from jaxdist.train.trainer import main, train

GPT = ["--model", "gpt", "--seq-len", "8", "--d-model", "16", "--n-heads", "2", "--n-layers", "1"]
GPT += ["--global-batch-size", "8", "--num-devices", "2", "--log-every", "1"]


def error_line(code: int, err: str, expected: list[str]) -> str:
    """Asserts exit 2 and exactly one error line holding every ``expected`` text."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if "jaxdist: error:" in line]
    assert len(lines) == 1 and lines[0].startswith("jaxdist: error: "), err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in err
    return lines[0]


def run_main(capsys, tmp_path, *args) -> tuple[int, str]:
    code = main(["--run-dir", str(tmp_path / "run"), "--steps", "2", *args])  # args win
    return code, capsys.readouterr().err


# Config values: finite, in range, of their type.


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--lr", "nan"], ["optim.lr (--lr)", "finite", "nan"]),
        (["--lr", "inf"], ["optim.lr (--lr)", "finite", "inf"]),
        (["--lr", "-0.001"], ["optim.lr (--lr)", ">= 0", "-0.001"]),
        (["--weight-decay", "nan"], ["optim.weight_decay", "finite", "nan"]),
        (["--init-timeout=-inf"], ["dist.init_timeout", "finite", "-inf"]),
        (["--min-lr-ratio", "-5"], ["optim.min_lr_ratio", "in [0, 1]", "-5.0"]),
        (["--weight-decay", "-0.1"], ["optim.weight_decay", ">= 0", "-0.1"]),
        (["--momentum", "1"], ["optim.momentum", "in [0, 1)", "1.0"]),
        (["--clip-norm", "-1"], ["optim.clip_norm", ">= 0", "-1.0"]),
        (["--seed", "-1"], ["train.seed (--seed)", "in [0, 9223372036854775807]", "-1"]),
        (["--seed", str(2**63)], ["train.seed", "9223372036854775807]", str(2**63)]),
        (["--in-features", "0"], ["model.in_features", ">= 1", "got 0"]),
        (["--heartbeat-timeout", "0.5"], ["dist.heartbeat_timeout", "in [1, 1000000]"]),
    ],
)
def test_numbers_out_of_range_or_not_finite(tmp_path, capsys, args, expected):
    error_line(*run_main(capsys, tmp_path, *args), expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_zero_learning_rate_is_allowed_and_changes_no_parameter(optimizer):
    """--lr 0 (evaluating a loaded model through the training path, checking the data): the
    run trains its steps and every parameter ends as it began, bit for bit, weight decay
    included (optax and PyTorch scale the decay by the learning rate too)."""
    config = small_config(steps=3, num_devices=2)
    config.optim.lr, config.optim.optimizer = 0.0, optimizer
    run = train(config, write=False, quiet=True)
    first = run.dp.host_params(run.dp.init_state())
    last = run.dp.host_params(run.state)
    assert len(run.history) == 3 and all(math.isfinite(h["loss"]) for h in run.history)
    assert all(h["lr"] == 0 for h in run.history)
    for name, value in first.items():
        np.testing.assert_array_equal(last[name], value, err_msg=name)


def test_steps_fit_the_int32_step_counter():  # parsed only: a regression would train
    with pytest.raises(config_lib.ConfigError, match=r"train.steps .* in \[1, 2147483647\]"):
        config_lib.parse_args(["--steps", "2147483648"])


def test_every_numeric_field_has_a_range():
    numeric = {
        f"{section}.{f.name}"
        for section, f, typ in config_lib._leaf_fields()
        if typ in (int, float)
    }
    assert numeric == set(RANGES)
    for key, value in _defaults().items():
        if key in RANGES:
            assert RANGES[key].holds(value), (key, value)  # every default is allowed


def _defaults() -> dict:
    tree = dataclasses.asdict(config_lib.Config())
    return {f"{s}.{k}": v for s, values in tree.items() for k, v in values.items()}


YAML_CASES = [
    ("train:\n  steps: true\n", ["train.steps", "True (bool) is not an int"]),
    ("train:\n  sync_batch_stats: 1\n", ["train.sync_batch_stats", "1 (int) is not a bool"]),
    ("train:\n  steps: '5'\n", ["train.steps", "'5' (str) is not an int"]),
    ("optim:\n  lr: .nan\n", ["optim.lr", "finite", "nan"]),
    ("optim:\n  momentum: abc\n", ["optim.momentum", "'abc' (str) is not a number"]),
    ("model:\n  loss: [a, b]\n", ["model.loss", "(list) is not text"]),
    ("model:\n  dtype: true\n", ["model.dtype", "True is not one of float32, bfloat16"]),
    ("train:\n  steps: 3\n bad: [\n", ["c.yaml: not valid YAML: line 3, column 2: expected"]),
    ("train: [1, 2\n", ["c.yaml: not valid YAML: line 2, column 1", "expected ',' or ']'"]),
    ("- 1\n- 2\n", ["c.yaml: top level must be a mapping"]),
    (
        'train:\n  steps: !!python/object/apply:os.system ["echo hi"]\n',
        ["c.yaml: not valid YAML: line 2, column 10", "python/object/apply:os.system"],
    ),
]


@pytest.mark.parametrize("text, expected", YAML_CASES)
def test_yaml_values_types_and_syntax(tmp_path, capsys, text, expected):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)  # the error names the file as given
        code = main(["--config", "c.yaml", "--run-dir", str(tmp_path / "run")])
    error_line(code, capsys.readouterr().err, expected)
    assert not (tmp_path / "run").exists()


def test_cli_text_and_yaml_numbers_still_parse(tmp_path):
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 1e-3\n  momentum: 0\ntrain:\n  seed: 7\n")
    args = ["--config", str(tmp_path / "c.yaml"), "--sync-batch-stats", "false"]
    config = config_lib.parse_args([*args, "--steps", "5", "--weight-decay", "1e-4"])
    assert config.optim.lr == 0.001 and config.optim.momentum == 0.0  # YAML 1.1: "1e-3"
    assert config.train.steps == 5 and config.optim.weight_decay == 1e-4
    assert config.train.sync_batch_stats is False and config.train.seed == 7
    assert config_lib.parse_args(["--sync-batch-stats"]).train.sync_batch_stats is True


# Where the run writes.


def test_run_dir_and_save_params_that_cannot_be_written(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["--run-dir", str(a_file)], [f"--run-dir {a_file}: it is a file, not a directory"]),
        (["--run-dir", str(a_file / "run")], [f"{a_file / 'run'}: {a_file} is a file"]),
        (["--save-params", str(a_file / "p.npz")], ["--save-params", f"{a_file} is a file"]),
        (["--save-params", str(tmp_path)], [f"--save-params {tmp_path}: it is a directory"]),
    ]
    for args, expected in cases:
        run_dir = [] if "--run-dir" in args else ["--run-dir", str(tmp_path / "run")]
        code = main([*args, *run_dir, "--steps", "2", "--num-devices", "2"])
        error_line(code, capsys.readouterr().err, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing was made


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_run_dir_in_a_read_only_directory(tmp_path, capsys):
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    try:
        code = main(["--run-dir", str(read_only / "run"), "--steps", "2"])
    finally:
        read_only.chmod(0o700)
    error_line(code, capsys.readouterr().err, [f"{read_only} is not writable"])
    assert not (read_only / "run").exists()


# User modules that fail as they are imported or called.

BROKEN = {
    "raises_on_import": 'raise RuntimeError("boom")\n',
    "bad_syntax": "def build(:\n    pass\n",
    "raises_on_call": (
        "def data(split):\n    raise KeyError('no split ' + split)\n\n\n"
        "def model(rngs):\n    raise ValueError('no model today')\n"
    ),
}


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--model", "raises_on_import:build"],
            ["--model", "importing module 'raises_on_import'", "RuntimeError: boom"],
        ),
        (["--loss", "raises_on_import:f"], ["--loss", "raises_on_import.py:1"]),
        (["--data", "raises_on_import:f"], ["--data", "RuntimeError: boom"]),
        (["--model", "bad_syntax:build"], ["'bad_syntax'", "SyntaxError", "bad_syntax.py, line 1"]),
        (["--data", "raises_on_call:data"], ["--data", "KeyError: 'no split train'", ".py:2"]),
        (["--model", "raises_on_call:model"], ["--model", "ValueError: no model today"]),
    ],
)
def test_user_modules_that_raise(tmp_path, capsys, monkeypatch, args, expected):
    for name, source in BROKEN.items():
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    error_line(*run_main(capsys, tmp_path, *args, "--num-devices", "2"), expected)
    assert not (tmp_path / "run").exists()


# metrics.jsonl stays JSON.


def test_metrics_jsonl_is_strict_json_with_null_for_nan_and_inf(tmp_path):
    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}"))

    metrics_file = MetricsFile(lambda: tmp_path / "metrics.jsonl")
    for record in [
        {"step": 1, "loss": math.nan, "lr": 0.1, "grad_norm": math.inf, "n": 3},
        {"step": 2, "loss": 1.5, "lr": 0.1, "grad_norm": -math.inf, "n": 4},
    ]:
        metrics_file.handle(StepMetrics(record["step"], record))
    metrics_file.close()
    records = [strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 1, "loss": None, "lr": 0.1, "grad_norm": None, "n": 3},
        {"step": 2, "loss": 1.5, "lr": 0.1, "grad_norm": None, "n": 4},
    ]
