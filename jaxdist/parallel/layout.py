"""Layout as a parameter: the one function that decides where every array of the
training state lives on the mesh, ``state_shardings(abstract_state, mesh, rules)``.

A parameter's ``PartitionSpec`` comes from, in order:
1. the model's own Flax annotations (``nnx.with_partitioning``, ``nnx.Param(...,
   out_sharding=...)``; Linen's ``nn.with_logical_partitioning`` through flax's bridge):
   names stored as the Variable metadata ``out_sharding``, each mapped to a mesh axis
   (or none) by ``jaxdist.parallel.axis_names`` (the user's ``--axis-names`` first; a
   name nothing maps is an error). Fewer names than dimensions name the leading ones,
   the rest unsharded,
   as flax's ``get_partition_spec`` and JAX's ``PartitionSpec`` read them (``nn.DenseGeneral``
   annotates its (embed, heads, head_dim) kernel with the names of its flat 2-d init);
2. the user's path rules (``rules=[(regex, axes), ...]``, ``--rules file.yaml``): the
   first regex that matches the path ("blocks/0/fc/kernel") gives one mesh axis (or a
   tuple of axes, or None) per dimension;
3. otherwise, under ``fsdp``: the largest dimension that the fsdp size divides is split
   over ``fsdp``; arrays under ``MIN_SHARDED`` elements stay replicated.
Mesh axes of size 1 are dropped, so a data-only mesh replicates everything. Optimizer
state follows its parameter (same path suffix, same shape); the step counter, batch
statistics and RNG state are replicated. A ``model`` or ``stage`` axis that does not
divide its dimension is an error naming the parameter, its shape and the axis: where they
lie changes the computation. ``fsdp`` only decides where bytes are stored, so a dimension
it does not divide gives way: the array is split over fsdp on another dimension (as the
default would), or replicated if none fits; process 0 says how many arrays did so.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.errors import JaxdistError
from jaxdist.parallel.axis_names import Names
from jaxdist.parallel.device_mesh import DATA, axis_size
from jaxdist.parallel.offload import in_host_memory
from jaxdist.parallel.zero import over_data

FSDP = "fsdp"

MIN_SHARDED = 1024  # elements: smaller unannotated arrays are replicated


class LayoutError(JaxdistError):
    pass


def state_shardings(abstract_state, mesh: Mesh, rules=None, axis_names=None, shard_optimizer=False):
    """The ``NamedSharding`` of every array of ``abstract_state`` (a ``TrainState``, or
    an ``nnx.State`` of parameters), as a tree that ``jax.jit``'s ``in_shardings`` and
    ``out_shardings`` take (one sharding per Variable). ``axis_names``: the user's map of
    the model's names onto mesh axes. ``shard_optimizer``: the optimizer state split over
    ``data`` too (``zero``, ZeRO-1)."""
    table = Names(axis_names)
    path_rules = [(re.compile(pattern), axes) for pattern, axes in (rules or [])]
    replicated = NamedSharding(mesh, P())
    params = getattr(abstract_state, "params", abstract_state)
    by_path: dict[tuple, tuple[tuple[int, ...], NamedSharding]] = {}
    moved: list[str] = []  # arrays whose named fsdp dimension gave way

    def param(path, leaf):
        name, shape = path_name(path), _shape(leaf)
        spec = _param_spec(name, shape, _metadata(leaf), mesh, table, path_rules, moved)
        by_path[_keys(path)] = (shape, NamedSharding(mesh, spec))
        return by_path[_keys(path)][1]

    param_shardings = _map(param, params)
    table.check()  # every name the annotations use maps to an axis (or to null)
    if moved and jax.process_index() == 0:
        print(
            f"jaxdist: layout: {len(moved)} parameter(s) name a dimension that fsdp="
            f"{mesh.shape[FSDP]} does not divide, so fsdp stores them split over another "
            f"dimension or replicated (it changes no number), e.g. {moved[0]}",
            flush=True,
        )
    if params is abstract_state:
        return param_shardings

    def follow(path, leaf):  # optimizer state: the sharding of the parameter it mirrors
        keys, shape = _keys(path), _shape(leaf)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == shape:
                return over_data(hit[1], shape) if shard_optimizer else hit[1]
        return replicated

    def everywhere(tree):
        return _map(lambda path, leaf: replicated, tree)

    return type(abstract_state)(
        step=replicated,
        params=param_shardings,
        batch_stats=everywhere(abstract_state.batch_stats),
        rng_state=everywhere(abstract_state.rng_state),
        opt_state=_map(follow, abstract_state.opt_state),
    )


def gathered(param_shardings, axis: str = "fsdp"):
    """The parameters' shardings with ``axis`` removed: the layout in which the forward
    and backward pass use them (FSDP: gathered before use, gradients reduce-scattered
    back), so XLA splits the batch, not the weights' contracting dimension."""

    def drop(sharding):
        spec = [
            tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a != axis) or None
            if e is not None
            else None
            for e in sharding.spec
        ]
        spec = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
        return NamedSharding(sharding.mesh, P(*spec))

    return jax.tree.map(drop, param_shardings)


def fsdp_use(param_shardings):
    """``params -> params`` for the step: gathered over fsdp where they are used (an
    all-gather per parameter), so XLA splits the batch rather than the weights'
    contracting dimension. On CPU XLA then all-reduces the gradient and keeps its shard;
    GPU's reduce-scatter pass turns that into a reduce-scatter."""
    use = gathered(param_shardings)
    return lambda params: jax.lax.with_sharding_constraint(params, use)


