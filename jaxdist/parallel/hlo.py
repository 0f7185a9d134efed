"""Collective bytes and matmul FLOPs per device, read from a compiled XLA program's text.

``read_program(jax.jit(f).lower(...).compile().as_text(), num_devices)`` walks the
per-device program (after SPMD partitioning; CPU or GPU compiler) and counts, per run of
the program, every collective (kind, bytes, replica groups, executions) and the FLOPs of
every matmul (``dot``, ``convolution``, cuBLAS GEMM custom-calls), each multiplied by how
often its computation runs: a ``while`` body runs its trip count times.

Bytes per device per execution of one collective (n = replica group size):
  all-reduce: the operands' bytes (the buffer reduced);
  all-gather: bytes received = result bytes x (n-1)/n;
  reduce-scatter, all-to-all: bytes sent = operand bytes x (n-1)/n;
  collective-permute: operand bytes, 0 when every pair is (i, i).
Device ids are the program's partition ids (its positions in the device assignment).
Async pairs are counted once, at ``*-start`` or at the collective an ``async-start`` wraps.
Instructions must be one per line, as compiled text prints them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from jaxdist.parallel.replica_groups import close_bracket, parse_replica_groups

# Bytes per element; every f8 variant (f8e4m3fn, f8e5m2, ...) is 1, see _nbytes.
_ELEMENT_BYTES = {
    **{"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2},
    **{"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16},
    **{"s4": 0.5, "u4": 0.5, "token": 0},
}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([<=\d,]*)\]")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEE_LIST = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    bytes: float  # per device per execution, as defined in the module docstring
    groups: tuple[tuple[int, ...], ...]  # replica groups (source/target pairs for a permute)
    count: int  # executions per program run (trip counts multiplied)
    name: str  # the HLO instruction name

    def link(self, node_of: Callable[[int], int]) -> str:
        """Return "intra" if every group lies inside one node, else "inter"."""
        spans = any(len({node_of(d) for d in group}) > 1 for group in self.groups)
        return "inter" if spans else "intra"


@dataclass(frozen=True)
class ProgramCounts:
    collectives: tuple[Collective, ...]
    matmul_flops: float  # per device per program run, loops multiplied
    unknown_trip_counts: int  # while loops whose trip count could not be read (counted once)

    def bytes_by_link(self, node_of: Callable[[int], int]) -> dict[str, float]:
        """Bytes x count per device per run, split by ``Collective.link``."""
        out = {"intra": 0.0, "inter": 0.0}
        for c in self.collectives:
            out[c.link(node_of)] += c.bytes * c.count
        return out

    def bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.bytes * c.count
        return out


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: str  # result shape text, maybe a tuple
    opcode: str
    operands: str  # the text between the opcode's parentheses
    attrs: str  # everything after them


@dataclass
class _Computation:
    instrs: list[_Instr]
    root: str = ""


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: operands like ``f32[8,32]{1,0} %a``."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[last:i].strip())
            last = i + 1
    tail = text[last:].strip()
    return parts + [tail] if tail else parts


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array in a (possibly nested tuple) shape, in order; layouts are skipped."""
    return [
        (dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(shape)
    ]


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]]) -> float:
    return float(
        sum(
            math.prod(dims) * (1 if dtype.startswith("f8") else _ELEMENT_BYTES[dtype])
            for dtype, dims in arrays
        )
    )


def _parse_instr(line: str) -> tuple[bool, _Instr] | None:
    m = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end() :]
    shape_end = close_bracket(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    if shape_end < 0:
        return None
    op = re.match(r"\s*([\w\-]+)\(", rest[shape_end:])
    if not op:
        return None
    open_at = shape_end + op.end() - 1
    close_at = close_bracket(rest, open_at)
    attrs = rest[close_at + 1 :]
    instr = _Instr(m[2], rest[:shape_end], op[1], rest[open_at + 1 : close_at], attrs)
    return bool(m[1]), instr


def _parse_module(hlo_text: str) -> tuple[dict[str, _Computation], str]:
    comps: dict[str, _Computation] = {}
    entry, current = "", None
    for raw in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", raw)  # "/*index=5*/" inside long tuples
        line = re.sub(r"metadata=\{[^}]*\}", "", line)  # op names may hold "(" or "="
        head = re.match(r"\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{\s*$", line)
        if current is None and head and not line.startswith("HloModule"):
            current = comps.setdefault(head[2], _Computation([]))
            entry = head[2] if head[1] else entry
        elif current is not None and line.strip().startswith("}"):
            current = None
        elif current is not None and (parsed := _parse_instr(line)):
            is_root, instr = parsed
            current.instrs.append(instr)
            current.root = instr.name if is_root else current.root
    return comps, entry


def _operands(instr: _Instr, shapes: dict[str, str]) -> list[tuple[str, str]]:
    """(name, shape) per operand: the shape printed inline, else the defining instruction's."""
    out = []
    for tok in _split_top(instr.operands):
        m = re.match(r"(?:(.*\S)\s+)?%?([\w.\-]+)$", tok)
        if m:
            out.append((m[2], m[1] or shapes.get(m[2], "")))
    return out


def _collective(
    instr: _Instr, shapes: dict[str, str], num_devices: int, count: int
) -> Collective | None:
    kind = instr.opcode.removesuffix("-start")
    if kind not in KINDS:
        return None
    operand_bytes = _nbytes([a for _, s in _operands(instr, shapes) for a in _arrays(s)])
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=(\{.*?\}\})", instr.attrs)
        groups = parse_replica_groups(pairs[1], num_devices) if pairs else ()
        moves = any(a != b for a, b in groups)
        return Collective(kind, operand_bytes if moves else 0.0, groups, count, instr.name)
    at = instr.attrs.find("replica_groups=")
    groups = parse_replica_groups(instr.attrs[at + 15 :] if at >= 0 else "{}", num_devices)
    # Each device keeps its own 1/n and moves the rest: 7/8 of the buffer on 8 devices.
    share = (len(groups[0]) - 1) / len(groups[0])
    if kind == "all-gather":
        results = _arrays(instr.shape)
        if instr.opcode.endswith("-start"):  # ((operands), (results)): keep the results
            results = results[len(results) // 2 :]
        nbytes = _nbytes(results) * share
    else:
        nbytes = operand_bytes * (1.0 if kind == "all-reduce" else share)
    return Collective(kind, nbytes, groups, count, instr.name)


def _matmul_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    """2 x output elements x product of the lhs contracting (or kernel input) sizes."""
    if instr.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    elif instr.opcode == "custom-call" and any(f'"{t}"' in instr.attrs for t in _GEMM_TARGETS):
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    elif instr.opcode == "convolution":
        labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
        kernel = _arrays(_operands(instr, shapes)[1][1])[0][1]
        inner = [d for d, label in zip(kernel, labels[1], strict=True) if label != "o"]
        return 2.0 * math.prod(_arrays(instr.shape)[0][1]) * math.prod(inner)
    else:
        return 0.0
    lhs = _arrays(_operands(instr, shapes)[0][1])[0][1]
    dims = [int(d.strip(' "')) for d in contracting[1].split(",") if d.strip(' "')]
    return 2.0 * math.prod(_arrays(instr.shape)[0][1]) * math.prod(lhs[d] for d in dims)


def _trip_count(instr: _Instr, comps: dict[str, _Computation]) -> int | None:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    if known:
        return int(known[1])
    # Fallback: a condition "i < constant", assuming i starts at 0 and steps by 1.
    cond = comps.get(re.search(r"condition=%?([\w.\-]+)", instr.attrs)[1])
    if cond is None:
        return None
    by_name = {i.name: i for i in cond.instrs}
    compare = by_name.get(cond.root)
    args = [n for n, _ in _operands(compare, {})] if compare else []
    if compare and compare.opcode == "fusion":  # the compare wrapped in a fused computation
        fused = comps.get(re.search(r"calls=%?([\w.\-]+)", compare.attrs)[1])
        inner = {i.name: i for i in fused.instrs} if fused else {}
        compare = inner.get(fused.root) if fused else None
        params = [inner.get(n) for n, _ in _operands(compare, {})] if compare else []
        args = [args[int(p.operands)] if p and p.opcode == "parameter" else "" for p in params]
    if not compare or compare.opcode != "compare" or "direction=LT" not in compare.attrs:
        return None
    bound = by_name.get(args[1]) if len(args) == 2 else None
    if bound and bound.opcode == "constant" and bound.operands.strip().isdigit():
        return int(bound.operands)
    return None


def _multiplicities(comps: dict[str, _Computation], entry: str) -> tuple[dict[str, int], int]:
    """Runs of each computation per program run, and the number of unknown trip counts.
    A while condition runs trip + 1 times (5 iterations test it 6 times); each branch of a
    conditional counts as taken (an upper bound); reducers and comparators (``to_apply``
    of anything but ``call``) run per element and hold no dots or collectives: skipped."""
    callers: dict[str, list[tuple[str, int]]] = {}
    unknown = 0
    for name, comp in comps.items():
        for instr in comp.instrs:
            if instr.opcode in ("async-done", "async-update"):  # same callee as async-start
                continue
            trip = 1
            if instr.opcode == "while":
                found = _trip_count(instr, comps)
                unknown += found is None
                trip = 1 if found is None else found
            edges = list(_CALLEE.findall(instr.attrs))
            for key, listed in _CALLEE_LIST.findall(instr.attrs):
                edges += [(key, c.strip().lstrip("%")) for c in listed.split(",") if c.strip()]
            for key, callee in edges:
                if key == "to_apply" and instr.opcode != "call":
                    continue
                factor = {"body": trip, "condition": trip + 1}.get(key, 1)
                callers.setdefault(callee, []).append((name, factor))
    memo: dict[str, int] = {entry: 1}

    def runs(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # guards against a malformed cyclic call graph
            memo[name] = sum(runs(c) * f for c, f in callers.get(name, ()))
        return memo[name]

    return {name: runs(name) for name in comps}, unknown


def read_program(hlo_text: str, num_devices: int) -> ProgramCounts:
    """Collectives and matmul FLOPs of one compiled program, per device per run.
    ``num_devices`` sizes the single group that ``replica_groups={}`` means."""
    comps, entry = _parse_module(hlo_text)
    if entry not in comps:
        raise ValueError("no ENTRY computation in the HLO text")
    runs, unknown = _multiplicities(comps, entry)
    collectives: list[Collective] = []
    flops = 0.0
    for name, comp in comps.items():
        if not runs[name]:
            continue
        shapes = {i.name: i.shape for i in comp.instrs}
        for instr in comp.instrs:
            found = _collective(instr, shapes, num_devices, runs[name])
            collectives += [found] if found else []
            flops += _matmul_flops(instr, shapes) * runs[name]
    return ProgramCounts(tuple(collectives), flops, unknown)
