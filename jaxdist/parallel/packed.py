"""A ``TrainState`` held as its flat list of arrays, for a thin step dispatch.

Why: ``jax.jit`` flattens its arguments and unflattens its results on every call. A
``TrainState`` holds ``nnx.State``s of ``nnx.Variable``s, which flax flattens in Python:
for the tiny GPT's 89 Variables (28 params, 56 Adam moments, RNG counts) that is ~0.8 ms
a step on the host, more than a hand-written step on a dict of arrays pays in all
(jax flattens lists and dicts in C++). ``PackedState`` is one pytree node whose children
are the arrays themselves: jax flattens it with one Python call, and the ``TrainState``
is rebuilt only inside the traced step, or on the host when something reads a field
(a checkpoint, an evaluation, a replica check), and then once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


@jax.tree_util.register_pytree_node_class
class PackedState:
    """A ``TrainState`` as ``leaves`` (its arrays, in ``jax.tree.leaves`` order) and
    ``treedef``. Reads like the state it holds (``.step``, ``.params``, ``.opt_state``,
    ...); ``unpack()`` gives the ``TrainState`` itself. Donated by a step like the state."""

    __slots__ = ("leaves", "treedef", "_state")

    def __init__(self, leaves, treedef):
        self.leaves, self.treedef, self._state = tuple(leaves), treedef, None

    def unpack(self):
        """The ``TrainState`` (built once, on first use)."""
        if self._state is None:
            self._state = jax.tree.unflatten(self.treedef, self.leaves)
        return self._state

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(leaves, treedef)

    def __getattr__(self, name: str):  # the TrainState's fields: step, params, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.unpack(), name)

    def __repr__(self) -> str:
        return f"PackedState({len(self.leaves)} arrays of {self.unpack()!r})"


def pack_as(state, treedef) -> PackedState:
    """``state`` as a ``PackedState`` of ``treedef`` (a ``TrainState`` is flattened here,
    once); a state of another structure is an error naming both."""
    if isinstance(state, PackedState):
        return state
    leaves, found = jax.tree.flatten(state)
    if found != treedef:
        raise ValueError(
            f"the state's structure is not this Parallel's: {len(leaves)} arrays (expected "
            f"{treedef.num_leaves}); pass the state from init_state, restore or step:\n"
            f"{found}\nexpected\n{treedef}"
        )
    return PackedState(leaves, treedef)


def unpack(state):
    """The ``TrainState`` of a ``PackedState``; any other state as it is."""
    return state.unpack() if isinstance(state, PackedState) else state


def packed_step(train_step: Callable) -> Callable:
    """``train_step(state, batch) -> (state, metrics)`` as the same function of
    ``PackedState``s: unpacked and packed while tracing only."""

    def step(packed: PackedState, batch):
        state, metrics = train_step(packed.unpack(), batch)
        return pack_as(state, packed.treedef), metrics  # the structure it was given

    step.__name__ = step.__qualname__ = "train_step"  # the program's name in traces and HLO
    return step


def packed_eval(eval_step: Callable) -> Callable:
    """``eval_step(state, batch)`` as a function of a ``PackedState``."""

    def step(packed: PackedState, batch):
        return eval_step(packed.unpack(), batch)

    step.__name__ = step.__qualname__ = "eval_step"
    return step
