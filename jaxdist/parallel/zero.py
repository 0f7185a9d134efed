"""ZeRO-1 as a layout (``--shard-optimizer``): the optimizer state, and the gradient it
is updated with, split over ``data`` while the parameters stay whole on every replica.

Under GSPMD this is three shardings, no new code path: the optimizer state is stored
split (``state_shardings(..., shard_optimizer=True)``), the gradient is constrained to
that split before the update (the step's ``shard_grads``: XLA reduce-scatters it where it
would all-reduce, on GPU; on CPU it all-reduces and keeps its slice), each device
updates its slice, and the new parameters leave the step whole (their out sharding), one
all-gather. AdamW's two moments are 8 of the 16 bytes a float32 parameter costs with its
gradient: split 8 ways they cost 1, so a replica holds 9 bytes a parameter instead of 16.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.parallel.device_mesh import DATA

MIN_SPLIT = 1024  # elements: smaller arrays (biases, norms) stay whole, as fsdp's do


def over_data(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` split over ``data`` too, on the largest dimension whose size the
    axes already on it times ``data`` divide; unchanged for a small array or when no
    dimension divides (the array then stays whole on each replica)."""
    mesh = sharding.mesh
    data = mesh.shape.get(DATA, 1)
    if data == 1 or math.prod(shape) < MIN_SPLIT:
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        entry = spec[dim]
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if DATA in names:
            return sharding
        existing = math.prod(mesh.shape[a] for a in names)
        if shape[dim] % (existing * data) == 0:
            # data inside the axes already there: each fsdp shard split over data, as a
            # per-replica reduce-scatter of that shard leaves it (strategies.shard_map)
            spec[dim] = (*names, DATA) if names else DATA
            return NamedSharding(mesh, P(*spec))
    return sharding


def split_shardings(param_shardings, source):
    """Each parameter's sharding split over data: its gradient's and moments' layout
    (``source``: the model's abstract state)."""

    def one(sharding, variable):
        return over_data(sharding, tuple(jax.tree.leaves(variable)[0].shape))

    return jax.tree.map(one, param_shardings, source.abstract_state.params)


def grads_to(param_shardings, source):
    """``grads -> grads`` laid out as the optimizer state that updates them."""
    split = split_shardings(param_shardings, source)
    return lambda grads: jax.lax.with_sharding_constraint(grads, split)
