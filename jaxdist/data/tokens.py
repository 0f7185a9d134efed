"""Token files, read through a memory map: a flat little-endian binary of token ids
(``.bin``, uint16 or uint32, as nanoGPT-style pipelines write) or a 1-D integer ``.npy``.

``write_token_file`` writes a ``.bin`` and its sidecar ``<file>.json``::

    {"dtype": "uint16", "num_tokens": N, "vocab_size": V, "max_token": M,
     "documents": D, "sources": "what the tokens came from", "files": [...]}

``files`` (optional) names the documents in token order, one entry each: for text,
the file's path relative to the folder given as input, else the path as given.
``tokenizer`` (optional; ``prepare --tokenizer``) is what made the ids::

    {"path": ".../tokenizer.json", "fingerprint": "sha256:...", "vocab_size": V,
     "eos_id": E, "eos_token": "<|endoftext|>"}
"""

from __future__ import annotations

import json
import os
import secrets
import weakref
from pathlib import Path

import numpy as np

from jaxdist.data.sidecar import read_sidecar, sidecar_path
from jaxdist.errors import JaxdistError

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SCAN_CHUNK_TOKENS = 1 << 24  # a max() pass holds 16M ids (32-64 MB) of the file at a time


def create_temp(path: Path) -> tuple[int, Path]:
    """A new hidden file beside ``path`` to rename onto it; unlike mkstemp's 0600 it gets
    the usual permissions (0666 less the umask). Unique per writer, so several processes
    may prepare the same file at once: the last rename wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


class TokenWriter:
    """Appends token ids to a temp file beside ``path``; ``commit`` renames it, then its
    sidecar, into place, so readers never see half a file. As a context manager, leaving
    without a commit (an error, Ctrl-C) removes the temp file."""

    def __init__(self, path, vocab_size: int, extra: dict | None = None):
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.extra = dict(extra or {})  # more sidecar fields, e.g. {"tokenizer": {...}}
        self.dtype = DTYPES["uint16" if self.vocab_size <= 1 << 16 else "uint32"]
        self.num_tokens = self.documents = 0
        self.max_token = -1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = create_temp(self.path)
        self.file = os.fdopen(fd, "wb")

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)  # gone already after a commit

    def write(self, tokens: np.ndarray, documents: int = 0) -> None:
        if tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise JaxdistError(
                    f"{self.path}: token id {bad} is outside the vocabulary of {self.vocab_size}"
                )
            self.max_token = max(self.max_token, high)
        self.file.write(memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)))
        self.num_tokens += tokens.size
        self.documents += documents

    def commit(self, sources: str, files: list[str] | None = None) -> Path:
        self.file.close()
        meta = {
            "dtype": self.dtype.name,
            "num_tokens": self.num_tokens,
            "vocab_size": self.vocab_size,
            "max_token": self.max_token,
            "documents": self.documents,
            "sources": sources,
        }
        if files is not None:
            meta["files"] = files
        meta.update(self.extra)
        os.replace(self.tmp, self.path)
        _write_text_atomic(sidecar_path(self.path), json.dumps(meta, indent=1) + "\n")
        return self.path


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_token_file(
    path, tokens: np.ndarray, *, vocab_size: int, documents: int, sources: str, files=None
) -> Path:
    """Writes ``tokens`` (1-D ids) to ``path`` (uint16 when vocab_size <= 65536, else uint32)
    and the sidecar ``path.json``, each atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise JaxdistError(f"{path}: tokens must be 1-D integers, got {tokens.dtype}{tokens.shape}")
    with TokenWriter(path, vocab_size) as writer:
        writer.write(tokens, documents)
        return writer.commit(sources, files)


