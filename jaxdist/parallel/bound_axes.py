"""Axis names that a model uses for its own collectives, bound by jaxdist.

Flax models name axes for cross-device statistics, e.g. ``BatchNorm(axis_name="batch")``
(Linen and NNX), which calls ``lax.pmean(..., "batch")``. Outside a ``pmap``/``shard_map``
that binds the name, JAX stops with "unbound axis name: batch". jaxdist finds such names
when it first traces the loss and binds each one, so the model needs no edit per strategy:

- to a trivial axis of size 1 (``jax.vmap`` with ``axis_size=1``): a mean over it is the
  value itself. Under gspmd the statistics are then those of the global batch (the model
  sees global arrays); under pmap/shard_map those of each device's rows, as PyTorch DDP's
  plain BatchNorm;
- or, under pmap/shard_map with ``sync_batch_stats=True``, to the data axis itself
  (SyncBatchNorm): the strategy binds its per-device axis under the model's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax

from jaxdist.errors import ModelError
from jaxdist.parallel.device_mesh import DATA

_UNBOUND = re.compile(r"unbound axis name: ([^\s.,;:]+)")


def unbound_name(error: NameError) -> str | None:
    """The axis name in JAX's "unbound axis name: NAME" error, else None."""
    match = _UNBOUND.search(str(error))
    return match.group(1) if match else None


def bind_trivially(fn: Callable, names) -> Callable:
    """``fn`` with each of ``names`` bound to an axis of size 1 (collectives over it are
    the identity); the result is ``fn``'s, unchanged."""
    for name in names:
        fn = _bind_one(fn, name)
    return fn


def _bind_one(fn: Callable, name: str) -> Callable:
    def bound(*args):
        out = jax.vmap(fn, in_axes=None, out_axes=0, axis_size=1, axis_name=name)(*args)
        return jax.tree.map(lambda x: x[0], out)

    return bound


def names_used(fn: Callable, *args) -> list[str]:
    """The axis names ``fn(*args)`` uses without binding them, found by tracing it
    abstractly (``jax.eval_shape``: nothing runs) until no name is left unbound."""
    names: list[str] = []
    while True:
        try:
            jax.eval_shape(bind_trivially(fn, names), *args)
            return names
        except NameError as err:
            name = unbound_name(err)
            if name is None or name in names:
                raise
            names.append(name)


def plan(names: list[str], strategy: str, sync: bool) -> tuple[str, list[str], dict[str, str]]:
    """(the strategy's per-device axis name, names to bind trivially, a description of
    each binding) for the names a model uses."""
    per_device = strategy in ("pmap", "shard_map")
    data_axis, trivial, described = DATA, [], {}
    if sync and per_device:
        own = [n for n in names if n != DATA]
        if len(own) > 1:
            raise ModelError(
                f"the model names the axes {', '.join(map(repr, own))}; with "
                "sync_batch_stats=True one name can stand for the data axis"
            )
        data_axis = own[0] if own else DATA
    for name in names:
        if per_device and name in (DATA, data_axis):
            described[name] = "the data axis (statistics over every device's rows)"
        elif per_device:
            trivial.append(name)
            described[name] = (
                "a trivial axis: statistics of each device's rows (sync_batch_stats=True "
                "for SyncBatchNorm)"
            )
        else:
            trivial.append(name)
            described[name] = "a trivial axis: gspmd's statistics are already global"
    return data_axis, trivial, described
