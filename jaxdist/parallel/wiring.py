"""What a ``Parallel``'s one step is told, feature by feature: where a ``Stack`` runs
(fsdp's layer-by-layer gathers, a pipeline schedule), how fsdp's parameters are used
under gspmd, where ZeRO-1 splits the gradient. Each option of the layout adds its line
here and nowhere else in the wrapper; the step itself (``jaxdist.parallel.step``) reads
only ``StepOptions``."""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from jaxdist.errors import ModelError
from jaxdist.parallel import bound_axes, explicit_view, layout, offload, strategies, zero
from jaxdist.parallel.axis_names import Names
from jaxdist.parallel.device_mesh import batch_shards
from jaxdist.parallel.step import StepOptions
from jaxdist.parallel.strategies import pipeline, pipeline_1f1b, pipeline_interleaved
from jaxdist.parallel.strategies.shard_map import PerReplica


def model_axes(parallel, batch) -> tuple[list[str], explicit_view.ExplicitView | None]:
    """(the axis names the model binds for its own collectives, ``bound_axes``; the
    explicit view it runs on if it is written in JAX's explicit-sharding style, else
    None), from tracing the loss abstractly on the first batch's shapes: on jaxdist's
    mesh, and where that fails, on the explicit view (``jaxdist.parallel.explicit_view``)."""
    source, mesh = parallel._source, parallel.mesh
    rows = strategies.example_rows(parallel.strategy, mesh, parallel._options.grad_accum, batch)
    args = source.abstract_args(rows)
    try:
        names = bound_axes.names_used(source.abstract_loss(parallel._loss_fn), *args)
    except ModelError as plain:
        renames = Names(parallel.layout.axis_names).renames()
        # pmap's state is one sharding for every array (copies): the model's replicated
        shardings = getattr(parallel.state_sharding, "params", None)
        view = explicit_view.for_model(mesh, renames, shardings, source.abstract_params)
        # the global batch's rows, as gspmd (which alone runs such a model) gives them
        global_rows = strategies.example_rows("gspmd", mesh, parallel._options.grad_accum, batch)
        try:
            names = bound_axes.names_used(
                source.abstract_loss(parallel._loss_fn, view), *source.abstract_args(global_rows)
            )
        except ModelError as explicit:
            chosen = explicit_view.which_error(plain, explicit, view)
            raise chosen from chosen.__cause__  # the user's own error, its traceback kept
    else:  # the older style: said where the model annotates its weights at all
        annotated = jax.tree.leaves(jax.tree.map(
            explicit_view.annotated, source.abstract_params,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        ))  # fmt: skip
        if any(annotated) and jax.process_index() == 0:
            print("jaxdist: the model names its axes for jaxdist to map (logical names, Auto "
                  "axes; the compiler places its activations)", flush=True)  # fmt: skip
        return names, None
    explicit_view.check_layout(parallel.strategy, mesh)
    if jax.process_index() == 0:
        print(f"jaxdist: {explicit_view.describe(view)}", flush=True)
    return names, view


def pipelined(parallel) -> bool:
    return bool(parallel.pipeline and parallel.pipeline.microbatches)


def replicas(parallel, per_replica: bool, axis_name) -> PerReplica | None:
    """The per-replica region of the step (``shard_map.PerReplica``), or None. fsdp
    gathers a ``Stack``'s layers one at a time there, unless the stack is pipelined.
    A sequence or experts split inside pipeline stages need that region
    (``check_stage_nesting``)."""
    strategies.check_stage_nesting(parallel.mesh, per_replica)
    if not per_replica:
        return None
    by_layer = None if pipelined(parallel) else parallel._source.by_layer
    params = parallel.state_sharding.params
    split = (
        zero.split_shardings(params, parallel._source) if parallel.layout.shard_optimizer else None
    )
    return PerReplica(parallel.mesh, params, axis_name, by_layer, split)


def step_options(parallel, batch, replicas, axis_name, trivial_axes) -> StepOptions:
    """``parallel``'s ``StepOptions`` for global batches shaped like ``batch``."""
    source, mesh = parallel._source, parallel.mesh
    options = dataclasses.replace(parallel._options, axis_name=axis_name, trivial_axes=trivial_axes)
    if replicas is not None and not pipelined(parallel) and source.has_stack:
        options = dataclasses.replace(options, stack_runner=replicas.layer_runner)
    if pipelined(parallel):
        rows = jax.tree.leaves(batch)[0].shape[0]
        parallel.pipeline.check_rows(rows, batch_shards(mesh), parallel._options.grad_accum)
        options = dataclasses.replace(options, stack_runner=pipeline_runner(parallel))
    gspmd_fsdp = parallel.strategy == "gspmd" and mesh.shape.get("fsdp", 1) > 1
    if parallel.explicit_view is not None:  # the model gathers what it needs itself
        options = dataclasses.replace(options, explicit_view=parallel.explicit_view)
    elif replicas is None and gspmd_fsdp:
        use_params = layout.fsdp_use(parallel.state_sharding.params)
        options = dataclasses.replace(options, use_params=use_params)
    if parallel.layout.shard_optimizer:  # the gradient split as the moments it updates
        split = zero.grads_to(parallel.state_sharding.params, source)
        options = dataclasses.replace(options, shard_grads=split)
    if parallel.layout.offload:  # host memory between steps, device memory inside
        options = offload.step_options(options, parallel.state_sharding, parallel.layout.offload)
    return options


def pipeline_runner(parallel):
    """The ``Stack`` runner of ``parallel.pipeline.schedule``; each stack's layer count
    checked against it first (interleaved cuts it into S x V chunks)."""
    plan, source = parallel.pipeline, parallel._source
    flat = nnx.to_flat_state(source.one_copy_state.params)
    stacks = {v.get_value().shape[0] for p, v in flat if layout.path_name(p) in source.stacked}
    for layers in sorted(stacks):  # L of each stack
        plan.check_layers(layers)
    kw = dict(mesh=parallel.mesh, microbatches=plan.microbatches)
    if plan.schedule == "interleaved":
        return functools.partial(pipeline_interleaved.interleaved, virtual=plan.virtual, **kw)
    run = pipeline_1f1b.one_f_one_b if plan.schedule == "1f1b" else pipeline.gpipe
    return functools.partial(run, **kw)
