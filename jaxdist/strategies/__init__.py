"""Each strategy wires the one pure ``train_step`` (and ``eval_step``) to devices, and
does nothing else.

``layout(name, mesh)`` says where the state lives; ``wire(name, train_step, eval_step,
mesh, axis_name) -> Wired``. Every strategy's step takes the same global batch
(``shard_batch`` output, rows split over ``data``); what differs is the state's layout and
whether the step runs per device (pmap, shard_map: ``axis_name`` bound) or globally (gspmd).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.config import ConfigError
from jaxdist.layout import state_shardings
from jaxdist.sharding import DATA

NAMES = ("pmap", "shard_map", "gspmd")


@dataclass(frozen=True)
class Layout:
    """Where the state lives: each array laid out on the mesh as ``state_shardings``
    decides (gspmd), replicated (shard_map), or (pmap) one copy per device stacked on a
    leading axis of ``copies`` = N."""

    mesh: Mesh
    copies: int = 0
    sharded: bool = False  # gspmd: layout.state_shardings decides each array
    rules: tuple = ()  # the user's path rules (regex, axes)
    logical_rules: dict | None = None

    def shardings(self, abstract_state):
        """The state's shardings: a tree for jit's in/out_shardings (or one for all)."""
        if self.copies:
            return NamedSharding(self.mesh, P(DATA))
        if not self.sharded:
            return NamedSharding(self.mesh, P())
        return state_shardings(abstract_state, self.mesh, self.rules, self.logical_rules)

    def expand(self, state):
        """One copy -> this layout; inside ``jax.jit`` with ``out_shardings``, so each
        device computes its own copy or shard and none holds more."""
        if not self.copies:
            return state
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.copies, *jnp.shape(x))), state)

    def one_copy(self, state):
        """This layout -> one whole copy readable on every process (pmap: device 0's, from
        this process's first device; sharded arrays: gathered, replicated)."""
        if self.copies:
            return jax.tree.map(lambda x: x.addressable_data(0)[0], state)
        if all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state)):
            return state
        return _gather(self.mesh)(state)


@functools.cache
def _gather(mesh: Mesh):
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


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


def layout(name: str, mesh: Mesh, rules=(), logical_rules=None) -> Layout:
    _module(name)  # checks the name
    beyond_data = {a: n for a, n in mesh.shape.items() if a != DATA and n > 1}
    if beyond_data and name != "gspmd":
        axes = ",".join(f"{a}={n}" for a, n in beyond_data.items())
        raise ConfigError(
            f"strategy {name}: the mesh has axes beyond data ({axes}); {name} only splits "
            "the batch over data. Use --strategy gspmd for fsdp, model or stage axes"
        )
    if name == "pmap":  # (N, ...): device d holds row d
        return Layout(mesh, copies=mesh.size)
    return Layout(
        mesh, sharded=name == "gspmd", rules=tuple(rules or ()), logical_rules=logical_rules
    )


def wire(
    name: str,
    train_step: Callable,
    eval_step: Callable,
    mesh: Mesh,
    axis_name: str = DATA,
    state_sharding=None,
) -> Wired:
    """``axis_name``: the name the per-device strategies bind their data axis to (the
    model's own, for SyncBatchNorm); gspmd binds none. ``state_sharding``: the state's
    layout (``Layout.shardings``), which gspmd keeps in and out of the step."""
    if state_sharding is None:
        state_sharding = NamedSharding(mesh, P())
    return _module(name).wire(train_step, eval_step, mesh, axis_name, state_sharding)


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
