"""Text to token files. Byte-level: each file becomes its bytes (ids 0..255) followed by
``EOT`` (256). With a tokenizer (``jaxdist.data.tokenizer``): each file's UTF-8 text
becomes the tokenizer's ids followed by its end-of-document id. ``prepare`` writes
train/eval token files, split by file; ``stdlib_corpus`` prepares the running Python's
standard library once into a cache folder."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxdist.data.prepare_progress import Progress
from jaxdist.data.tokens import TokenWriter, read_sidecar
from jaxdist.errors import JaxdistError

EOT = 256  # document separator, after every file
BYTE_VOCAB = 257
# The share held out for evaluation by default: the trainer's --eval-fraction and
# ``python -m jaxdist.data prepare``'s read it here, so that they cannot drift apart.
EVAL_FRACTION = 0.02
SPLIT_BUCKETS = 10_000
_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})

Entry = tuple[Path, str]  # (file, split key: relative to a folder input, else as given)


def collect_files(inputs: list[str]) -> list[Path]:
    """Files named by ``inputs`` (files, folders walked recursively, globs), sorted, once each."""
    return [path for path, _ in _collect(inputs)]


def _collect(inputs: list[str]) -> list[Entry]:
    found: dict[str, Entry] = {}
    for given in inputs:
        matches = _expand(str(given))
        if not matches:
            raise JaxdistError(
                f"{given}: matches no file (not a file, a folder with files or a glob)"
            )
        for path, key in matches:
            found.setdefault(os.path.realpath(path), (path, key))
    if not found:
        raise JaxdistError("no input files given")
    return sorted(found.values(), key=lambda entry: entry[0])


def _expand(given: str) -> list[Entry]:
    path = Path(given)
    if path.is_file():
        return [(path, path.as_posix())]
    if path.is_dir():
        return [(path / rel, rel.as_posix()) for rel in _walk(path)]
    entries = []
    for match in map(Path, sorted(glob.glob(given, recursive=True))):
        if match.is_file():
            entries.append((match, match.as_posix()))
        elif match.is_dir():
            entries.extend((match / rel, (match / rel).as_posix()) for rel in _walk(match))
    return entries


def _walk(folder: Path, skip_dirs=frozenset()) -> Iterator[Path]:
    """Files under ``folder`` (relative to it), sorted; hidden files and folders skipped."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip_dirs)
        for name in sorted(files):
            if not name.startswith(".") and os.path.isfile(os.path.join(root, name)):
                yield Path(root, name).relative_to(folder)


def held_out(keys: list[str], eval_fraction: float) -> list[bool]:
    """Which files go to eval: crc32(key) % 10_000 < eval_fraction * 10_000, so a file's
    split depends on its name alone. With 2+ files and eval_fraction > 0, the lowest
    bucket is held out and the highest kept if need be, so both splits get a file."""
    buckets = [zlib.crc32(key.encode()) % SPLIT_BUCKETS for key in keys]
    held = [bucket < eval_fraction * SPLIT_BUCKETS for bucket in buckets]
    if eval_fraction > 0 and len(keys) >= 2:
        if not any(held):
            held[buckets.index(min(buckets))] = True
        if all(held):
            held[buckets.index(max(buckets))] = False
    return held


def prepare(inputs, out_dir, *, eval_fraction: float = 0.0, progress: bool = True, tokenizer=None):
    """Tokenises ``inputs`` into ``out_dir/train.bin`` (and ``eval.bin`` when
    eval_fraction > 0), each with a sidecar; returns {"train": path[, "eval": path]}.
    ``tokenizer``: a ``jaxdist.data.tokenizer.TextTokenizer`` (its ids, its end of
    document, recorded in the sidecars), else bytes. On an error nothing is left: no
    file, and no ``out_dir`` if this call made it."""
    inputs = _as_list(inputs)
    entries, out_dir = _collect(inputs), Path(out_dir)
    made = not out_dir.exists()
    try:
        return _prepare(entries, out_dir, eval_fraction, progress, " ".join(inputs), tokenizer)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # only if still empty (temp files are gone)
                out_dir.rmdir()
        raise


def held_out_bytes(inputs, eval_fraction: float) -> int:
    """Bytes of text that ``prepare`` would hold out for ``eval.bin``. 0: too few files
    to hold any out, or only empty ones (an ``eval.bin`` of separators alone), or one
    file too short for ``eval_fraction`` of it (its tail) to be a byte."""
    if eval_fraction <= 0:
        return 0
    entries = _collect(_as_list(inputs))
    sizes = [_size(path) for path, _ in entries]
    if len(entries) == 1:  # what _write_tail_split cuts off
        return sizes[0] - round(sizes[0] * (1 - eval_fraction))
    held = held_out([key for _, key in entries], eval_fraction)
    return sum(size for size, is_eval in zip(sizes, held, strict=True) if is_eval)


def _as_list(inputs) -> list[str]:
    return [str(i) for i in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)]


def _prepare(
    entries: list[Entry],
    out_dir: Path,
    eval_fraction: float,
    progress: bool,
    sources: str,
    tokenizer=None,
) -> dict[str, Path]:
    if not 0 <= eval_fraction < 1:
        raise JaxdistError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    held = held_out([key for _, key in entries], eval_fraction)
    if len(entries) == 1:
        held = [False]  # one file: split inside it, below
    sizes = [_size(path) for path, _ in entries]
    _check_not_empty(sizes, held, sources)
    names = ["train", "eval"] if eval_fraction > 0 else ["train"]
    vocab = tokenizer.vocab_size if tokenizer is not None else BYTE_VOCAB
    extra = {"tokenizer": tokenizer.sidecar()} if tokenizer is not None else None
    with contextlib.ExitStack() as stack:
        writers = {
            name: stack.enter_context(TokenWriter(out_dir / f"{name}.bin", vocab, extra))
            for name in names
        }
        bar = stack.enter_context(Progress(sum(sizes), progress))
        documents = _documents(entries, tokenizer, bar)
        if eval_fraction > 0 and len(entries) == 1:
            files = _write_tail_split(entries[0], documents, eval_fraction, writers)
        else:
            files = _write_by_file(entries, documents, held, writers)
        return {name: writers[name].commit(sources, files[name]) for name in names}


