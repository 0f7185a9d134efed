"""jaxdist.data: token files, byte-level text preparation, the stdlib corpus, npz."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import run_module
from jaxdist.data import (
    BYTE_VOCAB,
    EOT,
    NpzArrays,
    TokenWindows,
    collect_files,
    default_cache_dir,
    prepare,
    read_sidecar,
    stdlib_corpus,
    write_token_file,
)
from jaxdist.data import text as text_lib
from jaxdist.data import tokens as tokens_lib
from jaxdist.errors import JaxdistError


def _write(path: Path, tokens, vocab_size=1000) -> Path:
    return write_token_file(path, tokens, vocab_size=vocab_size, documents=1, sources="test")


def _raw(path: Path, tokens: np.ndarray) -> Path:
    path.write_bytes(tokens.tobytes())  # no sidecar, like a nanoGPT .bin
    return path


# Token files.


def test_round_trip_gives_the_original_windows_with_stride_seq_len(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.uint16)
    path = _write(tmp_path / "t.bin", tokens)
    assert path.stat().st_size == 2 * 5000  # uint16 for a vocabulary <= 65536
    meta = read_sidecar(path)
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == 5000
    assert meta["max_token"] == tokens.max() and meta["vocab_size"] == 1000

    windows = TokenWindows(path, 64, vocab_size=1000)
    assert len(windows) == (5000 - 1) // 64 == 78
    assert windows.num_tokens == 5000 and windows.vocab_size == 1000 and windows.path == path
    batch = windows[np.array([0, 5, 77])]["tokens"]
    assert batch.dtype == np.int32 and batch.shape == (3, 65)
    for row, i in enumerate([0, 5, 77]):
        np.testing.assert_array_equal(batch[row], tokens[i * 64 : i * 64 + 65])
    # Every token after the first is a target exactly once per epoch.
    every = windows[np.arange(len(windows))]["tokens"]  # (78, 65)
    np.testing.assert_array_equal(every[:-1, -1], every[1:, 0])
    np.testing.assert_array_equal(every[:, 1:].reshape(-1), tokens[1 : 1 + 78 * 64])
    with pytest.raises(IndexError):
        windows[np.array([78])]


def test_large_vocabulary_is_written_as_uint32(tmp_path):
    tokens = np.array([0, 70_000, 5, 99_999, 3], np.int64)
    path = _write(tmp_path / "big.bin", tokens, vocab_size=100_000)
    assert path.stat().st_size == 4 * 5 and read_sidecar(path)["dtype"] == "uint32"
    windows = TokenWindows(path, 2)  # dtype from the sidecar
    np.testing.assert_array_equal(windows[[0, 1]]["tokens"], [[0, 70_000, 5], [5, 99_999, 3]])


def test_dtype_auto_without_sidecar_is_uint16_and_explicit_uint32_reads_uint32(tmp_path):
    tokens = np.arange(100, dtype=np.uint32) * 1000
    path = _raw(tmp_path / "raw.bin", tokens.astype("<u4"))
    np.testing.assert_array_equal(
        TokenWindows(path, 9, dtype="uint32")[[1]]["tokens"][0], tokens[9:19]
    )
    as_uint16 = TokenWindows(path, 9)  # auto: no sidecar, so uint16, twice the tokens
    assert as_uint16.num_tokens == 200 and as_uint16.vocab_size is None


def test_npy_input_with_header_dtype(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 300, 1000).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    windows = TokenWindows(tmp_path / "t.npy", 100, vocab_size=300)
    assert len(windows) == 9
    np.testing.assert_array_equal(windows[[3]]["tokens"][0], tokens[300:401])
    with pytest.raises(
        JaxdistError, match=r"t\.npy: dtype uint16 was asked for.*header says int32"
    ):
        TokenWindows(tmp_path / "t.npy", 100, dtype="uint16")


def test_dtype_that_contradicts_the_sidecar_names_both(tmp_path):
    path = _write(tmp_path / "t.bin", np.arange(10))
    with pytest.raises(
        JaxdistError, match=r"t\.bin: dtype uint32 was asked for.*sidecar says uint16"
    ):
        TokenWindows(path, 4, dtype="uint32")


def test_odd_byte_size_names_size_and_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 4097)
    with pytest.raises(JaxdistError, match=r"odd\.bin: 4097 bytes .* uint16"):
        TokenWindows(path, 8)
    path.write_bytes(b"\x01" * 4098)
    with pytest.raises(JaxdistError, match=r"odd\.bin: 4098 bytes .* uint32"):
        TokenWindows(path, 8, dtype="uint32")


@pytest.mark.parametrize("sidecar", [False, True])
def test_vocab_overflow_names_file_id_position_and_vocabulary(tmp_path, monkeypatch, sidecar):
    monkeypatch.setattr(tokens_lib, "SCAN_CHUNK_TOKENS", 1000)  # several chunks
    tokens = np.full(5000, 7, np.uint16)
    tokens[1234], tokens[4321] = 300, 300  # the first occurrence is reported
    path = tmp_path / "v.bin"
    _write(path, tokens) if sidecar else _raw(path, tokens)
    message = (
        rf"v\.bin: token id 300 at position 1234 exceeds the model's vocabulary of {BYTE_VOCAB}"
    )
    with pytest.raises(JaxdistError, match=message):
        TokenWindows(path, 16, vocab_size=BYTE_VOCAB)
    assert len(TokenWindows(path, 16, vocab_size=301)) == 4999 // 16


def test_negative_ids_in_a_signed_npy_are_an_error(tmp_path):
    tokens = np.zeros(50, np.int64)
    tokens[17] = -3
    np.save(tmp_path / "neg.npy", tokens)
    with pytest.raises(JaxdistError, match=r"neg\.npy: token id -3 at position 17 is negative"):
        TokenWindows(tmp_path / "neg.npy", 4, vocab_size=10)


def test_too_short_empty_missing_and_stale_sidecar(tmp_path):
    path = _raw(tmp_path / "x.bin", np.zeros(700, np.uint16))
    with pytest.raises(
        JaxdistError, match=rf"length 1024 needs at least 1025 tokens; {path} has 700"
    ):
        TokenWindows(path, 1024)
    assert len(TokenWindows(path, 699)) == 1
    empty = _raw(tmp_path / "empty.bin", np.zeros(0, np.uint16))
    with pytest.raises(JaxdistError, match="empty.bin has 0"):
        TokenWindows(empty, 1)
    with pytest.raises(JaxdistError, match=r"nope\.bin: no such token file"):
        TokenWindows(tmp_path / "nope.bin", 8)
    stale = _write(tmp_path / "s.bin", np.arange(100))
    _raw(stale, np.arange(50, dtype=np.uint16))
    with pytest.raises(JaxdistError, match=r"says 100 tokens but .*s\.bin holds 50"):
        TokenWindows(stale, 8)


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
    assert held == [f for f in sorted(files) if zlib.crc32(f.encode()) % 10_000 < 3000]
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


# npz arrays.


def test_npz_arrays(tmp_path):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(10, 3, 2)), rng.integers(0, 4, 10)
    y[0] = 6
    np.savez(tmp_path / "d.npz", x=x, y=y, extra=np.zeros(3))
    data = NpzArrays(tmp_path / "d.npz")
    assert len(data) == 10 and data.num_classes == 7 and data.in_features == (3, 2)
    batch = data[np.array([4, 0])]
    assert batch["x"].dtype == np.float32 and batch["x"].shape == (2, 3, 2)
    assert batch["y"].dtype == np.int32 and batch["y"].tolist() == [y[4], 6]
    np.testing.assert_allclose(batch["x"], x[[4, 0]], rtol=1e-6)
    np.savez(tmp_path / "named.npz", images=x[:4], classes=y[:4].astype(np.uint8))
    named = NpzArrays(tmp_path / "named.npz", inputs="images", labels="classes")
    assert len(named) == 4 and named[[1]]["y"].tolist() == [y[1]]


def test_npz_errors(tmp_path):
    np.savez(tmp_path / "keys.npz", a=np.zeros((4, 2)), b=np.zeros(4, int))
    with pytest.raises(JaxdistError, match=r"keys\.npz: no array named x, y; it has a, b"):
        NpzArrays(tmp_path / "keys.npz")
    np.savez(tmp_path / "rows.npz", x=np.zeros((4, 2)), y=np.zeros(5, int))
    with pytest.raises(JaxdistError, match=r"rows\.npz: x has 4 rows but y has 5"):
        NpzArrays(tmp_path / "rows.npz")
    np.savez(tmp_path / "float.npz", x=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(JaxdistError, match=r"float\.npz: labels y must be 1-D integers"):
        NpzArrays(tmp_path / "float.npz")
    with pytest.raises(JaxdistError, match=r"gone\.npz: no such file"):
        NpzArrays(tmp_path / "gone.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "single.npy", np.zeros(3))
    for name in ("text.npz", "single.npy"):
        with pytest.raises(JaxdistError, match=rf"{name}: not an \.npz file"):
            NpzArrays(tmp_path / name)


def test_outputs_get_the_usual_permissions_and_no_temp_files_remain(tmp_path):
    _write(tmp_path / "j.bin", np.arange(3))
    assert json.loads((tmp_path / "j.bin.json").read_text())["sources"] == "test"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.bin", "j.bin.json"]
    umask = os.umask(0)
    os.umask(umask)
    for name in ("j.bin", "j.bin.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask
