"""Replica groups of an XLA collective, from the three forms compiled text prints them
in: explicit ``{{0,1},{2,3}}`` (``{}``: every device), iota ``[2,4]<=[2,2,2]T(0,2,1)``
(an iota over the second shape, transposed, reshaped to [groups, group size]) and mesh
axes ``mesh['a'=2,'b'=4] {'b'}`` (GSPMD's, naming the axes a group spans)."""

from __future__ import annotations

import math
import re

import numpy as np


def close_bracket(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in {text[start : start + 80]!r}")


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Groups from the text after ``replica_groups=`` (trailing attributes are ignored):
    ``{{0,1},{2,3}}``, ``{}`` (all devices), iota ``[2,4]<=[2,2,2]T(0,2,1)`` or mesh axes
    ``mesh['a'=2,'b'=4] {'b'}``."""
    text = text.strip()
    if text.startswith("mesh["):
        groups = _mesh_groups(text)
    elif text.startswith("["):
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        if not m:
            raise ValueError(f"unreadable iota replica groups {text[:80]!r}")
        groups = _iota(m[2], m[3]).reshape([int(d) for d in m[1].split(",")])
    else:
        braces = text[: close_bracket(text, 0) + 1]
        if re.fullmatch(r"\{\s*\}", braces):  # "{}": one group of every device
            return (tuple(range(num_devices)),)
        inner = re.findall(r"\{([\d,\s]*)\}", braces)
        return tuple(tuple(int(d) for d in g.split(",") if d.strip()) for g in inner)
    return tuple(tuple(int(d) for d in row) for row in groups)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    arr = np.arange(math.prod(shape)).reshape(shape)
    return arr.transpose([int(p) for p in perm.split(",")]) if perm else arr


def _mesh_groups(text: str) -> np.ndarray:
    """XLA's MeshAxesReplicaGroupList: split each mesh axis into its referenced sub-axes
    ("'a':(pre)size"), move the grouped ones last, one group per row."""
    axes_end = text.index("]")
    mesh = re.findall(r"'?([^'=,\s]+)'?=(\d+)", text[5:axes_end])
    names, sizes = [n for n, _ in mesh], [int(s) for _, s in mesh]
    rest, devices = text[axes_end + 1 :], np.arange(math.prod(sizes))
    ids = re.match(r",\s*device_ids=\(", rest)
    if ids:  # a permuted mesh: "[2,4]T(1,0)" (iota) or a list of ids
        end = close_bracket(rest, ids.end() - 1)
        body = rest[ids.end() : end]
        iota = re.fullmatch(r"\s*(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", body)
        devices = _iota(iota[1], iota[2]) if iota else np.array(re.findall(r"\d+", body), int)
        rest = rest[end + 1 :]
    refs = re.findall(r"'?([^',:{}\s]+)'?(?::\((\d+)\)(\d+))?", rest[: rest.index("}") + 1])
    dims: list[int] = []
    grouped: list[int] = []
    for name, full in zip(names, sizes, strict=True):
        mine = [(int(pre), int(size)) for n, pre, size in refs if n == name and pre]
        if any(n == name and not pre for n, pre, _ in refs):
            mine = [(1, full)]  # the whole axis
        local: list[int] = []
        slot: dict[int, int] = {}
        prefix = 1
        for k in sorted(range(len(mine)), key=lambda k: mine[k][0]):
            pre, size = mine[k]
            if pre != prefix:  # an unreferenced piece below this sub-axis
                local.append(pre // prefix)
            slot[k] = len(local)
            local.append(size)
            prefix = pre * size
        if prefix != full:
            local.append(full // prefix)
        grouped += [len(dims) + slot[k] for k in range(len(mine))]
        dims += local
    perm = [d for d in range(len(dims)) if d not in grouped] + grouped
    group_size = math.prod(dims[g] for g in grouped)
    return devices.reshape(dims).transpose(perm).reshape(-1, group_size)
