"""GPT-2's and a Llama's training speed on one device: jaxdist vs plain JAX vs torch.compile.

Command:   python experiments/bench_gpt.py                       # GPU: GPT-2 124M and 355M
           python experiments/bench_gpt.py --model llama         # GPU: the Llama, 124M and 1B
           python experiments/bench_gpt.py --cpu [--model llama] # tiny sizes, for tests
           python experiments/bench_gpt.py --sizes 124M --who jaxdist --attention xla
           python experiments/bench_gpt.py --cache-study         # cold vs warm compile
Hardware:  one H100 or H200 (bf16 matmul peak measured in the run), or any CPU with --cpu.
Expected:  batch 16 x 1024, vocabulary 50304, bf16 compute, fp32 master weights, AdamW:
           jaxdist >= torch.compile's tokens/s and within 2% of plain JAX. Measured on an
           H200: 477K tokens/s at 124M (torch.compile 477K, plain JAX 460K), 190K at 355M
           (185K, 185K); experiments/PERF.md has the tables and commands. The Llama: not
           measured on a GPU yet (experiments/gpu_round.py has its rows).

Each (who, size) runs in its own process, so compile time is cold and peak memory is its
own. jaxdist runs through the real trainer (``jaxdist.train.train``: token file, sampler,
background prefetch, strategy, optimizer); plain JAX (``peer_plain_jax.py``) and
torch.compile (``peer_torch.py``) train the same model on device-resident batches.
Output: a table, and one JSON line per measurement in ``--out``.

``--model llama`` measures jaxdist's ``--model llama`` in Llama 3's shape (grouped-query
attention, SwiGLU, RoPE of theta 500000, RMSNorm of eps 1e-5, the head tied to the
embedding as Llama 3.2's 1B ties it), with the GPT's vocabulary of 50304 rows, against
``peer_plain_jax_llama.py`` and transformers' ``LlamaForCausalLM`` under torch.compile
(``peer_torch.py``), all three of one parameter count. 124M: GPT-2 124M's 12 layers of
768 with 12 query heads over 4 key/value heads (head_dim 64) and an MLP of 2304 (3 x d),
121.2M parameters; 1B: Llama 3.2 1B's 16 layers of 2048, 32 query heads over 8 key/value
heads (head_dim 64), an MLP of 8192, 1.076B parameters (its vocabulary of 128256 aside).
FLOPs per token: the GPT's 6N + 12 L d T, the Llama's 6N + 12 L H Dh T
(``jaxdist.flops``; tied, every weight is multiplied): 0.840 and 6.86 GFLOP at T = 1024.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxdist.flops import gpt_flops_per_token, llama_flops_per_token

HERE = Path(__file__).resolve().parent
LLAMA3 = dict(rope_theta=500000.0, rms_norm_eps=1e-5)  # tied: the Llama's default
SIZES = {  # batch 16 x 1024 tokens, vocabulary 50304 (GPT-2's 50257 padded to 64)
    "gpt": {  # GPT-2's sizes
        "124M": dict(n_layers=12, d_model=768, n_heads=12),
        "355M": dict(n_layers=24, d_model=1024, n_heads=16),
    },
    "llama": {  # Llama 3's shape (the docstring): 121.2M and 1.076B parameters
        "124M": dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=4, ffn_dim=2304, **LLAMA3),
        "1B": dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, **LLAMA3),
    },
}
GPU_RUN = dict(batch=16, seq_len=1024, vocab_size=50304, dtype="bfloat16")
CPU_SIZES = {
    "gpt": {"tiny": dict(n_layers=2, d_model=64, n_heads=4)},
    "llama": {"tiny": dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=192, **LLAMA3)},
}
CPU_RUN = dict(batch=4, seq_len=64, vocab_size=512, dtype="float32")
WHO = ("jaxdist", "plain-jax", "torch.compile")


def flops_per_token(model: str, n_params: int, dims: dict, seq_len: int) -> float:
    """The GPT's 6N + 12 L d T, or the Llama's 6N + 12 L H Dh T; the bench's Llama is
    tied, so every one of its N weights is multiplied (bench_gpt_one imports this)."""
    if model == "gpt":
        return gpt_flops_per_token(n_params, dims["n_layers"], dims["d_model"], seq_len)
    head_dim = dims["d_model"] // dims["n_heads"]
    return llama_flops_per_token(n_params, dims["n_layers"], dims["n_heads"], head_dim, seq_len)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--model", default="gpt", choices=sorted(SIZES), help="which family")
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
    sizes = sizes[args.model]
    if args.sizes:
        unknown = set(args.sizes.split(",")) - set(sizes)
        if unknown:
            have = f"{args.model} has {list(sizes)}"
            raise SystemExit(f"bench_gpt: unknown size(s) {sorted(unknown)}; {have}")
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
    argv += ["--model", args.model]
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
        error = f"timeout {err.timeout} s"
        return {"who": who, "model": args.model, "size": size, "note": args.note, "error": error}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        error = f"exit {proc.returncode}: {tail}"
        return {"who": who, "model": args.model, "size": size, "note": args.note, "error": error}
    return json.loads(lines[-1])


def table(records: list[dict]) -> str:
    head = f"{'who':<14}{'model':<6}{'size':<6}{'step ms':>9}{'tokens/s':>12}{'MFU':>7}"
    head += f"{'compile s':>11}{'peak GB':>9}  note"
    rows = [head]
    for r in records:
        which = f"{r['who']:<14}{r.get('model', 'gpt'):<6}{r['size']:<6}"
        if "error" in r or "skipped" in r:
            rows.append(f"{which}  {r.get('skipped') or r['error'][-200:]}")
            continue
        mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
        rows.append(
            f"{which}{r['step_ms']:>9.1f}{r['tokens_per_s']:>12,.0f}"
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
