"""``--data`` -> the train and held-out sources, checked before anything compiles.

``--data`` is one of: empty (the task's default: the standard library corpus for ``lm``,
the synthetic teacher set for ``classify``); ``synthetic``; ``grammar``; a token file
(``.bin``, ``.npy``); an ``.npz`` of arrays; text files, folders or globs
(comma-separated; tokenised at the byte level once, into the cache); or
``package.module:factory`` returning a ``DataSource`` or a grain ``MapDataset`` or
random-access source (``jaxdist.data.grain_source``; ``--data-workers`` apply to these
alone). Every source, train and held-out, is then checked on a sample of rows for ids
or labels out of range (``data.checks``), and the files they read are fingerprinted
(``Data.fingerprints``: what a checkpoint records).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from jaxdist.data import fingerprint, grain_source, row_checks, sidecar, text
from jaxdist.data.arrays import NpzArrays
from jaxdist.data.loader import DataSource
from jaxdist.data.synthetic import ByteWindows, TeacherClassification, grammar_corpus
from jaxdist.data.tokens import TokenWindows, read_sidecar
from jaxdist.train.config import Config, ConfigError
from jaxdist.train.factories import bind, import_object, parse_model_args


@dataclass
class Data:
    train: DataSource
    eval: DataSource | None  # None: no held-out set
    vocab_size: int = 0  # lm: what the model's vocabulary must cover
    byte_level: bool = False  # lm over bytes: eval reports bits per byte
    description: str = ""
    # DataParallel's batch_check: per row, ids (lm) or labels (classify) in range
    row_check: Callable | None = None
    # role ("train", "eval") -> the file its source reads; none for synthetic or a user's
    files: dict[str, Path] = field(default_factory=dict)
    # role -> {"path", "size", "blake2b"} of those files, taken once when the sources
    # open (what the run reads: an .npz held in memory, a token file mapped): what each
    # checkpoint records and a resume compares (``jaxdist.train.resume``)
    fingerprints: dict[str, dict] = field(default_factory=dict)
    eos_id: int = text.EOT  # lm: the end-of-document id (a tokenizer's, else bytes' 256)

    def batch_shapes(self, global_batch_size: int) -> dict:
        """The step's global batch as shapes and dtypes, e.g. {"tokens": (64, T + 1) int32}."""
        example = self.train[np.arange(1)]
        return {
            name: jax.ShapeDtypeStruct(
                (global_batch_size, *np.shape(x)[1:]), jax.dtypes.canonicalize_dtype(x.dtype)
            )
            for name, x in example.items()
        }


def build(config: Config, task: str, progress: bool = True) -> Data:
    """The sources of ``--data`` and ``--eval-data``, each checked on a sample of rows.
    ``progress``: show data preparation (the main process only)."""
    data = _build(config, task, progress)
    path = config.data.path or ("stdlib" if task == "lm" else "synthetic")
    grain_source.check_workers(data.train, config.data.data_workers, f"--data {path}")
    bound = row_checks.value_range(
        task, _limit(config, task, data.vocab_size), config.data.npz_labels
    )
    row_checks.check_source(data.train, f"--data {path}", bound)
    if data.eval is not None:
        eval_name = config.data.eval_path and f"--eval-data {config.data.eval_path}"
        row_checks.check_source(data.eval, eval_name or f"--data {path} (held-out split)", bound)
    data.row_check = row_checks.batch_check(bound, data.train[[0]])
    data.fingerprints = fingerprint.fingerprints(data.files)
    return data


def _limit(config: Config, task: str, data_vocab: int = 0) -> int:
    """The model's vocabulary (lm) or number of classes: --model-args, else the flags
    (else, for the vocabulary, the data's)."""
    m, declared = config.model, parse_model_args(config.model.model_args)
    if task == "lm":
        return int(declared.get("vocab_size") or m.vocab_size or data_vocab)
    return int(declared.get("num_classes") or m.num_classes)


