"""One GPU session's measurements of experiments/PERF.md, inside a fixed device budget.

Command:   python experiments/gpu_round.py --out DIR [--budget-s 540]
Hardware:  one H100 or H200 (a session is lent about 15 minutes of device time in all).
Expected:  DIR/gpu_round.jsonl, one bench_gpt.py record per run (``phase`` "compile" or
           "timed"), DIR/profile/ (a 5-step trace of jaxdist's 124M step and its
           summary), DIR/gpu_round.log; the runs that did not fit the budget are
           records with "skipped".

Cold compilation dominates: about 20 programs of 30-90 s each would not fit one session
run one after another. So the runs go in two phases sharing one JAX compilation cache
(and one TorchInductor cache):

1. "compile": every run but the first, several at a time (as many as the GPU's memory
   holds), each capped to its share of the memory. Their compile times are cold but
   contended (several compilers share 16 cores and the GPU's autotuning); their step
   times are not measurements.
2. "timed": one run at a time, in priority order, with warm caches. The first, jaxdist's
   124M baseline, compiles cold and alone (the clean cold compile time); the last
   repeats it with the cache warm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpt  # noqa: E402

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
# (note, who, size, bench_gpt.py options, extra XLA flags), in priority order
RUNS = [
    ("baseline", "jaxdist", "124M", [], ""),
    ("baseline", "plain-jax", "124M", [], ""),
    ("baseline", "torch.compile", "124M", [], ""),
    ("baseline", "jaxdist", "355M", [], ""),
    ("baseline", "plain-jax", "355M", [], ""),
    ("baseline", "torch.compile", "355M", [], ""),
    ("xla attention", "jaxdist", "124M", ["--attention", "xla"], ""),
    ("xla attention", "plain-jax", "124M", ["--attention", "xla"], ""),
    ("shard_map", "jaxdist", "124M", ["--strategy", "shard_map"], ""),
    ("pmap", "jaxdist", "124M", ["--strategy", "pmap"], ""),
    ("profile", "jaxdist", "124M", ["--profile", "{out}/profile"], ""),
    ("cache warm", "jaxdist", "124M", [], ""),
    ("fused loss, 8 slices", "jaxdist", "124M", ["--loss-chunks", "8"], ""),
    ("fused loss, 8 slices", "jaxdist", "355M", ["--loss-chunks", "8"], ""),
    ("scan layers", "jaxdist", "124M", ["--scan-layers"], ""),
    ("remat block", "jaxdist", "124M", ["--remat", "block"], ""),
    ("no donation", "plain-jax", "124M", ["--no-donate"], ""),
    ("latency-hiding scheduler", "jaxdist", "124M", [], LHS),
    ("command buffers off", "jaxdist", "124M", [], "--xla_gpu_enable_command_buffer="),
    ("autotune level 0", "jaxdist", "124M", [], "--xla_gpu_autotune_level=0"),
]
# Not in the compile phase: jaxdist's 124M baseline (its clean cold compile) and the runs
# of the same program (the profile, the rerun with the cache warm)
COMPILED_ALONE = {0} | {i for i, r in enumerate(RUNS) if r[0] in ("profile", "cache warm")}
GB_PER_UNIT = 18  # a 124M run's share of GPU memory in the compile phase; 355M takes two


def gpu_memory_gb(cpu: bool) -> float:
    if cpu:  # a dry run of the driver on the CPU (tests): tiny models, two at a time
        return 2 * GB_PER_UNIT / 0.9
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.split()[0]) / 1024


class Budget:
    """Memory units shared by the compile phase's concurrent runs."""

    def __init__(self, units: int):
        self.free, self.cond = units, threading.Condition()

    def take(self, n: int):
        with self.cond:
            self.cond.wait_for(lambda: self.free >= n)
            self.free -= n

    def give(self, n: int):
        with self.cond:
            self.free += n
            self.cond.notify_all()


