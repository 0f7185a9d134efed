"""What does each mesh layout cost per device? Memory, state and collectives of one GPT step.

Command:   python experiments/layouts.py [--layouts data=8 fsdp=8 ...] [--json rows.jsonl]
Hardware:  8 emulated CPU devices on a 2-core machine; steps are only compiled, never run.
Measures:  per layout, the compiled train step of the built-in GPT (3.3M parameters, AdamW,
           global batch 32 x 128 tokens): XLA's bytes per device (arguments, outputs, temps,
           total = arguments + outputs + temps - aliased), the params + optimizer state per
           device, the result bytes of each collective kind per step (loop bodies times their
           trip counts; a reduce-scatter's result is its 1/N shard) and the compile time.
Expected:  fsdp=8 and model=8 hold about 1/8 of data=8's state per device (1/2 for the 2-way
           layouts, 1/4 for data=2,fsdp=2,model=2; small vectors stay replicated). data=8 only
           all-reduces gradients: 4 B x params, plus one more tied-embedding gradient (its
           two uses are reduced separately; with accum=4 they are summed locally first:
           exactly 4 B x params, once per step, and temps fall to under half). fsdp=8
           all-gathers the params once (4 B x params) and reduce-scatters the gradients
           (results 1/8). model=8 moves nothing but the (32, 128, 256) activations'
           all-reduces, twice per layer each way, 5.5x data=8's bytes; every device sees the
           whole batch, so its temps are the largest. data=2,fsdp=2,model=2 (gspmd keeps XLA's
           own reduction with a model axis) gathers each weight's fsdp halves and all-reduces
           gradients and activations. The pipeline sends one microbatch's (1, 128, 256)
           activations per tick and all-reduces each stage's gradients once. 3-6 s a compile.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import Counter

import jax
import numpy as np
import optax
from flax import nnx

import jaxdist
from jaxdist.models.gpt import GPT

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
DTYPE_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8}
# "  ROOT %all-reduce.54 = (f32[1024]{0}, ...) all-reduce(%x), channel_id=1, ...": the result
# type sits between " = " and the opcode, the first lowercase word followed by "(".
INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?\S+ = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
CALLEE = re.compile(r"\b(?:calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")  # a conditional's {%a, %b}
TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(hlo_type: str) -> int:
    """f32[2,256] -> 2 * 256 * 4; a tuple type sums its elements; token[] counts 0."""
    return sum(
        math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES.get(dtype, 0)
        for dtype, dims in SHAPE.findall(hlo_type)
    )


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """HLO text -> {computation name: its instruction lines}, and the entry's name."""
    comps, entry, name = {}, "", None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            entry = name if line.startswith("ENTRY") else entry
            comps[name] = []
        elif name and line.startswith("  "):
            comps[name].append(line)
    return comps, entry


def collective_bytes(hlo: str) -> tuple[Counter, list[str]]:
    """Bytes per collective kind for one execution of the entry computation: a while body's
    collectives count once per iteration (its known_trip_count), nested loops multiply; each
    branch of a conditional counts as if it ran (an upper bound)."""
    comps, entry = computations(hlo)
    notes, memo = [], {}

    def total(name: str) -> Counter:
        if name not in memo:
            memo[name] = sum(map(instruction, comps.get(name, [])), Counter())
        return memo[name]

    def instruction(line: str) -> Counter:
        m = INSTRUCTION.match(line)
        if not m:
            return Counter()
        hlo_type, opcode, rest = m.groups()
        # Async "-start" counts (on GPU its tuple also holds the operand); "-done" only waits.
        if opcode.removesuffix("-start") in KINDS:
            return Counter({opcode.removesuffix("-start"): shape_bytes(hlo_type)})
        trip = TRIP.search(rest)
        if opcode == "while" and not trip:
            notes.append(f"unknown trip count, loop body counted once: {line.strip()[:80]}")
        trips = int(trip.group(1)) if opcode == "while" and trip else 1
        branches = re.findall(r"%([\w.\-]+)", "".join(BRANCHES.findall(rest)))
        out = Counter()
        for callee in CALLEE.findall(rest) + branches:
            out.update({kind: trips * n for kind, n in total(callee).items()})
        return out

    return total(entry), notes


