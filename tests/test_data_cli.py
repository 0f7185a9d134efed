"""Real data through ``python -m jaxdist.train``: token files, text, arrays, a user
source, evaluation, the data-wait metric, bad input, and 2 processes."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from helpers import launch, metrics_of, run_cli, run_module
from jaxdist.data import write_token_file

GPT = ["--model", "gpt", "--steps", "3", "--log-every", "1", "--seq-len", "16"]
GPT += ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--global-batch-size", "8"]


@pytest.fixture
def text_folder(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(12):  # 12 files of 2000 bytes: some held out by file
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox. " * 95)
    return folder


def test_text_folder_is_prepared_once_and_evaluated_in_bits_per_byte(tmp_path, text_folder):
    args = [*GPT, "--data", str(text_folder), "--eval-fraction", "0.2", "--eval-every", "3"]
    args += ["--cache-dir", str(tmp_path / "cache")]
    first = run_cli(*args, "--run-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    prepared = list((tmp_path / "cache").glob("text-*/train.bin"))
    assert len(prepared) == 1
    mtime = prepared[0].stat().st_mtime_ns
    second = run_cli(*args, "--run-dir", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert prepared[0].stat().st_mtime_ns == mtime  # reused, not re-tokenised
    last = metrics_of(tmp_path / "a")[-1]
    assert last["eval_count"] > 0 and last["eval_loss"] > 0
    # bits per byte: nats over all targets / ln 2 / byte targets; EOT targets are few
    assert last["eval_bpb"] == pytest.approx(last["eval_loss"] / np.log(2), rel=0.02)
    assert all("data_wait_s" in r for r in metrics_of(tmp_path / "a")[1:])
    assert metrics_of(tmp_path / "a")[-1]["loss"] == metrics_of(tmp_path / "b")[-1]["loss"]


def test_token_files_with_vocabulary_from_the_sidecar(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in [("train", 3000), ("eval", 500)]:
        ids = rng.integers(0, 1000, n).astype(np.uint16)
        write_token_file(tmp_path / f"{split}.bin", ids, vocab_size=1000, documents=1, sources="t")
    proc = run_cli(
        *GPT,
        "--data",
        str(tmp_path / "train.bin"),
        "--eval-data",
        str(tmp_path / "eval.bin"),
        "--eval-every",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        "--save-params",
        str(tmp_path / "params.npz"),
    )
    assert proc.returncode == 0, proc.stderr
    last = metrics_of(tmp_path / "run")[-1]
    assert last["eval_count"] == (500 - 1) // 16  # windows of 17 tokens at stride 16
    embeddings = [v.shape for v in np.load(tmp_path / "params.npz").values()]
    assert (1024, 16) in embeddings  # the sidecar's vocabulary 1000, padded to 128s
    assert "eval_bpb" not in last  # not byte-level text


def test_npz_classification_with_1001_held_out_examples(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "train.npz", x=rng.normal(size=(512, 12)), y=rng.integers(0, 5, 512))
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(1001, 12)), y=rng.integers(0, 5, 1001))
    args = ["--data", str(tmp_path / "train.npz"), "--eval-data", str(tmp_path / "eval.npz")]
    args += ["--in-features", "12", "--num-classes", "5", "--steps", "4", "--eval-every", "4"]
    args += ["--global-batch-size", "32", "--log-every", "1", "--seed", "2"]
    one = run_cli(*args, "--cpu-devices", "1", "--run-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two_procs, _ = launch(
        "--nproc",
        "2",
        "--cpu-devices-per-proc",
        "4",
        "--",
        sys.executable,
        "-m",
        "jaxdist.train",
        *args,
        "--run-dir",
        str(tmp_path / "two"),
    )
    assert two_procs.returncode == 0, two_procs.stdout[-3000:] + two_procs.stderr[-3000:]
    want = metrics_of(tmp_path / "one")[-1]
    assert want["eval_count"] == 1001
    for name in ("two",):  # 8 devices in 2 processes (each 4: 1001 rows over 8 shards)
        got = metrics_of(tmp_path / name)[-1]
        assert got["eval_count"] == 1001, name
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5), name
        assert got["eval_accuracy"] == pytest.approx(want["eval_accuracy"], abs=1e-6), name
        got_losses = [r["loss"] for r in metrics_of(tmp_path / name)]
        want_losses = [r["loss"] for r in metrics_of(tmp_path / "one")]
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)


def test_npz_batches_keep_the_arrays_names(tmp_path):
    """A loss written as batch["image"], batch["label"] (and any other array of as many
    rows) works; --npz-inputs/--npz-labels name what the model's example input and the
    default evaluation read. The loss returns (loss, logits), as flax's examples do."""
    rng = np.random.default_rng(3)
    for name, n in [("train", 256), ("eval", 100)]:
        image = rng.normal(size=(n, 3, 2)).astype(np.float32)
        np.savez(
            tmp_path / f"{name}.npz",
            image=image,
            label=(image[:, 0, 0] > 0).astype(np.int64),
            weight=np.ones(n),
            classes=np.array(["no", "yes"]),  # not rows: left out of the batches
        )
    (tmp_path / "named.py").write_text(
        textwrap.dedent(
            """
            import optax
            from flax import linen

            class Net(linen.Module):  # Linen: initialised on the batch's "image"
                @linen.compact
                def __call__(self, image):
                    return linen.Dense(2)(image.reshape(len(image), -1))

            def net(rngs):
                return Net()

            def loss(model, batch):
                assert set(batch) == {"image", "label", "weight"}, set(batch)
                logits = model(batch["image"])
                losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
                return (losses * batch["weight"]).mean(), logits
            """
        )
    )
    proc = run_cli(
        *["--model", "named:net", "--loss", "named:loss", "--num-classes", "2"],
        *["--data", "train.npz", "--eval-data", "eval.npz", "--eval-every", "4"],
        *["--npz-inputs", "image", "--npz-labels", "label", "--steps", "4"],
        *["--global-batch-size", "32", "--cpu-devices", "2", "--run-dir", "run"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    last = metrics_of(tmp_path / "run")[-1]
    assert last["eval_count"] == 100 and 0 <= last["eval_accuracy"] <= 1
    # the logits are not metrics: only the trainer's own names are logged
    logged = {"loss", "lr", "grad_norm", "step", "step_time_s", "samples_per_s"}
    logged |= {"skipped_steps", "data_wait_s", "data_wait_frac"}
    assert set(last) == logged | {"eval_loss", "eval_accuracy", "eval_count"}


def test_user_data_source(tmp_path):
    (tmp_path / "my_data.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            class Squares:  # a DataSource: __len__, and __getitem__(indices) -> numpy batch
                def __init__(self, n, seed):
                    rng = np.random.default_rng(seed)
                    self.x = rng.normal(size=(n, 4)).astype(np.float32)
                    self.y = (self.x[:, 0] ** 2 > 0.5).astype(np.int32)

                def __len__(self):
                    return len(self.x)

                def __getitem__(self, indices):
                    return {"x": self.x[indices], "y": self.y[indices]}

            def build(split):
                return Squares(640 if split == "train" else 100, seed=split == "eval")
            """
        )
    )
    proc = run_cli(
        "--data",
        "my_data:build",
        "--in-features",
        "4",
        "--num-classes",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "4",
        "--run-dir",
        str(tmp_path / "run"),
        "--cpu-devices",
        "2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert metrics_of(tmp_path / "run")[-1]["eval_count"] == 100


def _files(tmp_path):
    write_token_file(
        tmp_path / "ok.bin", np.arange(300) % 257, vocab_size=257, documents=1, sources="t"
    )
    (tmp_path / "raw.bin").write_bytes(np.arange(300, dtype=np.uint16).tobytes())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_bytes(b"")
    np.savez(tmp_path / "bad.npz", inputs=np.zeros((4, 2)), labels=np.zeros(4))
    return tmp_path


BAD = [
    (["--data", "{d}/missing.bin"], ["missing.bin", "no such token file"]),
    (["--data", "{d}/empty"], ["empty", "0 bytes"]),
    (["--data", "{d}/ok.bin", "--vocab-size", "100"], ["ok.bin", "256", "100"]),
    (["--data", "{d}/ok.bin", "--token-dtype", "uint32"], ["ok.bin", "uint16", "uint32"]),
    (["--data", "{d}/raw.bin"], ["raw.bin", "--vocab-size"]),
    (["--data", "{d}/raw.bin", "--vocab-size", "200"], ["raw.bin", "299", "200"]),
    (["--data", "{d}/ok.bin", "--seq-len", "512"], ["ok.bin", "512", "513", "300"]),
    (
        ["--data", "{d}/ok.bin", "--global-batch-size", "64"],
        ["ok.bin", "18 windows of 17 tokens", "64"],
    ),
    (["--data", "{d}/bad.npz", "--model", "mlp"], ["bad.npz", "inputs", "labels"]),
]


@pytest.mark.parametrize("args, expected", BAD)
def test_bad_data_is_a_clear_error_before_compiling(tmp_path, args, expected):
    d = _files(tmp_path)
    model = [] if "--model" in args else ["--model", "gpt", "--seq-len", "16"]
    proc = run_cli(*model, *[a.format(d=d) for a in args], "--run-dir", str(d / "run"))
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("jaxdist: error:"), proc.stderr
    for word in expected:
        assert word in message, message
    assert "Traceback" not in proc.stderr
    assert not (d / "run").exists()  # nothing written


def test_prepare_command_then_train(tmp_path, text_folder):
    out = tmp_path / "prepared"
    proc = run_module(
        "jaxdist.data", "prepare", str(text_folder), "--out", str(out), "--eval-fraction", "0.2"
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "train.bin").exists() and (out / "eval.bin").exists()
    train = run_cli(
        *GPT,
        "--data",
        str(out / "train.bin"),
        "--eval-data",
        str(out / "eval.bin"),
        "--eval-every",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert train.returncode == 0, train.stderr
    assert "eval_bpb" in metrics_of(tmp_path / "run")[-1]  # byte-level: the sidecar says 257
