"""Hugging Face tokenizers for token files: ``load(path)`` reads a ``tokenizer.json`` (or a
model folder holding one) with the ``tokenizers`` package, imported only here and only
when called, and finds its end-of-document token. ``python -m jaxdist.data prepare
--tokenizer PATH`` writes token files with it; the sidecar records what ``sidecar()``
gives (path, fingerprint, vocabulary, end-of-document id), and ``for_token_file`` loads
that tokenizer again, checked against the fingerprint, to turn ids back into text.
(A run checks a token file's vocabulary against the model's: ``sidecar.check_vocabulary``.)

The end-of-document token, in this order: ``eos_token`` (``--eos-token``); else, in the
folder (a folder given, or the one holding the file given), ``tokenizer_config.json``'s
``eos_token``; else ``config.json``'s ``eos_token_id`` (the first, if a list). None of
these: an error naming what was looked for and the tokenizer's special tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jaxdist.errors import JaxdistError

EXTRA = "text"  # pip install 'jaxdist[text]': the tokenizers package
FILE = "tokenizer.json"
CONFIGS = ("tokenizer_config.json", "config.json")


def import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise JaxdistError(
            f"--tokenizer needs the tokenizers package, which is not installed: "
            f"pip install 'jaxdist[{EXTRA}]' (or pip install tokenizers)"
        ) from err
    return tokenizers


class TextTokenizer:
    """A loaded tokenizer: ``encode(text) -> list[int]`` (the text's ids alone: no
    special tokens added, no truncation), ``decode(ids) -> str`` (special tokens kept, so
    ``decode(encode(text)) == text`` for a byte-level BPE), ``eos_id``, ``eos_token``,
    ``vocab_size`` (1 + the largest id, added tokens included), ``fingerprint``
    (``sha256:`` of the tokenizer.json bytes) and ``path`` (the tokenizer.json)."""

    def __init__(self, tokenizer, path: Path, fingerprint: str, eos_token: str, eos_id: int):
        self.tokenizer = tokenizer
        self.path = path
        self.fingerprint = fingerprint
        self.eos_token = eos_token
        self.eos_id = int(eos_id)
        largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), largest + 1)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]  # numpy arrays and scalars too
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def sidecar(self) -> dict:
        """What a token file's sidecar records under ``"tokenizer"``."""
        return {
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }

    def __repr__(self) -> str:
        return (
            f"TextTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"eos={self.eos_token!r} (id {self.eos_id}))"
        )


def load(path, eos_token: str | None = None) -> TextTokenizer:
    """The tokenizer at ``path``: a ``tokenizer.json``, or a folder holding one (a Hugging
    Face model folder). ``eos_token``: the end-of-document token, else the folder's
    configs say (the module's docstring). JaxdistError, one line, for what is not one."""
    json_path = tokenizer_file(path)
    try:
        data = json_path.read_bytes()
    except OSError as err:
        raise JaxdistError(f"{json_path}: cannot read: {err.strerror}") from err
    tokenizer = _parse(json_path, data)
    tokenizer.no_truncation()  # a tokenizer.json may cut every document at 512 ids
    tokenizer.no_padding()
    fingerprint = "sha256:" + hashlib.sha256(data).hexdigest()
    eos_token, eos_id = _eos(tokenizer, json_path, eos_token)
    return TextTokenizer(tokenizer, json_path.resolve(), fingerprint, eos_token, eos_id)


