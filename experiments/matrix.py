"""Every layout with every run feature: does each cell run and match its reference?

Command:   python experiments/matrix.py [--layouts data=8 ...] [--features resume ...]
                                        [--out experiments/MATRIX.md] [--json cells.jsonl]
                                        [--in-process]
Hardware:  8 emulated CPU devices on a 2-core machine (the 2-process layout: 2 x 4, started
           by ``python -m jaxdist.launch``); about 40 minutes for the 8 x 15 cells (--in-process).
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
           every feature the GPT has.
Expected:  every cell "ok": losses within 1e-4 (relative) of the reference, bf16 within 3e-2,
           resumed runs bit for bit; dropout equal to 1 device's where the layout draws one key
           for the global batch and within 3e-2 where it draws one per replica or per
           pipeline microbatch (the key contract of jaxdist/parallel/step.py). Refused
           cells (none at present) print the refusal, which README's layout section lists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

LAYOUTS = {  # name -> (--mesh, processes)
    "data=8": ("data=8", 1),
    "data=4,model=2": ("data=4,model=2", 1),
    "fsdp=8": ("fsdp=8", 1),
    "data=2,fsdp=2,model=2": ("data=2,fsdp=2,model=2", 1),
    "stage=2,data=4": ("stage=2,data=4", 1),
    "stage=2,fsdp=2,model=2": ("stage=2,fsdp=2,model=2", 1),
    "seq=2,fsdp=2,model=2": ("seq=2,fsdp=2,model=2", 1),  # the sequence split 2 ways
    # each fsdp pair spans the 2 processes, each model group stays inside one
    "2 procs x 4: fsdp=2,model=4": ("fsdp=2,model=4", 2),
    # a model in JAX's explicit-sharding style, naming its tensor-parallel axis "tp"
    # (tests/explicit_model.py): the layouts its annotations allow, 2 processes among them
    "explicit: data=8": ("data=8", 1),
    "explicit: data=2,fsdp=2,model=2": ("data=2,fsdp=2,model=2", 1),
    "explicit, 2 procs x 4: fsdp=4,model=2": ("fsdp=4,model=2", 2),
    # the built-in Llama (LLAMA below), split every way a layer can be and pipelined
    "llama: data=2,fsdp=2,model=2": ("data=2,fsdp=2,model=2", 1),
    "llama: stage=2,fsdp=2,model=2": ("stage=2,fsdp=2,model=2", 1),
}
RUN = ["--global-batch-size", "16", "--steps", "6", "--log-every", "1"]
GPT = ["--model", "gpt"]
# the explicit model on the same data (bytes: vocabulary 257, padded to 258 for tp=2)
EXPLICIT = [
    *("--model", "explicit_model:build", "--model-args", "vocab=258"),
    *("--loss", "explicit_model:loss", "--task", "lm", "--axis-names", "tp=model"),
]
# the built-in Llama with its switches on (heads 4 of 16 features, 2 key/value heads split
# over model=2; a window of 48 of the 64 positions; llama3 RoPE stretching 16 positions)
LLAMA = [
    *("--model", "llama", "--n-kv-heads", "2", "--qk-norm", "--attention-bias", "qkv"),
    *("--sliding-window-tokens", "48", "--no-tie-embeddings", "--rope-type", "llama3"),
    *("--rope-factor", "4", "--rope-original-max-positions", "16", "--ffn-dim", "128"),
]
TESTS = Path(__file__).resolve().parents[1] / "tests"  # where explicit_model.py lives
# The GPT's own flags: what the explicit model (its own blocks, float32) has no use for
GPT_ONLY = {"bfloat16", "remat block", "dropout", "1f1b", "interleaved"}


def model_flags(layout: str) -> list[str]:
    if layout.startswith("explicit"):
        return EXPLICIT
    return LLAMA if layout.startswith("llama") else GPT


def layout_of(layout: str) -> tuple[str, int]:
    """(--mesh, processes) of a row, or of a mesh named after a row's model
    ("llama: data=8", the llama rows' elastic target)."""
    return LAYOUTS.get(layout) or (layout.rpartition(": ")[2], 1)


def mesh_of(layout: str) -> str:
    return layout_of(layout)[0]


SGD = ["--optimizer", "sgd", "--lr", "0.3", "--clip-norm", "0", "--momentum", "0"]
RTOL, LOOSE = 1e-4, 3e-2
REFERENCE = "1 device"  # every cell's reference: the same flags on one device
NAN_STEP = 3  # the ``nan`` fault's step under --nan-policy skip


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
        return main([*args, "--compile-cache", "off"]), ""
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def close(got: list, want: list, rtol: float) -> float:
    """The largest relative difference of two loss lists (None: a skipped step, which
    must be skipped in both); inf when they differ in length or skips."""
    if len(got) != len(want) or [g is None for g in got] != [w is None for w in want]:
        return float("inf")
    diffs = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True) if w is not None]
    return max(diffs, default=0.0)


