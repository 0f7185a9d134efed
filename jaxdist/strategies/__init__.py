"""Each strategy wires the one pure ``train_step`` (and ``eval_step``) to devices, and
does nothing else.

``layout(name, mesh)`` says where the state lives; ``wire(name, train_step, eval_step,
mesh, axis_name) -> Wired``. Every strategy's step takes the same global batch
(``shard_batch`` output, rows split over ``data``); what differs is the state's layout and
whether the step runs per device (pmap, shard_map: ``axis_name`` bound) or globally (gspmd).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.config import ConfigError
from jaxdist.sharding import BATCH_SPEC, DATA

NAMES = ("pmap", "shard_map", "gspmd")


@dataclass(frozen=True)
class Layout:
    """Where the state lives: each leaf one array replicated over the mesh, or (pmap) one
    copy per device stacked on a leading axis of ``copies`` = N."""

    sharding: NamedSharding
    copies: int = 0

    def expand(self, state):
        """One copy -> this layout; inside ``jax.jit`` with ``out_shardings=sharding``,
        so each device computes its own copy and none holds more than one."""
        if not self.copies:
            return state
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.copies, *jnp.shape(x))), state)

    def one_copy(self, state):
        """This layout -> one copy (pmap: device 0's, from this process's first device)."""
        if not self.copies:
            return state
        return jax.tree.map(lambda x: x.addressable_data(0)[0], state)


@dataclass(frozen=True)
class Wired:
    step: Callable  # (state, global_batch) -> (state, metrics), compiled on first call
    lower: Callable  # (state, global_batch) -> jax.stages.Lowered, for HLO inspection
    evaluate: Callable  # (state, global_batch with "mask") -> {name: summed value}


def _module(name: str):
    if name == "pmap":
        from jaxdist.strategies import pmap as module
    elif name == "shard_map":
        from jaxdist.strategies import shard_map as module
    elif name == "gspmd":
        from jaxdist.strategies import gspmd as module
    else:
        raise ConfigError(f"strategy: {name!r} is not one of {', '.join(NAMES)}")
    return module


def layout(name: str, mesh: Mesh) -> Layout:
    if name == "pmap":  # (N, ...): device d holds row d
        return Layout(NamedSharding(mesh, BATCH_SPEC), copies=mesh.size)
    _module(name)  # checks the name
    return Layout(NamedSharding(mesh, P()))


def wire(
    name: str, train_step: Callable, eval_step: Callable, mesh: Mesh, axis_name: str = DATA
) -> Wired:
    """``axis_name``: the name the per-device strategies bind their data axis to (the
    model's own, for SyncBatchNorm); gspmd binds none."""
    return _module(name).wire(train_step, eval_step, mesh, axis_name)


def local_value(x) -> np.ndarray:
    """This process's first copy of a replicated (or per-device stacked) array; works when
    the global array spans other processes' devices too."""
    return np.asarray(x.addressable_data(0))


def scalars(metrics) -> dict[str, float]:
    """Replicated scalars, or pmap's (N,) per-device copies: the first local value."""
    return {k: float(local_value(v).reshape(-1)[0]) for k, v in metrics.items()}