def _build(config: Config, task: str, progress: bool) -> Data:
    d = config.data
    path = d.path or ("stdlib" if task == "lm" else "synthetic")
    if ":" in path and not Path(path).exists():
        return _user(path, config, task)
    if path == "synthetic":
        return _synthetic(config, task)
    if path == "grammar":
        _need(task, "lm", "--data grammar")
        seq_len = config.model.seq_len
        train = ByteWindows(seq_len, grammar_corpus(seed=1234))
        held_out = ByteWindows(seq_len, grammar_corpus(num_sentences=2000, seed=4321))
        # raw bytes, no end of document: one id of the byte vocabulary stays unused
        return Data(train, held_out, text.BYTE_VOCAB, True, "the built-in grammar corpus")
    if path == "stdlib":
        _need(task, "lm", "--data stdlib")
        files = text.stdlib_corpus(
            d.cache_dir or None, eval_fraction=d.eval_fraction, progress=progress
        )
        return _token_files(config, files["train"], files.get("eval"), "stdlib")
    if path.endswith((".bin", ".npy")):
        _need(task, "lm", f"token file {path}")
        eval_path = Path(d.eval_path) if d.eval_path else None
        return _token_files(config, Path(path), eval_path, path)
    if path.endswith(".npz"):
        _need(task, "classify", f"array file {path}")
        return _arrays(config, path)
    _need(task, "lm", f"text {path}")
    return _text(config, path.split(","), progress)


def _need(task: str, wanted: str, what: str) -> None:
    if task != wanted:
        raise ConfigError(f"--data: {what} is {wanted} data, but the model's task is {task}")


def _synthetic(config: Config, task: str) -> Data:
    _need(task, "classify", "--data synthetic")
    m, d, seed = config.model, config.data, config.train.seed
    train = TeacherClassification(d.num_examples, m.in_features, m.num_classes, seed)
    held_out = TeacherClassification(d.eval_examples, m.in_features, m.num_classes, seed, 1)
    return Data(train, held_out, description="synthetic teacher classification")


def _token_files(config: Config, train: Path, eval_path: Path | None, name: str) -> Data:
    seq_len, dtype = config.model.seq_len, config.data.token_dtype
    vocab = config.model.vocab_size or file_vocab(train)
    _check_vocabulary(config, train, eval_path, vocab)
    windows = TokenWindows(train, seq_len, dtype=dtype, vocab_size=vocab)
    held_out = (
        TokenWindows(eval_path, seq_len, dtype=dtype, vocab_size=vocab) if eval_path else None
    )
    byte_level = windows.vocab_size == text.BYTE_VOCAB and windows.tokenizer is None
    description = f"{name} ({windows.num_tokens:,} tokens)"
    files = {"train": train, **({"eval": eval_path} if eval_path else {})}
    eos = (windows.tokenizer or {}).get("eos_id", text.EOT)
    return Data(windows, held_out, vocab, byte_level, description, files=files, eos_id=eos)


def model_for(model, data: Data, task: str):
    """The ModelConfig with what the data fixes where not given: the vocabulary and,
    with ``--document-mask``, the end-of-document id."""
    if task == "lm" and not model.vocab_size:
        model = dataclasses.replace(model, vocab_size=data.vocab_size)
    if model.document_mask and model.document_eos_id < 0:
        model = dataclasses.replace(model, document_eos_id=int(data.eos_id))
    return model


def _check_vocabulary(config: Config, train: Path, eval_path: Path | None, vocab: int) -> None:
    """The model's vocabulary (--model-args, --vocab-size, else the training file's)
    covers each file's declared one (its sidecar's: a tokenizer's, or the bytes' 257),
    and a held-out file was made by the training file's tokenizer, if both say."""
    declared = parse_model_args(config.model.model_args).get("vocab_size")
    given_by = (
        "--model-args vocab_size"
        if declared
        else "--vocab-size"
        if config.model.vocab_size
        else f"the vocabulary of --data {train}"
    )
    model_vocab = _limit(config, "lm", vocab)
    sidecar.check_vocabulary(train, model_vocab, given_by, "--data")
    if eval_path is not None:
        sidecar.check_vocabulary(eval_path, model_vocab, given_by, "--eval-data")
        sidecar.check_same_tokenizer(train, eval_path)


