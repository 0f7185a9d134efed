"""shard_map: each replica computes the gradient of its own rows as per-device code,
``jax.shard_map`` manual over the batch axes (data, fsdp); the model and stage axes are
left to the compiler, and the optimizer update runs outside, on the state's layout.
(At the boundary of such a partly manual region XLA gathers ``model``-split weights whole,
as measured by ``experiments/layouts.py``: gspmd uses this only without a model axis.)

Per replica, once per optimizer step (not once per microbatch):
- parameters split over ``fsdp`` are all-gathered before use (ZeRO-3): a ``Stack``'s one
  layer at a time inside its scan (``layer_runner``), the others once per step;
- the microbatches' gradients are summed locally, then reduced once: ``psum_scatter``
  over fsdp (each replica keeps its shard) and ``pmean`` over data; a parameter not split
  over fsdp is ``pmean``-ed over both, one all-reduce;
- loss, metrics and batch statistics are ``pmean``-ed over the batch axes.

``check_vma=False`` keeps per-device autodiff, as pmap: with JAX's default ``check_vma=True``
the gradient of a replicated parameter comes back already summed over devices, and
averaging it again would give N times the 1-device gradient.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.models.stack import scan_layers
from jaxdist.parallel.collectives import mean_over_replicas
from jaxdist.parallel.device_mesh import BATCH_AXES, DATA, EXPERT

NO_DIM = -1  # a parameter not split over fsdp


class PerReplica:
    """Runs step pieces once per replica of the batch axes and returns global values.

    ``param_shardings``: the parameters' layout (``jaxdist.parallel.layout.state_shardings``).
    ``axis_name``: the name the step uses for the data axis; the model's own (e.g. the
    ``"batch"`` of ``BatchNorm(axis_name="batch")``) for SyncBatchNorm, which needs a
    mesh with only a data axis."""

    def __init__(
        self, mesh: Mesh, param_shardings, axis_name: str = DATA, by_layer=None, grad_shardings=None
    ):
        beyond_data = {a: n for a, n in mesh.shape.items() if a != DATA and n > 1}
        if not beyond_data and axis_name != DATA:
            # SyncBatchNorm under the model's own axis name: a 1-D mesh of that name, all
            # manual. Only here: a program holding a primitive that needs its devices at
            # lowering (cuDNN attention, a callback) must use one mesh throughout, and
            # JAX refuses this one beside the run's ("mesh should be the same across the
            # entire program"; seen on an H200 with jax 0.11.2, and on CPU with callbacks).
            self.mesh = Mesh(mesh.devices.reshape(-1), (axis_name,), axis_types=mesh.axis_types[:1])
            self.axis, self.manual = axis_name, frozenset({axis_name})
            self.axes = (axis_name,)
        else:
            if axis_name != DATA:
                raise ConfigError(
                    f"sync_batch_stats: the model's axis {axis_name!r} can stand for the data "
                    f"axis only on a data-only mesh, not with {beyond_data}"
                )
            self.mesh, self.axis = mesh, BATCH_AXES
            self.axes = BATCH_AXES
            # Manual over the batch axes; model and stage stay with the compiler.
            self.manual = frozenset(a for a, n in mesh.shape.items() if a in BATCH_AXES or n == 1)
        self.fsdp, self.expert = mesh.shape.get("fsdp", 1), mesh.shape.get(EXPERT, 1)
        # split over expert (a MoE's kernels): each replica's gradient of its shard already
        # sums the cotangents of its whole expert group, sent back by the all_to_alls
        self.by_expert = jax.tree.map(lambda s: EXPERT in _axes(s.spec), param_shardings)
        self.specs = jax.tree.map(lambda s: _manual_spec(s.spec, self.manual), param_shardings)
        self.dims = jax.tree.map(lambda s: _fsdp_dim(s.spec), param_shardings)
        # by_layer: True for the stacked parameters of a Stack, which its scan gathers one
        # layer at a time (``layer_runner``) instead of all at once before the step.
        by_layer = by_layer or jax.tree.map(lambda _: False, self.dims)
        self.later = jax.tree.map(lambda d, b: bool(b) and d != NO_DIM, self.dims, by_layer)

        self.batch_spec = P(self.axis)
        # ZeRO-1 (grad_shardings: the optimizer state's layout, split over data): each
        # gradient leaves reduce-scattered over data on the dimension its moments split,
        # one psum_scatter instead of a pmean (an all-reduce) and a slice.
        grad_shardings = grad_shardings or param_shardings
        self.scatter_dims = jax.tree.map(
            lambda s, g: _data_dim(s.spec, g.spec, self.manual), param_shardings, grad_shardings
        )
        self.grad_specs = jax.tree.map(
            lambda d, spec, g: spec if d == NO_DIM else _manual_spec(g.spec, self.manual),
            self.scatter_dims, self.specs, grad_shardings,
        )  # fmt: skip

    def gather(self, params):
        """Each replica's shards of fsdp-split parameters -> whole parameters; stacked
        ones are only marked with the dimension a layer is gathered on."""

        def one(dim, later, p):
            if dim == NO_DIM:
                return p
            if later:  # (L, ...) stacked: a layer's dimension dim - 1
                return p.replace(p.get_value(), **{_LAYER_DIM: dim - 1})
            return _on_value(p, _all_gather(dim))

        return jax.tree.map(one, self.dims, self.later, params)

    def layer_runner(self, apply, stacked, x):
        """A ``Stack`` runner: the scan gathers each layer's fsdp shards just before the
        layer runs, and again in the backward pass (ZeRO-3: one layer whole at a time);
        all_gather's transpose reduce-scatters each layer's gradient."""

        # One checkpoint per layer: the block's remat policy (models.stack.BlockApply),
        # and never the gathered layer. A block's own checkpoint inside this one would
        # be overruled by it: every activation saved, whatever --remat says.
        run = getattr(apply, "plain", apply)
        keep = getattr(apply, "policy", jax.checkpoint_policies.everything_saveable)
        never = jax.checkpoint_policies.save_anything_except_these_names(_GATHERED)

        def policy(*args, **params):  # keep's answer last: an Offloadable passes through
            return never(*args, **params) and keep(*args, **params)

        def gathered(layer, h):
            return run(jax.tree.map(_gather_marked, layer, is_leaf=_is_variable), h)

        return scan_layers(jax.checkpoint(gathered, policy=policy), stacked, x)

    def reduce(self, grads):
        """Local whole gradients -> the global-batch mean, in the parameters' layout."""

        def mean(x, axes):  # over the axes of size > 1 only: XLA keeps trivial all-reduces
            axes = tuple(a for a in axes if self.mesh.shape[a] > 1)
            return lax.pmean(x, axes) if axes else x

        def over_data(x, split):  # the data mean, scattered where ZeRO-1 splits it
            if split == NO_DIM:
                return mean(x, (DATA,))
            return _scatter(split, self.mesh.shape[DATA], DATA)(x)

        def one(dim, later, split, experts, g):
            if self.expert > 1:  # the expert group's mean: a sum over it for its shards
                if experts:
                    g = _on_value(g, lambda x: x / self.expert)
                elif dim != NO_DIM or split != NO_DIM:
                    g = _on_value(g, lambda x: mean(x, (EXPERT,)))
            if dim == NO_DIM:
                if split == NO_DIM:  # one all-reduce over the batch axes, expert's done
                    axes = self.axes if self.expert == 1 or not experts else self._rows
                    return _on_value(g, lambda x: mean(x, axes))
                return _on_value(g, lambda x: over_data(mean(x, ("fsdp",)), split))
            if later:  # already summed over fsdp and scattered, layer by layer
                return _unmarked(_on_value(g, lambda x: over_data(x / self.fsdp, split)))
            return _on_value(g, lambda x: over_data(_scatter(dim, self.fsdp)(x), split))

        return jax.tree.map(one, self.dims, self.later, self.scatter_dims, self.by_expert, grads)

    @property
    def _rows(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a != EXPERT)

    def grads(self, grads_fn):
        """``grads_fn(params, stats, rng_state, step, batch)`` of ``step.make_grads``
        -> the same function returning global-batch means, run per replica."""

        def local(params, stats, rng_state, step, batch):
            out = grads_fn(self.gather(params), stats, rng_state, step, batch)
            loss, metrics, stats, grads = out
            loss, metrics, stats = mean_over_replicas((loss, metrics, stats), self.axis)
            return loss, metrics, stats, self.reduce(grads)

        in_specs = (self.specs, P(), P(), P(), self.batch_spec)
        return self._map(local, in_specs, (P(), P(), P(), self.grad_specs))

    def sums(self, sums_fn):
        """``sums_fn(params, stats, rng_state, batch)`` (which psums over the data axis
        itself) run per replica on whole parameters."""

        def local(params, stats, rng_state, batch):
            return sums_fn(self.gather(params), stats, rng_state, batch)

        return self._map(local, (self.specs, P(), P(), self.batch_spec), P())

    def _map(self, fn, in_specs, out_specs):
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=self.manual,
            check_vma=False,
        )