def state_bytes(state) -> int:
    """Params + optimizer state one device holds: each leaf's shard shape x itemsize; e.g.
    data=8 (replicated): 3 x 4 B x 3.32M (params, AdamW's mu and nu) + the int32 count."""
    leaves = jax.tree.leaves((state.params, state.opt_state))
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves
    )


def loss_fn(model, batch):
    tokens = batch["tokens"]  # (B, T + 1): inputs are the first T, targets the last T
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def compile_step(spec: str, args):
    """A layout, e.g. "data=4,model=2" or "data=8,accum=4" -> (dp, program, compiled, s)."""
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    accum = sizes.pop("accum", 1)
    stacked = sizes.get("stage", 1) > 1  # the pipeline splits the stacked blocks over stages
    dims = (args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    dp = jaxdist.DataParallel(
        lambda: GPT(*dims, attention="xla", scan_layers=stacked, rngs=nnx.Rngs(0)),
        optax.adamw(1e-3),
        loss_fn,
        mesh=jaxdist.make_mesh(**sizes),
        grad_accum=accum,
        microbatches=args.microbatches,
    )
    program = dp.program({"tokens": jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), np.int32)})
    start = time.perf_counter()
    compiled = program.compile()  # trace + lower + XLA compile; nothing runs
    return dp, program, compiled, time.perf_counter() - start


def measure(spec: str, args) -> dict:
    """One layout -> one row: bytes per device, collective bytes per step, compile time."""
    dp, program, compiled, seconds = compile_step(spec, args)
    mem, hlo = compiled.memory_analysis(), compiled.as_text()  # the HLO after partitioning
    if args.dump_hlo:
        with open(f"{args.dump_hlo}/{spec.replace(',', '_')}.hlo", "w") as f:
            f.write(hlo)
    collectives, notes = collective_bytes(hlo)
    sizes = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes)
    return {
        "layout": spec,
        **dict(zip(("arguments", "outputs", "temps"), sizes, strict=True)),
        "total": sum(sizes) - mem.alias_size_in_bytes,  # donated state: outputs reuse inputs
        "state": state_bytes(program.state),
        **{kind: collectives[kind] for kind in KINDS},
        "compile_s": round(seconds, 2),
        "notes": notes + ([dp.pipeline.describe()] if dp.pipeline else []),
    }


def markdown(rows: list[dict]) -> str:
    """Bytes in MB (1e6) per device; collectives per step."""
    heads = ["layout", "args MB", "out MB", "temp MB", "total MB", "state MB"]
    heads += [f"{k} MB" for k in KINDS] + ["compile s"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" + "--:|" * (len(heads) - 1)]
    for r in rows:
        mb = [
            f"{r[k] / 1e6:.2f}" for k in ("arguments", "outputs", "temps", "total", "state", *KINDS)
        ]
        lines.append(f"| `{r['layout']}` | " + " | ".join(mb) + f" | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    default = ["data=8", "fsdp=8", "model=8", "data=4,model=2", "data=2,fsdp=2,model=2"]
    default += ["data=4,stage=2", "data=8,accum=4"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=default, help="accum=K: grad-accum")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--microbatches", type=int, default=0, help="pipeline; 0: 4 per stage")
    parser.add_argument("--json", help="also write one JSON line per layout here")
    parser.add_argument("--dump-hlo", help="a folder to write each layout's HLO text into")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before any device is used

    rows = []
    for spec in args.layouts:
        rows.append(measure(spec, args))
        print(f"{spec}: compiled in {rows[-1]['compile_s']} s", flush=True)
    print("\n" + markdown(rows) + "\n")
    for r in rows:
        for note in r["notes"]:
            print(f"{r['layout']}: {note}")
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
