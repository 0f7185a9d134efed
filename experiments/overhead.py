"""Per-step overhead of the trainer: ``python -m jaxdist.train`` against a hand-written
plain-JAX loop training the same GPT, side by side, alternating, best of N.

Command:   python experiments/overhead.py                          # all cases, best of 3
           python experiments/overhead.py --cases default,log-every-1 --repeats 5
Hardware:  any CPU (the figures in experiments/PERF.md: the 2-core CPU of our machines).
Expected:  jaxdist's wall time per step within 3% of plain JAX's in every case. On a
           shared 2-core CPU a run's speed drifts by up to 20% from one minute to the
           next, so one best-of-N gap carries about +-5% of noise: read several.

The model is bench_gpt.py's tiny GPT (2 layers, d=64, T=64, vocabulary 512, fp32, AdamW,
unrolled layers as the plain loop has them), batch 4 on one device; 16 on 2 processes x
4 CPU devices. Cases:
  default       jaxdist as a user runs it: run directory (metrics.jsonl, TensorBoard),
                health on (per-step checks, watchdog), a log record every 10 steps
  log-every-1   the same with --log-every 1; the plain loop reads every step's loss
  no-health     --no-health, for reference
  2x4           2 processes x 4 CPU devices (``python -m jaxdist.launch``), against the
                same plain loop on a 2 x 4 group (``jax.distributed``); both get
                jaxdist's CPU thread pool (8 threads per device), so only the loops differ
Each run is its own process (group): 20 warm-up steps (the first compiles), then
``--steps`` timed. jaxdist's figure is its metrics.jsonl's wall time per step over the
timed steps (``step_time_s`` covers everything between two records: logging, checks,
data); the plain loop's is the same span timed around its loop, ending with a wait for
the device. The plain loop is careful: device-resident batches, donated state, and it
reads a logged step's loss only after dispatching the next step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 20  # steps: a multiple of every log interval here
MODEL = dict(n_layers=2, d_model=64, n_heads=4, seq_len=64, vocab_size=512)
CASES = {  # jaxdist's extra flags, log interval, processes, devices per process, batch
    "default": ([], 10, 1, 1, 4),
    "log-every-1": (["--log-every", "1"], 1, 1, 1, 4),
    "no-health": (["--no-health"], 10, 1, 1, 4),
    "2x4": ([], 10, 2, 4, 16),
}
THREADS_PER_DEVICE = 8  # jaxdist.cluster.cpu_backend's, given to the plain group too


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per case")
    parser.add_argument("--out", default="", help="JSON lines, appended")
    parser.add_argument("--plain-child", nargs=5, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def environment(procs: int, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PJRT_", "JAXDIST_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
    if procs * devices > 1:
        env["PJRT_NPROC"] = str(max(os.cpu_count() or 1, THREADS_PER_DEVICE * devices))
    return env


def token_file(directory: str, tokens: int) -> str:
    import numpy as np

    from jaxdist.data import write_token_file

    ids = np.random.default_rng(0).integers(0, MODEL["vocab_size"], tokens, dtype=np.uint32)
    path = write_token_file(
        f"{directory}/random.bin",
        ids,
        vocab_size=MODEL["vocab_size"],
        documents=1,
        sources="random",
    )
    return str(path)


def run_jaxdist(case: str, steps: int) -> float:
    """Wall ms per timed step of ``python -m jaxdist.train``, from its metrics.jsonl."""
    flags, log_every, procs, devices, batch = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        data = token_file(tmp, (WARMUP + steps + 4) * batch * (MODEL["seq_len"] + 1))
        argv = ["--model", "gpt", "--no-scan-layers", "--data", data, "--run-dir", f"{tmp}/run"]
        argv += [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
        argv += ["--steps", str(WARMUP + steps), "--global-batch-size", str(batch)]
        argv += ["--log-every", str(log_every), *flags]
        command = [sys.executable, "-m", "jaxdist.train", *argv]
        if procs > 1:
            launch = [sys.executable, "-m", "jaxdist.launch", "--nproc", str(procs)]
            command = [*launch, "--cpu-devices-per-proc", str(devices), "--", *command]
        proc = subprocess.run(command, capture_output=True, text=True, env=environment(1, 1))
        if proc.returncode:
            raise SystemExit(f"jaxdist ({case}) exit {proc.returncode}:\n{proc.stderr[-3000:]}")
        lines = Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    timed, previous, total_s = 0, WARMUP, 0.0
    for r in records:
        if r["step"] > WARMUP:
            total_s += r["step_time_s"] * (r["step"] - previous)
            timed, previous = timed + r["step"] - previous, r["step"]
    return total_s / timed * 1e3


def run_plain(case: str, steps: int) -> float:
    """Wall ms per timed step of the plain-JAX loop (process 0's, in a group)."""
    _, log_every, procs, devices, batch = CASES[case]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = []
    for process_id in range(procs):
        spec = [str(x) for x in (procs, devices, process_id, port, f"{batch}:{log_every}")]
        command = [sys.executable, __file__, "--plain-child", *spec, "--steps", str(steps)]
        env = environment(procs, devices)
        children.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env))
    outputs = [c.communicate()[0] for c in children]
    if any(c.returncode for c in children):
        raise SystemExit(f"plain JAX ({case}) failed: {[c.returncode for c in children]}")
    return json.loads(outputs[0].splitlines()[-1])["step_ms"]


