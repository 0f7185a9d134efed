"""Where the training loop's host time goes, per step: CPU time of each part of the loop
on its own thread, and of every thread of the process.

Command:   python experiments/loop_profile.py                   # tiny GPT, 1000 steps
           python experiments/loop_profile.py --log-every 1 --steps 600
           python -m jaxdist.launch --nproc 2 --cpu-devices-per-proc 4 -- \
               python experiments/loop_profile.py --global-batch-size 16 --steps 150 --dir DIR
Hardware:  any CPU (the table in experiments/PERF.md: the 2-core CPU of our machines).
Expected:  the step's dispatch is the largest part (a hand-written jax.jit call of the
           same state costs about the same); checks, stop poll, data and events each tens
           of microseconds; file and terminal writing on the reporting thread.

Runs ``jaxdist.train.trainer.train`` in this process on overhead.py's tiny GPT (one CPU
device, a run directory with metrics.jsonl and TensorBoard, health on). Each measured
function is wrapped to add up the CPU time (``time.thread_time``) its calls take on the
loop's thread, over the steps after a 20-step warm-up; thread CPU comes from
/proc/self/task (Linux). CPU, not wall time: waiting for the device is not host work.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 20
# (module, owner, attribute, label): what the loop calls every step
MEASURED = [
    ("jaxdist.parallel.wrapper", "Parallel", "step", "dispatch (Parallel.step)"),
    ("jaxdist.train.loop", None, "finish_step", "check (+ log record) of the step before"),
    ("jaxdist.train.loop", None, "log_values", "  of which: log record's values"),
    ("jaxdist.parallel.wrapper", "Parallel", "check", "  of which: health read"),
    ("jaxdist.cluster.preemption", "StopFlag", "stop_after", "stop-flag poll"),
    ("jaxdist.data.loader", "Prefetcher", "__next__", "next batch (from the prefetcher)"),
    ("jaxdist.sinks", "Sinks", "emit", "events (queued for the reporting thread)"),
    ("jaxdist.health.watchdog", "Watchdog", "phase", "watchdog phase marks"),
    ("jaxdist.health.fault_injection", "Faults", "before_step", "fault-injection hook"),
]


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, by name (Python's where known)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        name = names.get(int(tid), "XLA and other native threads" if comm != "python" else comm)
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return out


def jax_process_index() -> int:
    """This process's index in a launched group (before JAX starts), else 0."""
    return int(os.environ.get("JAXDIST_PROCESS_ID", "0"))


def instrument(totals: dict, counting: list) -> None:
    import importlib

    for module, owner, attribute, label in MEASURED:
        holder = importlib.import_module(module)
        holder = getattr(holder, owner) if owner else holder
        original = getattr(holder, attribute)

        def timed(*args, _original=original, _label=label, **kwargs):
            if not counting or threading.current_thread() is not threading.main_thread():
                return _original(*args, **kwargs)
            started = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] += time.thread_time() - started

        setattr(holder, attribute, timed)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="measured steps")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--dir", default="", help="token file and run here (several processes)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import overhead

    from jaxdist.sinks import Sinks
    from jaxdist.train.config import parse_args
    from jaxdist.train.trainer import train

    totals: dict[str, float] = collections.Counter()
    counting: list = []
    marks: dict[str, tuple] = {}
    instrument(totals, counting)
    emit = Sinks.emit

    def marking_emit(self, event):  # the measured span: warm-up's end to the last step's
        if event.kind == "step_starting" and event.step == WARMUP + 1:
            marks["start"] = (time.perf_counter(), thread_cpu())
            counting.append(True)
        if event.kind == "step_metrics" and event.step == WARMUP + args.steps:
            counting.clear()
            marks["end"] = (time.perf_counter(), thread_cpu())
        return emit(self, event)

    Sinks.emit = marking_emit
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.dir or tmp)
        data, rows = where / "random.bin", WARMUP + args.steps + 4
        if not data.exists():  # one process makes it; the others wait for it
            if jax_process_index() == 0:
                overhead.token_file(tmp, rows * args.global_batch_size * 65)
                os.replace(f"{tmp}/random.bin", data)
            while not data.exists():
                time.sleep(0.1)
        argv = ["--model", "gpt", "--no-scan-layers", "--data", str(data)]
        argv += ["--run-dir", str(where / "run")]
        argv += [f"--{k.replace('_', '-')}={v}" for k, v in overhead.MODEL.items()]
        argv += ["--steps", str(WARMUP + args.steps)]
        argv += ["--global-batch-size", str(args.global_batch_size)]
        argv += ["--log-every", str(args.log_every)]
        train(parse_args(argv), quiet=True)
    (t0, cpu0), (t1, cpu1) = marks["start"], marks["end"]
    per_step = 1e3 / args.steps
    print(f"wall time per step: {(t1 - t0) * per_step:.3f} ms (log every {args.log_every})")
    print("\nloop's thread, CPU ms/step:")
    for _, _, _, label in MEASURED:
        print(f"  {label:<48}{totals[label] * per_step:>8.3f}")
    print("\nevery thread, CPU ms/step:")
    for name in sorted(cpu1, key=lambda n: -(cpu1[n] - cpu0.get(n, 0))):
        used = (cpu1[name] - cpu0.get(name, 0)) * per_step
        if used > 0:
            print(f"  {name:<48}{used:>8.3f}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
