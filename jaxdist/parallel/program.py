"""The compiled step of one layout as an object that lowers without data
(``StepProgram``), and abstract inputs carrying their shardings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxdist.parallel.device_mesh import batch_shardings


@dataclass(frozen=True)
class StepProgram:
    """The training step of one layout as one object: the jitted function and the
    abstract inputs it is built for (``jax.ShapeDtypeStruct``s carrying their shardings).
    It lowers and compiles without data or a real state, e.g.
    ``program.compile().memory_analysis()`` or ``.as_text()`` for its collectives."""

    fn: Callable  # jitted: (PackedState, global batch) -> (PackedState, metrics); donates it
    state: Any  # abstract PackedState (jaxdist.parallel.packed): reads like a TrainState
    batch: Any  # abstract global batch
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, state, batch):
        return self.fn(state, batch)

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(self.state, self.batch)

    def abstract_batch(self, batch):
        """``batch``'s shapes and dtypes, laid out as this program's batches are."""
        return abstract(batch, batch_shardings(jax.tree.leaves(self.batch)[0].sharding.mesh, batch))

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


def shapes_of(batch) -> tuple:
    """A batch's shapes and dtypes, hashable: which program it runs."""
    return tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch))


def no_eval_fn(model, batch):
    raise TypeError("DataParallel.evaluate needs DataParallel(..., eval_fn=...)")
