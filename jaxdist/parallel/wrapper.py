"""``DataParallel``: PyTorch's ``DDP(model)`` for a Flax model, an optax optimizer and a
loss function. It builds the one pure step and wires it to devices by strategy."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxdist.errors import ConfigError
from jaxdist.parallel import bound_axes, packed, step_checks, strategies, wiring
from jaxdist.parallel.device_mesh import batch_shardings, make_mesh
from jaxdist.parallel.host import host_value, scalars
from jaxdist.parallel.initial_state import ModelSource
from jaxdist.parallel.offload import offloaded
from jaxdist.parallel.program import StepProgram, abstract, no_eval_fn, shapes_of
from jaxdist.parallel.saved_state import SavedState, split_layers
from jaxdist.parallel.step import StepOptions, TrainState, make_eval_step, make_train_step
from jaxdist.parallel.strategies import pipeline


class Parallel:
    """Training of one model over a mesh, in any layout: data parallel over ``data`` and
    ``fsdp``, the state laid out by ``jaxdist.parallel.layout.state_shardings`` (fsdp, model
    axes), a ``stage`` axis pipelined. ``DataParallel`` is the same class under the name
    PyTorch users look for.

    Args:
      model: an ``nnx.Module``, a ``linen.Module`` (with ``example_input``), or a function
        of no arguments returning either; a function is run inside ``jax.jit``, so the
        state is created directly in its layout on the devices.
      optimizer: an optax ``GradientTransformation``.
      loss_fn: ``loss_fn(model, batch)`` -> ``loss`` or ``(loss, aux)``, the mean over the
        rows it is given; with a parameter ``rngs`` (or a third positional one) it also
        gets an ``nnx.Rngs`` for the step. Only a dict ``aux`` of scalars is reported.
      mesh: from ``make_mesh()``; default all devices.
      strategy: ``"gspmd"`` (default), ``"shard_map"`` or ``"pmap"``.
      grad_accum: microbatches per device per step.
      seed: base of the per-step keys; the model's RNG streams are reseeded every step as
        ``nnx.reseed`` does (see ``jaxdist.parallel.step``): each dropout layer its own mask.
      schedule: the optimizer's LR schedule, only to report ``lr`` in the metrics.
      eval_fn: ``(model, batch) -> {name: (B,) per-example values}`` for ``evaluate``.
      linen_train_arg: a Linen model's training flag, if not ``train``/``training``/
        ``is_training``/``deterministic``/``use_running_average`` ("!name": True in eval).
      sync_batch_stats: under pmap/shard_map, a model's axis name (``BatchNorm(
        axis_name="batch")``) means the data axis (SyncBatchNorm); default: each device's
        rows, as DDP. Under gspmd the statistics are always the global batch's.
      nan_policy: ``"halt"``: ``check`` raises on a non-finite loss or gradient;
        ``"skip"``: such a step leaves params, optimizer state and statistics unchanged.
      batch_check: ``fn(batch) -> (B,) bool`` run on the devices in every step; a False
        row makes ``check`` raise ``BadBatchError`` naming the step and the row.
      rules: the layout's path rules (``jaxdist.parallel.layout.state_shardings``).
      axis_names: the model's names for axes -> jaxdist's mesh axes or None, e.g.
        ``{"tp": "model"}`` (``jaxdist.parallel.axis_names``); ``logical_rules``: the
        same, its older name (both may be given: ``axis_names`` wins).
      microbatches: with a ``stage`` mesh axis, the GPipe schedule's (0: 4 per stage).
      shard_optimizer: the optimizer state split over ``data`` (ZeRO-1; not under pmap).
      pipeline_schedule, virtual_stages: gpipe, 1f1b, interleaved (V chunks per device).
      offload: in host memory: any of optimizer, params, activations.

    Example::

        dp = jaxdist.DataParallel(model, optax.adamw(1e-3), loss_fn, mesh=mesh)
        state = dp.init_state()
        for step, host_batch in enumerate(loader, 1):  # this process's rows, numpy
            state, metrics = dp.step(state, jaxdist.shard_batch(host_batch, mesh))
            dp.check(metrics, step)                    # NaN, bad rows: raises
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
        linen_train_arg: str | None = None,
        sync_batch_stats: bool = False,
        nan_policy: str = "halt",
        batch_check: Callable | None = None,
        rules=None,
        axis_names: dict | None = None,
        logical_rules: dict | None = None,
        microbatches: int = 0,
        shard_optimizer: bool = False,
        pipeline_schedule: str = "gpipe",
        virtual_stages: int = 2,
        offload: tuple[str, ...] = (),
    ):
        if nan_policy not in step_checks.POLICIES:
            raise ConfigError(f"nan_policy: {nan_policy!r} is not one of halt, skip")
        self.mesh = make_mesh() if mesh is None else mesh
        self.strategy = strategy
        names = {**(logical_rules or {}), **(axis_names or {})}
        self.layout = strategies.layout(strategy, self.mesh, rules, names, shard_optimizer)
        self.layout = offloaded(self.layout, offload, strategy)  # checked; in host memory
        self.nan_policy = nan_policy
        self.sync_batch_stats = sync_batch_stats
        self.axis_bindings: dict[str, str] = {}  # the model's axis names -> what they mean
        self.explicit_view = None  # an explicit-style model's view (found on the first batch)
        self._source = ModelSource(
            model, optimizer, self.layout, example_input, seed=seed, linen_train_arg=linen_train_arg
        )
        self.graphdef = self._source.eval_graphdef  # merge() builds eval-mode models
        self.notices = self._source.notices  # what the layout does not do for this model
        for line in self.notices if jax.process_index() == 0 else ():
            print(f"jaxdist: warning: {line}", flush=True)
        # The stage axis: a GPipe schedule over the model's Stack (None without stages).
        self.pipeline = pipeline.plan(
            self.mesh, self._source.has_stack, self._source.stacked, microbatches,
            schedule=pipeline_schedule, virtual_stages=virtual_stages,
        )  # fmt: skip
        self.offload = self.layout.offload
        self._loss_fn, self._eval_fn, self._tx = loss_fn, eval_fn or no_eval_fn, optimizer
        self._options = StepOptions(grad_accum, seed, schedule, nan_policy, batch_check)
        self._wired: tuple | None = None  # on first use: needs the batch shapes
        self._on_new_shapes: Callable | None = None  # see on_new_batch_shapes
        self._batch_shapes: set = set()
        self._saved = SavedState(self.layout, self._source.one_copy_state, self.state_sharding)
        self._treedef = jax.tree.structure(self._source.abstract_state)  # of its arrays

    @property
    def state_sharding(self):
        """Where each array of the state lives (``jaxdist.parallel.layout.state_shardings``)."""
        return self._source.state_sharding

    def init_state(self) -> TrainState:
        """The initial state on the devices, in this strategy's layout: made by one compiled
        program, so no device holds more than its copy. The model passed in is untouched."""
        return self._source.init_state()

    def step(self, state: TrainState, batch) -> tuple[packed.PackedState, dict]:
        """One optimizer step on a global batch from ``shard_batch``. Donates ``state``.
        The new state comes back as a ``PackedState`` (its arrays in a flat list, read
        like a ``TrainState``: ``.params``, ``.step``; ``.unpack()``), which the next step
        passes to the device without flattening flax's Variables again."""
        program = self.program(batch)
        if self._on_new_shapes is not None and shapes_of(batch) not in self._batch_shapes:
            self._batch_shapes.add(shapes_of(batch))  # rare: a batch of new shapes
            self._on_new_shapes(program, batch)
        return program(self._packed(state), batch)

    def on_new_batch_shapes(self, callback: Callable, *, known=None) -> None:
        """``callback(program, batch)`` runs before a step on batch shapes not seen
        before (the step compiles anew for them); ``known``: a batch whose shapes need no
        call. The trainer makes every process agree on the program there."""
        self._on_new_shapes = callback
        if known is not None:
            self._batch_shapes.add(shapes_of(known))

    def check(self, metrics, step: int) -> bool:
        """Reads the step's health (a few scalars): raises ``NonFiniteError`` (NaN or inf
        loss or gradient, ``nan_policy="halt"``) or ``BadBatchError`` (``batch_check``);
        returns True when the update was skipped (``nan_policy="skip"``)."""
        return step_checks.check_metrics(metrics, step, self._source.leaf_paths, self.nan_policy)

    def save(self, state: TrainState, directory, *, extra=None, keep=3, deadline_s=1800.0):
        """Starts an asynchronous checkpoint of ``state`` as ``directory/<state.step>``
        (every process calls it; each writes its own shards); returns the seconds it
        blocked. ``extra``: JSON-able values kept with it (the trainer: data position,
        config). The newest ``keep`` are kept. ``wait_for_saves()`` before exit. A save
        fails on every process or none, none waiting past ``deadline_s`` (+ 60 s)."""
        state = packed.unpack(state)
        step = int(host_value(state.step).reshape(-1)[0])
        saver = self._saved.checkpointer(directory, keep, deadline_s)
        return saver.save(step, self._saved.named(state), extra)

    def restore(self, directory, *, step: int | None = None):
        """``(state, extra)`` from the newest checkpoint in ``directory`` that passes its
        fingerprints (or checkpoint ``step``), in this Parallel's layout, whatever mesh
        or process count saved it; None if there is none. A damaged checkpoint is skipped
        with a warning; a checkpoint of another model raises ``ConfigError``."""
        found = self._saved.restore(directory, step)
        if found is None:
            return None
        _, arrays, meta = found
        extra = {k: v for k, v in meta.items() if k not in ("step", "tree", "fingerprints")}
        return self._saved.state(arrays), extra

    @property
    def damaged_checkpoints(self) -> list[tuple[int, str]]:
        """``(step, what is wrong)`` of each checkpoint the last ``restore`` passed over."""
        return list(self._saved.skipped)

    def wait_for_saves(self) -> None:
        """Blocks until every save is on disk; ``StorageError`` if one could not be."""
        self._saved.wait()

    def save_in_flight(self):
        """(step, seconds, directory) of the longest background write, or None."""
        return self._saved.in_flight()

    def evaluate(self, state: TrainState, batch) -> dict[str, float]:
        """Sums of ``eval_fn``'s per-example values over the rows of a global batch whose
        ``mask`` (from ``EvalSampler``) is 1, and ``count``, the number of such rows."""
        return scalars(self._wire(batch)[1](self._packed(state), batch))

    def program(self, batch) -> StepProgram:
        """The compiled training step for global batches shaped like ``batch`` (arrays or
        ``jax.ShapeDtypeStruct``s): ``.lower()``, ``.compile()`` (``memory_analysis()``,
        ``as_text()``, ``cost_analysis()``) need no data and no real state."""
        return self._wire(batch)[0]

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """The lowered step, e.g. ``dp.lower(state, batch).compile().as_text()``."""
        return self.program(batch).fn.lower(self._packed(state), batch)

    def lower_init(self) -> jax.stages.Lowered:
        """The lowered ``init_state`` program, e.g. for its ``memory_analysis()``."""
        return self._source.lower_init()

    def unreplicate(self, state: TrainState) -> TrainState:
        """One whole copy of the state (pmap keeps one per device; sharded arrays are
        gathered), readable on every process."""
        return self.layout.one_copy(packed.unpack(state))

    def metrics(self, metrics) -> dict[str, float]:
        """Device metrics -> Python floats (waits for the step to finish)."""
        return scalars({k: v for k, v in metrics.items() if not k.startswith("health/")})

    def host_params(self, state: TrainState, per_layer: bool = False) -> dict[str, np.ndarray]:
        """The parameters as numpy on this host, keyed by path ("layers/0/kernel");
        ``per_layer``: a ``Stack``'s as the unstacked model names them (checkpoints')."""
        flat = nnx.to_flat_state(self.unreplicate(state).params)
        arrays = {"/".join(map(str, path)): host_value(var.get_value()) for path, var in flat}
        return split_layers(flat, arrays) if per_layer else arrays

    @property
    def named_targets(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The state's arrays by their checkpoint names, shaped and sharded in the layout."""
        return dict(self._saved.target)

    def named_state(self, state: TrainState) -> dict[str, jax.Array]:
        """The state's arrays by their checkpoint names (a Stack's layers one by one)."""
        return self._saved.named(state)

    def from_named(self, arrays: dict[str, jax.Array]) -> TrainState:
        """The inverse of ``named_state``: the state, in the layout."""
        return self._saved.state(arrays)

    def merge(self, state: TrainState) -> nnx.Module:
        """The trained model as an ``nnx.Module`` in eval mode (dropout off, running
        statistics used and never updated, Linen models called with their eval flag)."""
        one = self.unreplicate(state)
        return nnx.merge(self.graphdef, one.params, one.batch_stats, one.rng_state)

    def _packed(self, state) -> packed.PackedState:
        return packed.pack_as(state, self._treedef)

    def _wire(self, batch) -> tuple[StepProgram, Callable]:
        self._wired = self._wired or self._build_steps(batch)
        return self._wired

    def _build_steps(self, batch) -> tuple[StepProgram, Callable]:
        """Finds the model's axis names and sharding style on the first batch, then builds
        and wires the steps."""
        names, self.explicit_view = wiring.model_axes(self, batch)
        per_replica = self.explicit_view is None and strategies.wants_per_replica(
            self.strategy,
            self.mesh,
            self._options.grad_accum,
            self._source.has_batch_stats or names,
        )
        axis_name, trivial, self.axis_bindings = bound_axes.plan(
            names, self.strategy, self.sync_batch_stats
        )
        if self.axis_bindings and jax.process_index() == 0:
            bound = "; ".join(f"{n!r} -> {what}" for n, what in self.axis_bindings.items())
            print(f"jaxdist: the model's axis names: {bound}", flush=True)
        replicas = wiring.replicas(self, per_replica, axis_name)
        axis_name = replicas.axis if replicas is not None else axis_name
        options = wiring.step_options(self, batch, replicas, axis_name, tuple(trivial))

        def build(replicas):  # both of a PackedState: a thin dispatch (jaxdist.parallel.packed)
            train_graphdef, eval_graphdef = self._source.train_graphdef, self._source.eval_graphdef
            train = make_train_step(train_graphdef, self._loss_fn, self._tx, options, replicas)
            evaluate = make_eval_step(eval_graphdef, self._eval_fn, options, replicas)
            return packed.packed_step(train), packed.packed_eval(evaluate)

        abstract_state = self._packed(abstract(self._source.abstract_state, self.state_sharding))
        shardings = packed.PackedState([x.sharding for x in abstract_state.leaves], self._treedef)
        step, evaluate = strategies.wire(
            self.strategy, build, self.mesh, axis_name, shardings, replicas
        )
        abstract_batch = abstract(batch, batch_shardings(self.mesh, batch))
        return StepProgram(step, abstract_state, abstract_batch), evaluate


DataParallel = Parallel  # PyTorch's DDP-shaped name; one class, one code path
