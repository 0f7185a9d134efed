"""``DataParallel``: PyTorch's ``DDP(model)`` for a Flax model, an optax optimizer and a
loss function. It builds the one pure step and wires it to devices by strategy."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxdist import strategies
from jaxdist.adapt import as_nnx
from jaxdist.sharding import make_mesh
from jaxdist.step import TrainState, init_state, make_eval_step, make_train_step
from jaxdist.strategies import local_value


class DataParallel:
    """Data-parallel training of one model over the ``data`` axis of a mesh.

    Args:
      model: an ``nnx.Module``, or a ``linen.Module`` with ``example_input`` (bridged).
      optimizer: an optax ``GradientTransformation``.
      loss_fn: ``loss_fn(model, batch, rngs) -> loss`` or ``(loss, aux_dict)``; the mean
        over the rows it is given. ``rngs`` (optional argument) is an ``nnx.Rngs`` for the
        step; the model's own RNG streams (e.g. ``nnx.Dropout(rngs=...)``) are reseeded
        with the same key every step.
      mesh: from ``make_mesh()``; default all devices.
      strategy: ``"gspmd"`` (default), ``"shard_map"`` or ``"pmap"``.
      grad_accum: microbatches per device per step.
      seed: base of the per-step keys (``fold_in(key(seed), step)``).
      schedule: the optimizer's LR schedule, only to report ``lr`` in the metrics.
      eval_fn: ``eval_fn(model, batch) -> {name: (B,) per-example values}`` for
        ``evaluate``; e.g. ``jaxdist.losses.classification_eval``.

    Example::

        dp = jaxdist.DataParallel(model, optax.adamw(1e-3), loss_fn, mesh=mesh)
        state = dp.init_state()
        for host_batch in loader:                      # this process's rows, numpy
            state, metrics = dp.step(state, jaxdist.shard_batch(host_batch, mesh))
        trained = dp.merge(state)                      # an nnx.Module in eval mode
    """

    def __init__(
        self,
        model,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable,
        *,
        mesh: Mesh | None = None,
        strategy: str = "gspmd",
        grad_accum: int = 1,
        seed: int = 0,
        schedule: optax.Schedule | None = None,
        example_input=None,
        eval_fn: Callable | None = None,
    ):
        model = as_nnx(model, example_input, seed=seed)
        model.train()  # dropout on, BatchNorm uses batch statistics
        self.mesh = make_mesh() if mesh is None else mesh
        self.strategy = strategy
        self.graphdef, self._host_state = init_state(model, optimizer)
        train_step = make_train_step(
            self.graphdef, loss_fn, optimizer, grad_accum=grad_accum, seed=seed, schedule=schedule
        )
        eval_step = make_eval_step(self.graphdef, eval_fn or _no_eval_fn)
        self._wired = strategies.wire(strategy, train_step, eval_step, self.mesh)

    def init_state(self) -> TrainState:
        """The initial state on the devices, in this strategy's layout."""
        return self._wired.put_state(self._host_state)

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step on a global batch from ``shard_batch``. Donates ``state``."""
        return self._wired.step(state, batch)

    def evaluate(self, state: TrainState, batch) -> dict[str, float]:
        """Sums of ``eval_fn``'s per-example values over the rows of a global batch whose
        ``mask`` (from ``EvalSampler``) is 1, and ``count``, the number of such rows."""
        return self._wired.get_metrics(self._wired.evaluate(state, batch))

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step, e.g. ``dp.lower(state, batch).compile().as_text()``."""
        return self._wired.lower(state, batch)

    def unreplicate(self, state: TrainState) -> TrainState:
        """One copy of the state (pmap keeps one per device)."""
        return self._wired.get_state(state)

    def metrics(self, metrics) -> dict[str, float]:
        """Device metrics -> Python floats (waits for the step to finish)."""
        return self._wired.get_metrics(metrics)

    def host_params(self, state: TrainState) -> dict[str, np.ndarray]:
        """The parameters as numpy on this host, keyed by path ("layers/0/kernel")."""
        flat = nnx.to_flat_state(self.unreplicate(state).params)
        return {"/".join(map(str, path)): local_value(var.get_value()) for path, var in flat}

    def merge(self, state: TrainState) -> nnx.Module:
        """The trained model as an ``nnx.Module`` in eval mode."""
        one = self.unreplicate(state)
        model = nnx.merge(self.graphdef, one.params, one.batch_stats, one.rng_state)
        model.eval()
        return model


def _no_eval_fn(model, batch):
    raise TypeError("DataParallel.evaluate needs DataParallel(..., eval_fn=...)")
