"""Can the input pipeline feed the devices? Host tokens/s, and the step's data wait.

Command:   python experiments/bench_data.py [--cpu-devices 8] [--seconds 3]
Hardware:  any; the README's figures are from a 2-core CPU emulating 8 devices.
Expected:  1) host throughput for GPT batches (16 x 1024 tokens, windows of a token file
           picked by the shuffled sampler) far above 10M tokens/s per host: 20 times what
           one H100 consumes training a 124M GPT (about 455K tokens/s);
           2) with shard_batch to the devices as well (what the background producer does);
           3) in a real training run through the trainer, the share of step time spent
           waiting for data (metrics.jsonl's data_wait_frac): about 0.
The token file is the standard library corpus (prepared on first use, ~30M tokens).
"""

from __future__ import annotations

import argparse
import json
import time

import jax


def tokens_per_s(make_batch, tokens_per_batch: int, seconds: float) -> float:
    make_batch(0)  # warm up (page cache, compilation of any transfer)
    start, batches = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        make_batch(batches)
        batches += 1
    return batches * tokens_per_batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import jaxdist
    from jaxdist.data import TokenWindows, stdlib_corpus
    from jaxdist.train.config import from_dict
    from jaxdist.train.trainer import train

    path = stdlib_corpus()["train"]
    windows = TokenWindows(path, args.seq_len)
    sampler = jaxdist.DistributedSampler(len(windows), args.batch, seed=0)
    mesh = jaxdist.make_mesh()
    per_batch = args.batch * args.seq_len

    host = tokens_per_s(lambda k: windows[sampler.indices(k)], per_batch, args.seconds)
    to_devices = tokens_per_s(
        lambda k: jax.block_until_ready(jaxdist.shard_batch(windows[sampler.indices(k)], mesh)),
        per_batch,
        args.seconds,
    )
    # A real run: a small GPT whose steps are short, the hardest case for the producer.
    config = from_dict(
        {
            "model": {"name": "gpt", "seq_len": 128, "d_model": 64, "n_layers": 2, "n_heads": 4},
            "data": {"path": str(path)},
            "train": {"steps": 60, "global_batch_size": 32, "log_every": 10},
        }
    )
    run = train(config, write=False, quiet=True)
    waits = [r["data_wait_frac"] for r in run.history if "data_wait_frac" in r]
    step_ms = [r["step_time_s"] * 1e3 for r in run.history[1:]]
    result = {
        "token_file": f"{path.name}: {windows.num_tokens:,} tokens",
        "host_tokens_per_s": round(host),
        "host_plus_shard_batch_tokens_per_s": round(to_devices),
        "devices": f"{mesh.size} {jax.devices()[0].platform}",
        "train_step_ms": round(sum(step_ms) / len(step_ms), 2),
        "train_data_wait_frac": round(sum(waits) / len(waits), 4),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
