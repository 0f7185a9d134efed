"""Data identity across a resume: each checkpoint records a fingerprint of every data
file (size and a hash of sampled blocks, content only); a resume on other contents at
the same path stops with exit 2 naming the file and both fingerprints, unless
``--data-changed ok``, which trains on and says so in the log and in metrics.jsonl. The
same content at another path is the same data: resumed silently."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest

from helpers import metrics_of
from jaxdist.data import fingerprint, write_token_file
from jaxdist.data.fingerprint import BLOCK, BLOCKS, block_offsets, file_fingerprint
from jaxdist.errors import JaxdistError
from jaxdist.report import reader
from jaxdist.train import build_data, resume
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import main
from test_bad_input import GPT, error_line

MLP = ["--in-features", "12", "--num-classes", "5", "--hidden", "16", "--depth", "1"]
MLP += ["--global-batch-size", "16", "--num-devices", "2", "--log-every", "1"]
MLP += ["--checkpoint-every", "2", "--compile-cache", "off", "--no-tensorboard"]


def test_a_fingerprint_is_of_the_content_and_of_sampled_blocks(tmp_path):
    data = np.random.default_rng(0).bytes(3 * BLOCKS * BLOCK + 12345)  # 3 MiB and a bit
    (tmp_path / "a").mkdir()
    original = tmp_path / "a" / "corpus.bin"
    original.write_bytes(data)
    copy = tmp_path / "copy.bin"  # another directory, name, inode and mtime
    shutil.copyfile(original, copy)
    os.utime(copy, (0, 0))
    saved = file_fingerprint(original)
    assert saved == file_fingerprint(copy)
    assert saved["size"] == len(data) and len(saved["blake2b"]) == 32  # 16 bytes, hex

    def changed(at: int) -> dict:
        edited = bytearray(data)
        edited[at] ^= 0xFF
        copy.write_bytes(bytes(edited))
        return file_fingerprint(copy)

    offsets = block_offsets(len(data))
    assert len(offsets) == BLOCKS and offsets[0] == 0 and offsets[-1] == len(data) - BLOCK
    assert changed(offsets[7] + 100) != saved  # one byte inside a sampled block
    assert changed(len(data) - 1) != saved  # the last byte: the last block is sampled
    assert changed(offsets[1] - 1) == saved  # between blocks: the price of not reading all
    copy.write_bytes(data + b"\0")
    assert file_fingerprint(copy) != saved  # one byte longer
    # a small file is read whole: any byte counts
    small = tmp_path / "small.bin"
    small.write_bytes(data[:300_000])
    before = file_fingerprint(small)
    small.write_bytes(data[:150_000] + b"x" + data[150_001:300_000])
    assert file_fingerprint(small) != before
    assert fingerprint.differences({"train": saved}, {"train": {**saved, "path": "x"}}) == []


def test_a_large_file_costs_a_bounded_read(tmp_path, monkeypatch):
    """1 GiB (sparse): 16 blocks of 64 KiB read, 1 MiB, in well under a second."""
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    read = []

    class Counting:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def fileno(self):
            return self.file.fileno()

        def seek(self, offset):
            return self.file.seek(offset)

        def read(self, n):
            read.append(n)
            return self.file.read(n)

    # the module's open (a global that shadows the builtin), its reads counted
    counting = lambda *a: Counting(open(*a))  # noqa: E731, SIM115 - closed by Counting
    monkeypatch.setattr(fingerprint, "open", counting, raising=False)
    started = time.perf_counter()
    print_ = file_fingerprint(big)
    took = time.perf_counter() - started
    assert print_["size"] == 1 << 30
    assert len(read) == BLOCKS and sum(read) == BLOCKS * BLOCK == 1 << 20, read
    assert took < 0.5, took


def write_classes(path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.normal(size=(256, 12)), y=rng.integers(0, 5, 256))


def checkpoint_files(run_dir, step: int) -> dict:
    """The data files' record in the meta of checkpoint ``step``."""
    for path in (run_dir / "checkpoints" / str(step)).rglob("*"):
        if path.is_file() and b'"files"' in path.read_bytes()[:1_000_000]:
            return json.loads(path.read_text())["data"]["files"]
    raise AssertionError(f"no data record in checkpoint {step}")


