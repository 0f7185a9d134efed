"""Reading device arrays on the host: a replicated array's local copy, a sharded one
gathered across processes, a step's scalar metrics."""

from __future__ import annotations

import jax
import numpy as np


def local_value(x) -> np.ndarray:
    """This process's first copy of a replicated (or per-device stacked) array; works when
    the global array spans other processes' devices too."""
    return np.asarray(x.addressable_data(0))


def host_value(x) -> np.ndarray:
    """The whole value of a global array as numpy, on every process: a replicated array's
    local copy, a sharded one gathered (``process_allgather``)."""
    if not isinstance(x, jax.Array) or x.sharding.is_fully_replicated:
        return local_value(x) if isinstance(x, jax.Array) else np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def scalars(metrics) -> dict[str, float]:
    """Replicated scalars, or pmap's (N,) per-device copies (equal): the first value."""
    return {k: float(host_value(v).reshape(-1)[0]) for k, v in metrics.items()}
