"""The model's names for its axes, mapped onto jaxdist's mesh axes in one place.

A model names the axes of its arrays in its own words: logical names in its annotations
(``nnx.with_partitioning(init, ("embed", "mlp"))``, Linen's ``with_logical_partitioning``),
or mesh axis names of its author's mesh (``P("fsdp", "tp")``, JAX's explicit sharding).
Each name becomes one of jaxdist's mesh axes (``data``, ``stage``, ``fsdp``, ``model``,
``seq``, ``expert``), or none (replicated), by the first of:

1. the user's map (``--axis-names tp=model,kv=null``; ``Parallel(axis_names=...)``; the
   ``axis_names:`` (or ``logical:``) part of ``--rules``);
2. the parameter's own Flax ``sharding_rules`` metadata, then the Linen/Flax logical
   axis rules in effect (``nn.logical_axis_rules(...)``, ``nn.set_logical_axis_rules``):
   a logical name to its author's mesh name, which is then read by 1, 4 and 5;
3. a name that is a jaxdist axis is that axis;
4. jaxdist's table of common logical names (``LOGICAL_RULES``: embed -> fsdp, mlp and
   heads -> model, vocab -> model, layers -> stage, expert -> expert, length and norm -> none, ...).

A name none of these maps is an error naming it and the parameters that use it, never a
silent replication: replicating on purpose is a map to null.
"""

from __future__ import annotations

from collections.abc import Mapping

from flax.core import spmd as flax_spmd

from jaxdist.errors import JaxdistError
from jaxdist.parallel.device_mesh import AXES

# Logical axis names (Flax / MaxText vocabulary) -> mesh axes.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),
    "activation_batch": ("data", "fsdp", "expert"),
    "embed": "fsdp",
    "mlp": "model",
    "heads": "model",
    "q_heads": "model",
    "kv_heads": "model",
    "kv": None,
    "head_dim": None,
    "vocab": "model",
    "layers": "stage",
    "stage": "stage",
    "length": None,
    "norm": None,
    "expert": "expert",  # a MoE's (E, ...) kernels: E/N experts per device (expert_parallel)
    "experts": "expert",
}
NULL = ("null", "none", "None", "")  # --axis-names kv=null: replicated on purpose


class UnmappedNames(JaxdistError):
    """Annotation names that map to no mesh axis (exit 2)."""


def parse(text: str) -> dict[str, str | None]:
    """``--axis-names "tp=model,dp=data,kv=null"`` -> {"tp": "model", "dp": "data", "kv":
    None}; each target one of jaxdist's axes or null."""
    out: dict[str, str | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, axis = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise JaxdistError(f"--axis-names {text!r}: {part!r} is not NAME=AXIS")
        out[name] = _target(axis, f"--axis-names {text!r}")
    return out


def checked(mapping: Mapping | None, where: str = "axis_names") -> dict[str, str | None]:
    """A user's map with each target a jaxdist axis, a tuple of them, or None."""
    return {str(k): _target(v, f"{where} {k!r}") for k, v in (mapping or {}).items()}


def _target(axis, where: str):
    if axis is None or (isinstance(axis, str) and axis in NULL):
        return None
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    bad = [a for a in axes if a not in AXES]
    if bad:
        raise JaxdistError(
            f"{where}: {', '.join(map(repr, bad))} is not a mesh axis ({', '.join(AXES)}) or null"
        )
    return axes[0] if len(axes) == 1 else axes


class Names:
    """Resolves annotation names to jaxdist's mesh axes (see the module), and remembers
    the names it could not, with the parameters that used them."""

    def __init__(self, user: Mapping | None = None):
        self.user = checked(user)
        self.context_rules = dict(_pairs(flax_spmd.get_logical_axis_rules()))
        self.unmapped: dict[str, list[str]] = {}

    def axes(self, entry, param: str, metadata: Mapping) -> tuple[str, ...]:
        """One annotation entry (a name, a tuple of names, or None) -> its mesh axes."""
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        own = dict(_pairs(metadata.get("sharding_rules") or ()))
        out: list[str] = []
        for name in names:
            for axis in self._resolve(name, own, param):
                if axis not in out:
                    out.append(axis)
        return tuple(out)

    def _resolve(self, name, own: dict, param: str) -> tuple[str, ...]:
        if name in self.user:
            return _as_axes(self.user[name])
        for rules in (own, self.context_rules):  # the author's logical -> mesh names
            if name in rules:
                meshes = _as_names(rules[name])
                return tuple(a for m in meshes for a in self._mesh_name(m, param))
        return self._mesh_name(name, param)

    def _mesh_name(self, name, param: str) -> tuple[str, ...]:
        if name in self.user:
            return _as_axes(self.user[name])
        if name in AXES:
            return (name,)
        if name in LOGICAL_RULES:
            return _as_axes(LOGICAL_RULES[name])
        self.unmapped.setdefault(name, []).append(param)
        return ()

    def check(self) -> None:
        """``UnmappedNames`` listing every name no rule maps, with its parameters."""
        if not self.unmapped:
            return
        listed = "; ".join(f"{name!r} ({_some(params)})" for name, params in self.unmapped.items())
        example = ",".join(f"{name}=model" for name in self.unmapped)
        raise UnmappedNames(
            f"the model's annotations name axes that map to no mesh axis: {listed}. Map "
            f"each onto one of {', '.join(AXES)} or null (replicated) with --axis-names "
            f"(e.g. --axis-names {example}; Parallel(axis_names=...); axis_names: in --rules)"
        )

    def renames(self) -> dict[str, str]:
        """jaxdist axis -> the model's name for it, from the user's map alone (a name
        mapped onto one whole axis): how an explicit-style model sees the mesh."""
        out: dict[str, str] = {}
        for name, axis in self.user.items():
            if isinstance(axis, str) and name != axis and name not in AXES:
                if axis in out:
                    raise JaxdistError(
                        f"--axis-names maps both {out[axis]!r} and {name!r} onto {axis}: a model "
                        "that names mesh axes in its PartitionSpecs sees one name per axis"
                    )
                out[axis] = name
        return out


def _pairs(rules) -> list[tuple]:
    return [tuple(rule) for rule in rules or ()]


def _as_names(value) -> tuple:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def _as_axes(value) -> tuple[str, ...]:
    return _as_names(value)


def _some(items: list[str], shown: int = 3) -> str:
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
