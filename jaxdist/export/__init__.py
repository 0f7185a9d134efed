"""``python -m jaxdist.export RUN_DIR --out DIR [--map MAP]``: a run's weights as safetensors.

The command only; the work is ``jaxdist.weights.export_run``. Writes the newest good
checkpoint's parameters (or ``--step N``'s) into DIR: ``model.safetensors``, or above
``--max-shard-size`` numbered shards with ``model.safetensors.index.json``, and the
map's ``config.json``. ``--map`` takes what ``--init-map`` takes (``gpt2``: Hugging
Face names). Exit 0: written; 2: bad input, said in one line, nothing written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jaxdist.errors import ConfigError

__all__ = ["main", "parse_size"]

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}  # fmt: skip


def parse_size(text: str) -> int:
    """ "5GB" -> 5 * 10**9 bytes (KB, MB, GB decimal; KiB, MiB, GiB binary)."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).upper() if found else ""
    if not found or unit not in UNITS or float(found.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: give a size such as 5GB or 500MB")
    return int(float(found.group(1)) * UNITS[unit])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdist.export", description=__doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path)
    parser.add_argument("--out", required=True, type=Path, help="a new or empty folder")
    parser.add_argument("--map", default="", help="a weight map (YAML) or a shipped one: gpt2")
    parser.add_argument("--step", type=int, default=None, help="default: the newest good one")
    parser.add_argument("--max-shard-size", default="5GB", help="per file, e.g. 5GB, 500MB")
    args = parser.parse_args(argv)
    from jaxdist.train.resume import model_settings
    from jaxdist.weights import export_run, load

    try:
        exported = export_run(
            args.run_dir, args.out, load(args.map, flag="--map"), model_settings, step=args.step,
            max_shard_bytes=parse_size(args.max_shard_size),
        )  # fmt: skip
    except ConfigError as err:
        print(f"jaxdist export: error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote step {exported.step}'s {exported.tensors} tensors ({exported.bytes / 1e6:.1f} "
        f"MB) to {args.out}: {', '.join(p.name for p in exported.files)}"
    )
    return 0
