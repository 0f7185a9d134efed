"""Every layout with every run feature: does each cell run and match its reference?

Command:   python experiments/matrix.py [--layouts data=8 ...] [--features resume ...]
                                        [--out experiments/MATRIX.md] [--json cells.jsonl]
                                        [--in-process] [--merge experiments/MATRIX.md]
                                        [--cells cells.jsonl]
Hardware:  8 emulated CPU devices on a 2-core machine (the 2-process layout: 2 x 4, started
           by ``python -m jaxdist.launch``); about 85 minutes for the 15 x 15 cells (--in-process).
Runs:      the built-in GPT on its default data (bytes of the standard library), global batch
           16, 6 steps, SGD at lr 0.3 without clipping (Adam turns the float noise of a
           gradient that is zero in exact arithmetic, the key bias's, into whole steps, and
           clipping hides a wrong gradient scale), every layout of ``LAYOUTS`` with each
           feature of ``FEATURES`` (each maps to the check that runs it: its flags and what
           it is compared with). References are 1-device runs with the same flags (the
           1-device run equals a plain optax loop in tests/test_equivalence.py and
           tests/test_layouts.py). A stacked (pipelined) model's saved params are
           compared per layer with the unstacked model's (the checkpoints' form).
           The rows named "explicit" train tests/explicit_model.py instead, a model in JAX's
           explicit-sharding style that names its tensor-parallel axis "tp" (``--axis-names
           tp=model``), on the same data; the GPT's own flags (bf16, remat, dropout, the
           pipeline schedules) are n/a there. The rows named "llama" train the built-in
           Llama (``LLAMA``: grouped-query attention, QK-norm, q/k/v biases, a sliding
           window shorter than the sequence, Llama 3's RoPE scaling, an untied head) with
           every feature the GPT has; the row named "gemma" Gemma 2 (``GEMMA``: sliding
           and global layers alternating through pipeline stages, both soft-caps); the
           row named "moe" the Llama with experts (``MOE``: a dense first layer, then 4
           routed experts, top 2, dropless, and a shared one) split 2 a device over
           expert=2 beside fsdp and model, its elastic resume onto expert=4,data=2 (1
           expert a device), the pipeline schedules n/a (no stage on that layout; stage
           with expert: tests/test_moe_llama.py).
Expected:  every cell "ok": losses within 1e-4 (relative) of the reference, bf16 within 3e-2,
           resumed runs bit for bit; dropout equal to 1 device's where the layout draws one key
           for the global batch and within 3e-2 where it draws one per replica or per
           pipeline microbatch (the key contract of jaxdist/parallel/step.py). Refused
           cells (none at present) print the refusal, which README's layout section lists.
Layout:    the rows here in matrix_rows.py, what each feature runs and compares in
           matrix_checks.py, the markdown in matrix_table.py; this file runs the cells.
Merging:   ``--merge PAGE`` writes (``--out``) the table PAGE holds with this run's cells
           in place of theirs and its new rows added, the text above the table kept: new
           rows without running the whole matrix again. ``--cells`` takes the cells of an
           earlier run's ``--json`` instead of running any.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below
from matrix_checks import (  # noqa: E402
    FEATURES,
    LOOSE,
    NAN_STEP,
    RTOL,
    SGD,
    close,
    compared,
    continued,
    dropout,
    params_close,
    resumed,
    verdict,
)
from matrix_rows import (  # noqa: E402
    EXPLICIT,
    GPT,
    GPT_ONLY,
    LAYOUTS,
    LLAMA,
    ONLY_WITH_STAGE,
    REFERENCE,
    RUN,
    TESTS,
    applies,
    elastic_target,
    layout_of,
    mesh_of,
    model_flags,
    slug,
)
from matrix_table import Cell, merged, read_cells, split, table  # noqa: E402

__all__ = [  # the names this module has held, the siblings' among them (tests/test_matrix.py)
    "EXPLICIT", "FEATURES", "GPT", "GPT_ONLY", "IN_PROCESS", "LAYOUTS", "LLAMA", "LOOSE",
    "NAN_STEP", "ONLY_WITH_STAGE", "REFERENCE", "RTOL", "RUN", "SGD", "TESTS", "Cell",
    "Matrix", "Result", "applies", "close", "compared", "continued", "dropout",
    "elastic_target", "layout_of", "main", "mesh_of", "model_flags", "params_close",
    "resumed", "run", "run_cells", "slug", "table", "verdict",
]  # fmt: skip


@dataclass
class Result:
    """One finished (or refused) run: its metrics.jsonl records and saved params."""

    code: int
    records: list[dict]
    params: dict[str, np.ndarray] = field(default_factory=dict)
    tail: str = ""

    def losses(self, key: str = "loss") -> list[float]:
        return [r.get(key) for r in self.records if key in r]


def run(
    work: Path, name: str, layout: str, flags: list[str], env=None, run_dir=None, model=None
) -> Result:
    """``python -m jaxdist.train`` (through the launcher for a 2-process layout) in
    ``work/name``; a run directory given is reused (a resume). In this process instead
    (``IN_PROCESS``, the tests' way: no interpreter to start) for one process. ``model``:
    the model's flags (default: the layout row's)."""
    mesh, processes = layout_of(layout)
    run_dir = run_dir or work / name
    npz = work / f"{name}.npz"
    where = ["--mesh", mesh] if layout != REFERENCE else ["--num-devices", "1"]
    model = model_flags(layout) if model is None else model
    args = [*model, *RUN, *flags, *where, "--run-dir", str(run_dir), "--save-params", str(npz)]
    if processes == 1 and IN_PROCESS:
        code, tail = _in_process(args, env or {})
    else:
        code, tail = _subprocess(args, processes, env or {})
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    params = dict(np.load(npz)) if code == 0 and npz.exists() else {}
    return Result(code, records, params, tail)


IN_PROCESS = False  # tests/test_matrix.py sets it (its process already has 8 CPU devices)
# The in-process runs' compilation cache: none (--in-process: every cell compiles its own);
# tests/test_matrix.py's runs use its session's (a resume loads its first run's programs)
IN_PROCESS_CACHE = ["--compile-cache", "off"]


def _subprocess(args: list[str], processes: int, env: dict) -> tuple[int, str]:
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))}
    train = [sys.executable, "-m", "jaxdist.train", *args]
    command = (
        [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--cpu-devices-per-proc", "4",
         "--", *train]
        if processes == 2
        else [*train, "--cpu-devices", "8"]
    )  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    proc = subprocess.run(
        command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
        env={**environment, "JAX_PLATFORMS": "cpu", **env},
    )  # fmt: skip
    return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


def _in_process(args: list[str], env: dict) -> tuple[int, str]:
    from jaxdist.train.trainer import main

    if str(TESTS) not in sys.path:  # the explicit model's module
        sys.path.insert(0, str(TESTS))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return main([*args, *IN_PROCESS_CACHE]), ""
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


class Matrix:
    """Runs cells, each reference once (``ref``)."""

    def __init__(self, work: Path):
        self.work, self._refs = work, {}

    def ref(self, flags: tuple[str, ...], env=None, layout: str = "data=8") -> Result:
        """1 device's run of ``flags``, with ``layout``'s model."""
        model = model_flags(layout)
        key = (tuple(model), flags, tuple(sorted((env or {}).items())))
        if key not in self._refs:
            name = f"ref{len(self._refs)}"
            self._refs[key] = self.run(name, REFERENCE, list(flags), env, model=model)
        return self._refs[key]

    def run(self, name: str, layout: str, flags: list[str], env=None, run_dir=None, model=None):
        """``run`` in this matrix's folder (the checks' way to train)."""
        return run(self.work, name, layout, flags, env, run_dir, model)

    def cell(self, layout: str, feature: str) -> Cell:
        if why := applies(layout, feature):
            return Cell(layout, feature, "n/a", why)
        start = time.monotonic()
        status, detail = FEATURES[feature](self, layout, slug(layout, feature))
        return Cell(layout, feature, status, detail, round(time.monotonic() - start, 1))


def run_cells(layouts: list[str], features: list[str], json_out: Path | None) -> list[Cell]:
    """Every cell of ``layouts`` x ``features``, each printed (and written to ``json_out``)
    as it ends."""
    cells = []
    with tempfile.TemporaryDirectory(prefix="jaxdist-matrix-") as work:
        matrix = Matrix(Path(work))
        for layout in layouts:
            for feature in features:
                cells.append(cell := matrix.cell(layout, feature))
                print(f"{layout:28} {feature:15} {cell.status:7} {cell.seconds:5.0f}s  "
                      f"{cell.detail}", flush=True)  # fmt: skip
                if json_out:
                    with json_out.open("a") as f:
                        f.write(json.dumps(asdict(cell)) + "\n")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    parser.add_argument("--out", type=Path, help="the table, as markdown")
    parser.add_argument("--json", type=Path, help="one JSON line per cell")
    parser.add_argument(
        "--in-process", action="store_true", help="one process's runs in this one (no start-up)"
    )
    parser.add_argument(
        "--merge", type=Path, help="a page holding a table: its cells, this run's in their place"
    )
    parser.add_argument("--cells", type=Path, help="an earlier run's --json, instead of running")
    args = parser.parse_args(argv)
    if args.in_process:  # 8 CPU devices, set before jax is imported (by the first run)
        global IN_PROCESS
        IN_PROCESS = True
        os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    if args.cells:
        cells = [Cell(**json.loads(x)) for x in args.cells.read_text().splitlines() if x.strip()]
    else:
        cells = run_cells(args.layouts, args.features, args.json)
    page = table(cells)
    if args.merge:
        text = args.merge.read_text()
        old = read_cells(text, applies)
        page = split(text)[0] + table(merged(old, cells, list(LAYOUTS), list(FEATURES)))
    if args.out:
        args.out.write_text(page)
    return 0 if all(c.status != "FAILED" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
