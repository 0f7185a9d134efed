"""``python -m jaxdist.plan --target 8x8:A100-80GB [--json] TRAINING FLAGS``: the table of
candidate layouts and the command for the best that fits. Exit 0 with a plan whose best
layout fits, 1 when none fits, 2 for bad input (the message names it), 3 when no layout
was compiled (the budget or the time limits cut every one off: nothing was ruled out)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from jaxdist.errors import JaxdistError
from jaxdist.plan import gpu_compiler, table
from jaxdist.plan.planner import Options, plan
from jaxdist.train.flags import OneLineParser

NONE_FITS = 1
NOTHING_COMPILED = 3


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m jaxdist.plan",
        description="Which layout fits a cluster and runs fastest, from the step compiled "
        "for it. Every other flag is a training flag (python -m jaxdist.train --help).",
    )
    d = Options()
    p.add_argument("--target", help="NODESxDEVICES:KIND (8x8:A100-80GB), KIND, cpu:N, or "
                   "NxM:FILE.yaml; kinds: A100-80GB, A100-40GB, H100-80GB, H200, B200")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout")
    p.add_argument(
        "--budget-s",
        type=float,
        default=d.budget_s,
        help="no compile starts after this many seconds; 0: search everything",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="compiling processes")
    p.add_argument(
        "--efficiency",
        type=float,
        default=d.efficiency,
        help="share of the peak FLOP/s the step reaches (the estimate's)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="estimate communication as hidden under compute (default: added)",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=d.memory_fraction,
        help="share of a device's memory the run may use "
        "(the command sets XLA_PYTHON_CLIENT_MEM_FRACTION to it)",
    )
    p.add_argument("--candidate-timeout-s", type=float, default=d.candidate_timeout_s)
    p.add_argument("--worker-memory-gib", type=float, default=d.worker_memory_gib)
    p.add_argument("--install-gpu-compiler", action="store_true",
                   help="install XLA's GPU compiler (JAX's CUDA plugin) for planning GPU "
                   "targets on a machine without one, then exit")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args, train_flags = parser().parse_known_args(argv)
        if args.install_gpu_compiler:
            gpu_compiler.install()
            return 0
        if not args.target:
            raise JaxdistError("--target is required, e.g. --target 8x8:A100-80GB or cpu:8")
        options = Options(
            args.budget_s, args.workers, args.efficiency, args.overlap, args.memory_fraction,
            args.candidate_timeout_s, args.worker_memory_gib,
        )  # fmt: skip
        # the library's start-up lines (building the step to size its state) to stderr:
        # stdout is the plan alone (its JSON, with --json)
        with contextlib.redirect_stdout(sys.stderr):
            result = plan(train_flags, args.target, options, progress=_progress())
    except JaxdistError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(table.as_json(result), indent=1))
    else:
        print(table.render(result))
    if result.best:
        return 0
    tried = any(c.phase != "screen" for c in result.candidates)
    return NOTHING_COMPILED if tried and result.compiled == 0 else NONE_FITS


def _progress():
    """On a terminal one line on stderr, rewritten: ``[#####.....]  7/21 fsdp=64 accum
    16`` (the total grows as fitting layouts are refined); else a line per candidate."""
    if not sys.stderr.isatty():
        return lambda done, total, text: print(f"[{done}/{total}] {text}", file=sys.stderr)

    def show(done: int, total: int, text: str) -> None:
        filled = round(20 * done / max(total, 1))
        bar = "#" * filled + "." * (20 - filled)
        end = "\n" if done == total else ""
        line = f"\r[{bar}] {done:>3}/{total} compiled {text:<40}"
        print(line, end=end, file=sys.stderr, flush=True)

    return show


if __name__ == "__main__":
    sys.exit(main())