def params_close(got: dict, want: dict) -> float:
    if sorted(got) != sorted(want):
        return float("inf")
    return max(
        float(np.linalg.norm(got[k] - want[k]) / max(np.linalg.norm(want[k]), 1e-30)) for k in want
    )


@dataclass
class Cell:
    layout: str
    feature: str
    status: str  # "ok", "refused", "FAILED", "n/a" (the feature needs another layout)
    detail: str
    seconds: float = 0.0


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
            self._refs[key] = run(self.work, name, REFERENCE, list(flags), env, model=model)
        return self._refs[key]

    def cell(self, layout: str, feature: str) -> Cell:
        if why := applies(layout, feature):
            return Cell(layout, feature, "n/a", why)
        start = time.monotonic()
        status, detail = FEATURES[feature](self, layout, slug(layout, feature))
        return Cell(layout, feature, status, detail, round(time.monotonic() - start, 1))


def slug(*parts: str) -> str:
    return "-".join(p.replace("=", "").replace(",", "_").replace(" ", "") for p in parts)


def verdict(result: Result, error: float, rtol: float, what: str) -> tuple[str, str]:
    if result.code != 0:
        return "FAILED", f"exit {result.code}: {result.tail.strip().splitlines()[-1:]}"
    if not error <= rtol:
        return "FAILED", f"{what}: relative difference {error:.2e} > {rtol:g}"
    return "ok", f"{what} within {error:.1e}"


def compared(flags: list[str], rtol=RTOL, env=None, key="loss", what="losses", optim=SGD):
    """A feature whose run equals 1 device's with the same flags (losses and saved params)."""

    def check(m: Matrix, layout: str, name: str):
        flags_ = [*optim, *flags]
        got, want = run(m.work, name, layout, flags_, env), m.ref(tuple(flags_), env, layout)
        error = close(got.losses(key), want.losses(key), rtol)
        if got.code == 0 and key == "loss":
            error = max(error, params_close(got.params, want.params) if rtol == RTOL else 0)
        return verdict(got, error, rtol, what + (" and params" if rtol == RTOL else ""))

    return check


def resumed(m: Matrix, layout: str, name: str, elastic: bool = False):
    """``--checkpoint-every 3``, stopped after step 3's checkpoint, then continued."""
    flags = [*SGD, "--checkpoint-every", "3"]
    full = run(m.work, name, layout, flags)
    target = elastic_target(layout) if elastic else layout
    return continued(m, name, full, target, flags, {}, exact=target == layout, model=layout)


def elastic_target(layout: str) -> str:
    """Where an elastic resume goes: data=8, with the layout row's model."""
    for model in ("explicit", "llama"):  # the rows of a model other than the GPT
        if layout.startswith(model):
            return f"{model}: data=8"
    return "data=8"


def continued(m: Matrix, name: str, full: Result, target: str, flags, env, exact: bool, model=None):
    """``full``'s run directory as a run stopped after step 3 leaves it (its later
    checkpoint removed), continued on ``target``: steps 4-6 equal ``full``'s bit for bit
    (``exact``: on its own layout), or within RTOL. ``model``: the layout row whose
    model ran (default ``target``'s)."""
    if full.code != 0:
        return verdict(full, 0.0, RTOL, "")
    again = m.work / slug(name, "from3", target, str(len(list(m.work.iterdir()))))
    shutil.copytree(m.work / name, again)
    shutil.rmtree(again / "checkpoints" / "6")
    (again / "metrics.jsonl").write_text("")  # what the resumed run logs, alone
    got = run(m.work, again.name, target, flags, env, run_dir=again,
              model=model_flags(model or target))  # fmt: skip
    want = [r["loss"] for r in full.records if r["step"] > 3]
    if not exact:
        return verdict(got, close(got.losses(), want, RTOL), RTOL, f"steps 4-6 on {target}")
    if got.code == 0 and got.losses() == want:
        return "ok", "steps 4-6 bit for bit"
    return verdict(got, close(got.losses(), want, 0), 0, "steps 4-6 against the uninterrupted")


