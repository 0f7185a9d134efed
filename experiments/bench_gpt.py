"""GPT-2 training speed on one device: jaxdist vs a plain-JAX step vs torch.compile.

Command:   python experiments/bench_gpt.py                       # GPU: 124M and 355M
           python experiments/bench_gpt.py --cpu                 # tiny sizes, for tests
           python experiments/bench_gpt.py --sizes 124M --who jaxdist --attention xla
           python experiments/bench_gpt.py --cache-study         # cold vs warm compile
Hardware:  one H100 or H200 (bf16 matmul peak measured in the run), or any CPU with --cpu.
Expected:  batch 16 x 1024, vocabulary 50304, bf16 compute, fp32 master weights, AdamW:
           jaxdist >= torch.compile's tokens/s and within 2% of plain JAX. Measured on an
           H200: 477K tokens/s at 124M (torch.compile 477K, plain JAX 460K), 190K at 355M
           (185K, 185K); experiments/PERF.md has the tables and commands.

Each (who, size) runs in its own process, so compile time is cold and peak memory is its
own. jaxdist runs through the real trainer (``jaxdist.train.train``: token file, sampler,
background prefetch, strategy, optimizer); plain JAX (``peer_plain_jax.py``) and
torch.compile (``peer_torch.py``) train the same model on device-resident batches.
Output: a table, and one JSON line per measurement in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxdist.flops import gpt_flops_per_token

HERE = Path(__file__).resolve().parent
SIZES = {  # GPT-2 sizes; batch 16 x 1024 tokens, vocabulary 50304 (50257 padded to 64)
    "124M": dict(n_layers=12, d_model=768, n_heads=12),
    "355M": dict(n_layers=24, d_model=1024, n_heads=16),
}
GPU_RUN = dict(batch=16, seq_len=1024, vocab_size=50304, dtype="bfloat16")
CPU_SIZES = {"tiny": dict(n_layers=2, d_model=64, n_heads=4)}
CPU_RUN = dict(batch=4, seq_len=64, vocab_size=512, dtype="float32")
WHO = ("jaxdist", "plain-jax", "torch.compile")
flops_per_token = gpt_flops_per_token  # bench_gpt_one imports it from here


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--sizes", default="", help="comma-separated; default all")
    parser.add_argument("--who", default=",".join(WHO), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default 60; cpu 5)")
    parser.add_argument("--attention", default="auto", choices=["auto", "cudnn", "xla"])
    parser.add_argument("--strategy", default="gspmd", choices=["gspmd", "shard_map", "pmap"])
    parser.add_argument("--scan-layers", action="store_true", help="jaxdist: one scanned block")
    parser.add_argument("--remat", default="none", choices=["none", "block", "full"])
    parser.add_argument(
        "--loss-chunks", type=int, default=-1, help="jaxdist: fused loss slices (-1: its default)"
    )
    parser.add_argument("--fp8", action="store_true", help="jaxdist: float8 linear layers")
    parser.add_argument("--no-donate", action="store_true", help="plain JAX: copy, not donate")
    parser.add_argument("--profile", default="", help="jaxdist: trace 5 steps into this dir")
    parser.add_argument("--note", default="", help="a label kept in the records")
    parser.add_argument("--xla-flags", default="", help="added to XLA_FLAGS for every run")
    parser.add_argument(
        "--cache-study",
        action="store_true",
        help="jaxdist twice with one compilation cache: cold, then warm",
    )
    parser.add_argument(
        "--torch-backend", default="inductor", help="torch.compile's backend (aot_eager: no C++)"
    )
    parser.add_argument("--out", default="bench_gpt.jsonl", help="JSON lines, appended")
    parser.add_argument("--one", nargs=2, metavar=("WHO", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def settings(args) -> tuple[dict, dict]:
    sizes, run = (CPU_SIZES, CPU_RUN) if args.cpu else (SIZES, GPU_RUN)
    if args.sizes:
        unknown = set(args.sizes.split(",")) - set(sizes)
        if unknown:
            raise SystemExit(f"bench_gpt: unknown size(s) {sorted(unknown)}; have {list(sizes)}")
        sizes = {k: v for k, v in sizes.items() if k in args.sizes.split(",")}
    # Timed steps in windows of `window`, each ending with a wait for the device, after
    # one window of warm-up (its first step compiles): step_ms is the median of the
    # windows' means. The trainer logs every `window` steps: its records are the windows.
    steps = args.steps or (5 if args.cpu else 60)
    window = min(steps, 10)
    return sizes, {**run, "steps": steps, "window": window, "warmup": window}


def child_argv(args, who: str, size: str) -> list[str]:
    """The command line of one measurement: this file with ``--one`` and the options."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", who, size]
    argv += ["--attention", args.attention, "--steps", str(args.steps)]
    argv += ["--strategy", args.strategy, "--remat", args.remat]
    argv += ["--loss-chunks", str(args.loss_chunks), "--torch-backend", args.torch_backend]
    argv += ["--scan-layers"] * args.scan_layers + ["--no-donate"] * args.no_donate
    argv += ["--fp8"] * args.fp8
    argv += ["--profile", args.profile] if args.profile else []
    argv += ["--note", args.note] if args.note else []
    return argv + (["--cpu"] if args.cpu else [])


def run_one(args, who: str, size: str, cache_dir: str = "", env_extra=None, timeout=None):
    """One measurement in a fresh process; returns its JSON record."""
    cmd = child_argv(args, who, size) + (["--cache-dir", cache_dir] if cache_dir else [])
    env = {**os.environ, **(env_extra or {})}
    flags = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    if flags:
        env["XLA_FLAGS"] = flags
    if args.cpu:  # one CPU device, like the one GPU
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return {"who": who, "size": size, "note": args.note, "error": f"timeout {err.timeout} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        error = f"exit {proc.returncode}: {tail}"
        return {"who": who, "size": size, "note": args.note, "error": error}
    return json.loads(lines[-1])


def table(records: list[dict]) -> str:
    head = f"{'who':<14}{'size':<6}{'step ms':>9}{'tokens/s':>12}{'MFU':>7}"
    head += f"{'compile s':>11}{'peak GB':>9}  note"
    rows = [head]
    for r in records:
        if "error" in r or "skipped" in r:
            rows.append(f"{r['who']:<14}{r['size']:<6}  {r.get('skipped') or r['error'][-200:]}")
            continue
        mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
        rows.append(
            f"{r['who']:<14}{r['size']:<6}{r['step_ms']:>9.1f}{r['tokens_per_s']:>12,.0f}"
            f"{r['mfu']:>7.1%}{r['compile_s']:>11.1f}{mem:>9}  {r.get('note', '')}"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    args = parse(argv)
    sizes, run = settings(args)
    if args.one:
        from bench_gpt_one import measure  # the child: one measurement, one JSON line

        print(json.dumps(measure(args, *args.one, sizes[args.one[1]], run)), flush=True)
        return
    records = []
    for size in sizes:
        for who in args.who.split(","):
            records.append(run_one(args, who, size))
            print(table(records[-1:]).splitlines()[-1], flush=True)
    if args.cache_study:  # compile times only: untraced
        untraced = argparse.Namespace(**{**vars(args), "profile": ""})
        with tempfile.TemporaryDirectory() as cache:
            for label in ("cold", "warm"):
                record = run_one(untraced, "jaxdist", next(iter(sizes)), cache)
                record["note"] = f"compilation cache {label}"
                records.append(record)
    print(table(records))
    with open(args.out, "a") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
