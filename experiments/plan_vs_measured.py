"""The planner against a real GPU: the 1-GPU step's predicted peak memory and step time
(``python -m jaxdist.plan``, compiled for the device kind without using the device)
next to the ones measured on the device, for the GPT at three sizes.

Command:   python experiments/plan_vs_measured.py --out experiments/results [--steps 10]
           python experiments/plan_vs_measured.py --predict-only --target H200 --out DIR
           python experiments/plan_vs_measured.py --out DIR   # then reads DIR's predictions
Hardware:  one NVIDIA GPU (H100 80GB or H200); ``--sizes tiny`` runs on a CPU as a smoke
           test (no memory statistics there, and a nominal peak: no comparison).
           ``--predict-only`` needs no GPU (the planner compiles without one): run with
           JAX_PLATFORMS=cpu, it writes OUT/plan_predictions_<target>.json, which a later
           run on the GPU reads instead of planning again (gpu_round.py plans while it
           compiles its other programs).
Expected:  predicted peak within 10% of ``memory_stats()["peak_bytes_in_use"]`` and
           predicted step time within 25% of the measured median (the planner's bar);
           OUT/plan_vs_measured_<device>.json and a markdown table on stdout.

Both sides use XLA's attention (``--attention xla``): the planner cannot compile cuDNN's
without cuDNN's library. The step time's efficiency is the planner's default (0.5); the
table also gives the efficiency that would have matched.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")  # as the plan's command

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist.plan import Options, targets  # noqa: E402
from jaxdist.train import compile_only  # noqa: E402
from jaxdist.train import config as config_lib  # noqa: E402

# name: (d_model, n_layers, n_heads, seq_len, global batch)
SIZES = {
    "tiny": (64, 2, 4, 64, 8),
    "124M": (768, 12, 12, 1024, 16),
    "355M": (1024, 24, 16, 1024, 8),
    "1.3B": (2048, 24, 16, 1024, 8),
}


def flags(size: str) -> list[str]:
    d, layers, heads, seq, batch = SIZES[size]
    return [
        "--model", "gpt", "--d-model", str(d), "--n-layers", str(layers),
        "--n-heads", str(heads), "--seq-len", str(seq), "--global-batch-size", str(batch),
        "--vocab-size", "50304", "--dtype", "bfloat16", "--attention", "xla",
        "--mesh", "data=1", "--grad-accum", "1", "--remat", "none",
    ]  # fmt: skip


def target_for(device) -> str:
    if device.platform == "cpu":
        return "cpu:1"
    kind = device.device_kind.upper()
    return "H200" if "H200" in kind else "H100-80GB"


def measure(size: str, steps: int) -> dict:
    """The step trained on this device: its peak memory and median step time."""
    config = config_lib.parse_args(flags(size))
    dp, _, mesh = compile_only.build(config, jax.devices()[:1])
    state = dp.init_state()
    rng = np.random.default_rng(0)
    d, _, _, seq, batch = SIZES[size]
    tokens = rng.integers(0, 50257, (batch, seq + 1), dtype=np.int32)
    batch_arrays = jaxdist.shard_batch({"tokens": tokens}, mesh)
    times = []
    for _ in range(steps + 2):  # the first two compile and warm up
        t0 = time.perf_counter()
        state, metrics = dp.step(state, batch_arrays)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    return {"step_s": statistics.median(times[2:]), "peak_bytes": stats.get("peak_bytes_in_use")}


def predict(size: str, target: str) -> dict:
    plan = jaxdist.plan(flags(size), target, Options(budget_s=0, workers=1))
    (c,) = plan.candidates
    if c.status != "compiled":
        return {"status": c.status, "why": c.why}
    return {
        "peak_bytes": c.measured["peak_bytes"], "step_s": c.time.step_s,
        "matmul_flops": c.measured["matmul_flops"], "compile_s": c.measured["compile_s"],
    }  # fmt: skip


def predictions_file(out: Path, target: str) -> Path:
    return out / f"plan_predictions_{target}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="124M,355M,1.3B")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--predict-only", action="store_true", help="plan; touch no device")
    parser.add_argument("--target", default="", help="with --predict-only: H200, H100-80GB...")
    parser.add_argument("--measure-only", action="store_true", help="no planning (warm-up)")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.predict_only:
        found = {size: predict(size, args.target) for size in sizes}
        predictions_file(args.out, args.target).write_text(json.dumps(found, indent=1))
        print(json.dumps(found), flush=True)
        return
    device = jax.devices()[0]
    target = target_for(device)
    kind = targets.parse_target(target).kind
    planned = predictions_file(args.out, target)
    known = json.loads(planned.read_text()) if planned.exists() else {}
    rows = []
    for size in sizes:
        predicted = known.get(size) or ({} if args.measure_only else predict(size, target))
        measured = measure(size, args.steps)
        row = {"size": size, "target": target, "predicted": predicted, "measured": measured}
        if measured["peak_bytes"] and "peak_bytes" in predicted:
            row["memory_error"] = predicted["peak_bytes"] / measured["peak_bytes"] - 1
            row["time_error"] = predicted["step_s"] / measured["step_s"] - 1
            peak = kind.peak_flops["bfloat16"]
            row["matching_efficiency"] = predicted["matmul_flops"] / (peak * measured["step_s"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = device.device_kind.replace(" ", "_")
    (args.out / f"plan_vs_measured_{name}.json").write_text(json.dumps(rows, indent=1))
    print("| size | predicted peak | measured peak | error | predicted step | measured step |"
          " error | efficiency that matches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        gib = lambda n: f"{n / 2**30:.2f} GiB" if n else "-"  # noqa: E731
        print(f"| {r['size']} | {gib(p.get('peak_bytes'))} | {gib(m['peak_bytes'])} | "
              f"{r.get('memory_error', float('nan')):+.0%} | {p.get('step_s', 0):.4f} s | "
              f"{m['step_s']:.4f} s | {r.get('time_error', float('nan')):+.0%} | "
              f"{r.get('matching_efficiency', float('nan')):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
