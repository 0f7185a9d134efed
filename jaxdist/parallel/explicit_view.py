"""The mesh a model in JAX's explicit-sharding style sees while it runs.

Such a model annotates its activations itself: ``jnp.einsum(..., out_sharding=P("fsdp",
None, "tp"))``, ``jax.reshard(w, P(None, "tp"))``, PartitionSpecs of mesh axis names,
which JAX only takes under a mesh whose axes are ``Explicit`` (and, for a bare
PartitionSpec, a mesh in context). jaxdist's own mesh keeps ``Auto`` axes and its own
names (its layouts, pipelines and per-replica regions are written for them), so the
model runs in a region of the step with an explicit view of the same devices, under the
model's names for the axes (``--axis-names tp=model``: jaxdist's ``model`` is ``tp``
there):

- entering (``enter``), every array the model gets is ``jax.reshard``-ed onto the view:
  a parameter as the layout placed it (an unannotated one gathered over fsdp, as the
  step uses it), the batch with its rows over the batch axes. Same devices, same
  blocks: no data moves, only the types change;
- the loss function runs under ``use_abstract_mesh(view)`` (``running``);
- leaving (``leave``), what the loss returns (the loss, its metrics, batch statistics)
  is resharded onto jaxdist's mesh, replicated; gradients flow back through both.

A model in the older style (logical names, ``with_sharding_constraint``) runs without
this region, as before. ``tests/test_explicit_sharding.py`` holds both to plain loops.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.parallel.axis_names import UnmappedNames
from jaxdist.parallel.device_mesh import AXES, batch_spec


@dataclass(frozen=True)
class ExplicitView:
    """The explicit view of ``mesh`` under the model's names (``renames``: jaxdist axis
    -> the model's name) and where the parameters lie on it (``params``: a tree of
    jaxdist's ``NamedSharding``s shaped like the parameters, as the loss uses them)."""

    mesh: Mesh
    renames: tuple[tuple[str, str], ...] = ()
    params: object = None

    @property
    def view(self):
        names = tuple(dict(self.renames).get(a, a) for a in self.mesh.axis_names)
        types = (AxisType.Explicit,) * len(names)
        return self.mesh.abstract_mesh.update(axis_names=names, axis_types=types)

    def name(self, axis: str) -> str:
        """The model's name for jaxdist's ``axis``."""
        return dict(self.renames).get(axis, axis)

    def spec(self, spec: P) -> P:
        """jaxdist's spec in the model's names."""

        def one(entry):
            if entry is None:
                return None
            if isinstance(entry, str):
                return self.name(entry)
            return tuple(self.name(a) for a in entry)

        return P(*(one(e) for e in spec))

    @contextlib.contextmanager
    def running(self):
        with jax.sharding.use_abstract_mesh(self.view):
            yield

    def enter(self, params, others, batch, key):
        """(params, others, batch, key) on the view; call inside ``running()``.
        ``others``: the model's other state (statistics, RNG streams), replicated."""
        to_view = lambda x, s: jax.reshard(x, self.spec(s.spec))  # noqa: E731
        params = _variables(params, self.params, to_view)
        others = [_variables(tree, None, lambda x, _: jax.reshard(x, P())) for tree in others]
        rows = lambda x: jax.reshard(x, self.spec(batch_spec(self.mesh, x.shape)))  # noqa: E731
        batch = jax.tree.map(rows, batch)
        return params, others, batch, jax.reshard(key, P())

    def leave(self, tree):
        """``tree`` back on jaxdist's mesh, replicated; call outside ``running()``."""
        whole = NamedSharding(self.mesh, P())
        return _variables(tree, None, lambda x, _: jax.reshard(x, whole))


def _variables(tree, specs, fn):
    """``fn(array, spec)`` on each array of ``tree`` (Variables' values, or plain arrays);
    ``specs`` a tree of shardings shaped like ``tree``, or None."""

    def one(leaf, spec=None):
        if isinstance(leaf, nnx.Variable):
            return leaf.replace(fn(leaf.get_value(), spec))
        return fn(leaf, spec)

    is_leaf = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if specs is None:
        return jax.tree.map(one, tree, is_leaf=is_leaf)
    return jax.tree.map(one, tree, specs, is_leaf=is_leaf)


