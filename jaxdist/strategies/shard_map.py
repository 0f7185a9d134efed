"""shard_map: each replica computes the gradient of its own rows as per-device code,
``jax.shard_map`` manual over the batch axes (data, fsdp); the model and stage axes are
left to the compiler, and the optimizer update runs outside, on the state's layout.
(At the boundary of such a partly manual region XLA gathers ``model``-split weights whole,
as measured by ``experiments/layouts.py``: gspmd uses this only without a model axis.)

Per replica, once per optimizer step (not once per microbatch):
- parameters split over ``fsdp`` are all-gathered before use (ZeRO-3);
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
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.config import ConfigError
from jaxdist.replicas import mean_over_replicas
from jaxdist.sharding import BATCH_AXES, DATA

NO_DIM = -1  # a parameter not split over fsdp


class PerReplica:
    """Runs step pieces once per replica of the batch axes and returns global values.

    ``param_shardings``: the parameters' layout (``jaxdist.layout.state_shardings``).
    ``axis_name``: the name the step uses for the data axis; the model's own (e.g. the
    ``"batch"`` of ``BatchNorm(axis_name="batch")``) for SyncBatchNorm, which needs a
    mesh with only a data axis."""

    def __init__(self, mesh: Mesh, param_shardings, axis_name: str = DATA):
        beyond_data = {a: n for a, n in mesh.shape.items() if a != DATA and n > 1}
        if not beyond_data:  # data only: a 1-D mesh named as the step expects, all manual
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
        self.fsdp = mesh.shape.get("fsdp", 1)
        self.specs = jax.tree.map(lambda s: _manual_spec(s.spec, self.manual), param_shardings)
        self.dims = jax.tree.map(lambda s: _fsdp_dim(s.spec), param_shardings)

        self.batch_spec = P(self.axis)

    def gather(self, params):
        """Each replica's shards of fsdp-split parameters -> whole parameters."""
        return jax.tree.map(
            lambda d, p: p if d == NO_DIM else _on_value(p, _all_gather(d)), self.dims, params
        )

    def reduce(self, grads):
        """Local whole gradients -> the global-batch mean, in the parameters' layout."""

        def mean(x, axes):  # over the axes of size > 1 only: XLA keeps trivial all-reduces
            axes = tuple(a for a in axes if self.mesh.shape[a] > 1)
            return lax.pmean(x, axes) if axes else x

        def one(dim, g):
            if dim == NO_DIM:
                return _on_value(g, lambda x: mean(x, self.axes))
            return _on_value(g, lambda x: mean(_scatter(dim, self.fsdp)(x), (DATA,)))

        return jax.tree.map(one, self.dims, grads)

    def grads(self, grads_fn):
        """``grads_fn(params, stats, rng_state, step, batch)`` of ``jaxdist.step.make_grads``
        -> the same function returning global-batch means, run per replica."""

        def local(params, stats, rng_state, step, batch):
            out = grads_fn(self.gather(params), stats, rng_state, step, batch)
            loss, metrics, stats, grads = out
            loss, metrics, stats = mean_over_replicas((loss, metrics, stats), self.axis)
            return loss, metrics, stats, self.reduce(grads)

        in_specs = (self.specs, P(), P(), P(), self.batch_spec)
        return self._map(local, in_specs, (P(), P(), P(), self.specs))

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


def _manual_spec(spec: P, manual) -> P:
    """The part of ``spec`` on manual axes: what shard_map's ``in_specs`` name."""

    def keep(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        names = tuple(a for a in names if a in manual)
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(e) for e in spec))


def _fsdp_dim(spec: P) -> int:
    for dim, entry in enumerate(spec):
        if entry == "fsdp" or (isinstance(entry, tuple) and "fsdp" in entry):
            return dim
    return NO_DIM


def _all_gather(dim: int):
    return lambda x: lax.all_gather(x, "fsdp", axis=dim, tiled=True)


def _scatter(dim: int, size: int):
    return lambda x: lax.psum_scatter(x, "fsdp", scatter_dimension=dim, tiled=True) / size


def _on_value(variable, fn):
    """``fn`` applied to the array(s) inside an ``nnx.Variable`` (or to a plain array)."""
    return jax.tree.map(fn, variable)
