"""Quantities as people read them: ``size(n_bytes)``, in binary units (67.1 GiB, 312.0 MiB,
4.0 KiB, 17 B), the one way every message and table of jaxdist writes bytes."""

from __future__ import annotations

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def size(n: float) -> str:
    """Bytes in the largest unit that keeps the number at least 1."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
