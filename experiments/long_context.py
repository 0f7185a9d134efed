"""Long context: peak memory and step time of a GPT's training step per sequence length,
for seq = 1, 2, 4, 8 and each attention split (ring, gather, all-to-all).

Command:   python experiments/long_context.py --cpu-devices 8              # CPU, T <= 2K
           python experiments/long_context.py --lengths 1024 4096 16384 32768 --steps 5
Hardware:  8 devices: 8 emulated CPU devices (the memory figures are the compiled
           program's own; the times are CPU arithmetic, not interconnect), or 8 GPUs.
Measures:  per (T, seq, way): the compiled step's temporary bytes per device
           (``memory_analysis``), the median step time over ``--steps`` steps after the
           first (compilation), the loss. The mesh is data = 8 / seq x seq and the global
           batch 8 / seq rows of T tokens: each device holds T / seq positions of one
           row. A 2-layer GPT, d_model 64, 8 heads (every seq size divides them, as
           all-to-all needs), bf16 on GPU, float32 on CPU, SGD.
Expected:  memory per device falls about as 1/seq for ring and all-to-all (gather keeps
           the whole K and V); ring's per-hop sends against all-to-all's four exchanges:
           all-to-all moves 4 x T/seq x d per layer whatever seq, ring (seq - 1) x 2 x
           T/seq x d, so all-to-all moves less from seq = 4 on; the printed "crossover"
           is the smallest seq at which all-to-all's measured step time beats the ring's.
Measured:  CPU, jax 0.10.2, 8 emulated devices on a 2-core machine, 2026-12-02
           (``--cpu-devices 8 --lengths 256 1024 --steps 2``), temp MiB per device at
           T = 1024: seq=1 169.2; seq=2 ring 98.5, gather 117.2, all-to-all 116.7;
           seq=4 39.6, 51.6, 50.7; seq=8 20.6, 26.3, 25.6. The same losses across ways.
           CPU step times measure arithmetic, not interconnect (the ring led at T = 1024,
           all-to-all at T = 256 from seq=4): the crossover is a GPU's to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--seq", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--ways", nargs="+", default=["ring", "gather", "all-to-all"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cpu-devices", type=int, default=0, help="emulate N CPU devices")
    p.add_argument("--out", default="", help="one JSON line per measurement")
    return p.parse_args(argv)


def measure(t: int, seq: int, way: str, steps: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.losses import next_token_loss
    from jaxdist.models.gpt import GPT

    gpu = jax.default_backend() == "gpu"
    dtype = jax.numpy.bfloat16 if gpu else jax.numpy.float32
    mesh = jaxdist.make_mesh(data=8 // seq, seq=seq) if seq > 1 else jaxdist.make_mesh(data=8)

    def model():
        return GPT(260, t, 64, 2, 8, dtype=dtype, seq_attention=way, rngs=nnx.Rngs(0))

    dp = jaxdist.DataParallel(model, optax.sgd(0.1), next_token_loss, mesh=mesh)
    rng = np.random.default_rng(0)
    rows = 8 // seq  # one row per data group: T / seq positions on each device
    batch = {"tokens": rng.integers(0, 257, (rows, t + 1)).astype(np.int32)}
    state, placed = dp.init_state(), jaxdist.shard_batch(batch, mesh)
    memory = dp.program(placed).compile().memory_analysis()
    times, loss = [], None
    for _ in range(steps + 1):
        start = time.perf_counter()
        state, metrics = dp.step(state, placed)
        loss = float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - start)
    timed = sorted(times[1:])
    return {"T": t, "seq": seq, "way": way if seq > 1 else "-", "loss": loss,
            "temp_bytes": int(memory.temp_size_in_bytes), "step_s": timed[len(timed) // 2],
            "platform": jax.default_backend()}  # fmt: skip


def crossover(rows: list[dict], t: int) -> int | None:
    """The smallest seq at which all-to-all's step beats the ring's at length ``t``."""
    by = {(r["seq"], r["way"]): r["step_s"] for r in rows if r["T"] == t}
    for seq in sorted({s for s, _ in by}):
        both = (seq, "all-to-all") in by and (seq, "ring") in by
        if both and by[(seq, "all-to-all")] < by[(seq, "ring")]:
            return seq
    return None


def main(argv=None) -> list[dict]:
    """The measurements, printed as a table (and written to ``--out``)."""
    args = parse(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={args.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    rows = []
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - lines as they finish
    print(f"{'T':>6} {'seq':>4} {'way':>10} {'temp MiB':>9} {'step s':>8} {'loss':>7}")
    for t in args.lengths:
        for seq in args.seq:
            for way in args.ways if seq > 1 else ["ring"]:
                if t % (2 * seq):
                    continue
                row = measure(t, seq, way, args.steps)
                rows.append(row)
                print(f"{t:>6} {seq:>4} {row['way']:>10} {row['temp_bytes'] / 2**20:>9.2f} "
                      f"{row['step_s']:>8.3f} {row['loss']:>7.3f}", flush=True)  # fmt: skip
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    for t in args.lengths:
        found = crossover(rows, t)
        print(f"T={t}: all-to-all first beats the ring at seq={found}" if found else
              f"T={t}: all-to-all never beats the ring here")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
