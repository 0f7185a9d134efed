"""A token file's sidecar (``train.bin.json``, the format in ``jaxdist.data.tokens``): its
fields read and checked, and what a run's model must cover of it: the vocabulary the file
declares (a tokenizer's, or the bytes' 257), and the same tokenizer for a held-out file.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxdist.errors import JaxdistError

# The sidecar's fields, each optional: what a value must be, and the test of it.
SIDECAR_FIELDS = {
    "dtype": ("a string", lambda v: isinstance(v, str)),
    "num_tokens": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "vocab_size": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "max_token": ("an int >= -1", lambda v: _is_int(v) and v >= -1),  # -1: no tokens
    "documents": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "sources": ("a string", lambda v: isinstance(v, str)),
    "files": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
    "tokenizer": (
        "an object with path, fingerprint, vocab_size and eos_id",
        lambda v: (
            isinstance(v, dict)
            and isinstance(v.get("path"), str)
            and isinstance(v.get("fingerprint"), str)
            and _is_int(v.get("vocab_size"))
            and _is_int(v.get("eos_id"))
        ),
    ),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sidecar_path(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def read_sidecar(path) -> dict | None:
    """The sidecar of token file ``path``, or None when it has none."""
    meta_path = sidecar_path(path)
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise JaxdistError(f"{meta_path}: unreadable sidecar: {err}") from err
    if not isinstance(meta, dict):
        raise JaxdistError(f"{meta_path}: the sidecar is not a JSON object")
    for key, (wanted, fits) in SIDECAR_FIELDS.items():
        if key in meta and not fits(meta[key]):
            raise JaxdistError(f"{meta_path}: field {key!r} is {meta[key]!r}, not {wanted}")
    return meta


def check_vocabulary(path, model_vocab: int, given_by: str, role: str = "--data") -> None:
    """Refuses a model vocabulary smaller than the one token file ``path``'s sidecar
    declares (a tokenizer's, or the bytes' 257): ids the tokenizer makes would have no
    row, even where this file happens not to hold them. ``given_by`` says where the
    model's number came from (``--vocab-size``, ``--model-args vocab_size``, ...), ``role``
    the flag that named the file. No sidecar, no claim: nothing to check here (the
    reader checks each id)."""
    meta = read_sidecar(path) if Path(path).is_file() else None
    declared = (meta or {}).get("vocab_size")
    if not declared or model_vocab >= declared:
        return
    record = meta.get("tokenizer")
    whose = f"tokenizer {record.get('path')}" if record else f"{sidecar_path(path).name}"
    largest = f", ids up to {meta['max_token']} in it" if meta.get("max_token", -1) >= 0 else ""
    advice = {
        "--vocab-size": f": give --vocab-size {declared} or more, or leave it out to take the "
        "file's",
        "--model-args vocab_size": f": give --model-args vocab_size={declared} or more",
    }.get(given_by, "")
    raise JaxdistError(
        f"{role} {path}: its vocabulary is {declared:,} ({whose}{largest}), larger than the "
        f"model's {model_vocab:,} ({given_by}){advice}"
    )


def check_same_tokenizer(train, held_out) -> None:
    """Refuses a held-out token file prepared with another tokenizer than the training
    file (both sidecars record one, with different fingerprints)."""
    records = [
        (read_sidecar(p) or {}).get("tokenizer") if Path(p).is_file() else None
        for p in (train, held_out)
    ]
    if not all(records):
        return
    (a, b) = (r.get("fingerprint") for r in records)
    if a != b:
        raise JaxdistError(
            f"--eval-data {held_out} was prepared with another tokenizer than --data {train}: "
            f"{records[1].get('path')} ({b}) against {records[0].get('path')} ({a})"
        )
