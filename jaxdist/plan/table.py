"""A plan as text: one row per candidate, the best layout's command, and what each
column rests on."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxdist.plan.targets import Target
from jaxdist.units import size

if TYPE_CHECKING:  # the planner imports the trainer; the table alone does not
    from jaxdist.plan.planner import Candidate, Plan

GiB = 2**30
GPU_NOTE = (
    "Kernels: XLA's own. cuDNN's flash attention (a GPU run's choice in bf16) cannot be "
    "compiled without cuDNN's library: attention here is XLA's, its memory an upper bound"
)
ORDER = {"compiled": 0, "too big": 1, "unsplittable": 2, "failed": 3, "timed out": 3,
         "worker memory": 3, "budget": 4}  # fmt: skip


def render(plan: Plan) -> str:
    kind, options = plan.target.kind, plan.options
    peak = f"{kind.peak_flops[plan.dtype] / 1e12:,.3g}"
    lines = [
        f"Plan for {plan.target}: {plan.target.num_devices} devices, "
        f"{size(plan.capacity_bytes)} usable each "
        f"({options.memory_fraction:.0%} of {size(kind.memory_bytes)}); "
        f"training state {size(plan.state_bytes)} in all",
        f"Step time = matmul FLOPs at {peak} TFLOP/s x {options.efficiency:.0%}"
        + (" (nominal: no datasheet for a CPU)" if kind.platform == "cpu" else "")
        + f" {'overlapped with' if options.overlap else '+'} collectives at "
        f"{kind.intra_node_bytes_per_s / 1e9:.0f} GB/s in a node, "
        f"{kind.inter_node_bytes_per_s / 1e9:.0f} GB/s across nodes (per device, one way)",
        "Per device and step: memory from the compiled program (peak = arguments + outputs + "
        "temporaries - reuse), collective bytes by link from its replica groups, matmul FLOPs "
        "with loops counted",
        *([GPU_NOTE] if plan.target.is_gpu else []),
        *plan.notes,
        "",
    ]
    width = max(len(c.layout.mesh) for c in plan.candidates)
    lines.append(_row(["mesh", "accum", "remat", "options", "args", "temp", "peak", "fits",
                       "in node", "across", "FLOPs", "step s", "note"], width))  # fmt: skip
    for c in sorted(plan.candidates, key=_sort_key):
        lines.append(_row(_cells(c, plan), width))
    lines.append("")
    compiled = plan.compiled
    lines.append(f"{len(plan.candidates)} layouts, {compiled} compiled, in {plan.elapsed_s:.0f} s")
    if plan.best:
        b = plan.best
        chosen = " ".join(["--mesh", b.layout.mesh, "--grad-accum", str(b.layout.grad_accum),
                           *b.layout.option_flags])  # fmt: skip
        cost = f"{size(b.peak_bytes)}, ~{b.time.step_s:.3g} s a step"
        lines += ["", f"Best that fits: {chosen} ({cost})", plan.command]
    elif compiled == 0 and any(c.phase != "screen" for c in plan.candidates):
        lines += ["", nothing_compiled(plan)]
    else:
        lines += ["", "No layout fits: more devices, a smaller batch or model, or --remat full."]
    return "\n".join(lines)


def nothing_compiled(plan: Plan) -> str:
    """What a plan that measured nothing says: no layout is ruled out."""
    counts: dict[str, int] = {}
    for c in plan.candidates:
        counts[c.status] = counts.get(c.status, 0) + 1
    why = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return (
        f"No layout was compiled ({why}): nothing was measured, so no layout is ruled out. "
        f"Give the search more time (--budget-s, now {plan.options.budget_s:.0f} s; 0: no "
        f"limit; --candidate-timeout-s, now {plan.options.candidate_timeout_s:.0f} s), or "
        "fewer programs to compile (--scan-layers: one block for all; --mesh to fix the layout)"
    )


def _sort_key(c: Candidate):
    return (ORDER.get(c.status, 5), not c.fits, c.time.step_s if c.time else 0, c.layout)


def _cells(c: Candidate, plan: Plan) -> list[str]:
    layout = c.layout
    head = [layout.mesh, str(layout.grad_accum), layout.remat, layout.option_names]
    if c.status != "compiled":
        why = c.why.split("; ")[0]  # the layout function's first clause names the problem
        return [*head, "", "", "", "no" if c.status == "too big" else "-", "", "", "", "",
                f"{c.status}: {why}"]  # fmt: skip
    m = c.measured
    note = "" if not m["unknown_loops"] else f"{m['unknown_loops']} loop(s) counted once"
    for notice in m.get("notices", []):  # e.g. "--mesh model=2 splits no parameter ..."
        note += f" {notice.split(':')[0]}"
    if m.get("microbatches"):
        note = f"pipeline {m['microbatches']} microbatches " + note
    return [
        *head, size(m["argument_bytes"]), size(m["temp_bytes"]), size(m["peak_bytes"]),
        "yes" if c.fits else "no",
        size(m["collective_bytes"]["intra"]), size(m["collective_bytes"]["inter"]),
        f"{m['matmul_flops']:.3g}",
        f"{c.time.step_s:.3g}", note.strip(),
    ]  # fmt: skip


WIDTHS = [5, 5, 10, 9, 9, 9, 4, 10, 10, 8, 7]  # after the mesh; the note last


def _row(cells: list[str], mesh_width: int) -> str:
    out = [cells[0].ljust(mesh_width)]
    out += [cell.rjust(width) for cell, width in zip(cells[1:-1], WIDTHS, strict=True)]
    return "  ".join([*out, cells[-1]]).rstrip()


def train_command(train_flags, layout, target: Target, memory_fraction: float, gpt: bool) -> str:
    """The user's flags with the plan's layout: ``python -m jaxdist.train ...``."""
    kept, skip = [], {"--mesh", "--grad-accum", "--remat", "--cpu-devices", "--num-devices",
                      "--shard-optimizer", "--pipeline-schedule", "--seq-attention"}  # fmt: skip
    flags = list(train_flags)
    while flags:
        flag = flags.pop(0)
        name = flag.split("=", 1)[0]
        if name in skip or name.replace("_", "-").removeprefix("--train.") in {s[2:] for s in skip}:
            if "=" not in flag and flags and not flags[0].startswith("--"):
                flags.pop(0)
            continue
        kept.append(flag)
    layout_flags = ["--mesh", layout.mesh, "--grad-accum", str(layout.grad_accum)]
    layout_flags += layout.option_flags
    if gpt:
        layout_flags += ["--remat", layout.remat]
    prefix = ""
    if target.is_gpu:
        prefix = f"XLA_PYTHON_CLIENT_MEM_FRACTION={memory_fraction:.2f} "
    elif target.kind.platform == "cpu":
        layout_flags += ["--cpu-devices", str(target.num_devices)]
    return prefix + " ".join(["python -m jaxdist.train", *kept, *layout_flags])


def as_json(plan: Plan) -> dict:
    """The plan as plain JSON (``--json``): every candidate, the best, the command."""

    def one(c: Candidate) -> dict:
        return {
            "mesh": c.layout.mesh, "grad_accum": c.layout.grad_accum,
            "remat": c.layout.remat, "shard_optimizer": c.layout.zero,
            "pipeline_schedule": c.layout.schedule if c.layout.stage > 1 else None,
            "phase": c.phase, "status": c.status,
            "fits": c.fits, "why": c.why, "measured": c.measured,
            "time": dataclasses.asdict(c.time) if c.time else None,
        }  # fmt: skip

    return {
        "target": str(plan.target), "capacity_bytes": plan.capacity_bytes,
        "options": dataclasses.asdict(plan.options), "state_bytes": plan.state_bytes,
        "elapsed_s": plan.elapsed_s, "candidates": [one(c) for c in plan.candidates],
        "best": one(plan.best) if plan.best else None, "command": plan.command,
        "compiled": plan.compiled, "notes": plan.notes,
    }  # fmt: skip
