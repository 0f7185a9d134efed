"""A ``Parallel``'s state as checkpoints hold it: one copy (pmap's N stacked copies
folded to one), as a flat mapping of named arrays (``params/blocks/0/attn/kernel``,
``opt_state/0/mu/blocks/0/attn/kernel``), in the layout's shardings. The names make a
checkpoint readable by any layout of the same model, and its errors readable by people.
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint.checkpointer import Checkpointer
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
        self.target = {
            name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            for name, x, sharding in zip(
                self.names, jax.tree.leaves(one_copy_state), shardings, strict=True
            )
        }
        self._replicated = replicated
        self._expand = jax.jit(layout.expand, out_shardings=state_sharding)
        self._checkpointers: dict[Path, Checkpointer] = {}
        self.skipped: list[tuple[int, str]] = []

    def named(self, state) -> dict[str, jax.Array]:
        one = jax.tree.map(self._fold, state) if self.layout.copies else state
        return dict(zip(self.names, jax.tree.leaves(one), strict=True))

    def _fold(self, x: jax.Array) -> jax.Array:
        """pmap's (N, ...) copies -> one replicated global array, built from each
        process's own copy: with several processes pmap's outputs span only this
        process's devices, so no jitted program could take them all."""
        first = x.addressable_data(0)[0]  # this process's first copy (PRNG keys too)
        devices = self._replicated.addressable_devices_indices_map(first.shape)  # in order
        copies = [jax.device_put(first, d) for d in devices]
        return jax.make_array_from_single_device_arrays(first.shape, self._replicated, copies)

    def state(self, arrays: dict[str, jax.Array]):
        one = jax.tree.unflatten(self.treedef, [arrays[name] for name in self.names])
        return self._expand(one) if self.layout.copies else one

    def checkpointer(self, directory, keep: int) -> Checkpointer:
        """The one that saves into ``directory`` (saves there wait for each other)."""
        key = Path(directory).absolute()
        if key not in self._checkpointers:
            self._checkpointers[key] = Checkpointer(key, keep=keep)
        return self._checkpointers[key]

    def restore(self, directory, step: int | None):
        """``Checkpointer.restore`` into this layout; a directory not saved into yet is
        read by a checkpointer of its own, so the one that saves later keeps its ``keep``."""
        key = Path(directory).absolute()
        reader = self._checkpointers.get(key) or Checkpointer(key)
        try:
            return reader.restore(self.target, step)
        finally:
            self.skipped = reader.skipped  # damaged checkpoints passed over, (step, why)
            if key not in self._checkpointers:
                reader.close()

    def wait(self) -> None:
        for checkpointer in self._checkpointers.values():
            checkpointer.wait()


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)
