"""Which data-parallel strategy is fastest? Times the real trainer for each.

Command:   python experiments/bench_strategies.py [--cpu-devices 8] [--steps 60]
Hardware:  any; here a 2-core CPU emulating 8 devices.
Expected:  a table of median step time per (model, strategy). On 8 emulated CPU devices
           the three are within noise of each other (they compile to the same all-reduce);
           gspmd is the default because it needs no per-device code at all.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    from jaxdist.train.config import from_dict
    from jaxdist.train.trainer import train

    print(f"{'model':6} {'strategy':10} {'median step ms':>15} {'samples/s':>10}")
    for model in ("mlp", "gpt"):
        for strategy in ("pmap", "shard_map", "gspmd"):
            times = []
            for _ in range(args.repeats):
                config = from_dict(
                    {
                        "model": {"name": model},
                        "train": {"strategy": strategy, "steps": args.steps, "log_every": 1},
                    }
                )
                run = train(config, write=False, quiet=True)
                times += [h["step_time_s"] for h in run.history[5:]]  # skip warm-up steps
            ms = 1e3 * statistics.median(times)
            row = {
                "model": model,
                "strategy": strategy,
                "median_step_ms": ms,
                "samples_per_s": config.train.global_batch_size / ms * 1e3,
            }
            print(f"{model:6} {strategy:10} {ms:15.2f} {row['samples_per_s']:10.0f}")
            print(json.dumps(row))


if __name__ == "__main__":
    main()
