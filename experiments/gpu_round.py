"""One GPU session's measurements of experiments/PERF.md, inside a fixed device budget.

Command:   python experiments/gpu_round.py --out DIR [--budget-s 540]
           python experiments/gpu_round.py --out DIR --cpu     # the rehearsal, on a CPU
Hardware:  one H100 or H200 (a session is lent about 15 minutes of device time in all).
Expected:  DIR/gpu_round.jsonl, one record per run as it ends (``phase`` "compile" or
           "timed"; bench_gpt.py's records, ``{"job": ...}`` records of the studies with
           their rows, and the environment first), DIR/profile/ (a 5-step trace of
           jaxdist's fp8 355M step and its summary), DIR/cpu_tests.log (the pipeline, seq
           and offload tests under this machine's JAX, on its CPU),
           DIR/plan_predictions.log, DIR/gpu_round.log: 6 files, within what a device call
           brings back. What did not fit the budget is a record with "skipped"; a summary
           table ends the log. Measured 2026-11-27 on an H200: experiments/PERF.md.

What runs, in priority order (issue: the GPU round): the baseline (jaxdist, plain JAX and
torch.compile at GPT-2 124M and 355M; jaxdist with its defaults, which on a GPU include
the fused loss in 8 slices), the Llama-family model at 124M against transformers'
LlamaForCausalLM under torch.compile and plain JAX (``bench_gpt.py --model llama``: the
same three measurements as the GPT's, the round's comparison not yet measured), jaxdist
with the plain loss (``--loss-chunks 0``), ``--fp8``, a trace of the fp8 step, the Llama
at 1B against the same two peers (if time allows: last of the bench rows), the planner
against the device (``plan_vs_measured.py``), the offload study (``offload.py``), last the
MoE Llama against the dense one of its active parameters (``bench_moe.py --gpu``: one
GPU, expert=1). The long-context benchmark joins this list when it has a GPU row.

Cold compilation dominates: some 20 programs of 10-60 s each would not fit one session
run one after another. So the runs go in two phases sharing one JAX compilation cache
(and one TorchInductor cache):

1. "compile": every run but the first, several at a time (as many as the GPU's memory
   holds), each capped to its share of the memory. Their compile times are cold but
   contended (several compilers share 16 cores and the GPU's autotuning); their step
   times are not measurements. Beside them, on the CPU alone, the planner's predictions
   (``plan_vs_measured.py --predict-only``) and the CPU tests, at low priority.
2. "timed": one run at a time, in priority order, with warm caches. The first, jaxdist's
   124M baseline, compiles cold and alone (the clean cold compile time).
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
from gpu_round_runs import (  # noqa: E402
    COMPILED_ALONE,
    GB_PER_UNIT,
    RUNS,
    UNITS,
    background,
    environment,
    gpu_memory_gb,
    model_of,
    plan_target,
    scripts,
)


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
    # the rehearsal's torch.compile: aot_eager, as tests/test_bench_gpt.py (inductor's C++
    # build costs 40-80 s a process on 2 cores; the GPU's kernels are Triton's anyway)
    argv += ["--torch-backend", "aot_eager"] * cpu
    argv += [x.replace("{out}", str(out)) for x in options]
    try:  # "=": the flags' value starts with "--"
        args = bench_gpt.parse(argv + ([f"--xla-flags={flags}"] if flags else []))
        started = time.perf_counter()
        record = bench_gpt.run_one(args, who, size, env_extra=env, timeout=max(timeout, 1))
    except (Exception, SystemExit) as err:  # one bad run must not end the session's others
        error = f"driver: {err!r}"
        return {"who": who, "model": model_of(spec), "size": size, "note": note, "error": error}
    record.update(note=note, xla_flags=flags, wall_s=round(time.perf_counter() - started, 1))
    return record


def script(job: str, command: list[str], env: dict, timeout: float, lines_file=None) -> dict:
    """A study's command in its own process; its JSON lines (printed, or in
    ``lines_file``) and the end of its output."""
    started = time.perf_counter()
    if lines_file is not None and lines_file.exists():
        lines_file.unlink()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, **env}, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        return {"job": job, "error": f"timeout {err.timeout:.0f} s"}
    text = lines_file.read_text() if lines_file and lines_file.exists() else done.stdout
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    record = {"job": job, "exit": done.returncode, "results": lines}
    record.update(wall_s=round(time.perf_counter() - started, 1), tail=done.stdout[-1500:])
    if done.returncode:
        record["error"] = f"exit {done.returncode}: {done.stderr[-1500:]}"
    return record


def compile_phase(out: Path, work: Path, caches: dict, deadline: float, log, cpu: bool) -> None:
    total_gb = gpu_memory_gb(cpu)
    units = max(1, int(total_gb * 0.9 // GB_PER_UNIT))
    budget = Budget(units)
    log(f"compile phase: {total_gb:.0f} GB GPU, {units} memory units of {GB_PER_UNIT} GB")
    scratch = work / "compile-phase"  # the studies' files from this phase are not kept
    scratch.mkdir(parents=True, exist_ok=True)

    def work(item):
        need = min(units, item[0])
        budget.take(need)
        try:
            left = deadline - time.time()
            if left < 20:
                record = {"skipped": "time"}
            else:
                env = {**caches, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{need * GB_PER_UNIT / total_gb:.3f}"
                record = item[1](env, left)
        finally:
            budget.give(need)
        record["phase"] = "compile"
        log(f"  compiled {item[2]}: {short(record)}", record)

    items = []
    for i, spec in enumerate(RUNS):
        if i not in COMPILED_ALONE:
            need, label = UNITS[spec[2]], f"{spec[0]} {spec[1]} {spec[2]}"
            items.append((need, lambda env, left, spec=spec: one(spec, out, env, left, cpu), label))
    for job, command, need, lines in scripts(scratch, cpu, warm=True):
        run = lambda env, left, j=job, c=command, f=lines: script(j, c, env, left, f)  # noqa: E731
        items.append((need, run, job))
    items.sort(key=lambda item: -item[0])  # the largest (longest compiles) first
    with ThreadPoolExecutor(max_workers=units) as pool:
        list(pool.map(work, items))


def start_background(out: Path, work: Path, target: str, log, cpu: bool) -> list:
    """The CPU-only jobs, started now at low priority; each writes DIR/<job>.log."""
    started = []
    for job, command in background(work, target, cpu):
        name = job.replace(" ", "_")
        handle = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed by finish_background
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(HERE.parent)}
        proc = subprocess.Popen(
            ["nice", "-n", "19", *command], stdout=handle, stderr=subprocess.STDOUT,
            env=env, cwd=HERE.parent,
        )  # fmt: skip
        ended: dict = {}  # when it exited, read by finish_background
        threading.Thread(target=_note_exit, args=(proc, ended), daemon=True).start()
        started.append((job, proc, handle, time.time(), ended))
        log(f"background: {job} started ({' '.join(command[1:4])} ...)")
    return started


def _note_exit(proc: subprocess.Popen, ended: dict) -> None:
    proc.wait()
    ended["at"] = time.time()


def finish_background(started: list, deadline: float, out: Path, log) -> None:
    for job, proc, handle, began, ended in started:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        handle.close()
        text = (out / f"{job.replace(' ', '_')}.log").read_text()
        wall = ended.get("at", time.time()) - began
        record = {"job": job, "exit": proc.returncode, "wall_s": round(wall, 1)}
        record["tail"] = text[-1500:]
        log(f"  background {job}: exit {proc.returncode}", record)


def timed_phase(
    out: Path, work: Path, caches: dict, deadline: float, log, cpu: bool, before_scripts
) -> list[dict]:
    records = []
    for spec in RUNS:
        left = deadline - time.time()
        if left < 25:
            record = {"who": spec[1], "model": model_of(spec), "size": spec[2]}
            record.update(note=spec[0], skipped="time")
        else:
            record = one(spec, out, caches, min(left - 5, 240), cpu)
        record["phase"] = "timed"
        log(f"  timed {spec[0]} {spec[1]} {spec[2]}: {short(record)}", record)
        records.append(record)
    before_scripts()
    for job, command, _, lines in scripts(work, cpu):
        left = deadline - time.time()
        if left < 30:
            record = {"job": job, "skipped": "time"}
        else:
            record = script(job, command, caches, left, lines)
        record["phase"] = "timed"
        log(f"  timed {job}: {short(record)}", record)
    return records


def short(r: dict) -> str:
    if "error" in r or "skipped" in r:
        return (r.get("skipped") or r["error"])[-600:]
    if "job" in r:
        return f"exit {r['exit']}, {len(r['results'])} results, wall {r['wall_s']} s"
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
        default=0.35,
        help="the share of the budget the compile phase may use",
    )
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
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
    work = cache_root / "studies"
    work.mkdir(parents=True, exist_ok=True)
    log("environment", environment(args.cpu))
    end = start + args.budget_s
    started = start_background(out, work, plan_target(args.cpu), log, args.cpu)
    compile_phase(out, work, caches, start + args.budget_s * args.compile_share, log, args.cpu)

    def predictions():  # written before the planner's study is timed (or it plans itself)
        finish_background(started[:1], min(end - 90, time.time() + 60), out, log)

    records = timed_phase(out, work, caches, end, log, args.cpu, predictions)
    finish_background(started[1:], time.time() + 5, out, log)
    log("timed runs:\n" + bench_gpt.table(records))


if __name__ == "__main__":
    main()