def one(spec, out: Path, env: dict, timeout: float, cpu: bool) -> dict:
    note, who, size, options, flags = spec
    size = "tiny" if cpu else size
    argv = ["--who", who, "--sizes", size, "--note", note] + ["--cpu"] * cpu
    argv += [x.replace("{out}", str(out)) for x in options]
    try:  # "=": the flags' value starts with "--"
        args = bench_gpt.parse(argv + ([f"--xla-flags={flags}"] if flags else []))
        started = time.perf_counter()
        record = bench_gpt.run_one(args, who, size, env_extra=env, timeout=max(timeout, 1))
    except (Exception, SystemExit) as err:  # one bad run must not end the session's others
        return {"who": who, "size": size, "note": note, "error": f"driver: {err!r}"}
    record.update(note=note, xla_flags=flags, wall_s=round(time.perf_counter() - started, 1))
    return record


def compile_phase(out: Path, caches: dict, deadline: float, log, cpu: bool) -> list[dict]:
    total_gb = gpu_memory_gb(cpu)
    units = max(1, int(total_gb * 0.9 // GB_PER_UNIT))
    budget, records = Budget(units), []
    log(f"compile phase: {total_gb:.0f} GB GPU, {units} memory units of {GB_PER_UNIT} GB")

    def work(i: int):
        spec = RUNS[i]
        need = min(units, 2 if spec[2] == "355M" else 1)
        budget.take(need)
        try:
            left = deadline - time.time()
            if left < 20:
                return {"who": spec[1], "size": spec[2], "note": spec[0], "skipped": "time"}
            env = {**caches, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{need * GB_PER_UNIT / total_gb:.3f}"
            record = one(spec, out, env, left, cpu)
        finally:
            budget.give(need)
        record["phase"] = "compile"
        log(f"  compiled {spec[0]} {spec[1]} {spec[2]}: {short(record)}", record)
        return record

    order = [i for i in range(len(RUNS)) if i not in COMPILED_ALONE]
    order.sort(key=lambda i: RUNS[i][2] != "355M")  # the longest compiles first
    with ThreadPoolExecutor(max_workers=units) as pool:
        records = list(pool.map(work, order))
    return records


def timed_phase(out: Path, caches: dict, deadline: float, log, cpu: bool) -> list[dict]:
    records = []
    for spec in RUNS:
        left = deadline - time.time()
        if left < 25:
            record = {"who": spec[1], "size": spec[2], "note": spec[0], "skipped": "time"}
        else:
            record = one(spec, out, caches, min(left - 5, 240), cpu)
        record["phase"] = "timed"
        log(f"  timed {spec[0]} {spec[1]} {spec[2]}: {short(record)}", record)
        records.append(record)
    return records


def short(r: dict) -> str:
    if "error" in r or "skipped" in r:
        return (r.get("skipped") or r["error"])[-600:]
    return (
        f"{r['step_ms']:.2f} ms/step, {r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu']:.1%}, "
        f"compile {r['compile_s']:.1f} s, wall {r['wall_s']} s"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--cpu", action="store_true", help="a dry run with tiny models")
    parser.add_argument(
        "--compile-share",
        type=float,
        default=0.4,
        help="the share of the budget the compile phase may use",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    lock = threading.Lock()

    def log(text: str, record: dict | None = None) -> None:
        """A progress line, and a record written at once (a killed run keeps the rest)."""
        line = f"[{time.time() - start:6.1f} s] {text}"
        with lock:
            print(line, flush=True)
            with open(out / "gpu_round.log", "a") as f:
                f.write(line + "\n")
            if record is not None:
                with open(out / "gpu_round.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")

    cache_root = Path(os.environ.get("TMPDIR", "/tmp")) / "jaxdist-gpu-round"
    caches = {
        "JAX_COMPILATION_CACHE_DIR": str(cache_root / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
        "PYTHONUNBUFFERED": "1",
    }
    deadline = start + args.budget_s * args.compile_share
    compile_phase(out, caches, deadline, log, args.cpu)
    records = timed_phase(out, caches, start + args.budget_s, log, args.cpu)
    log("timed runs:\n" + bench_gpt.table(records))


if __name__ == "__main__":
    main()
