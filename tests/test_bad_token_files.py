"""Bad token files end in exit code 2 and one ``jaxdist: error: ...`` line naming the
file and the numbers (the conventions of tests/test_bad_input.py): a sidecar field of the
wrong type, an id beyond the vocabulary that a lying sidecar would hide, a file truncated
while training (a subprocess: reading it unchecked would be SIGBUS)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import run_module
from jaxdist.data import write_token_file
from jaxdist.data.row_checks import sample_indices
from jaxdist.train import build_data
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import main
from test_bad_input import GPT, error_line, run_main


def test_sidecar_field_of_the_wrong_type(tmp_path, capsys):
    path = write_token_file(
        tmp_path / "t.bin", np.arange(200) % 50, vocab_size=257, documents=1, sources="t"
    )
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    (tmp_path / "t.bin.json").write_text(json.dumps(meta | {"vocab_size": "abc"}))
    code, err = run_main(capsys, tmp_path, *GPT, "--data", str(path))
    error_line(code, err, [f"{path}.json: field 'vocab_size' is 'abc', not an int >= 1"])


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_sidecar_claiming_a_low_max_token_does_not_hide_an_id(tmp_path, capsys, split):
    """An id beyond the vocabulary in a row the setup check does not sample, in a file
    whose sidecar says max_token 199: stopped when read, naming the file and example."""
    n = 128  # examples of 8 tokens + 1; 4 global batches of 32
    bad = next(i for i in range(n) if i not in set(sample_indices(n).tolist()))
    tokens = np.arange(n * 8 + 1) % 200
    good = write_token_file(tmp_path / "ok.bin", tokens, vocab_size=257, documents=1, sources="")
    tokens[bad * 8 + 3] = 1000
    path = write_token_file(tmp_path / "lie.bin", tokens, vocab_size=2000, documents=1, sources="")
    meta = json.loads((tmp_path / "lie.bin.json").read_text())  # a wrong max_token
    (tmp_path / "lie.bin.json").write_text(json.dumps(meta | {"vocab_size": 257, "max_token": 199}))
    data = [str(path), str(good)] if split == "train" else [str(good), str(path)]
    args = [*GPT, "--data", data[0], "--eval-data", data[1], "--global-batch-size", "32"]
    code = main([*args, "--steps", "4", "--eval-every", "4", "--run-dir", str(tmp_path / "run")])
    expected = [f"{path}: example {bad} has token id 1000 at position {bad * 8 + 3}"]
    expected += ["vocabulary of 257", "max_token 199 is wrong"]
    message = error_line(code, capsys.readouterr().err, expected)
    if split == "train":
        assert message.startswith("jaxdist: error: step "), message


def test_token_files_get_the_per_step_batch_check(tmp_path):
    path = write_token_file(
        tmp_path / "t.bin", np.arange(100), vocab_size=257, documents=1, sources=""
    )
    config = config_lib.from_dict(
        {"model": {"name": "gpt", "seq_len": 8}, "data": {"path": str(path)}}
    )
    check = build_data.build(config, "lm", progress=False).row_check  # DataParallel's batch_check
    assert check({"tokens": np.array([[1, 256], [1, 257]])}).tolist() == [True, False]


TRUNCATING_RUN = """
import os
import sys

from jaxdist.data import tokens
from jaxdist.cluster.shutdown import exit_now
from jaxdist.train.trainer import main

path, calls, read = sys.argv[1], [0], tokens.TokenWindows.__getitem__


def truncating_read(self, indices):  # the 8th read (a training batch) finds it cut short
    calls[0] += 1
    if calls[0] == 8:
        os.truncate(path, 64)
    return read(self, indices)


tokens.TokenWindows.__getitem__ = truncating_read
exit_now(main(sys.argv[2:]))
"""


def test_a_token_file_truncated_while_training_is_named(tmp_path):
    tokens = np.arange(1024 * 8 + 1) % 200  # 4 pages: reading the last 3 would be SIGBUS
    path = write_token_file(tmp_path / "t.bin", tokens, vocab_size=257, documents=1, sources="")
    size = path.stat().st_size
    (tmp_path / "truncating_run.py").write_text(TRUNCATING_RUN)
    args = [*GPT, "--data", str(path), "--steps", "30", "--run-dir", "out", "--cpu-devices", "2"]
    proc = run_module("truncating_run", str(path), *args, cwd=tmp_path)
    expected = [f"{path} changed while in use: it was {size} bytes when opened, now 64"]
    message = error_line(proc.returncode, proc.stderr, expected)
    assert message.startswith("jaxdist: error: step "), message
    assert "Bus error" not in proc.stderr and "Fatal Python error" not in proc.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "out/metrics.jsonl").open()]
    assert steps and steps[-1] < 30  # it trained, then stopped
