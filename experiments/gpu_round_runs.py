"""What experiments/gpu_round.py runs, in priority order: the bench runs (``RUNS``), the
studies after them (``scripts``), the CPU work beside the compile phase
(``background``), and what the card is (its memory, the planner's name for it, the
record that opens the round)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PLAIN, FP8 = ["--loss-chunks", "0"], ["--fp8"]  # jaxdist's default on GPU: 8 slices
LLAMA = ["--model", "llama"]  # bench_gpt.py's Llama 3-shaped model (its docstring)
PEERS = ("jaxdist", "plain-jax", "torch.compile")
# (note, who, size, bench_gpt.py options, extra XLA flags), in priority order
RUNS = [
    *[("baseline", who, size, [], "") for size in ("124M", "355M") for who in PEERS],
    *[("llama", who, "124M", LLAMA, "") for who in PEERS],
    ("plain loss", "jaxdist", "124M", PLAIN, ""),
    ("plain loss", "jaxdist", "355M", PLAIN, ""),
    ("fp8", "jaxdist", "355M", FP8, ""),
    ("fp8", "jaxdist", "124M", FP8, ""),
    ("profile fp8", "jaxdist", "355M", FP8 + ["--profile", "{out}/profile"], ""),
    *[("llama", who, "1B", LLAMA, "") for who in PEERS],
]
# Not in the compile phase: jaxdist's 124M baseline (its clean cold compile) and the runs
# of a program compiled by another (the profile)
COMPILED_ALONE = {0} | {i for i, r in enumerate(RUNS) if r[0].startswith("profile")}
GB_PER_UNIT = 18  # a 124M run's share of GPU memory in the compile phase
UNITS = {"124M": 1, "355M": 2, "1B": 4}  # the Llama's 1B: 17 GB of state, ~50 GB at peak


def model_of(spec) -> str:
    options = spec[3]
    return options[options.index("--model") + 1] if "--model" in options else "gpt"


def scripts(out: Path, cpu: bool, warm: bool = False) -> list[tuple]:
    """(job, command, memory units, JSON-lines file or None): the studies after the bench
    runs, in priority order. ``out``: where each writes its files (not the round's
    folder: only a few files come back from the machine; their rows go into
    gpu_round.jsonl). ``warm``: the compile phase's run, which only compiles and measures
    (the planner's predictions are the background's)."""
    py = sys.executable
    plan = [py, str(HERE / "plan_vs_measured.py"), "--out", str(out)]
    plan += ["--measure-only"] * warm
    offload = [py, str(HERE / "offload.py"), "--out", str(out / "offload.jsonl")]
    # the MoE Llama against the dense one of its active parameters (one GPU: expert=1),
    # last: the lowest priority; warm, each program's one step only (its compile)
    moe = [py, str(HERE / "bench_moe.py"), "--out", str(out / "bench_moe.jsonl")]
    moe += ["--cpu", "--experts", "2", "--steps", "1"] if cpu else ["--gpu"]
    moe += ["--steps", "0"] * warm
    if cpu:
        plan += ["--sizes", "tiny", "--steps", "2"]
        offload += ["--cpu-devices", "8", "--mesh", "fsdp=8", "--small"]
    # the planner's study measures up to 1.3B: 51 GB at its peak, 4 units; the MoE's
    # 124M-shaped 8 experts (313M parameters, AdamW, batch 16 x 1024): 2 units
    return [
        ("plan vs measured", plan, 4, None),
        ("offload", offload, 1, out / "offload.jsonl"),
        ("bench moe", moe, 2, out / "bench_moe.jsonl"),
    ]


def background(work: Path, target: str, cpu: bool) -> list[tuple[str, list[str]]]:
    """(job, command): CPU-only work started with the compile phase, at low priority;
    the planner's predictions go to ``work``, where the timed study reads them."""
    py = sys.executable
    predict = [py, str(HERE / "plan_vs_measured.py"), "--predict-only", "--target", target]
    predict += ["--out", str(work)] + (["--sizes", "tiny"] if cpu else [])
    tests = ["tests/test_pipeline.py", "tests/test_pipeline_schedules.py"]
    tests += ["tests/test_sequence_parallel.py", "tests/test_offload.py"]
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2" if cpu else "6"]
    pytest += ["--durations=10"] + (["-k", "refusals", tests[2]] if cpu else tests)
    return [("plan predictions", predict), ("cpu tests", pytest)]


def gpu_memory_gb(cpu: bool) -> float:
    if cpu:  # a dry run of the driver on the CPU (tests): tiny models, two at a time
        return 2 * GB_PER_UNIT / 0.9
    return float(nvidia_smi("memory.total")) / 1024


def nvidia_smi(field: str) -> str:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[0]


def plan_target(cpu: bool) -> str:
    """The planner's name for this card."""
    if cpu:
        return "cpu:1"
    return "H200" if "H200" in nvidia_smi("name").upper() else "H100-80GB"


def environment(cpu: bool) -> dict:
    """The record that opens the round: the card, the driver, the versions, the commit."""
    import importlib.metadata as meta

    record = {"job": "environment", "python": sys.version.split()[0]}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers"):
        try:
            record[name] = meta.version(name)
        except meta.PackageNotFoundError:
            record[name] = None
    if not cpu:
        record["gpu"] = nvidia_smi("name,memory.total,driver_version,clocks.max.sm")
    git = ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"]
    # a copied tree's .git may be older than its files: JAXDIST_COMMIT names them
    head = subprocess.run(git, capture_output=True, text=True)
    record["commit"] = os.environ.get("JAXDIST_COMMIT") or head.stdout.strip() or None
    return record
