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

from jaxdist.checkpoint import Checkpointer
from jaxdist.layout import path_name
from jaxdist.strategies import Layout


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
        self._fold = jax.jit(lambda s: jax.tree.map(lambda x: x[0], s), out_shardings=replicated)
        self._expand = jax.jit(layout.expand, out_shardings=state_sharding)
        self._checkpointers: dict[Path, Checkpointer] = {}

    def named(self, state) -> dict[str, jax.Array]:
        one = self._fold(state) if self.layout.copies else state
        return dict(zip(self.names, jax.tree.leaves(one), strict=True))

    def state(self, arrays: dict[str, jax.Array]):
        one = jax.tree.unflatten(self.treedef, [arrays[name] for name in self.names])
        return self._expand(one) if self.layout.copies else one

    def checkpointer(self, directory, keep: int) -> Checkpointer:
        key = Path(directory).absolute()
        if key not in self._checkpointers:
            self._checkpointers[key] = Checkpointer(key, keep=keep)
        return self._checkpointers[key]

    def wait(self) -> None:
        for checkpointer in self._checkpointers.values():
            checkpointer.wait()


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)
