"""A ``Parallel``'s state as checkpoints hold it: one copy (pmap's N stacked copies
folded to one), as a flat mapping of named arrays (``params/blocks/0/attn/kernel``,
``opt_state/0/mu/blocks/0/attn/kernel``), in the layout's shardings. The names make a
checkpoint readable by any layout of the same model, and its errors readable by people.

One form on disk for every layout of a model: a ``Stack``'s arrays, held stacked as
(L, ...) under ``blocks/layers/...``, are saved as L arrays named as the unstacked list
of blocks names them (``blocks/0/...``, ``blocks/1/...``), its optimizer and RNG state
alike, and stacked again on restore. So the scanned, pipelined and unscanned forms of a
model restore each other's checkpoints; checkpoints saved stacked (by jaxdist before this
form) restore into the stacked forms.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint.checkpointer import Checkpointer
from jaxdist.models.stack import DEPTH
from jaxdist.parallel.device_mesh import axis_size
from jaxdist.parallel.layout import Layout, path_name


class SavedState:
    def __init__(self, layout: Layout, one_copy_state, state_sharding):
        self.layout = layout
        self.treedef = jax.tree.structure(one_copy_state)
        self.names = [path_name(p) for p, _ in jax.tree.leaves_with_path(one_copy_state)]
        assert len(set(self.names)) == len(self.names), "state leaves need distinct names"
        # Where a restored array goes: the layout's shardings; pmap: replicated, then
        # stacked into its N copies by `expand`.
        replicated = NamedSharding(layout.mesh, P())
        shardings = (
            [replicated] * len(self.names)
            if layout.copies
            else jax.tree.leaves(state_sharding, is_leaf=_is_sharding)
        )
        # The state's own names: what checkpoints saved stacked hold.
        self.native = {
            name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            for name, x, sharding in zip(
                self.names, jax.tree.leaves(one_copy_state), shardings, strict=True
            )
        }
        # A stack's array -> its layers' names: "params/blocks/layers/fc/kernel" (L, ...)
        # -> ["params/blocks/0/fc/kernel", ...]
        self.layers = per_layer_names(one_copy_state, self.names)
        self.target = {}  # the checkpoint's names, each array where it is restored
        for name, x in self.native.items():
            if name not in self.layers:
                self.target[name] = x
                continue
            layer = _layer_sharding(x.sharding, x.shape)
            for layer_name in self.layers[name]:
                self.target[layer_name] = jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=layer)
        assert len(self.target) == len(self.names) + sum(len(v) - 1 for v in self.layers.values())
        layers = self.layers

        def split(stacked):  # {stacked name: (L, ...)} -> {layer's name: (...)}
            return {k: stacked[name][i] for name in layers for i, k in enumerate(layers[name])}

        def stack(per_layer):  # the inverse
            return {name: jnp.stack([per_layer[k] for k in layers[name]]) for name in layers}

        self._split = jax.jit(
            split, out_shardings={k: self.target[k].sharding for v in layers.values() for k in v}
        )
        self._stack = jax.jit(
            stack, out_shardings={name: self.native[name].sharding for name in layers}
        )
        self._replicated = replicated
        self._expand = jax.jit(layout.expand, out_shardings=state_sharding)
        self._checkpointers: dict[Path, Checkpointer] = {}
        self.skipped: list[tuple[int, str]] = []

    def named(self, state) -> dict[str, jax.Array]:
        """The arrays to save, by their names on disk (a stack's layers one by one)."""
        one = jax.tree.map(self._fold, state) if self.layout.copies else state
        arrays = dict(zip(self.names, jax.tree.leaves(one), strict=True))
        if not self.layers:
            return arrays
        split = self._split({name: arrays[name] for name in self.layers})
        named = {}
        for name in self.names:  # in the state's order, a stack's layers in place
            for key in self.layers.get(name, [name]):
                named[key] = split[key] if name in self.layers else arrays[name]
        return named

    def _fold(self, x: jax.Array) -> jax.Array:
        """pmap's (N, ...) copies -> one replicated global array, built from each
        process's own copy: with several processes pmap's outputs span only this
        process's devices, so no jitted program could take them all."""
        first = x.addressable_data(0)[0]  # this process's first copy (PRNG keys too)
        devices = self._replicated.addressable_devices_indices_map(first.shape)  # in order
        copies = [jax.device_put(first, d) for d in devices]
        return jax.make_array_from_single_device_arrays(first.shape, self._replicated, copies)

    def state(self, arrays: dict[str, jax.Array]):
        """The state from restored arrays, by their names on disk (or stacked names)."""
        if self.layers and not all(name in arrays for name in self.layers):
            per_layer = {k: arrays[k] for names in self.layers.values() for k in names}
            arrays = {**arrays, **self._stack(per_layer)}
        one = jax.tree.unflatten(self.treedef, [arrays[name] for name in self.names])
        return self._expand(one) if self.layout.copies else one

    def checkpointer(self, directory, keep: int, deadline_s: float = 1800.0) -> Checkpointer:
        """The one that saves into ``directory`` (saves there wait for each other)."""
        key = Path(directory).absolute()
        if key not in self._checkpointers:
            self._checkpointers[key] = Checkpointer(key, keep=keep, deadline_s=deadline_s)
        return self._checkpointers[key]

    def restore(self, directory, step: int | None):
        """``Checkpointer.restore`` into this layout; a directory not saved into yet is
        read by a checkpointer of its own, so the one that saves later keeps its ``keep``."""
        key = Path(directory).absolute()
        reader = self._checkpointers.get(key) or Checkpointer(key)
        targets = [self.target, self.native] if self.layers else self.target
        try:
            return reader.restore(targets, step)
        finally:
            self.skipped = reader.skipped  # damaged checkpoints passed over, (step, why)
            if key not in self._checkpointers:
                reader.close()

    def wait(self) -> None:
        for checkpointer in self._checkpointers.values():
            checkpointer.wait()

    def in_flight(self) -> tuple[int, float, Path] | None:
        """The longest-running save still being written: (step, seconds, directory)."""
        found = [c.in_flight() for c in list(self._checkpointers.values())]
        return max((f for f in found if f), key=lambda f: f[1], default=None)


def split_layers(flat, arrays: dict) -> dict:
    """``arrays`` (host arrays named by the paths of ``flat``, ``nnx.to_flat_state`` of a
    model's params) with each ``Stack`` array (L, ...) split into L arrays named as the
    unstacked model names them: ``--save-params`` writes the checkpoints' form."""
    arrays = dict(arrays)
    for name, split in per_layer_names(nnx.from_flat_state(flat), list(arrays)).items():
        arrays.update(zip(split, arrays.pop(name), strict=True))
    return dict(sorted(arrays.items()))


def per_layer_names(state, names: list[str]) -> dict[str, list[str]]:
    """Each stacked array of a ``jaxdist.models.stack.Stack`` in ``state`` -> its layers'
    names, the stack's ``layers`` replaced by 0, 1, ..., L-1. A stack's Variables say how
    deep below ``layers`` they sit; an optimizer's plain arrays follow the Variable of the
    same path ("opt_state/0/mu/blocks/layers/fc/kernel" that of "params/blocks/...")."""
    leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    shapes = {name: _shape(leaf) for name, leaf in zip(names, leaves, strict=True)}
    depth: dict[str, int] = {}  # stacked array -> path keys after "layers"
    for name, leaf in zip(names, leaves, strict=True):
        if isinstance(leaf, nnx.Variable) and DEPTH in leaf.get_metadata():
            depth[name] = leaf.get_metadata()[DEPTH]
    by_path = {name.split("/", 1)[-1]: name for name in depth}  # "blocks/layers/fc/kernel"
    for name in names:
        parts = name.split("/")
        for start in range(1, len(parts)):
            known = by_path.get("/".join(parts[start:]))
            if name not in depth and known and shapes[known] == shapes[name]:
                depth[name] = depth[known]
    layers = {}
    for name, below in depth.items():
        parts, at = name.split("/"), name.count("/") - below
        if at >= 0 and parts[at] == "layers" and shapes[name]:
            layers[name] = [
                "/".join([*parts[:at], str(i), *parts[at + 1 :]]) for i in range(shapes[name][0])
            ]
    return layers


def _layer_sharding(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """Where one layer of a stacked array is kept while it is saved or restored: the
    stacked array's layout of the other dimensions, with the mesh axes that split the
    layers (a pipeline's stage) moved to the first dimension they divide, so that no
    device holds more of the saved state than of the stacked one."""
    spec = [_axes(e) for e in (*sharding.spec, *[None] * (len(shape) - len(sharding.spec)))]
    moved, inner = spec[0], spec[1:]
    mesh = sharding.mesh
    for dim, axes in enumerate(inner):
        if moved and shape[1 + dim] % axis_size(mesh, axes + moved) == 0:
            inner[dim], moved = axes + moved, ()
    return NamedSharding(mesh, P(*[None if not a else a[0] if len(a) == 1 else a for a in inner]))


def _shape(leaf) -> tuple[int, ...]:
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    return tuple(getattr(value, "shape", ()))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)