def file_vocab(path: Path) -> int:
    meta = read_sidecar(path) if path.is_file() else None
    if meta and meta.get("vocab_size"):
        return int(meta["vocab_size"])
    if not path.is_file():
        raise ConfigError(f"--data: {path}: no such token file")
    raise ConfigError(
        f"--data: {path} has no sidecar ({path.name}.json) saying its vocabulary; pass "
        "--vocab-size (e.g. 50304 for GPT-2's 50257 tokens, padded)"
    )


def _text(config: Config, inputs: list[str], progress: bool) -> Data:
    d = config.data
    files = text.collect_files(inputs)
    stats = "\n".join(f"{f.resolve()} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files)
    key = hashlib.sha256(f"{stats}\n{d.eval_fraction}".encode()).hexdigest()[:12]
    out_dir = Path(d.cache_dir or text.default_cache_dir()) / f"text-{key}"
    if not (out_dir / "train.bin.json").is_file():
        text.prepare(inputs, out_dir, eval_fraction=d.eval_fraction, progress=progress)
    held_out = out_dir / "eval.bin" if d.eval_fraction > 0 else None
    name = f"{len(files)} text file(s)"
    return _token_files(config, out_dir / "train.bin", held_out, name)


def _arrays(config: Config, path: str) -> Data:
    d, m = config.data, config.model
    train = NpzArrays(path, inputs=d.npz_inputs, labels=d.npz_labels)
    held_out = (
        NpzArrays(d.eval_path, inputs=d.npz_inputs, labels=d.npz_labels) if d.eval_path else None
    )
    classes = _limit(config, "classify")
    for name, arrays in [(path, train), (d.eval_path, held_out)]:
        if arrays is None:
            continue
        if m.name == "mlp" and tuple(arrays.in_features) != (m.in_features,):
            raise ConfigError(
                f"--data: {name} has inputs of shape {tuple(arrays.in_features)} per example; "
                f"the MLP takes ({m.in_features},): pass --in-features"
            )
        if arrays.num_classes > classes:
            raise ConfigError(
                f"--data: {name} has labels up to {arrays.num_classes - 1}; the model has "
                f"{classes} classes: pass --num-classes {arrays.num_classes}"
            )
    files = {"train": Path(path), **({"eval": Path(d.eval_path)} if d.eval_path else {})}
    return Data(train, held_out, description=f"{path} ({len(train):,} examples)", files=files)


def _user(ref: str, config: Config, task: str) -> Data:
    """``factory`` called by parameter name: ``split`` (``"train"`` or ``"eval"``) and
    ``config`` (the whole Config), each if it takes them; it returns a DataSource (or a
    grain dataset or source, adapted), or None for no held-out set. An lm source's
    vocabulary: its ``vocab_size`` attribute, else ``--vocab-size``, else bytes (257)."""
    factory = import_object(ref, "--data")
    if not callable(factory):
        raise ConfigError(f"--data {ref!r} is not callable")

    def call(split: str):
        supplied = {"split": lambda: split}
        supplied.update(dict.fromkeys(("config", "cfg"), lambda: config))
        return bind(factory, f"--data {ref}", supplied, fallback="split")()

    train = grain_source.user_source(call("train"), task, f"--data {ref}")
    for name in ("__len__", "__getitem__"):
        if not hasattr(train, name):
            raise ConfigError(f"--data {ref}: returned {type(train).__name__}, which has no {name}")
    vocab = getattr(train, "vocab_size", None) or config.model.vocab_size or text.BYTE_VOCAB
    held_out = grain_source.user_source(call("eval"), task, f"--data {ref} (split eval)")
    return Data(train, held_out, int(vocab), False, ref)
