"""``python -m jaxdist.data prepare INPUT [INPUT ...] --out DIR [--eval-fraction F]
[--tokenizer PATH [--eos-token TOKEN]]`` and ``python -m jaxdist.data stdlib
[--cache-dir DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxdist.data.text import (
    EOT,
    EVAL_FRACTION,
    default_cache_dir,
    held_out_bytes,
    prepare,
    stdlib_corpus,
)
from jaxdist.data.tokens import read_sidecar
from jaxdist.errors import JaxdistError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxdist.data",
        description="Prepare token files: byte-level, or a Hugging Face tokenizer's.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser("prepare", help="tokenise text files into train/eval .bin files")
    text.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="PATH",
        help="a tokenizer.json, or a Hugging Face model folder holding one: its ids, its "
        "end-of-document token between files (default: bytes, end of document 256; needs "
        "the tokenizers package)",
    )
    text.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN",
        help="with --tokenizer: the end-of-document token (default: the folder's "
        "tokenizer_config.json eos_token, else config.json eos_token_id)",
    )
    text.add_argument("inputs", nargs="+", metavar="INPUT", help="a file, a folder or a glob")
    text.add_argument("--out", required=True, type=Path, help="output folder")
    text.add_argument(
        "--eval-fraction",
        type=float,
        default=EVAL_FRACTION,  # the trainer's: --eval-data DIR/eval.bin then exists
        help="share of files held out for eval.bin (by file name hash; one file: its tail; "
        f"default {EVAL_FRACTION}, as the trainer's; 0: no eval.bin)",
    )
    stdlib = commands.add_parser("stdlib", help="prepare the Python standard library corpus")
    stdlib.add_argument(
        "--cache-dir", type=Path, default=None, help=f"default: {default_cache_dir()}"
    )
    return parser


def summary(name: str, path: Path) -> str:
    meta = read_sidecar(path)  # written by prepare, just now or when cached
    files, tokens, size = meta["documents"], meta["num_tokens"], path.stat().st_size
    return f"{name}: {files:,} files, {tokens:,} tokens, {size:,} bytes -> {path}"


def prepare_command(
    inputs: list[str],
    out: Path,
    eval_fraction: float,
    tokenizer_path: Path | None = None,
    eos_token: str | None = None,
) -> dict[str, Path]:
    """``prepare``, except that inputs with no text to hold out give train.bin alone and
    one line saying so: an ``eval.bin`` of end-of-document separators only would
    evaluate nothing. The tokenizer is read, and its end of document found, before
    anything is written."""
    if eos_token is not None and tokenizer_path is None:
        raise JaxdistError(
            f"--eos-token {eos_token!r} is for --tokenizer: byte-level files end each "
            f"document with id {EOT}"
        )
    tokenizer = None
    if tokenizer_path is not None:  # the tokenizers package is imported here, not before
        from jaxdist.data import tokenizer as tokenizer_lib

        tokenizer = tokenizer_lib.load(tokenizer_path, eos_token)
        print(
            f"tokenizer: {tokenizer.path}: vocabulary {tokenizer.vocab_size:,}, end of "
            f"document {tokenizer.eos_token!r} (id {tokenizer.eos_id})",
            flush=True,
        )
    if eval_fraction > 0 and not held_out_bytes(inputs, eval_fraction):
        print(
            f"jaxdist: note: no eval.bin: too few files or too little text to hold out "
            f"{eval_fraction:g} of it (by file; a single file: its tail), so all of it is in "
            "train.bin; give more text, or train without --eval-data",
            file=sys.stderr,
            flush=True,
        )
        eval_fraction = 0.0
    return prepare(inputs, out, eval_fraction=eval_fraction, tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            paths = prepare_command(
                args.inputs, args.out, args.eval_fraction, args.tokenizer, args.eos_token
            )
        else:
            paths = stdlib_corpus(args.cache_dir)
    except JaxdistError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr, flush=True)
        return 2
    for name, path in paths.items():
        print(summary(name, path), flush=True)
    if args.command == "prepare":  # what to run next, with the files just written
        held_out = f" --eval-data {paths['eval']} --eval-every 200" if "eval" in paths else ""
        data = f"--data {paths['train']}{held_out}"
        print(f"next: python -m jaxdist.train --model gpt {data}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