def plain_child(args) -> None:
    """One process of the plain loop: initialises (a group), trains, prints its timing."""
    procs, devices, process_id, port = (int(x) for x in args.plain_child[:4])
    batch, log_every = (int(x) for x in args.plain_child[4].split(":"))
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    if procs > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", procs, process_id)
    jax.devices()  # the backend starts here, with this environment's thread pool, before
    # jaxdist is imported (for the model's initial weights): its import may size the pool
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import peer_plain_jax as plain
    from jaxdist.train.build_model import build_model
    from jaxdist.train.config import from_dict

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    model, _ = build_model(from_dict({"model": {"name": "gpt", **MODEL}}).model, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated
    tx = plain.make_optimizer(3e-4)
    opt_state = jax.jit(tx.init)(params)
    step = plain.make_step(tx, n_heads=MODEL["n_heads"], dtype=jax.numpy.float32)
    rows = batch // procs  # this process's rows of each global batch
    rng = np.random.default_rng(process_id)
    batches = [  # on the devices, split over all of them
        jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")),
            rng.integers(0, MODEL["vocab_size"], (rows, MODEL["seq_len"] + 1), dtype=np.int32),
        )
        for _ in range(4)
    ]

    def read(loss) -> float:  # a replicated scalar: this process's copy
        return float(np.asarray(loss.addressable_data(0)))

    for i in range(WARMUP):
        params, opt_state, loss = step(params, opt_state, batches[i % 4])
    read(loss)
    jax.block_until_ready((params, opt_state))
    started, pending = time.perf_counter(), None
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batches[i % 4])
        if pending is not None:  # the logged step before: read after the next is queued
            read(pending)
        pending = loss if (i + 1) % log_every == 0 else None
    if pending is not None:
        read(pending)
    jax.block_until_ready((params, opt_state))
    elapsed_s = time.perf_counter() - started
    print(json.dumps({"step_ms": elapsed_s / args.steps * 1e3}), flush=True)


def main(argv=None) -> None:
    args = parse(argv)
    if args.plain_child:
        plain_child(args)
        return
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        raise SystemExit(f"overhead: unknown case(s) {sorted(unknown)}; have {list(CASES)}")
    head = f"{'case':<13}{'best: jaxdist':>14}{'plain':>8}{'gap':>8}"
    print(f"{head}{'median: jaxdist':>17}{'plain':>8}{'gap':>8}  runs (jaxdist | plain)")
    for case in args.cases.split(","):
        runs = {"jaxdist": [], "plain": []}
        for _ in range(args.repeats):  # alternating: drifts in the machine's speed hit both
            runs["jaxdist"].append(run_jaxdist(case, args.steps))
            runs["plain"].append(run_plain(case, args.steps))
        best = {who: min(times) for who, times in runs.items()}
        median = {who: statistics.median(times) for who, times in runs.items()}
        gap = best["jaxdist"] / best["plain"] - 1
        median_gap = median["jaxdist"] / median["plain"] - 1
        shown = " ".join(f"{t:.2f}" for t in runs["jaxdist"]) + " | "
        shown += " ".join(f"{t:.2f}" for t in runs["plain"])
        print(
            f"{case:<13}{best['jaxdist']:>14.3f}{best['plain']:>8.3f}{gap:>+8.1%}"
            f"{median['jaxdist']:>17.3f}{median['plain']:>8.3f}{median_gap:>+8.1%}  {shown}"
        )
        if args.out:
            record = {"case": case, "steps": args.steps, "best": best, "gap": gap}
            record.update(median=median, median_gap=median_gap, runs=runs)
            with open(args.out, "a") as out:
                out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
