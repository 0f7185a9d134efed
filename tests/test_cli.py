"""``python -m jaxdist.train`` end to end, and its errors for bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import run_cli, small_config
from jaxdist.train.trainer import train

TINY = ["--model.in_features", "12", "--hidden", "24"]


def test_run_writes_config_and_metrics_and_learns(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "--cpu-devices",
        "8",
        "--strategy",
        "shard_map",
        "--steps",
        "60",
        "--global-batch-size",
        "32",
        "--log-every",
        "10",
        "--lr",
        "0.01",
        "--run-dir",
        str(run_dir),
        *TINY,
    ]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["strategy"] == "shard_map"
    assert config["train"]["global_batch_size"] == 32
    assert config["model"]["hidden"] == 24
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 10, 20, 30, 40, 50, 60]  # the first step too
    for key in ("loss", "lr", "grad_norm", "step_time_s", "samples_per_s"):
        assert all(isinstance(x[key], float) for x in lines), key
    assert all(x["skipped_steps"] == 0 for x in lines)
    assert lines[-1]["loss"] < 0.7 * lines[0]["loss"]
    assert "done: 60 steps" in proc.stdout
    assert f"loss {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f}" in proc.stdout


def test_gpt_logs_tokens_per_second(tmp_path):
    args = [
        "--cpu-devices",
        "2",
        "--model",
        "gpt",
        "--steps",
        "4",
        "--log-every",
        "2",
        "--global-batch-size",
        "4",
        "--seq-len",
        "16",
        "--d-model",
        "32",
        "--dtype",
        "bfloat16",
        "--run-dir",
        str(tmp_path),
    ]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 16)


def test_yaml_config_with_cli_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  steps: 3\n  global_batch_size: 8\noptim:\n  lr: 0.01\n")
    proc = run_cli("--config", str(cfg), "--steps", "2", "--run-dir", str(tmp_path / "r"), *TINY)
    assert proc.returncode == 0, proc.stderr
    saved = yaml.safe_load((tmp_path / "r/config.yaml").read_text())
    assert saved["train"]["steps"] == 2  # CLI beats YAML
    assert saved["train"]["global_batch_size"] == 8
    assert saved["optim"]["lr"] == 0.01


def test_summary_starts_from_the_first_step_when_only_the_last_is_logged(capsys):
    run = train(small_config(steps=3, log_every=3, num_devices=2), write=False)
    first, last = (h["loss"] for h in run.history)
    assert [h["step"] for h in run.history] == [1, 3] and first != last
    assert f"loss {first:.4f} -> {last:.4f}; skipped_steps 0" in capsys.readouterr().out


def test_linear_lr_scaling_is_printed(tmp_path):
    proc = run_cli(
        "--cpu-devices",
        "8",
        "--steps",
        "1",
        "--global-batch-size",
        "64",
        "--lr",
        "0.001",
        "--lr-scaling",
        "linear",
        "--base-batch-size",
        "8",
        "--run-dir",
        str(tmp_path),
        *TINY,
    )
    assert proc.returncode == 0, proc.stderr
    assert "effective lr 0.008 (linear scaling)" in proc.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--cpu-devices", "8", "--global-batch-size", "12"], ["12", "8 devices"]),
        (["--strategy", "ddp"], ["--strategy", "ddp", "pmap", "shard_map", "gspmd"]),
        (["--no-such-flag", "1"], ["unrecognized arguments", "--no-such-flag"]),
        (["--cpu-devices", "2", "--num-devices", "4"], ["4 devices requested", "only 2"]),
        (["--model", "no_such_pkg.models:build"], ["no_such_pkg", "cannot import"]),
        (["--model", "json:nothing_here"], ["has no attribute", "nothing_here"]),
        (["--model", "builtins:repr"], ["repr needs parameter 'obj'", "repr(obj, /)"]),
        (["--model", "builtins:dict"], ["expected a flax.nnx.Module", "got dict"]),
        (["--optimizer", "lamb"], ["lamb", "adamw", "sgd"]),
        (["--steps", "0"], ["train.steps", "in [1, 2147483647]", "got 0"]),
        (["--steps", "ten"], ["--steps", "invalid int value"]),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, args, expected):
    run_dir = tmp_path / "run"
    proc = run_cli(*args, "--run-dir", str(run_dir))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()  # nothing half-written


def test_unknown_yaml_key_names_the_allowed_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  stepz: 3\n")
    proc = run_cli("--config", str(cfg))
    assert proc.returncode == 2
    assert "unknown config key train.stepz" in proc.stderr
    assert "steps" in proc.stderr and "global_batch_size" in proc.stderr


def test_user_model_factory_from_outside_the_package(tmp_path):
    (tmp_path / "my_models.py").write_text(
        "from flax import nnx\n"
        "class Linear(nnx.Module):\n"
        "    def __init__(self, cfg, rngs):\n"
        "        self.dense = nnx.Linear(cfg.in_features, cfg.num_classes, rngs=rngs)\n"
        "    def __call__(self, x):\n"
        "        return self.dense(x)\n"
        "def build(cfg, rngs):\n"
        "    return Linear(cfg, rngs)\n"
    )
    lines = train_user_module(tmp_path, "--model", "my_models:build", "--lr", "0.05")
    assert lines[-1]["loss"] < lines[0]["loss"]


def train_user_module(tmp_path, *args):
    """30 steps on 4 devices from a module in ``tmp_path``; the metrics.jsonl records."""
    run_args = ["--cpu-devices", "4", "--steps", "30", "--log-every", "10", "--run-dir", "out"]
    proc = run_cli(*args, *run_args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]


USER_MODELS = """
import jax
import optax
from flax import linen, nnx