def tokenizer_file(path) -> Path:
    """``path`` if a file, ``path/tokenizer.json`` if a folder holding one; else the
    error saying which it is not."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise JaxdistError(
            f"{path}: no such file or folder (--tokenizer takes a {FILE} or a Hugging Face "
            "model folder holding one)"
        )
    if (path / FILE).is_file():
        return path / FILE
    hint = ""
    if any((path / name).is_file() for name in ("tokenizer.model", "vocab.json")):
        hint = (
            ": its tokenizer.model or vocab.json is a slow tokenizer's; save the fast one with "
            "transformers (AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
        )
    raise JaxdistError(f"{path}: a folder without {FILE}{hint}")


def _parse(json_path: Path, data: bytes):
    try:
        json.loads(data)
    except (UnicodeDecodeError, ValueError) as err:
        raise JaxdistError(f"{json_path}: not JSON: {err}") from err
    tokenizers = import_tokenizers()
    try:
        return tokenizers.Tokenizer.from_str(data.decode())
    except Exception as err:  # the Rust side raises plain Exception
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise JaxdistError(
            f"{json_path}: not a tokenizer the tokenizers package can read: {why}"
        ) from err


def _eos(tokenizer, json_path: Path, given: str | None) -> tuple[str, int]:
    if given is not None:
        found = tokenizer.token_to_id(given)
        if found is None:
            raise JaxdistError(
                f"--eos-token {given!r} is not a token of {json_path}{_specials(tokenizer)}"
            )
        return given, found
    folder, looked = json_path.parent, []
    config = _read_config(folder / CONFIGS[0])
    token = (config or {}).get("eos_token")
    if isinstance(token, dict):  # an AddedToken, as transformers saves it
        token = token.get("content")
    if isinstance(token, str) and token:
        found = tokenizer.token_to_id(token)
        if found is None:
            raise JaxdistError(
                f"{folder / CONFIGS[0]}: eos_token {token!r} is not a token of {json_path}; "
                "pass --eos-token"
            )
        return token, found
    looked.append(f"eos_token in {folder / CONFIGS[0]} ({_state(config, 'eos_token')})")
    config = _read_config(folder / CONFIGS[1])
    found = (config or {}).get("eos_token_id")
    if isinstance(found, list) and found:
        found = found[0]
    if isinstance(found, int) and not isinstance(found, bool):
        token = tokenizer.id_to_token(found)
        if token is None:
            raise JaxdistError(
                f"{folder / CONFIGS[1]}: eos_token_id {found} is not an id of {json_path}; "
                "pass --eos-token"
            )
        return token, found
    looked.append(f"eos_token_id in {folder / CONFIGS[1]} ({_state(config, 'eos_token_id')})")
    raise JaxdistError(
        f"{json_path}: no end-of-document token: looked for {' and '.join(looked)}; pass "
        f"--eos-token{_specials(tokenizer)}"
    )


def _read_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise JaxdistError(f"{path}: not readable JSON: {err}") from err
    if not isinstance(config, dict):
        raise JaxdistError(f"{path}: not a JSON object")
    return config


def _state(config: dict | None, key: str) -> str:
    if config is None:
        return "no such file"
    return f"{key} is {config[key]!r}" if key in config else f"no {key}"


def _specials(tokenizer) -> str:
    decoder = tokenizer.get_added_tokens_decoder()
    names = [decoder[i].content for i in sorted(decoder) if decoder[i].special]
    if not names:
        return ""
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f" (its special tokens: {shown})"


def for_token_file(path) -> TextTokenizer:
    """The tokenizer a token file was prepared with, as its sidecar records it: loaded
    from the recorded path, with the recorded end of document, and refused if the file
    there is no longer the one the tokens came from (another fingerprint)."""
    from jaxdist.data.tokens import read_sidecar, sidecar_path

    meta = read_sidecar(path)
    record = (meta or {}).get("tokenizer")
    if not record:
        raise JaxdistError(
            f"{path}: its sidecar records no tokenizer (byte-level or another pipeline's ids)"
        )
    if not Path(record["path"]).exists():
        raise JaxdistError(
            f"{path}: the tokenizer its sidecar records, {record['path']}, is not there "
            "(moved or removed?)"
        )
    tokenizer = load(record["path"], record.get("eos_token"))
    if tokenizer.fingerprint != record.get("fingerprint"):
        raise JaxdistError(
            f"{record['path']} is not the tokenizer {path} was prepared with: "
            f"{sidecar_path(path)} says {record.get('fingerprint')}, the file is "
            f"{tokenizer.fingerprint}"
        )
    return tokenizer
