"""Byte-level text preparation, python -m jaxdist.data, and the stdlib corpus."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import run_module
from jaxdist.data import (
    BYTE_VOCAB,
    EOT,
    TokenWindows,
    collect_files,
    default_cache_dir,
    prepare,
    read_sidecar,
    stdlib_corpus,
)
from jaxdist.data import text as text_lib
from jaxdist.errors import JaxdistError

# Text.


CORPUS = {
    "a.txt": b"alpha\n",
    "b.py": b"print('b')\n",
    "sub/c.txt": "gamma \u00e9\n".encode(),
    "sub/deeper/d.md": b"# d\n",
    "sub/e.txt": b"",
    "f.txt": b"foxtrot" * 50,
    "g.txt": b"golf",
    "h.txt": b"hotel",
}


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    for name, data in {**CORPUS, ".hidden": b"no", ".git/config": b"no"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _decode(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2")


def _expected(names) -> np.ndarray:
    parts = [np.append(np.frombuffer(CORPUS[name], np.uint8), EOT) for name in names]
    return np.concatenate(parts).astype(np.uint16)


def test_prepare_train_decodes_to_the_files_and_separators(corpus, tmp_path):
    paths = prepare([str(corpus)], tmp_path / "out", progress=False)
    assert set(paths) == {"train"} and not (tmp_path / "out" / "eval.bin").exists()
    meta = read_sidecar(paths["train"])
    names = sorted(CORPUS)  # hidden files and folders skipped
    assert meta["files"] == names and meta["documents"] == len(CORPUS)
    assert meta["vocab_size"] == BYTE_VOCAB and meta["max_token"] == EOT
    np.testing.assert_array_equal(_decode(paths["train"]), _expected(names))
    assert sorted(os.listdir(tmp_path / "out")) == ["train.bin", "train.bin.json"]


def test_eval_split_is_by_file_and_independent_of_input_order(corpus, tmp_path):
    files = [str(corpus / name) for name in CORPUS]
    first = prepare(files, tmp_path / "one", eval_fraction=0.3, progress=False)
    second = prepare(files[::-1], tmp_path / "two", eval_fraction=0.3, progress=False)
    train, held = (read_sidecar(first[name])["files"] for name in ("train", "eval"))
    assert train and held and set(train).isdisjoint(held) and set(train) | set(held) == set(files)
    # By name: crc32 bucket below 30%; if no name falls there, the lowest bucket (both
    # splits always get a file; the names depend on the temporary path).
    buckets = {f: zlib.crc32(f.encode()) % 10_000 for f in files}
    want = [f for f in sorted(files) if buckets[f] < 3000] or [min(files, key=buckets.get)]
    assert held == want
    for name in ("train", "eval"):
        assert first[name].read_bytes() == second[name].read_bytes()
    rel = {str(corpus / name): name for name in CORPUS}
    np.testing.assert_array_equal(_decode(first["eval"]), _expected(rel[f] for f in held))
    np.testing.assert_array_equal(_decode(first["train"]), _expected(rel[f] for f in train))


def test_held_out_gives_both_splits_a_file():
    keys = [f"file{i}.txt" for i in range(20)]
    assert sum(text_lib.held_out(keys, 1e-9)) == 1
    assert sum(text_lib.held_out(keys, 0.99999)) == 19
    assert text_lib.held_out(keys, 0.0) == [False] * 20


def test_collect_files_folder_glob_single_and_dedup(corpus):
    every = sorted(corpus / name for name in CORPUS)
    assert collect_files([str(corpus)]) == every
    assert collect_files([str(corpus / "**" / "*.txt")]) == sorted(
        corpus / name for name in CORPUS if name.endswith(".txt")
    )
    assert collect_files([str(corpus / "g.txt")]) == [corpus / "g.txt"]
    assert collect_files([str(corpus / "a.txt"), str(corpus), str(corpus / "*.py")]) == every
    with pytest.raises(JaxdistError, match=r"nothing\*\.zip: matches no file"):
        collect_files([str(corpus), str(corpus / "nothing*.zip")])


def test_empty_corpus_errors(tmp_path, corpus, monkeypatch):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_bytes(b"")
    with pytest.raises(JaxdistError, match=r"empty: the corpus is empty \(1 files, 0 bytes\)"):
        prepare([str(tmp_path / "empty")], tmp_path / "out", progress=False)
    (tmp_path / "empty" / "b.txt").write_bytes(b"only in eval")
    monkeypatch.setattr(text_lib, "held_out", lambda keys, fraction: [False, True])
    with pytest.raises(JaxdistError, match=r"empty: the train split is empty"):
        prepare([str(tmp_path / "empty")], tmp_path / "out", eval_fraction=0.5, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_single_file_holds_out_its_tail(tmp_path):
    (tmp_path / "book.txt").write_bytes(bytes(range(200)) * 5)  # 1000 bytes
    paths = prepare(
        [str(tmp_path / "book.txt")], tmp_path / "out", eval_fraction=0.1, progress=False
    )
    train = np.fromfile(paths["train"], np.uint16)
    held = np.fromfile(paths["eval"], np.uint16)
    whole = np.frombuffer(bytes(range(200)) * 5, np.uint8)
    np.testing.assert_array_equal(train, np.append(whole[:900], EOT))  # first 90%, then EOT
    np.testing.assert_array_equal(held, np.append(whole[900:], EOT))  # the last 10%


def test_an_error_midway_leaves_no_temp_files_and_the_old_output(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    old = prepare([str(corpus / "a.txt")], out, progress=False)["train"].read_bytes()
    real = text_lib._tokenise

    def failing(path):
        if path.name == "f.txt":
            raise JaxdistError(f"{path}: cannot read: simulated")
        return real(path)

    monkeypatch.setattr(text_lib, "_tokenise", failing)
    with pytest.raises(JaxdistError, match="simulated"):
        prepare([str(corpus)], out, eval_fraction=0.3, progress=False)
    assert sorted(os.listdir(out)) == ["train.bin", "train.bin.json"]
    assert (out / "train.bin").read_bytes() == old


def _cli(*args, cwd):
    return run_module("jaxdist.data", *args, cwd=cwd, timeout=120)


def test_cli_prepare_writes_files_and_exits_2_on_a_missing_input(corpus, tmp_path):
    proc = _cli("prepare", "corpus", "--out", "out", "--eval-fraction", "0.3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "train:" in proc.stdout and "eval:" in proc.stdout and "tokens" in proc.stdout
    for name in ("train.bin", "train.bin.json", "eval.bin", "eval.bin.json"):
        assert (tmp_path / "out" / name).is_file()
    proc = _cli("prepare", "corpus", "missing.txt", "--out", "out2", cwd=tmp_path)
    assert proc.returncode == 2
    assert "jaxdist: error: missing.txt: matches no file" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out2").exists()


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXDIST_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("JAXDIST_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "jaxdist"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "jaxdist"


# The stdlib corpus: ~30 MB read once for the module.


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, stdlib_corpus(cache, progress=False)


def test_stdlib_corpus_splits_by_file(stdlib):
    _, paths = stdlib
    train, held = read_sidecar(paths["train"]), read_sidecar(paths["eval"])
    assert train["documents"] > 500 and held["documents"] >= 1
    assert set(train["files"]).isdisjoint(held["files"])
    assert all(name.endswith(".py") and "site-packages" not in name for name in train["files"])
    assert 0.005 < held["num_tokens"] / (train["num_tokens"] + held["num_tokens"]) < 0.1
    windows = TokenWindows(paths["train"], 256, vocab_size=BYTE_VOCAB)
    assert len(windows) == (train["num_tokens"] - 1) // 256
    assert (_decode(paths["eval"]) == EOT).sum() == held["documents"]


def test_stdlib_corpus_is_reused_without_reading(stdlib, monkeypatch):
    cache, paths = stdlib
    stamps = {path: path.stat().st_mtime_ns for path in paths.values()}

    def no_reading(path):
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr(text_lib, "_tokenise", no_reading)
    assert stdlib_corpus(cache, progress=False) == paths
    assert {path: path.stat().st_mtime_ns for path in paths.values()} == stamps