_LAYER_DIM = "jaxdist_layer_gather_dim"  # Variable metadata: gather this layer's shards
_GATHERED = "jaxdist_gathered_layer"  # checkpoint name: never saved for the backward pass


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _gather_marked(variable):
    dim = variable.get_metadata().get(_LAYER_DIM) if _is_variable(variable) else None
    if dim is None:
        return variable
    whole = lax.all_gather(variable.get_value(), "fsdp", axis=dim, tiled=True)
    return variable.replace(checkpoint_name(whole, _GATHERED))


def _unmarked(variable):
    meta = {k: v for k, v in variable.get_metadata().items() if k != _LAYER_DIM}
    return type(variable)(variable.get_value(), **meta)


def _manual_spec(spec: P, manual) -> P:
    """The part of ``spec`` on manual axes: what shard_map's ``in_specs`` name."""

    def keep(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        names = tuple(a for a in names if a in manual)
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(e) for e in spec))


def _axes(spec: P) -> set[str]:
    return {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def _fsdp_dim(spec: P) -> int:
    for dim, entry in enumerate(spec):
        if entry == "fsdp" or (isinstance(entry, tuple) and "fsdp" in entry):
            return dim
    return NO_DIM


def _data_dim(spec: P, split: P, manual) -> int:
    """The dimension ``split`` (ZeRO-1's layout) adds ``data`` to, where the parameter's
    ``spec`` has none; NO_DIM where it adds none, or shares the dimension with an axis the
    compiler handles (model): that gradient is all-reduced, then sliced by the layout."""
    for dim, entry in enumerate(split):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        before = spec[dim] if dim < len(spec) else None
        had = () if before is None else (before,) if isinstance(before, str) else tuple(before)
        if DATA in names and DATA not in had:
            others = [a for a in names if a != DATA]
            inner = names[-1] == DATA  # (fsdp, data): data splits each fsdp shard
            return dim if all(a in manual for a in others) and inner else NO_DIM
    return NO_DIM


def _all_gather(dim: int):
    return lambda x: lax.all_gather(x, "fsdp", axis=dim, tiled=True)


def _scatter(dim: int, size: int, axis: str = "fsdp"):
    return lambda x: lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True) / size


def _on_value(variable, fn):
    """``fn`` applied to the array(s) inside an ``nnx.Variable`` (or to a plain array)."""
    return jax.tree.map(fn, variable)
