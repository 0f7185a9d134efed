"""Each strategy wires the one pure ``train_step`` (and ``eval_step``) to devices, and
does nothing else.

``wire(name, train_step, eval_step, mesh) -> Wired``. Every strategy's step takes the same global
batch (``shard_batch`` output, rows split over ``data``); what differs is the state's
layout and whether the step runs per device (pmap, shard_map) or globally (gspmd).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from jaxdist.config import ConfigError


@dataclass(frozen=True)
class Wired:
    step: Callable  # (state, global_batch) -> (state, metrics), compiled on first call
    lower: Callable  # (state, global_batch) -> jax.stages.Lowered, for HLO inspection
    put_state: Callable  # one host copy of the state -> device state in this layout
    get_state: Callable  # device state -> one copy
    get_metrics: Callable  # device metrics -> {name: float}
    evaluate: Callable  # (state, global_batch with "mask") -> {name: summed value}


NAMES = ("pmap", "shard_map", "gspmd")


def wire(name: str, train_step: Callable, eval_step: Callable, mesh: Mesh) -> Wired:
    if name == "pmap":
        from jaxdist.strategies import pmap as module
    elif name == "shard_map":
        from jaxdist.strategies import shard_map as module
    elif name == "gspmd":
        from jaxdist.strategies import gspmd as module
    else:
        raise ConfigError(f"strategy: {name!r} is not one of {', '.join(NAMES)}")
    return module.wire(train_step, eval_step, mesh)


def local_value(x) -> np.ndarray:
    """This process's first copy of a replicated (or per-device stacked) array; works when
    the global array spans other processes' devices too."""
    return np.asarray(x.addressable_data(0))


def scalars(metrics) -> dict[str, float]:
    """Replicated scalars, or pmap's (N,) per-device copies: the first local value."""
    return {k: float(local_value(v).reshape(-1)[0]) for k, v in metrics.items()}
