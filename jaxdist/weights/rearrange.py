"""Reordering a tensor's axes by a pattern, as einops writes it, and back.

``"d (three h e) -> d (h three e)"`` reads a (D, 3 * H * E) matrix whose columns are
q | k | v, each head-major, and gives the columns head by head, q, k and v of a head
adjacent: GPT-2's fused ``c_attn`` in the built-in GPT's order. The same pattern read
right to left is the inverse, so one line in a weight map serves import and export.

Axis sizes come from the tensor and from ``sizes`` (a group of several names may leave
one unknown: it is what the axis length leaves). ``read`` builds a region of the result
from a region of the source: an axis the pattern keeps whole and alone (``d`` above) is
sliced before the source is read, so a process reads only the rows it holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np

from jaxdist.errors import ConfigError

Groups = list[list[str]]


def parse(pattern: str) -> tuple[Groups, Groups]:
    """``"a (b c) -> (c b) a"`` -> ([[a], [b, c]], [[c, b], [a]]), checked."""
    if pattern.count("->") != 1:
        raise ConfigError(f"rearrange {pattern!r}: needs one '->' between two sides")
    left, right = (_groups(side, pattern) for side in pattern.split("->"))
    names = [n for g in left for n in g]
    if sorted(names) != sorted(n for g in right for n in g) or len(set(names)) != len(names):
        raise ConfigError(f"rearrange {pattern!r}: both sides must name the same axes, once each")
    return left, right


def _groups(side: str, pattern: str) -> Groups:
    tokens = re.findall(r"\(|\)|[A-Za-z_]\w*|\S", side)
    groups: Groups = []
    current: list[str] | None = None
    for token in tokens:
        if token == "(" and current is None:
            current = []
        elif token == ")" and current is not None:
            groups.append(current)
            current = None
        elif re.fullmatch(r"[A-Za-z_]\w*", token) and current is not None:
            current.append(token)
        elif re.fullmatch(r"[A-Za-z_]\w*", token):
            groups.append([token])
        else:
            raise ConfigError(f"rearrange {pattern!r}: unexpected {token!r}")
    if current is not None:
        raise ConfigError(f"rearrange {pattern!r}: an unclosed '('")
    return [g for g in groups if g]


def axis_sizes(groups: Groups, shape: tuple[int, ...], sizes: dict[str, int], what: str):
    """Each name's size: given in ``sizes`` or what its axis leaves (one per group)."""
    if len(groups) != len(shape):
        raise ConfigError(f"{what}: the pattern has {len(groups)} axes, the tensor {shape}")
    out = {}
    for group, length in zip(groups, shape, strict=True):
        known = {n: sizes[n] for n in group if n in sizes}
        unknown = [n for n in group if n not in sizes]
        product = math.prod(known.values())
        if len(unknown) > 1:
            raise ConfigError(f"{what}: give the sizes of all but one of {', '.join(group)}")
        if unknown and product and length % product == 0:
            known[unknown[0]] = length // product
        if math.prod(known.values()) != length or (unknown and not product):
            raise ConfigError(
                f"{what}: axis ({' '.join(group)}) of length {length} does not split as "
                f"{', '.join(f'{n}={v}' for n, v in known.items())}"
            )
        out.update(known)
    return out


def apply(x: np.ndarray, left: Groups, right: Groups, sizes: dict[str, int], what: str):
    """The rearrangement of ``x`` (shaped as ``left``) into ``right``'s shape."""
    size = axis_sizes(left, x.shape, sizes, what)
    flat = [n for g in left for n in g]
    split = x.reshape([size[n] for n in flat])
    order = [flat.index(n) for g in right for n in g]
    return split.transpose(order).reshape([math.prod(size[n] for n in g) for g in right])


def out_shape(left: Groups, right: Groups, shape, sizes, what: str) -> tuple[int, ...]:
    size = axis_sizes(left, tuple(shape), sizes, what)
    return tuple(math.prod(size[n] for n in g) for g in right)


def read(read_source: Callable, source_shape, left: Groups, right: Groups, sizes, index, what):
    """``result[index]`` without reading more of the source than needed: an axis kept
    alone on both sides is sliced in the source; the others are read whole."""
    alone = {g[0]: i for i, g in enumerate(left) if len(g) == 1}
    source_index = [slice(None)] * len(left)
    rest = list(index)
    sizes = dict(sizes)
    for axis, group in enumerate(right):
        if len(group) == 1 and group[0] in alone:
            source_index[alone[group[0]]] = index[axis]
            rest[axis] = slice(None)  # already cut
            sizes.pop(group[0], None)  # its length is the region's
    block = read_source(tuple(source_index))
    return apply(block, left, right, sizes, what)[tuple(rest)]