def dropout(m: Matrix, layout: str, name: str):
    """``--dropout 0.1``: equal to 1 device's where one key serves the global batch; where
    the layout draws one key per replica (``jaxdist.parallel.strategies.wants_per_replica``)
    or per pipeline microbatch, its masks differ: within LOOSE, unlike the run without."""
    flags = [*SGD, "--dropout", "0.1"]
    got, want = run(m.work, name, layout, flags), m.ref(tuple(flags), layout=layout)
    if got.code != 0:
        return verdict(got, 0.0, RTOL, "")
    error = close(got.losses(), want.losses(), RTOL)
    if error <= RTOL:
        return "ok", f"losses and masks as 1 device's (one key), within {error:.1e}"
    plain = close(got.losses()[1:], m.ref(tuple(SGD), layout=layout).losses()[1:], 0)
    if plain == 0:
        return "FAILED", "dropout did nothing"
    status, detail = verdict(got, close(got.losses(), want.losses(), LOOSE), LOOSE, "losses")
    return status, detail + " (masks per replica or per pipeline microbatch: the key contract)"


FEATURES = {
    "defaults": compared([], rtol=1e-3, what="default AdamW losses", optim=[]),
    "resume": resumed,
    "elastic resume": lambda m, layout, name: resumed(m, layout, name, elastic=True),
    "eval": compared(["--eval-every", "3"], key="eval_loss", what="eval losses"),
    "save-params": compared([]),
    "replica check": compared(["--check-replicas-every", "2"]),
    "grad-accum 2": compared(["--grad-accum", "2"]),
    "bfloat16": compared(["--dtype", "bfloat16"], rtol=LOOSE, what="bf16 losses"),
    "remat block": compared(["--remat", "block"]),
    "dropout": dropout,
    "nan skip": compared(
        ["--nan-policy", "skip"], env={"JAXDIST_FAULT": f"nan@0:{NAN_STEP}"}, what="skipped"
    ),
    # the memory options (AdamW: SGD without momentum has no state to split or offload)
    "shard-optimizer": compared(["--shard-optimizer"], rtol=1e-3, what="AdamW losses", optim=[]),
    "offload optimizer": compared(
        ["--offload", "optimizer"], rtol=1e-3, what="AdamW losses", optim=[]
    ),
    "1f1b": compared(["--pipeline-schedule", "1f1b"]),
    # 4 layers: 2 stages x 2 virtual stages of one layer each
    "interleaved": compared(["--pipeline-schedule", "interleaved", "--n-layers", "4"]),
}
# Features that only mean something on some layouts: (feature, why not elsewhere)
ONLY_WITH_STAGE = {"1f1b", "interleaved"}


def applies(layout: str, feature: str) -> str:
    """ "" where ``feature`` applies to ``layout``; else why it does not (the cell: n/a)."""
    if layout.startswith("explicit") and feature in GPT_ONLY:
        return "a flag of the built-in GPT's (its dtype, remat, dropout, pipeline blocks)"
    if feature in ONLY_WITH_STAGE and "stage" not in mesh_of(layout):
        return "no stage axis: no pipeline to schedule (the flag is ignored, as --microbatches)"
    return ""


def table(cells: list[Cell]) -> str:
    """Markdown: a row per layout, a column per feature, each cell its status; the
    details of every cell that is not plainly ok below."""
    layouts = list(dict.fromkeys(c.layout for c in cells))
    features = list(dict.fromkeys(c.feature for c in cells))
    at = {(c.layout, c.feature): c for c in cells}
    lines = ["| layout | " + " | ".join(features) + " |", "|---" * (len(features) + 1) + "|"]
    for layout in layouts:
        marks = [at[layout, f].status if (layout, f) in at else "" for f in features]
        lines.append(f"| {layout} | " + " | ".join(marks) + " |")
    notes = [f"- {c.layout} / {c.feature}: {c.status}: {c.detail}" for c in cells]
    if any(c.status == "n/a" for c in cells):  # one line per reason
        notes = [n for n in notes if ": n/a: " not in n]
        reasons = dict.fromkeys(c.detail for c in cells if c.status == "n/a")
        notes += [f"- n/a: {why}" for why in reasons]
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    parser.add_argument("--out", type=Path, help="the table, as markdown")
    parser.add_argument("--json", type=Path, help="one JSON line per cell")
    parser.add_argument(
        "--in-process", action="store_true", help="one process's runs in this one (no start-up)"
    )
    args = parser.parse_args(argv)
    if args.in_process:  # 8 CPU devices, set before jax is imported (by the first run)
        global IN_PROCESS
        IN_PROCESS = True
        os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    cells = []
    with tempfile.TemporaryDirectory(prefix="jaxdist-matrix-") as work:
        matrix = Matrix(Path(work))
        for layout in args.layouts:
            for feature in args.features:
                cells.append(cell := matrix.cell(layout, feature))
                print(f"{layout:28} {feature:15} {cell.status:7} {cell.seconds:5.0f}s  "
                      f"{cell.detail}", flush=True)  # fmt: skip
                if args.json:
                    with args.json.open("a") as f:
                        f.write(json.dumps(asdict(cell)) + "\n")
    if args.out:
        args.out.write_text(table(cells))
    return 0 if all(c.status != "FAILED" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
