"""``python -m jaxdist.data prepare INPUT [INPUT ...] --out DIR [--eval-fraction F]``
and ``python -m jaxdist.data stdlib [--cache-dir DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxdist.data.text import default_cache_dir, prepare, stdlib_corpus
from jaxdist.data.tokens import read_sidecar
from jaxdist.errors import JaxdistError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxdist.data", description="Prepare byte-level token files."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser("prepare", help="tokenise text files into train/eval .bin files")
    text.add_argument("inputs", nargs="+", metavar="INPUT", help="a file, a folder or a glob")
    text.add_argument("--out", required=True, type=Path, help="output folder")
    text.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        help="share of files held out for eval.bin (by file name hash; default 0: none)",
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            paths = prepare(args.inputs, args.out, eval_fraction=args.eval_fraction)
        else:
            paths = stdlib_corpus(args.cache_dir)
    except JaxdistError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr, flush=True)
        return 2
    for name, path in paths.items():
        print(summary(name, path), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
