"""Each strategy wires the one pure ``train_step`` (and ``eval_step``) to devices, and
does nothing else.

``layout(name, mesh)`` says where the state lives; ``wire(name, build, ...)`` returns
the jitted step and evaluation, which ``DataParallel`` holds as a ``StepProgram``. Every
strategy's step takes the same global batch (``shard_batch`` output, rows split over data
and fsdp); what differs is the state's layout and where the step runs per replica:
nowhere (gspmd: global arrays), its gradient part (shard_map: ``shard_map.PerReplica``),
or all of it (pmap).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from jaxdist.errors import ConfigError
from jaxdist.parallel.device_mesh import DATA, EXPERT, SEQ, batch_shards
from jaxdist.parallel.layout import Layout

NAMES = ("pmap", "shard_map", "gspmd")


def _module(name: str):
    if name == "pmap":
        from jaxdist.parallel.strategies import pmap as module
    elif name == "shard_map":
        from jaxdist.parallel.strategies import shard_map as module
    elif name == "gspmd":
        from jaxdist.parallel.strategies import gspmd as module
    else:
        raise ConfigError(f"strategy: {name!r} is not one of {', '.join(NAMES)}")
    return module


def layout(name: str, mesh: Mesh, rules=(), axis_names=None, shard_optimizer=False) -> Layout:
    _module(name)  # checks the name
    if shard_optimizer and name == "pmap":
        raise ConfigError(
            "--shard-optimizer: pmap keeps one whole copy of the state per device; use "
            "--strategy gspmd (or shard_map) to split the optimizer state over data"
        )
    if mesh.shape.get(EXPERT, 1) > 1 and name == "pmap":
        raise ConfigError(
            f"strategy pmap: --mesh expert={mesh.shape[EXPERT]} splits a MoE's experts over "
            "devices, which needs the mesh inside the step; pmap only copies the model per "
            "device. Use --strategy gspmd (or shard_map)"
        )
    beyond_data = {a: n for a, n in mesh.shape.items() if a != DATA and n > 1}
    if beyond_data and name == "pmap":
        axes = ",".join(f"{a}={n}" for a, n in beyond_data.items())
        raise ConfigError(
            f"strategy pmap: the mesh has axes beyond data ({axes}); pmap only splits the "
            "batch over data. Use --strategy gspmd (or shard_map) for fsdp, model, stage or "
            "seq axes"
        )
    if name == "pmap":  # (N, ...): device d holds row d
        return Layout(mesh, copies=mesh.size, axis_names=axis_names)
    return Layout(mesh, rules=tuple(rules or ()), axis_names=axis_names,
                  shard_optimizer=shard_optimizer)  # fmt: skip


def check_stage_nesting(mesh: Mesh, per_replica: bool) -> None:
    """``seq`` or ``expert`` split inside pipeline stages runs per replica only: nested in
    that region (``check_vma=False``), the stages' shard_map and attention's over seq
    (or the experts' over expert) lower. Without it the inner shard_map sits in the
    stages' typed one, and Shardy refuses it ("manual axis seq after free axis stage",
    or "operates on axis stage which is already bound": values varying over stage)."""
    stages = mesh.shape.get("stage", 1)
    inner = {a: mesh.shape.get(a, 1) for a in (SEQ, EXPERT) if mesh.shape.get(a, 1) > 1}
    if stages == 1 or not inner or per_replica:
        return
    model = mesh.shape.get("model", 1)
    why = "this model (batch statistics, or explicit sharding)"
    if model > 1:
        why = f"a model axis (model={model})"
    axes = ",".join(f"{a}={n}" for a, n in inner.items())
    what = {SEQ: "a sequence split over seq", EXPERT: f"experts split over {EXPERT}"}
    said = " and ".join(what[a] for a in inner)
    raise ConfigError(
        f"--mesh {axes} with stage={stages}: pipeline stages run {said} per replica "
        f"(each device's rows), which {why} rules out; use {' or '.join(inner)} or "
        "stage without it"
    )


def wants_per_replica(name: str, mesh: Mesh, grad_accum: int, has_batch_stats: bool) -> bool:
    """Whether the gradient is computed per replica (``shard_map.PerReplica``).

    Always under shard_map. Under gspmd when XLA's partitioner alone would reduce more
    than once per step: with grad-accum it all-reduces inside the microbatch loop (K
    times), with pipeline stages inside the schedule's loop (once per tick and layer),
    and under fsdp CPU's XLA all-reduces whole gradients (no reduce-scatter). Not for a
    model with batch statistics: gspmd promises the global batch's, and per replica they
    would be each device's. Nor with a model axis: at the boundary of the per-replica
    region XLA gathers model-split weights whole, which costs more than it saves."""
    if name == "shard_map":
        return True
    shape = mesh.shape
    looped = grad_accum > 1 or shape.get("stage", 1) > 1
    wanted = looped or shape.get("fsdp", 1) > 1
    return name == "gspmd" and wanted and shape.get("model", 1) == 1 and not has_batch_stats


def example_rows(name: str, mesh: Mesh, grad_accum: int, batch):
    """Abstract rows as one loss call sees them: per device (pmap, shard_map) and per
    microbatch, e.g. global (64, T) on 8 devices with grad-accum 2 -> (4, T)."""
    per_call = (batch_shards(mesh) if name != "gspmd" else 1) * grad_accum
    if isinstance(batch, dict):
        batch = {k: v for k, v in batch.items() if k != "mask"}
    return jax.tree.map(
        lambda v: jax.ShapeDtypeStruct((v.shape[0] // per_call, *v.shape[1:]), v.dtype), batch
    )


def wire(name: str, build: Callable, mesh: Mesh, axis_name: str, state_sharding, per_replica):
    """``build(per_replica) -> (train_step, eval_step)`` wired by strategy ``name``:
    ``(step, evaluate)``, both jitted functions of (state, global batch)."""
    module = _module(name)
    if name == "pmap":
        return module.wire(build, mesh, axis_name)
    from jaxdist.parallel.strategies import gspmd

    return gspmd.wire(build, mesh, state_sharding, per_replica)