def annotated(variable) -> bool:
    """Whether the model placed this parameter itself (sharding metadata)."""
    meta = variable.get_metadata() if isinstance(variable, nnx.Variable) else {}
    return bool(meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding"))


def for_model(mesh: Mesh, renames: dict, param_shardings, abstract_params) -> ExplicitView:
    """The view for a model's loss: its annotated parameters as the layout placed them
    (the model gathers what it needs, as explicit-style code does), the others gathered
    over fsdp (jaxdist split them for storage only)."""

    def used(sharding, variable):
        if annotated(variable) or "fsdp" not in str(sharding.spec):
            return sharding
        spec = [_without(e, "fsdp") for e in sharding.spec]
        return NamedSharding(sharding.mesh, P(*spec))

    is_leaf = lambda x: isinstance(x, nnx.Variable | NamedSharding)  # noqa: E731
    if param_shardings is None:  # no layout of its own (pmap): replicated
        whole = NamedSharding(mesh, P())
        param_shardings = jax.tree.map(lambda _: whole, abstract_params, is_leaf=is_leaf)
    params = jax.tree.map(used, param_shardings, abstract_params, is_leaf=is_leaf)
    return ExplicitView(mesh, tuple(sorted(renames.items())), params)


def _without(entry, axis: str):
    if entry is None or entry == axis:
        return None
    if isinstance(entry, str):
        return entry
    kept = tuple(a for a in entry if a != axis)
    return kept[0] if len(kept) == 1 else kept or None


_NOT_IN_MESH = re.compile(r"[Rr]esource axis:? '?([\w-]+)'? .*not found in mesh")
_MESH_WORDS = ("mesh", "PartitionSpec", "Explicit", "Auto", "out_sharding", "reshard")


def which_error(plain: Exception, explicit: Exception, view: ExplicitView) -> Exception:
    """The error to report when the loss traced on neither mesh: an axis name of the
    model's PartitionSpecs that is no axis of the view (the map the user needs), the
    view's error where jaxdist's mesh failed on sharding (an explicit-style model), else
    jaxdist's mesh's (a model in the older style)."""
    text = str(explicit.__cause__ or explicit)
    missing = _NOT_IN_MESH.search(text)
    if missing:
        name = missing.group(1)
        axes = ", ".join(f"{a} ({view.name(a)})" if view.name(a) != a else a for a in AXES)
        return UnmappedNames(
            f"the model's forward pass names mesh axis {name!r} in a PartitionSpec, which "
            f"is no axis of jaxdist's mesh ({axes}): map it with --axis-names "
            f"{name}=model (or data, fsdp, stage, seq; Parallel(axis_names=...))"
        )
    cause = str(plain.__cause__ or plain)
    return explicit if any(word in cause for word in _MESH_WORDS) else plain


def check_layout(strategy: str, mesh: Mesh) -> None:
    """An explicit-style model runs under gspmd, on data, fsdp and model axes."""
    if strategy != "gspmd":
        raise ConfigError(
            f"--strategy {strategy}: the model annotates its own activations (JAX's explicit "
            "sharding: PartitionSpecs in its forward pass), which jaxdist runs under "
            "--strategy gspmd (the default)"
        )
    beyond = {a: mesh.shape[a] for a in ("stage", "seq", "expert") if mesh.shape.get(a, 1) > 1}
    if beyond:
        axes = ",".join(f"{a}={n}" for a, n in beyond.items())
        raise ConfigError(
            f"--mesh {axes}: the model annotates its own activations (JAX's explicit "
            "sharding); jaxdist runs such a model on data, fsdp and model axes, not on "
            "stage, seq or expert (their schedules and exchanges run jaxdist's own blocks)"
        )


def describe(view: ExplicitView) -> str:
    """The start-up line of an explicit-style model."""
    sizes = ", ".join(
        f"{view.name(a)}={n}" + (f" (jaxdist's {a})" if view.name(a) != a else "")
        for a, n in view.mesh.shape.items()
        if n > 1
    )
    return (
        "the model annotates its own activations (JAX's explicit sharding): it runs on an "
        f"explicit view of the mesh, {sizes or 'one device'}"
    )
