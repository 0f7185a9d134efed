"""``prepare --tokenizer``'s bad input as one line that writes nothing: each unreadable
tokenizer, end of document or text, and a missing tokenizers package naming the extra;
a byte-level prepare does not import tokenizers (tokenizer_corpus.py: the corpus)."""

from __future__ import annotations

import subprocess
import sys

from jaxdist.data.__main__ import main as data_main
from jaxdist.data.tokens import read_sidecar
from test_bad_input import error_line
from tokenizer_corpus import EOS, bpe, corpus  # noqa: F401


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, corpus, bpe, capsys):  # noqa: F811
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "vocab.json").write_text("{}")
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"model": 1}')
    (tmp_path / "badconfig").mkdir()
    (tmp_path / "badconfig" / "tokenizer.json").write_bytes(bpe.read_bytes())
    (tmp_path / "badconfig" / "tokenizer_config.json").write_text("eos?")
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_text("fine")
    (tmp_path / "latin1" / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    d = str(tmp_path)
    cases = [
        ([str(corpus), "--tokenizer", f"{d}/missing.json"], ["missing.json", "no such file"]),
        ([str(corpus), "--tokenizer", f"{d}/empty_folder"], ["a folder without tokenizer.json"]),
        ([str(corpus), "--tokenizer", f"{d}/slow"], ["without tokenizer.json", "vocab.json"]),
        ([str(corpus), "--tokenizer", f"{d}/garbage.json"], ["garbage.json", "not JSON"]),
        ([str(corpus), "--tokenizer", f"{d}/other.json"], ["other.json", "tokenizers package"]),
        (
            [str(corpus), "--tokenizer", f"{d}/badconfig"],
            ["tokenizer_config.json", "not readable JSON"],
        ),
        (
            [str(corpus), "--tokenizer", str(bpe)],
            ["no end-of-document token", "tokenizer_config.json", "config.json", EOS],
        ),
        (
            [str(corpus), "--tokenizer", str(bpe), "--eos-token", "<nope>"],
            ["--eos-token '<nope>' is not a token", EOS],
        ),
        ([str(corpus), "--eos-token", EOS], ["--eos-token", "is for --tokenizer"]),
        (
            [f"{d}/latin1", "--tokenizer", str(bpe), "--eos-token", EOS],
            ["b.txt", "not UTF-8", "0xe9", "offset 3"],
        ),
    ]
    for i, (args, expected) in enumerate(cases):
        out = tmp_path / f"out{i}"
        code = data_main(["prepare", *args, "--out", str(out)])
        captured = capsys.readouterr()
        error_line(code, captured.err, expected)
        assert not out.exists(), (args, list(out.iterdir()))


def test_a_missing_tokenizers_package_names_the_extra(tmp_path, corpus, bpe, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    out = tmp_path / "out"
    code = data_main(["prepare", str(corpus), "--out", str(out), "--tokenizer", str(bpe)])
    error_line(code, capsys.readouterr().err, ["tokenizers package", "pip install 'jaxdist[text]'"])
    assert not out.exists()


def test_byte_level_prepare_does_not_import_tokenizers(tmp_path, corpus):  # noqa: F811
    script = (
        "import sys; from jaxdist.data.__main__ import main; "
        f"code = main(['prepare', {str(corpus)!r}, '--out', {str(tmp_path / 'out')!r}]); "
        "assert code == 0; assert 'tokenizers' not in sys.modules, 'imported'; print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr
    assert read_sidecar(tmp_path / "out" / "train.bin")["vocab_size"] == 257