class TokenWindows:
    """Example i is ``tokens[i*T : i*T + T + 1]`` (T = seq_len): consecutive windows share
    one token, so each token after the first is a target once per epoch."""

    def __init__(self, path, seq_len: int, *, dtype: str = "auto", vocab_size: int | None = None):
        self.path = Path(path)
        self.seq_len = int(seq_len)
        if self.seq_len < 1:
            raise JaxdistError(f"sequence length must be at least 1, got {seq_len}")
        if dtype != "auto" and dtype not in DTYPES:
            raise JaxdistError(f"{self.path}: dtype must be auto, uint16 or uint32, got {dtype}")
        if not self.path.is_file():
            raise JaxdistError(f"{self.path}: no such token file")
        meta = read_sidecar(self.path)
        self.vocab_size = meta.get("vocab_size") if meta else None
        self.tokenizer = meta.get("tokenizer") if meta else None  # None: bytes, or unknown
        # Kept open to see the mapped file's size before every read: a truncated file
        # would otherwise kill the process with SIGBUS at the first page past its end.
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        self._size = os.fstat(self._fd).st_size
        if self.path.suffix == ".npy":
            self.tokens = self._open_npy(dtype, meta)
        else:
            self.tokens = self._open_bin(dtype, meta)
        self.num_tokens = len(self.tokens)
        if meta and meta.get("num_tokens", self.num_tokens) != self.num_tokens:
            raise JaxdistError(
                f"{sidecar_path(self.path)} says {meta['num_tokens']} tokens but {self.path} "
                f"holds {self.num_tokens}: a stale sidecar? Prepare the data again"
            )
        # Every id read is checked against the vocabulary: the sidecar's max_token only
        # spares the pass over the whole file at setup.
        self._limit = int(vocab_size) if vocab_size is not None else self.vocab_size
        self._claimed_max = meta.get("max_token") if meta else None
        if vocab_size is not None:
            self._check_vocab(int(vocab_size), meta)

    def _open_bin(self, dtype: str, meta: dict | None) -> np.ndarray:
        found = meta.get("dtype") if meta else None
        if found is not None and found not in DTYPES:
            raise JaxdistError(f"{sidecar_path(self.path)}: unknown dtype {found}")
        if dtype != "auto" and found is not None and dtype != found:
            raise JaxdistError(
                f"{self.path}: dtype {dtype} was asked for, but its sidecar says {found}"
            )
        itemtype = DTYPES[found or ("uint16" if dtype == "auto" else dtype)]
        size = self._size
        if size % itemtype.itemsize:
            raise JaxdistError(
                f"{self.path}: {size} bytes is not a whole number of {itemtype.name} tokens "
                f"({itemtype.itemsize} bytes each)"
            )
        self._check_length(size // itemtype.itemsize)  # before mapping: mmap refuses 0 bytes
        return np.asarray(np.memmap(self.path, dtype=itemtype, mode="r"))

    def _open_npy(self, dtype: str, meta: dict | None) -> np.ndarray:
        try:
            tokens = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise JaxdistError(f"{self.path}: not a readable .npy file: {err}") from err
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise JaxdistError(
                f"{self.path}: token ids must be 1-D integers, got {tokens.dtype}{tokens.shape}"
            )
        found = tokens.dtype.name
        sidecar = meta.get("dtype") if meta else None
        for wanted, source in ((dtype, "was asked for"), (sidecar, "is in its sidecar")):
            if wanted not in (None, "auto", found):
                raise JaxdistError(
                    f"{self.path}: dtype {wanted} {source}, but its .npy header says {found}"
                )
        self._check_length(len(tokens))
        return np.asarray(tokens)

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens < self.seq_len + 1:
            raise JaxdistError(
                f"sequence length {self.seq_len} needs at least {self.seq_len + 1} tokens; "
                f"{self.path} has {num_tokens}"
            )

    def _check_vocab(self, vocab_size: int, meta: dict | None) -> None:
        signed = np.issubdtype(self.tokens.dtype, np.signedinteger)
        if meta and not signed and meta.get("max_token", vocab_size) < vocab_size:
            return  # the sidecar vouches for it: no pass over the file
        (low, low_at), (high, high_at) = _extremes(self.tokens)
        if high >= vocab_size:
            raise JaxdistError(
                f"{self.path}: token id {high} at position {high_at} exceeds the model's "
                f"vocabulary of {vocab_size}"
            )
        if low < 0:
            raise JaxdistError(f"{self.path}: token id {low} at position {low_at} is negative")

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"{self.path}: example indices must be in [0, {len(self)})")
        self._check_unchanged()
        width = self.seq_len + 1
        out = np.empty((len(indices), width), np.int32)  # (B, T + 1)
        for row, start in enumerate((indices * self.seq_len).tolist()):
            out[row] = self.tokens[start : start + width]  # one copy + cast per row
        # One pass: as uint32, a negative id (or one the int32 cast wrapped) is huge too.
        if self._limit is not None and out.size and out.view(np.uint32).max() >= self._limit:
            self._bad_id(indices, out)
        return {"tokens": out}

    def _check_unchanged(self) -> None:
        size = os.fstat(self._fd).st_size
        if size != self._size:
            raise JaxdistError(
                f"{self.path} changed while in use: it was {self._size} bytes when opened, "
                f"now {size}; something truncated or rewrote it"
            )

    def _bad_id(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Raises for the first id of ``out`` outside the vocabulary (or negative)."""
        row, col = np.argwhere((out < 0) | (out >= self._limit))[0]
        position = int(indices[row]) * self.seq_len + int(col)
        value = int(self.tokens[position])  # as stored: the int32 cast may have wrapped
        claim = self._claimed_max
        wrong = (
            f"; its sidecar's max_token {claim} is wrong"
            if claim is not None and claim < value
            else ""
        )
        raise JaxdistError(
            f"{self.path}: example {indices[row]} has token id {value} at position {position}, "
            f"outside the vocabulary of {self._limit}{wrong}"
        )


def _extremes(tokens: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
    """((min id, its first position), (max id, its first position)), a chunk at a time."""
    signed = np.issubdtype(tokens.dtype, np.signedinteger)
    low, high = (0, -1), (-1, -1)
    for start in range(0, len(tokens), SCAN_CHUNK_TOKENS):
        chunk = tokens[start : start + SCAN_CHUNK_TOKENS]
        i = int(chunk.argmin()) if signed else 0  # unsigned ids are never negative
        j = int(chunk.argmax())
        if chunk[i] < low[0]:
            low = (int(chunk[i]), start + i)
        if chunk[j] > high[0]:
            high = (int(chunk[j]), start + j)
    return low, high
