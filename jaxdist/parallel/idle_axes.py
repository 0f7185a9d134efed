"""What a layout asks for that does nothing for this model, said at start-up in one line
each (never a silent fallback to replication): a ``model`` axis that splits no parameter
(each of its devices holds every weight and does the same work), an ``expert`` axis on
a model without experts (it only splits rows, as data would), ``--shard-optimizer``
on a mesh whose ``data`` axis is 1 (nothing to split the optimizer state over)."""

from __future__ import annotations

import jax
from flax import nnx

from jaxdist.units import size


def notices(mesh, param_shardings, abstract_params, shard_optimizer: bool) -> list[str]:
    """The lines (without the ``jaxdist: warning:`` prefix) for this layout and model."""
    lines = []
    model = mesh.shape.get("model", 1)
    specs = [s.spec for s in jax.tree.leaves(param_shardings)]
    if model > 1 and not any("model" in _axes(spec) for spec in specs):
        nbytes = sum(
            v.get_value().size * v.get_value().dtype.itemsize
            for v in jax.tree.leaves(abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        )
        lines.append(
            f"--mesh model={model} splits no parameter of this model (none of its "
            f"annotations maps to model): {model} copies of {size(nbytes)} of parameters, "
            "the same work on each of those devices; map the model's names with --axis-names, "
            "or drop model from --mesh"
        )
    expert = mesh.shape.get("expert", 1)
    if expert > 1 and not any("expert" in _axes(spec) for spec in specs):
        lines.append(
            f"--mesh expert={expert} splits no parameter of this model (none of its "
            "annotations maps to expert: it has no mixture-of-experts kernels), so expert is "
            "one more data axis here (rows split, every weight copied); use data instead, "
            "or map the model's expert dimension with --axis-names NAME=expert"
        )
    if shard_optimizer and mesh.shape.get("data", 1) == 1:
        lines.append(
            "--shard-optimizer with data=1: there is no data axis to split the optimizer "
            "state over, so it stays where the layout places it"
        )
    return lines


def _axes(spec) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        if isinstance(entry, str):
            out.add(entry)
        elif entry is not None:
            out.update(entry)
    return out