def test_a_resume_on_changed_data_stops_unless_data_changed_ok(tmp_path, capsys):
    data, run_dir = tmp_path / "train.npz", tmp_path / "run"
    args = [*MLP, "--data", str(data), "--run-dir", str(run_dir)]
    write_classes(data, seed=0)
    assert main([*args, "--steps", "2"]) == 0
    saved = file_fingerprint(data)
    assert checkpoint_files(run_dir, 2) == {"train": {"path": str(data), **saved}}
    write_classes(data, seed=1)  # the same path and shapes, other contents
    found = file_fingerprint(data)
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    code = main([*args, "--steps", "4"])
    expected = [f"--data {data} is not the data the checkpoint of step 2 was trained on"]
    expected += [f"it is {found['size']:,} bytes, blake2b {found['blake2b']}"]
    expected += [f"the checkpoint recorded {saved['size']:,} bytes, blake2b {saved['blake2b']}"]
    expected += ["restore the original file, or pass --data-changed ok"]
    message = error_line(code, capsys.readouterr().err, expected)
    print(message)  # the exact line, for the record (pytest -s)
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing trained
    # --data-changed ok: trained on, said in the log and in metrics.jsonl
    assert main([*args, "--steps", "4", "--data-changed", "ok"]) == 0
    out = capsys.readouterr().out
    assert (
        f"jaxdist: note: resuming at step 2 on changed data (--data-changed ok): --data {data} "
        f"is {fingerprint.describe(found)}, the checkpoint recorded {fingerprint.describe(saved)}"
    ) in out, out
    records = metrics_of(run_dir)
    event = {"event": "data_changed", "step": 2, "role": "train", "file": str(data)}
    event |= {"saved": {"path": str(data), **saved}, "found": {"path": str(data), **found}}
    assert records[2] == event, records
    assert [r["step"] for r in records] == [1, 2, 2, 3, 4]
    assert [r["step"] for r in reader.load(run_dir).records] == [1, 2, 3, 4]  # the report
    assert checkpoint_files(run_dir, 4)["train"]["blake2b"] == found["blake2b"]


def test_the_same_tokens_at_another_path_resume_silently(tmp_path, capsys):
    """Content only: a copy on another file system is the same data (a token file, the
    memory-mapped source; with a held-out file)."""
    ids = np.random.default_rng(2).integers(0, 250, 600)
    for name in ("train", "eval"):
        write_token_file(tmp_path / f"{name}.bin", ids, vocab_size=257, documents=1, sources="")
    args = [*GPT, "--checkpoint-every", "2", "--compile-cache", "off", "--no-tensorboard"]
    args += ["--eval-data", str(tmp_path / "eval.bin"), "--run-dir", str(tmp_path / "run")]
    assert main([*args, "--data", str(tmp_path / "train.bin"), "--steps", "2"]) == 0
    recorded = checkpoint_files(tmp_path / "run", 2)
    assert sorted(recorded) == ["eval", "train"]
    (tmp_path / "moved").mkdir()
    for name in ("train.bin", "train.bin.json"):
        shutil.copyfile(tmp_path / name, tmp_path / "moved" / name)
    capsys.readouterr()
    assert main([*args, "--data", str(tmp_path / "moved" / "train.bin"), "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "resumed from the checkpoint of step 2" in out and "note: resuming" not in out, out
    assert [r["step"] for r in metrics_of(tmp_path / "run")] == [1, 2, 3, 4]


def test_a_checkpoint_without_fingerprints_resumes_unchecked_with_a_note(tmp_path, capsys):
    """An older jaxdist's checkpoint records no fingerprints: one note, no check. A
    changed file at another path names the checkpoint's too."""
    write_classes(tmp_path / "train.npz", seed=0)
    config = config_lib.from_dict(
        {
            "model": {"in_features": 12, "num_classes": 5},
            "data": {"path": str(tmp_path / "train.npz")},
        }
    )
    now = build_data.build(config, "classify", progress=False).fingerprints
    old = {"data": {"step": 4, "seed": 0, "global_batch_size": 16}}
    assert resume._check_data(old, config, 4, now) == []
    out = capsys.readouterr().out
    assert out.count("note: resuming at step 4: the checkpoint records no data fingerprints") == 1
    now = now["train"]
    before = {"path": "/elsewhere/train.npz", "size": now["size"] + 1, "blake2b": "0" * 32}
    with pytest.raises(
        JaxdistError, match=rf"recorded {now['size'] + 1:,} bytes, blake2b 0{{32}} \(of /elsewh"
    ):
        resume._check_data({"data": {"files": {"train": before}}}, config, 4, {"train": now})
