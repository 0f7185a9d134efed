"""Steps that go wrong through ``python -m jaxdist.train``: a NaN under ``--nan-policy
halt`` and ``skip``, a token id beyond the vocabulary in a row the setup check did not
sample, and a loss that raises before the first step (which must write nothing)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import jaxdist
from helpers import run_cli
from jaxdist.data.row_checks import sample_indices
from jaxdist.train.config import from_dict
from jaxdist.train.trainer import train

N, G = 256, 32  # examples, global batch: 8 steps per epoch, so each example once in 4 steps

USER = """
import numpy as np
import optax

STEP2 = {step2}  # the examples of step 2 (the sampler's global batch 1, seed 0)


class Rows:
    def __init__(self, weights):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=({n}, 4)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int32)
        self.w = weights

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        return {{"x": self.x[indices], "y": self.y[indices], "w": self.w[indices]}}


def poisoned(split):  # one row of step 2 weighs NaN: its loss and gradient are NaN
    w = np.ones({n}, np.float32)
    w[STEP2[5]] = np.nan
    return Rows(w) if split == "train" else None


def zeroed(split):  # every row of step 2 weighs 0: a zero gradient, i.e. no update
    w = np.ones({n}, np.float32)
    w[STEP2] = 0.0
    return Rows(w) if split == "train" else None


def weighted_loss(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return (losses * batch["w"]).mean()


def needs_labels(model, batch):
    return model(batch["x"]).mean() + batch["labels"].mean()  # KeyError: there is none


class Tokens:  # an lm source: every id in range but one, in a row the setup check skips
    def __init__(self, bad_example):
        self.tokens = np.arange({n} * 9).reshape({n}, 9) % 200
        self.tokens[bad_example, 3] = 999

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, indices):
        return {{"tokens": self.tokens[indices].astype(np.int32)}}


def tokens(split):
    return Tokens({bad_example}) if split == "train" else None
"""

# SGD at a constant rate, no momentum, decay or clipping: a step with a zero gradient
# leaves the params exactly as a skipped step does.
FLAGS = ["--in-features", "4", "--num-classes", "2", "--hidden", "8", "--depth", "1"]
FLAGS += ["--optimizer", "sgd", "--momentum", "0", "--weight-decay", "0", "--clip-norm", "0"]
FLAGS += ["--warmup-steps", "0", "--min-lr-ratio", "1", "--lr", "0.1"]
FLAGS += ["--global-batch-size", str(G), "--steps", "4", "--log-every", "1"]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    step2 = jaxdist.DistributedSampler(N, G, seed=0, process_index=0, process_count=1)
    step2 = step2.global_indices(1).tolist()
    sampled = set(sample_indices(N).tolist())
    bad_example = next(i for i in range(N) if i not in sampled)
    source = USER.format(n=N, step2=step2, bad_example=bad_example)
    (tmp_path / "health_user.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "health_user", raising=False)
    return tmp_path, bad_example


def test_halt_stops_at_the_nan_step_naming_it_and_a_parameter(user_dir):
    tmp_path, _ = user_dir
    proc = run_cli(
        *FLAGS,
        *["--data", "health_user:poisoned", "--loss", "health_user:weighted_loss"],
        *["--cpu-devices", "2", "--run-dir", "out"],
        cwd=tmp_path,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("jaxdist: error: step 2:"), proc.stderr
    assert "layers/0/kernel" in message or "head/" in message, message
    assert "Traceback" not in proc.stderr
    records = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # step 1 trained and was logged; 2 was not


def test_skip_leaves_out_the_nan_step_exactly(user_dir, capsys):
    def run(data, **train_flags):
        config = from_dict(_config(data, **train_flags))
        return train(config, write=False)

    skipped = run("health_user:poisoned", nan_policy="skip")
    assert [h["skipped_steps"] for h in skipped.history] == [0, 1, 1, 1]
    assert np.isnan(skipped.history[1]["loss"]) and np.isfinite(skipped.history[2]["loss"])
    done = [x for x in capsys.readouterr().out.splitlines() if x.startswith("done:")]
    assert len(done) == 1 and "skipped_steps 1" in done[0], done
    # Independent reference: the same run where step 2's rows weigh 0, so its update is
    # zero, without any skipping; the params must be the same, to the last bit.
    reference = run("health_user:zeroed")
    assert [h["skipped_steps"] for h in reference.history] == [0, 0, 0, 0]
    got, want = skipped.dp.host_params(skipped.state), reference.dp.host_params(reference.state)
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.isfinite(got[name]).all(), name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _config(data: str, **train_flags) -> dict:
    """FLAGS as a config, on 2 of the suite's 8 devices."""
    model = {"in_features": 4, "num_classes": 2, "hidden": 8, "depth": 1}
    optim = {"optimizer": "sgd", "momentum": 0, "weight_decay": 0, "clip_norm": 0}
    optim |= {"warmup_steps": 0, "min_lr_ratio": 1, "lr": 0.1}
    train = {"global_batch_size": G, "steps": 4, "log_every": 1, "num_devices": 2}
    return {
        "model": model | {"loss": "health_user:weighted_loss"},
        "data": {"path": data},
        "optim": optim,
        "train": train | train_flags,
    }


def test_a_token_id_beyond_the_vocabulary_stops_the_run_at_its_step(user_dir):
    tmp_path, bad_example = user_dir
    sampler = jaxdist.DistributedSampler(N, G, seed=0, process_index=0, process_count=1)
    step, row = next(
        (k + 1, int(np.flatnonzero(sampler.global_indices(k) == bad_example)[0]))
        for k in range(N // G)
        if bad_example in sampler.global_indices(k)
    )
    proc = run_cli(
        *["--model", "gpt", "--data", "health_user:tokens", "--seq-len", "8"],
        *["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--cpu-devices", "2"],
        *["--global-batch-size", str(G), "--steps", str(N // G), "--run-dir", "out"],
        cwd=tmp_path,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"jaxdist: error: step {step}: row {row} "), message
    assert "Traceback" not in proc.stderr


def test_a_failing_loss_writes_no_run_directory(user_dir):
    tmp_path, _ = user_dir
    proc = run_cli(
        *["--data", "health_user:zeroed", "--loss", "health_user:needs_labels"],
        *["--in-features", "4", "--num-classes", "2", "--run-dir", "out", "--steps", "2"],
        cwd=tmp_path,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    message = proc.stderr.strip().splitlines()[-1]
    assert "needs_labels" in message and "KeyError" in message, message
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # README: bad input writes nothing