class NNXNet(nnx.Module):
    def __init__(self, cfg, rngs):
        self.dense = nnx.Linear(cfg.in_features, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(16, cfg.num_classes, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.bn(self.dense(x)))))


class LinenNet(linen.Module):
    num_classes: int

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.relu(linen.BatchNorm(use_running_average=not train)(linen.Dense(16)(x)))
        return linen.Dense(self.num_classes)(linen.Dropout(0.1, deterministic=not train)(x))


def nnx_net(cfg, rngs):
    return NNXNet(cfg, rngs)


def linen_net(cfg, rngs):
    return LinenNet(cfg.num_classes)


def smooth_loss(model, batch, rngs):
    logits = model(batch["x"])
    labels = optax.smooth_labels(jax.nn.one_hot(batch["y"], logits.shape[-1]), 0.1)
    return optax.softmax_cross_entropy(logits, labels).mean(), {"custom": logits.mean()}


def per_example_loss(model, batch, rngs):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


class Counter(nnx.Variable):
    pass


class Odd(nnx.Module):
    def __init__(self, cfg, rngs):
        self.dense = nnx.Linear(cfg.in_features, cfg.num_classes, rngs=rngs)
        self.calls = Counter(0)

    def __call__(self, x):
        return self.dense(x)


def odd(cfg, rngs):
    return Odd(cfg, rngs)
"""


@pytest.mark.parametrize("factory", ["nnx_net", "linen_net"])
@pytest.mark.parametrize("strategy", ["gspmd", "pmap"])
def test_user_factory_and_custom_loss(tmp_path, factory, strategy):
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    model = ["--model", f"user_models:{factory}", "--loss", "user_models:smooth_loss"]
    lines = train_user_module(tmp_path, *model, "--strategy", strategy, "--lr", "0.02")
    assert "custom" in lines[0]  # the custom loss's aux metric is logged
    assert lines[-1]["loss"] < lines[0]["loss"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--model", "user_models:nnx_net", "--loss", "user_models:per_example_loss"],
            ["must return a scalar loss", "shape (64,)"],
        ),
        (["--model", "user_models:odd"], ["cannot find the batch statistics", "calls (Counter)"]),
        (["--loss", "user_models:nope"], ["--loss", "has no attribute 'nope'"]),
    ],
)
def test_bad_user_code_is_a_clear_error(tmp_path, args, expected):
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    proc = run_cli(*args, "--steps", "2", "--run-dir", "out", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr)
    assert "Traceback" not in proc.stderr
