"""Token files read as LM windows (jaxdist.data.tokens), and .npz arrays."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from jaxdist.data import BYTE_VOCAB, NpzArrays, TokenWindows, read_sidecar, write_token_file
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


@pytest.mark.parametrize(
    "field, value, wanted",
    [
        ("vocab_size", "abc", "an int >= 1"),
        ("vocab_size", 0, "an int >= 1"),
        ("num_tokens", -1, "an int >= 0"),
        ("max_token", True, "an int >= -1"),
        ("documents", 1.5, "an int >= 0"),
        ("dtype", 16, "a string"),
        ("sources", None, "a string"),
        ("files", ["a", 1], "a list of strings"),
    ],
)
def test_sidecar_fields_of_the_wrong_type_name_the_file_and_field(tmp_path, field, value, wanted):
    path = _write(tmp_path / "t.bin", np.arange(10))
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    (tmp_path / "t.bin.json").write_text(json.dumps(meta | {field: value}))
    message = rf"t\.bin\.json: field '{field}' is {re.escape(repr(value))}, not {wanted}"
    with pytest.raises(JaxdistError, match=message):
        TokenWindows(path, 4)


@pytest.mark.parametrize("dtype, bad", [(np.uint16, 700), (np.uint32, 3_000_000_000)])
def test_ids_read_are_checked_whatever_the_sidecar_claims(tmp_path, dtype, bad):
    tokens = (np.arange(801) % 50).astype(dtype)
    tokens[8 * 33 + 5] = bad  # example 33 of windows of 8 + 1
    path = _raw(tmp_path / "t.bin", tokens)
    meta = {"dtype": np.dtype(dtype).name, "num_tokens": 801, "vocab_size": 100, "max_token": 49}
    (tmp_path / "t.bin.json").write_text(json.dumps(meta))
    windows = TokenWindows(path, 8, vocab_size=100)  # the sidecar spares the full pass
    assert windows[[0, 32, 34]]["tokens"].max() < 50  # other rows read as they are
    message = (
        rf"t\.bin: example 33 has token id {bad} at position 269, outside the vocabulary "
        r"of 100; its sidecar's max_token 49 is wrong"
    )
    with pytest.raises(JaxdistError, match=message):
        windows[[2, 33]]


def test_a_file_truncated_after_opening_is_named_with_both_sizes(tmp_path):
    # Within the first page: without the check the read would be zeros, not SIGBUS (which
    # would end pytest itself); test_bad_input.py truncates a 4-page file in a subprocess.
    path = _write(tmp_path / "t.bin", np.arange(801) % 100)
    windows = TokenWindows(path, 8, vocab_size=100)
    windows[[50]]
    os.truncate(path, 64)
    message = r"t\.bin changed while in use: it was 1602 bytes when opened, now 64"
    with pytest.raises(JaxdistError, match=message):
        windows[[50]]


# npz arrays.


def test_npz_arrays(tmp_path):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(10, 3, 2)), rng.integers(0, 4, 10)
    y[0] = 6
    np.savez(tmp_path / "d.npz", x=x, y=y, extra=np.zeros(3))
    data = NpzArrays(tmp_path / "d.npz")
    assert len(data) == 10 and data.num_classes == 7 and data.in_features == (3, 2)
    batch = data[np.array([4, 0])]
    assert set(batch) == {"x", "y"}  # extra has 3 rows, not 10: not part of a batch
    assert batch["x"].dtype == np.float32 and batch["x"].shape == (2, 3, 2)
    assert batch["y"].dtype == np.int32 and batch["y"].tolist() == [y[4], 6]
    np.testing.assert_allclose(batch["x"], x[[4, 0]], rtol=1e-6)
    np.savez(tmp_path / "named.npz", images=x[:4], classes=y[:4].astype(np.uint8))
    named = NpzArrays(tmp_path / "named.npz", inputs="images", labels="classes")
    batch = named[[1]]  # keyed by the arrays' own names
    assert len(named) == 4 and set(batch) == {"images", "classes"}
    assert batch["classes"].dtype == np.int32 and batch["classes"].tolist() == [y[1]]


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
