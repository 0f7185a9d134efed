"""A Llama with experts against the dense Llama of its active parameters: tokens/s, memory
per device and the experts' all-to-all bytes, for expert = 1, 2, 4, 8.

Command:   python experiments/bench_moe.py --cpu [--out moe.jsonl]   # 8 emulated CPU devices
           python experiments/bench_moe.py --gpu [--out moe.jsonl]   # every GPU visible
           python experiments/bench_moe.py --cpu --experts 2 --steps 1   # the test's run
Hardware:  8 emulated CPU devices on a 2-core machine (the memory and byte counts are the
           compiled program's own; the times are CPU arithmetic of 8 devices sharing 2
           cores, not interconnect, and predict nothing of a GPU's), or N GPUs (one H200
           of the GPU round: expert=1 alone, the MoE's arithmetic against the dense).
Measures:  per row, the compiled training step (AdamW, dropless routing, no remat): its
           median step time over ``--steps`` steps after the first (compilation), tokens/s
           (global batch x T / step), per device XLA's temp bytes and its total (arguments
           + outputs + temps - aliased, as layouts.py and pipeline.py read it), the
           all-to-all bytes a device sends per step (``jaxdist.parallel.hlo``: operand x
           (N-1)/N, loops times their trip counts), the loss. Rows: the dense Llama on
           data=8 (ffn width K x F: the MoE's active parameters per token, the router's
           D x E aside; the same attention), then the MoE on expert=N,data=8/N. CPU: 2
           layers of d 64, 4 heads over 2 key/value heads, vocabulary 512, batch 16 x 64,
           float32; E = 8 experts, top K = 2, width F = 64 (dense: 128). GPU: bench_gpt's
           Llama 124M shape (12 layers of 768, an MLP of 2304 = 2 x 1152), E = 8 of width
           1152, batch 16 x 1024, vocabulary 50304, bf16.
Bytes:     ideally (a ragged all-to-all) each token's K pairs leave once and come back
           once: 2 K D x bytes per token forward, as much backward ("ideal": 4 K D bytes x
           n tokens a device x MoE layers x (N-1)/N). XLA:CPU has no ragged all-to-all:
           jaxdist.models.expert_parallel sends static buffers sized for the worst case,
           N buffers of n m rows each way, m = min(K, E/N) ("padded": 4 N n m D bytes x
           layers x (N-1)/N, N m / K times the ideal, plus the int32 expert ids forward).
Expected:  measured all-to-all = padded, exactly; 0 at expert=1. The experts' weights
           and AdamW state split 1/N (the rest replicated over data), the temps grow
           with the padded buffers (N m / K); at the CPU size the state is small, so the
           totals follow the temps. A GPU's timings are the GPU round's to measure
           (experiments/gpu_round_runs.py runs this file, last, on one GPU: expert=1).
Measured:  CPU, jax 0.10.2, 8 emulated devices on a 2-core machine (shared with other
           users), 2026-12-02, ``--cpu --steps 5`` (experiments/results/
           cpu_2026-12-02_bench_moe.jsonl and .log); MiB per device, MB per step:

           model mesh             step ms  tokens/s  temp MiB  total MiB  a2a  ideal  padded
           dense data=8              28.6    35,814      2.71       3.93  0     0      0
           moe   expert=1,data=8   1209.7       847     37.60      40.53  0     0      0
                 (the same row after the dropless sort went per device under a data split,
                 ``--experts 1 --no-dense --steps 5``: 310.7 ms, 3,295 tokens/s, the same
                 memory: XLA had gathered every row's expert ids to sort them everywhere)
           moe   expert=2,data=4    169.2     6,051      7.53       9.33  0.53  0.26   0.53
           moe   expert=4,data=2     88.6    11,557      9.03      10.27  1.58  0.39   1.58
           moe   expert=8,data=1     60.5    16,922      7.02       7.97  1.84  0.46   1.84

           0.11M parameters dense, 0.26M MoE of which 0.11M active per token (the dense's
           plus the router's 1,024). The all-to-all bytes are the padded count exactly
           (2x, 4x, 4x the ideal). expert=1 (no expert axis) is the slow row: the unsplit
           dropless path under GSPMD all-gathers the batch's 2,048 expert ids and sorts
           them on every device, so each device runs every token's experts (in the HLO:
           ``s32[2048] sort``; 4.4x dense's all-reduce bytes, 14x its temps). Split over
           expert, each device sorts its own rows. The MoE's steps are slower than the
           dense's at every N here: on CPU the sort, scatter and ragged_dot of 8 devices
           share 2 cores; these timings are not GPU predictions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

CPU = dict(vocab=512, seq_len=64, batch=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
           experts=8, top_k=2, expert_ffn=64, dtype="float32")  # fmt: skip
GPU = dict(vocab=50304, seq_len=1024, batch=16, d_model=768, n_layers=12, n_heads=12,
           n_kv_heads=4, experts=8, top_k=2, expert_ffn=1152, dtype="bfloat16")  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cpu", action="store_true", help="8 emulated CPU devices, tiny sizes")
    where.add_argument("--gpu", action="store_true", help="the visible GPUs, 124M-shaped")
    p.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="expert axis sizes (those not dividing the devices are skipped)",
    )
    p.add_argument("--no-dense", action="store_true", help="the MoE rows alone")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    p.add_argument("--out", default="", help="one JSON line per row, appended as it ends")
    return p.parse_args(argv)  # fmt: skip


def build(size: dict, moe: bool):
    """The Llama of ``size``: with E experts of width F (top K), or dense of width K x F."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxdist.models.llama import Llama
    from jaxdist.models.moe import MoESettings

    settings = MoESettings(size["experts"], size["top_k"], ffn_dim=size["expert_ffn"])
    return Llama(
        size["vocab"], size["d_model"], size["n_layers"], size["n_heads"],
        n_kv_heads=size["n_kv_heads"], ffn_dim=size["top_k"] * size["expert_ffn"],
        dtype=getattr(jnp, size["dtype"]), moe=settings if moe else None, rngs=nnx.Rngs(0),
    )  # fmt: skip