def _param_spec(name, shape, metadata, mesh, table, path_rules, moved) -> P:
    logical = metadata.get("out_sharding") or metadata.get("sharding_names")
    logical = logical or metadata.get("sharding")
    if logical:
        names = _as_tuple(logical, shape, name, pad=True)
        axes = tuple(table.axes(n, name, metadata) or None for n in names)
        return _checked(name, shape, axes, mesh, f"annotation {tuple(logical)}", moved)
    for pattern, axes in path_rules:
        if pattern.search(name):
            axes = _as_tuple(axes, shape, name)
            return _checked(name, shape, axes, mesh, f"rule {pattern.pattern!r}", moved)
    return _spec(_fsdp_elsewhere(shape, [None] * len(shape), mesh))


def _fsdp_elsewhere(shape, out: list, mesh) -> list:
    """``out`` with fsdp on the largest dimension it divides that no other axis splits;
    unchanged for an array under ``MIN_SHARDED`` elements or without such a dimension.
    The default layout under fsdp, and where a named dimension fsdp cannot split goes."""
    fsdp = mesh.shape.get(FSDP, 1)
    size = 1
    for d in shape:
        size *= d
    if fsdp == 1 or size < MIN_SHARDED:
        return out
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if out[i] is None and shape[i] % fsdp == 0:
            return [FSDP if j == i else e for j, e in enumerate(out)]
    return out


def _spec(out) -> P:
    return P(*out) if any(out) else P()


def _checked(name, shape, axes, mesh, why, moved) -> P:
    """Drops size-1 and repeated mesh axes; checks that each dimension divides, except
    that fsdp gives way (``_fsdp_elsewhere``, noted in ``moved``)."""
    used: set[str] = set()
    out, gave_way = [], False
    for dim, entry in zip(shape, axes, strict=True):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in names:
            if a not in mesh.axis_names:
                raise LayoutError(
                    f"parameter {name} {tuple(shape)}: {why} names mesh axis {a!r}, not one "
                    f"of {', '.join(mesh.axis_names)}"
                )
        names = tuple(a for a in names if mesh.shape[a] > 1 and a not in used)
        rest = tuple(a for a in names if a != FSDP)
        if dim % axis_size(mesh, names) and rest != names and dim % axis_size(mesh, rest) == 0:
            names, gave_way = rest, True  # only fsdp does not divide: stored elsewhere
        if dim % axis_size(mesh, names):
            raise LayoutError(
                f"parameter {name} of shape {tuple(shape)}: dimension {dim} is not divisible "
                f"by mesh axis {'x'.join(names)} of size {axis_size(mesh, names)} ({why}); "
                "give the model a size that divides, change --mesh, or map the name to "
                "another axis or null (--axis-names, axis_names=)"
            )
        used.update(names)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    if gave_way and FSDP not in used:
        out = _fsdp_elsewhere(shape, out, mesh)
        moved.append(f"{name} {tuple(shape)} ({why}): {_spec(out)}")
    return _spec(out)


def _as_tuple(axes, shape, name, pad=False) -> tuple:
    """One entry per dimension. ``pad`` (annotations): fewer name the leading dimensions
    and the rest are unsharded, as flax's ``get_partition_spec`` and JAX read them."""
    axes = (axes,) if axes is None or isinstance(axes, str) else tuple(axes)
    if pad and len(axes) < len(shape):
        axes += (None,) * (len(shape) - len(axes))
    if len(axes) != len(shape):
        raise LayoutError(
            f"parameter {name} of shape {tuple(shape)}: {len(axes)} axes {axes} for "
            f"{len(shape)} dimensions"
        )
    return axes


def _map(fn, tree):
    """``fn(path, leaf)`` over a state's Variables (or plain arrays)."""
    return jax.tree_util.tree_map_with_path(fn, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _metadata(leaf) -> dict:
    return leaf.get_metadata() if isinstance(leaf, nnx.Variable) else {}


def _shape(leaf) -> tuple[int, ...]:
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    return tuple(getattr(value, "shape", ()))


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def path_name(path) -> str:
    """ "blocks/0/attn/kernel" for a tree path."""
    parts = _keys(path)
    if parts and parts[-1] == "value":  # the array inside an nnx.Variable
        parts = parts[:-1]
    return "/".join(map(str, parts))


@dataclass(frozen=True)
class Layout:
    """Where the state lives: each array laid out on the mesh as ``state_shardings``
    decides (gspmd, shard_map), or (pmap) one copy per device stacked on a leading axis
    of ``copies`` = N."""

    mesh: Mesh
    copies: int = 0
    rules: tuple = ()  # the user's path rules (regex, axes)
    axis_names: dict | None = None  # the model's names -> mesh axes (jaxdist.parallel.axis_names)
    shard_optimizer: bool = False  # the optimizer state split over data (ZeRO-1)
    offload: tuple[str, ...] = ()  # held in host memory (jaxdist.parallel.offload)

    def shardings(self, abstract_state):
        """The state's shardings: a tree for jit's in/out_shardings (or one for all)."""
        if self.copies:
            return NamedSharding(self.mesh, P(DATA))
        args = (self.mesh, self.rules, self.axis_names, self.shard_optimizer)
        return in_host_memory(state_shardings(abstract_state, *args), self.offload)

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
