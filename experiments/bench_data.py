"""Can the input pipeline feed the devices? Host tokens/s, the step's data wait, and
grain's worker processes (``--data-workers``) against the thread prefetcher.

Command:   python experiments/bench_data.py [--cpu-devices 8] [--seconds 3]
           python experiments/bench_data.py --grain-only [--workers 2] [--example-ms 2]
           (part 4 alone; it needs ``pip install 'jaxdist[grain]'``, and is skipped
           without it)
Hardware:  any; the README's figures are from a 2-core CPU emulating 8 devices.
Expected:  1) host throughput for GPT batches (16 x 1024 tokens, windows of a token file
           picked by the shuffled sampler) far above 10M tokens/s per host: 20 times what
           one H100 consumes training a 124M GPT (about 455K tokens/s);
           2) with shard_batch to the devices as well (what the background producer does);
           3) in a real training run through the trainer, the share of step time spent
           waiting for data (metrics.jsonl's data_wait_frac): about 0;
           4) a grain MapDataset whose ``.map`` costs ``--example-ms`` of single-threaded
           numpy per example, batches of 32 through the Prefetcher: examples/s with the
           work in the prefetcher's thread (workers 0) and in ``--workers`` grain
           processes. The thread is bound to one core (the GIL); N processes approach
           min(N, cores) times it, less what the main process spends receiving batches.
The token file is the standard library corpus (prepared on first use, ~30M tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import jax
import numpy as np


def tokens_per_s(make_batch, tokens_per_batch: int, seconds: float) -> float:
    make_batch(0)  # warm up (page cache, compilation of any transfer)
    start, batches = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        make_batch(batches)
        batches += 1
    return batches * tokens_per_batch / (time.perf_counter() - start)


def augment(record: int, rounds: int) -> dict:
    """A stand-in for per-example CPU work (decoding, augmenting): elementwise numpy on a
    (64, 64) float32 image, single-threaded like most of it; ``rounds`` sets the cost."""
    image = np.random.default_rng(record).random((64, 64), dtype=np.float32)
    for _ in range(rounds):
        image = np.sin(image) * 1.01 + np.roll(image, 1, axis=0) * 0.5
    return {"x": image, "y": np.int32(record % 10)}


def rounds_for(example_ms: float) -> int:
    """How many rounds of ``augment`` take ``example_ms`` on this machine."""
    start, probe = time.perf_counter(), 200
    for record in range(20):
        augment(record, probe)
    per_round_ms = (time.perf_counter() - start) * 1e3 / (20 * probe)
    return max(1, round(example_ms / per_round_ms))


def grain_examples_per_s(workers: int, rounds: int, batch: int, seconds: float) -> dict:
    """Batches of a grain MapDataset through host_batches and the Prefetcher (as the
    trainer wires them, the devices left out): examples/s after the first batch."""
    import functools

    import grain

    import jaxdist
    from jaxdist.data import Prefetcher, host_batches

    examples = grain.MapDataset.range(100_000).map(functools.partial(augment, rounds=rounds))
    sampler = jaxdist.DistributedSampler(len(examples), batch, process_index=0, process_count=1)
    start = time.perf_counter()
    batches = Prefetcher(host_batches(examples, sampler, workers=workers), lambda b: b)
    next(batches)  # the workers' start: imports and the first batch
    first_s, start, count = time.perf_counter() - start, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    rate = count * batch / (time.perf_counter() - start)
    batches.close()
    return {"examples_per_s": round(rate), "first_batch_s": round(first_s, 2)}


def grain_comparison(args) -> dict:
    if importlib.util.find_spec("grain") is None:
        return {"grain": "skipped: pip install 'jaxdist[grain]'"}
    rounds = rounds_for(args.example_ms)
    start = time.perf_counter()
    for record in range(50):
        augment(record, rounds)
    measured_ms = (time.perf_counter() - start) * 1e3 / 50
    result = {"grain_example_ms": round(measured_ms, 2), "grain_batch": args.grain_batch}
    for workers in (0, args.workers):
        run = grain_examples_per_s(workers, rounds, args.grain_batch, args.seconds)
        result[f"grain_workers_{workers}"] = run
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--grain-only", action="store_true", help="part 4 alone")
    parser.add_argument("--workers", type=int, default=2, help="part 4: grain processes")
    parser.add_argument("--example-ms", type=float, default=2.0, help="part 4: work/example")
    parser.add_argument("--grain-batch", type=int, default=32)
    args = parser.parse_args()
    if args.grain_only:
        print(json.dumps(grain_comparison(args), indent=1))
        return
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
        **grain_comparison(args),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