def exchange_bytes(size: dict, n: int, devices: int) -> tuple[float, float]:
    """(ideal, padded) all-to-all bytes a device sends per step over expert=n (module
    docstring): the forward pass's two exchanges and the backward pass's two."""
    if n == 1:
        return 0.0, 0.0
    tokens = size["batch"] * size["seq_len"] / devices  # rows split over every device
    k, d, per = size["top_k"], size["d_model"], size["experts"] // n
    width = 2 if size["dtype"] == "bfloat16" else 4
    leaves, layers = (n - 1) / n, size["n_layers"]
    ideal = 4 * k * d * width * tokens * layers * leaves
    m = min(k, per)
    padded = 4 * n * tokens * m * d * width * layers * leaves
    padded += n * tokens * m * 4 * layers * leaves  # the expert ids, forward only
    return ideal, padded


def measure(size: dict, n: int, moe: bool, steps: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.losses import next_token_loss
    from jaxdist.parallel import hlo

    devices = jax.device_count()
    mesh = jaxdist.make_mesh(data=devices // n, expert=n)
    dp = jaxdist.DataParallel(lambda: build(size, moe), optax.adamw(1e-3), next_token_loss,
                              mesh=mesh)  # fmt: skip
    rng = np.random.default_rng(0)
    shape = (size["batch"], size["seq_len"] + 1)
    batch = {"tokens": rng.integers(0, size["vocab"], shape).astype(np.int32)}
    state, placed = dp.init_state(), jaxdist.shard_batch(batch, mesh)
    start = time.perf_counter()
    compiled = dp.program(placed).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    total = memory.argument_size_in_bytes + memory.output_size_in_bytes
    total += memory.temp_size_in_bytes - memory.alias_size_in_bytes
    sent = hlo.read_program(compiled.as_text(), devices).bytes_by_kind()
    times, metrics = [], {}
    for _ in range(steps + 1):
        begin = time.perf_counter()
        state, metrics = dp.step(state, placed)
        metrics = dp.metrics(metrics)  # host floats: waits for the step
        times.append(time.perf_counter() - begin)
    step_s = sorted(times[1:])[len(times[1:]) // 2] if steps else times[0]
    params = nnx.state(build_abstract(size, moe), nnx.Param)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    e, k, f, d = size["experts"], size["top_k"], size["expert_ffn"], size["d_model"]
    idle = (e - k) * 3 * d * f * size["n_layers"] if moe else 0  # experts a token skips
    ideal, padded = exchange_bytes(size, n, devices) if moe else (0.0, 0.0)
    where = f"expert={n},data={devices // n}" if moe else f"data={devices}"
    return {
        "model": "moe" if moe else "dense", "mesh": where,
        "expert": n, "devices": devices, "platform": jax.default_backend(), **size,
        "dense_ffn": k * f, "n_params": n_params, "active_params": n_params - idle,
        "step_s": step_s, "tokens_per_s": size["batch"] * size["seq_len"] / step_s,
        "compile_s": round(compile_s, 2), "temp_bytes": int(memory.temp_size_in_bytes),
        "total_bytes": int(total), "all_to_all_bytes": sent.get("all-to-all", 0.0),
        "ideal_bytes": ideal, "padded_bytes": padded, "collective_bytes": sent,
        "loss": metrics["loss"], "lm_loss": metrics.get("lm_loss", metrics["loss"]),
        "share_max": metrics.get("moe/share_max"),
    }  # fmt: skip


def build_abstract(size: dict, moe: bool):
    """The model's shapes alone (parameter counts), without computing its weights."""
    from flax import nnx

    return nnx.eval_shape(lambda: build(size, moe))


def table(rows: list[dict]) -> str:
    head = f"{'model':<6}{'mesh':<18}{'params':>9}{'active':>9}{'step ms':>9}{'tokens/s':>10}"
    head += f"{'temp MiB':>10}{'total MiB':>10}{'a2a MB':>8}{'ideal MB':>9}{'padded MB':>10}"
    lines = [head + f"{'loss':>8}"]
    for r in rows:
        mb = [r[k] / 1e6 for k in ("all_to_all_bytes", "ideal_bytes", "padded_bytes")]
        lines.append(
            f"{r['model']:<6}{r['mesh']:<18}{r['n_params'] / 1e6:>8.2f}M"
            f"{r['active_params'] / 1e6:>8.2f}M{r['step_s'] * 1e3:>9.1f}"
            f"{r['tokens_per_s']:>10,.0f}{r['temp_bytes'] / 2**20:>10.2f}"
            f"{r['total_bytes'] / 2**20:>10.2f}{mb[0]:>8.2f}{mb[1]:>9.2f}{mb[2]:>10.2f}"
            f"{r['loss']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    if args.cpu:  # before jax is imported
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")
        )
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    size, devices = CPU if args.cpu else GPU, jax.device_count()
    runs = [] if args.no_dense else [(1, False)]
    runs += [(n, True) for n in args.experts if devices % n == 0 and size["experts"] % n == 0]
    skipped = [n for n in args.experts if (n, True) not in runs]
    if skipped:
        print(f"bench_moe: expert={skipped} skipped: not dividing {devices} devices "
              f"and {size['experts']} experts", flush=True)  # fmt: skip
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - lines as they finish
    rows = []
    print(table([]), flush=True)
    for n, moe in runs:
        rows.append(measure(size, n, moe, args.steps))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        if out:
            out.write(json.dumps(rows[-1]) + "\n")
            out.flush()
    print("\n" + table(rows))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
