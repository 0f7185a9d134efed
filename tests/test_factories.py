"""User factories called by parameter name: ``--model pkg.mod:fn`` with ``--model-args``,
model classes, ``--data pkg.mod:fn``; and ``--linen-train-arg``, ``--sync-batch-stats``."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from flax import nnx

from helpers import run_cli
from jaxdist.train.build_model import model_factory
from jaxdist.train.config import ConfigError, from_dict
from jaxdist.train.factories import bind, parse_model_args
from jaxdist.train.trainer import main

MODELS = """
import numpy as np
import optax
from flax import linen, nnx


class Base(nnx.Module):
    def __init__(self, in_features, num_classes, *, widths=(16,), bias=False, rngs):
        sizes = [in_features, *widths]
        self.layers = nnx.List(
            [nnx.Linear(a, b, use_bias=bias, rngs=rngs) for a, b in zip(sizes, sizes[1:])]
        )
        self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


class Net(Base):  # a constructor that passes everything on, as wrappers often do
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def make_net(num_classes, rngs, depth=1):  # make_resnet18(num_classes=10)-style
    return Base(4, num_classes, widths=(8,) * depth, rngs=rngs)


class Rows:
    def __init__(self, n, seed):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 4)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        return {"x": self.x[indices], "y": self.y[indices]}


def rows(*, config, split):  # by name, in neither of the old positional orders
    return Rows(config.train.global_batch_size * 4, seed=split == "eval")


class SyncNet(linen.Module):  # a training flag of its own name, True in eval
    @linen.compact
    def __call__(self, x, is_eval: bool = False):
        x = linen.Dense(8)(x)
        x = linen.BatchNorm(use_running_average=is_eval, axis_name="batch")(x)
        return linen.Dense(2)(linen.relu(x))
"""


def test_model_args_parse_as_yaml_values():
    args = parse_model_args("num_classes=10,widths=[64,64],bias=true,lr=1e-3,name='a,b'")
    assert args == {"num_classes": 10, "widths": [64, 64], "bias": True, "lr": 1e-3, "name": "a,b"}
    cases = [("widths", ["widths", "key=value"]), ("a=1,a=2", ["a", "twice"])]
    cases += [("a=[1,2", ["a=[1,2", "not a YAML value"])]
    for bad, words in cases:
        with pytest.raises(ConfigError) as err:
            parse_model_args(bad)
        assert all(word in str(err.value) for word in words), err.value


def test_classes_are_called_by_the_parameters_of_the_first_real_init(tmp_path, monkeypatch):
    module = _import(tmp_path, monkeypatch, "by_name_models")
    supplied = {"rngs": lambda: nnx.Rngs(0)}
    # Net's own __init__ is (*args, **kwargs): Base's names the parameters
    net = bind(module.Net, "--model m:Net", supplied, {"in_features": 3, "num_classes": 5})()
    assert net.head.kernel.shape == (16, 5) and net.layers[0].kernel.shape == (3, 16)
    with pytest.raises(ConfigError) as err:
        bind(module.Net, "--model m:Net", supplied, {"in_features": 3})
    message = str(err.value)
    assert "--model m:Net" in message and "'num_classes'" in message
    assert "Net(in_features, num_classes, *, widths=(16,), bias=False, rngs)" in message
    with pytest.raises(ConfigError, match=r"make_net takes no parameter 'width'.*depth=1"):
        bind(module.make_net, "--model m:make_net", supplied, {"num_classes": 2, "width": 3})


def test_model_factory_gets_rngs_config_and_model_args(tmp_path, monkeypatch):
    _import(tmp_path, monkeypatch, "by_name_models2")
    config = from_dict(
        {"model": {"name": "by_name_models2:make_net", "model_args": "num_classes=3,depth=2"}}
    )
    model = model_factory(config.model, seed=0)()
    assert [layer.kernel.shape for layer in model.layers] == [(4, 8), (8, 8)]
    assert model.head.kernel.shape == (8, 3)
    again = model_factory(config.model, seed=0)()  # rngs = nnx.Rngs(seed): deterministic
    np.testing.assert_array_equal(again.head.kernel.get_value(), model.head.kernel.get_value())
    with pytest.raises(ConfigError, match="only for a factory"):
        model_factory(from_dict({"model": {"model_args": "a=1"}}).model, seed=0)


def test_class_and_data_factory_by_name_through_the_cli(tmp_path):
    (tmp_path / "cli_models.py").write_text(MODELS)
    proc = run_cli(
        *["--model", "cli_models:Net", "--data", "cli_models:rows", "--cpu-devices", "2"],
        *["--model-args", "in_features=4,num_classes=2,widths=[8,6],bias=true"],
        *["--steps", "3", "--global-batch-size", "16", "--eval-every", "3"],
        *["--run-dir", "out", "--save-params", "params.npz"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    shapes = {k: v.shape for k, v in np.load(tmp_path / "params.npz").items()}
    assert shapes["layers/0/kernel"] == (4, 8) and shapes["layers/1/kernel"] == (8, 6)
    assert shapes["layers/1/bias"] == (6,) and shapes["head/kernel"] == (6, 2)
    last = json.loads((tmp_path / "out/metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval_count"] == 64  # rows(config=..., split="eval"): 4 global batches


def test_model_args_errors_name_the_factory_and_parameter(tmp_path, monkeypatch, capsys):
    _import(tmp_path, monkeypatch, "cli_errors")
    cases = [
        (["--model-args", "num_classes=2,width=3"], ["make_net", "'width'", "depth=1"]),
        ([], ["make_net", "'num_classes'", "--model-args"]),
    ]
    for args, words in cases:
        code = main(["--model", "cli_errors:make_net", *args, "--run-dir", str(tmp_path / "r")])
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and message.startswith("jaxdist: error: --model cli_errors:make_net")
        assert all(word in message for word in words), message
        assert not (tmp_path / "r").exists()


def test_linen_train_arg_and_sync_batch_stats_reach_the_step(tmp_path, monkeypatch, capsys):
    _import(tmp_path, monkeypatch, "linen_flags")
    args = ["--model", "linen_flags:SyncNet", "--data", "linen_flags:rows", "--num-devices", "2"]
    args += ["--strategy", "shard_map", "--steps", "1", "--global-batch-size", "8"]
    # is_eval is no name jaxdist knows: without --linen-train-arg the model is refused
    assert main([*args, "--run-dir", str(tmp_path / "a")]) == 2
    assert "--linen-train-arg" in capsys.readouterr().err
    flags = ["--linen-train-arg", "!is_eval", "--sync-batch-stats"]
    assert main([*args, *flags, "--run-dir", str(tmp_path / "b")]) == 0
    # SyncBatchNorm: the model's axis "batch" is the data axis, not a trivial one
    assert "'batch' -> the data axis" in capsys.readouterr().out


def _import(tmp_path, monkeypatch, name: str):
    """``MODELS`` as module ``name`` (unique per test: modules are cached by name)."""
    import importlib
    import sys

    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)
