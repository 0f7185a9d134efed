"""A GPT trained on a tokenizer's token files (tokenizer_corpus.py), a model vocabulary
smaller than the tokenizer's refused with both numbers, and a held-out file of another
tokenizer refused naming both fingerprints."""

from __future__ import annotations

import numpy as np

from helpers import metrics_of, run_cli
from jaxdist.data.__main__ import main as data_main
from jaxdist.data.tokens import read_sidecar
from jaxdist.train.trainer import main as train_main
from test_bad_input import error_line
from tokenizer_corpus import EOS, bpe, corpus, prepared  # noqa: F401

GPT = ["--model", "gpt", "--steps", "3", "--log-every", "1", "--seq-len", "16"]
GPT += ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--global-batch-size", "8"]


def test_a_gpt_trains_on_the_tokens_and_a_smaller_vocabulary_is_refused(prepared, tmp_path, capsys):  # noqa: F811
    data = ["--data", str(prepared / "train.bin"), "--eval-data", str(prepared / "eval.bin")]
    run = tmp_path / "run"
    args = [*GPT, *data, "--eval-every", "3", "--run-dir", str(run)]
    proc = run_cli(*args, "--save-params", str(tmp_path / "params.npz"))
    assert proc.returncode == 0, proc.stderr
    last = metrics_of(run)[-1]
    assert last["step"] == 3 and np.isfinite(last["loss"]) and last["eval_count"] > 0
    assert "eval_bpb" not in last  # a tokenizer's ids are not bytes
    shapes = [v.shape for v in np.load(tmp_path / "params.npz").values()]
    assert (512, 16) in shapes  # the tokenizer's 400 ids, padded to 128s
    # --vocab-size below the tokenizer's: refused before anything compiles
    small = tmp_path / "small"
    code = train_main([*GPT, *data, "--vocab-size", "300", "--run-dir", str(small)])
    message = error_line(code, capsys.readouterr().err, ["train.bin", "400", "300"])
    assert "--vocab-size" in message and "tokenizer" in message
    assert not small.exists()
    # and by --dry-run, which reads no data
    code = train_main([*GPT, *data, "--vocab-size", "300", "--dry-run"])
    error_line(code, capsys.readouterr().err, ["train.bin", "400", "300"])


def test_a_held_out_file_of_another_tokenizer_is_refused(prepared, tmp_path, capsys, corpus, bpe):  # noqa: F811
    other = tmp_path / "other" / "tokenizer.json"  # the same vocabulary, another file
    other.parent.mkdir()
    other.write_text(bpe.read_text().replace('"<pad>"', '"<PAD>"'))
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "--out", str(out), "--tokenizer", str(other)]
    assert data_main([*args, "--eos-token", EOS, "--eval-fraction", "0"]) == 0
    capsys.readouterr()
    data = ["--data", str(prepared / "train.bin"), "--eval-data", str(out / "train.bin")]
    code = train_main([*GPT, *data, "--eval-every", "3", "--run-dir", str(tmp_path / "run")])
    fingerprints = [
        read_sidecar(p / "train.bin")["tokenizer"]["fingerprint"] for p in (out, prepared)
    ]
    expected = ["another tokenizer", str(other.resolve()), *fingerprints]
    error_line(code, capsys.readouterr().err, expected)
    assert not (tmp_path / "run").exists()