def _write_by_file(entries, documents, held, writers) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {name: [] for name in writers}
    for (_, key), tokens, is_eval in zip(entries, documents, held, strict=True):
        name = "eval" if is_eval else "train"
        writers[name].write(tokens, documents=1)  # (ids + 1,): the document, its end
        files[name].append(key)
    return files


def _write_tail_split(entry, documents, eval_fraction, writers) -> dict[str, list[str]]:
    """One file cannot be split by file: its last ``eval_fraction`` of tokens (bytes, or
    a tokenizer's ids) is held out (a 1 MB file at 0.02, byte-level: the first 980 KB
    train, the last 20 KB eval)."""
    _, key = entry
    tokens = next(iter(documents))  # (ids + 1,), ends with the end of document
    cut = round((len(tokens) - 1) * (1 - eval_fraction))
    writers["train"].write(np.append(tokens[:cut], tokens[-1:]), documents=1)
    writers["eval"].write(tokens[cut:], documents=1)
    return {"train": [f"{key}[:{cut}]"], "eval": [f"{key}[{cut}:]"]}


BATCH_FILES, BATCH_BYTES = 256, 32 << 20  # a tokenizer encodes this many files at once


def _documents(entries, tokenizer, bar) -> Iterator[np.ndarray]:
    """Each file's ids and its end of document, in order; ``bar`` advanced by its bytes.
    A tokenizer encodes files in batches (its own threads), a file whole at a time."""
    if tokenizer is None:
        for path, _ in entries:
            tokens = _tokenise(path)  # (bytes + 1,)
            bar.advance(len(tokens) - 1)
            yield tokens
        return
    batch: list[tuple[Path, bytes]] = []
    for i, (path, _) in enumerate(entries):
        batch.append((path, _read(path)))
        full = sum(len(data) for _, data in batch) >= BATCH_BYTES or len(batch) >= BATCH_FILES
        if full or i == len(entries) - 1:
            texts = [_text(path, data) for path, data in batch]
            for (_, data), ids in zip(batch, tokenizer.encode_batch(texts), strict=True):
                tokens = np.empty(len(ids) + 1, np.uint32)
                tokens[:-1] = ids
                tokens[-1] = tokenizer.eos_id
                bar.advance(len(data))
                yield tokens
            batch = []


def _text(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JaxdistError(
            f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "a tokenizer reads text: leave the file out, or convert it"
        ) from err


def _check_not_empty(sizes: list[int], held: list[bool], sources: str) -> None:
    if sum(sizes) == 0:
        raise JaxdistError(f"{sources}: the corpus is empty ({len(sizes)} files, 0 bytes)")
    if sum(size for size, is_eval in zip(sizes, held, strict=True) if not is_eval) == 0:
        raise JaxdistError(f"{sources}: the train split is empty (all its files have 0 bytes)")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as err:
        raise JaxdistError(f"{path}: cannot read: {err.strerror}") from err


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise JaxdistError(f"{path}: cannot read: {err.strerror}") from err


def _tokenise(path: Path) -> np.ndarray:
    data = _read(path)
    tokens = np.empty(len(data) + 1, np.uint16)
    tokens[:-1] = np.frombuffer(data, np.uint8)
    tokens[-1] = EOT
    return tokens


def default_cache_dir() -> Path:
    """``$JAXDIST_CACHE``, else ``$XDG_CACHE_HOME/jaxdist``, else ``~/.cache/jaxdist``."""
    if os.environ.get("JAXDIST_CACHE"):
        return Path(os.environ["JAXDIST_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "jaxdist"


def stdlib_corpus(cache_dir=None, *, eval_fraction: float = EVAL_FRACTION, progress: bool = True):
    """The running Python's standard library ``.py`` files as byte tokens, prepared once
    into ``cache_dir`` (default: ``default_cache_dir()``) and reused after that."""
    root = Path(sysconfig.get_paths()["stdlib"])
    entries = [
        (root / rel, rel.as_posix()) for rel in _walk(root, _NOT_STDLIB) if rel.suffix == ".py"
    ]
    total_bytes = sum(_size(path) for path, _ in entries)
    # The split depends on eval_fraction too, so it is part of the key.
    key_text = f"{root}\n{len(entries)}\n{total_bytes}\n{eval_fraction}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:10]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    out_dir = Path(cache_dir or default_cache_dir()) / f"stdlib-py{version}-{key}"
    names = ["train", "eval"] if eval_fraction > 0 else ["train"]
    paths = {name: out_dir / f"{name}.bin" for name in names}
    # A sidecar is renamed into place after its .bin: with all sidecars there, all is done.
    if all(path.with_name(path.name + ".json").is_file() for path in paths.values()):
        return paths
    sources = f"Python {version} standard library at {root}"
    paths = _prepare(entries, out_dir, eval_fraction, progress, sources)
    if not progress:  # e.g. processes other than 0: quiet
        return paths
    counts = {name: read_sidecar(path)["num_tokens"] for name, path in paths.items()}
    split = ", ".join(f"{name} {n:,}" for name, n in counts.items())
    print(
        f"jaxdist: prepared the {sources}: {len(entries)} files, "
        f"{sum(counts.values()):,} tokens ({split}) in {out_dir}",
        file=sys.stderr,
        flush=True,
    )
    return paths
