"""Each strategy wires the one pure ``train_step`` (and ``eval_step``) to devices, and
does nothing else.

``layout(name, mesh)`` says where the state lives; ``wire(name, build, ...)`` returns
the jitted step and evaluation, which ``DataParallel`` holds as a ``StepProgram``. Every
strategy's step takes the same global batch (``shard_batch`` output, rows split over data
and fsdp); what differs is the state's layout and where the step runs per replica:
nowhere (gspmd: global arrays), its gradient part (shard_map: ``shard_map.PerReplica``),
or all of it (pmap).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    decides (gspmd, shard_map), or (pmap) one copy per device stacked on a leading axis
    of ``copies`` = N."""

    mesh: Mesh
    copies: int = 0
    rules: tuple = ()  # the user's path rules (regex, axes)
    logical_rules: dict | None = None

    def shardings(self, abstract_state):
        """The state's shardings: a tree for jit's in/out_shardings (or one for all)."""
        if self.copies:
            return NamedSharding(self.mesh, P(DATA))
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
class StepProgram:
    """The training step of one layout as one object: the jitted function and the
    abstract inputs it is built for (``jax.ShapeDtypeStruct``s carrying their shardings).
    It lowers and compiles without data or a real state, e.g.
    ``program.compile().memory_analysis()`` or ``.as_text()`` for its collectives."""

    fn: Callable  # jitted: (state, global batch) -> (state, metrics); donates the state
    state: Any  # abstract TrainState
    batch: Any  # abstract global batch
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, state, batch):
        return self.fn(state, batch)

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(self.state, self.batch)

    def abstract_batch(self, batch):
        """``batch``'s shapes and dtypes, laid out as this program's batches are."""
        return abstract(batch, jax.tree.leaves(self.batch)[0].sharding)

    def compile(self) -> jax.stages.Compiled:
        if "compiled" not in self._compiled:
            self._compiled["compiled"] = self.lower().compile()
        return self._compiled["compiled"]


def abstract(tree, shardings):
    """``tree``'s shapes and dtypes with ``shardings`` (a tree, or one for all)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(lambda s, sub: abstract(sub, s), shardings, tree)


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
    if beyond_data and name == "pmap":
        axes = ",".join(f"{a}={n}" for a, n in beyond_data.items())
        raise ConfigError(
            f"strategy pmap: the mesh has axes beyond data ({axes}); pmap only splits the "
            "batch over data. Use --strategy gspmd (or shard_map) for fsdp, model or stage axes"
        )
    if name == "pmap":  # (N, ...): device d holds row d
        return Layout(mesh, copies=mesh.size)
    return Layout(mesh, rules=tuple(rules or ()), logical_rules=logical_rules)


def wants_per_replica(name: str, mesh: Mesh, grad_accum: int, has_batch_stats: bool) -> bool:
    """Whether the gradient is computed per replica (``shard_map.PerReplica``).

    Always under shard_map. Under gspmd when XLA's partitioner alone would reduce more
    than once per step: with grad-accum it all-reduces inside the microbatch loop (K
    times), with pipeline stages inside the schedule's loop (once per tick and layer),
    and under fsdp CPU's XLA all-reduces whole gradients (no reduce-scatter). Not for a
    model with batch statistics: gspmd promises the global batch's, and per replica they
    would be each device's. Nor with a model axis: at the boundary of the per-replica
    region XLA gathers model-split weights whole, which costs more than it saves."""
    if name == "shard_map":
        return True
    shape = mesh.shape
    looped = grad_accum > 1 or shape.get("stage", 1) > 1
    wanted = looped or shape.get("fsdp", 1) > 1
    return name == "gspmd" and wanted and shape.get("model", 1) == 1 and not has_batch_stats


def wire(name: str, build: Callable, mesh: Mesh, axis_name: str, state_sharding, per_replica):
    """``build(per_replica) -> (train_step, eval_step)`` wired by strategy ``name``:
    ``(step, evaluate)``, both jitted functions of (state, global batch)."""
    module = _module(name)
    if name == "pmap":
        return module.wire(build, mesh, axis_name)
    from jaxdist.strategies import gspmd

    return gspmd.wire(build, mesh, state_sharding, per_replica)


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
