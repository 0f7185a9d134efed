"""Summarises a ``jax.profiler`` trace: device time per step by kernel and by kind.

Command:   python experiments/profile_summary.py TRACE.xplane.pb[.gz] --steps 5
Hardware:  any (it reads a file); the traces worth reading come from a GPU run of
           ``bench_gpt.py --profile DIR`` (5 traced steps of the real trainer).
Expected:  a table of the top kernels by device time per step, and the share of matmul,
           attention, the loss, the optimizer and the rest, so that the next speed lever
           is chosen from data (experiments/PERF.md).

The kind of a kernel is read from its name and its stats (XLA writes the HLO op and the
JAX name stack beside each GPU kernel): the first pattern below that matches wins. With
XLA's command buffers on (the default) the stats name only the buffer, and the name
stacks of a jaxdist step carry no module or function names (``jit(train_step)/jvp()/
dot_general``), so on such a trace "loss" and "optimizer" stay empty: PERF.md's profile
section splits those out by hand, from a trace with command buffers off.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

KINDS = (  # (kind, pattern on "name stats"), first match wins
    ("attention", r"cudnn|fmha|flash|dot_product_attention|attention"),
    ("optimizer", r"adam|optax|apply_updates|clip_by_global_norm|scale_by|global_norm"),
    ("loss", r"cross_entropy|log_softmax|logsumexp|softmax_cross|next_token_loss"),
    ("matmul", r"gemm|cublas|cutlass|xmma|nvjet|matmul|sm90_|triton_gemm|\bdot\b"),
    ("copy/memset", r"memcpy|memset|copy"),
)


def load(path: str | Path):
    from jax.profiler import ProfileData

    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return ProfileData.from_serialized_xspace(f.read())
    return ProfileData.from_file(str(path))


def kind_of(text: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, text, re.IGNORECASE):
            return kind
    return "other"


def device_lines(profile, plane_prefix: str):
    """The lines of the device planes that hold kernels: the streams where there are
    streams (XLA's derived "XLA Ops" lines would count each kernel twice)."""
    for plane in profile.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.lower().startswith("stream")]
        yield from ((plane.name, line) for line in streams or lines)


def summarise(path, steps: int, plane_prefix: str = "/device:GPU", top: int = 25) -> dict:
    profile = load(path)
    totals = collections.Counter()  # kernel name -> ns
    counts = collections.Counter()
    detail: dict[str, str] = {}  # kernel name -> its first event's stats, as text
    per_line = collections.Counter()
    for plane_name, line in device_lines(profile, plane_prefix):
        for event in line.events:
            totals[event.name] += event.duration_ns
            counts[event.name] += 1
            per_line[f"{plane_name} {line.name}"] += event.duration_ns
            if event.name not in detail:
                detail[event.name] = " ".join(f"{k}={str(v)[:160]}" for k, v in event.stats)
    all_ns = sum(totals.values()) or 1
    kinds = collections.Counter()
    for name, ns in totals.items():
        kinds[kind_of(f"{name} {detail[name]}")] += ns
    ranked = [
        {
            "kernel": name[:200],
            "ms_per_step": ns / 1e6 / steps,
            "share": ns / all_ns,
            "calls_per_step": counts[name] / steps,
            "kind": kind_of(f"{name} {detail[name]}"),
            "stats": detail[name][:400],
        }
        for name, ns in totals.most_common(top)
    ]
    return {
        "steps": steps,
        "device_ms_per_step": all_ns / 1e6 / steps,
        "kernels": len(totals),
        "kinds": {k: ns / all_ns for k, ns in kinds.most_common()},
        "lines_ms_per_step": {k: ns / 1e6 / steps for k, ns in per_line.most_common()},
        "top": ranked,
    }


def table(summary: dict) -> str:
    rows = [
        f"device time {summary['device_ms_per_step']:.2f} ms/step, "
        f"{summary['kernels']} distinct kernels"
    ]
    rows += [f"  {kind:<12}{share:>7.1%}" for kind, share in summary["kinds"].items()]
    rows.append(f"{'ms/step':>8}{'share':>7}{'calls':>7}  kind        kernel")
    for r in summary["top"]:
        rows.append(
            f"{r['ms_per_step']:>8.3f}{r['share']:>7.1%}{r['calls_per_step']:>7.1f}  "
            f"{r['kind']:<12}{r['kernel'][:90]}"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=5, help="steps the trace holds")
    parser.add_argument("--plane", default="/device:GPU", help="device planes' name prefix")
    parser.add_argument("--json", action="store_true", help="the summary as JSON")
    args = parser.parse_args(argv)
    summary = summarise(args.trace, args.steps, args.plane)
    print(json.dumps(summary, indent=1) if args.json else table(summary))


if __name__ == "__main__":
    main()
