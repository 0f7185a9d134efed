"""The compiled step's collectives are the theoretical minimum for its layout, read from
the HLO of ``dp.program(batch).compile()`` (no data, no state needed):

- data=8 with grad-accum 4: one all-reduce of the gradient per step, after the
  microbatch loop (not one per microbatch), and no all-gather of parameters;
- fsdp=8: each sharded parameter all-gathered for use and its gradient reduce-scattered,
  no all-reduce of whole gradients (only of the few small replicated ones);
- model=2: the row-parallel all-reduces of the activations (B/4, T, D);
- stage=2: activations sent stage to stage (collective-permute).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import optax
from flax import nnx

import jaxdist
from jaxdist.models.gpt import GPT
from test_layouts import SEQ, VOCAB, build, loss_fn

OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
SHAPE = re.compile(r"[a-z]\d+\[([\d,]*)\]")


def compiled_ops(sizes, global_batch=16, grad_accum=1, model=build, strategy="gspmd"):
    """{op: [(computation, result element count, result dims of the first array)]}."""
    mesh = jaxdist.make_mesh(**sizes)
    dp = jaxdist.DataParallel(
        model, optax.sgd(0.1), loss_fn, mesh=mesh, grad_accum=grad_accum, strategy=strategy
    )
    tokens = jax.ShapeDtypeStruct((global_batch, SEQ + 1), np.int32)  # no data needed
    program = dp.program({"tokens": tokens})
    text = program.compile().as_text()
    found: dict[str, list] = {op: [] for op in OPS}
    computation = ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
        for op in OPS:
            marker = re.search(rf"= (.*?) {op}(-start)?\(", line)
            if marker:
                dims = [tuple(int(d) for d in s.split(",") if d) for s in SHAPE.findall(marker[1])]
                elements = sum(math.prod(d) for d in dims)
                found[op].append((computation, elements, dims[0] if dims else ()))
    params = jax.tree.leaves(program.state.params)  # ShapeDtypeStructs with shardings
    return found, params, dp


def test_grad_accum_all_reduces_once_per_step_after_the_loop():
    found, params, _ = compiled_ops(dict(data=8), global_batch=64, grad_accum=4)
    n_params = sum(math.prod(p.shape) for p in params)
    (reduce,) = found["all-reduce"]  # one (tuple-shaped) all-reduce in the whole program
    computation, elements, _ = reduce
    assert computation == "ENTRY", reduce  # not inside the microbatch loop's body
    assert elements >= n_params  # it carries every gradient element
    assert found["all-gather"] == [] and found["reduce-scatter"] == []


def test_fsdp_gathers_params_and_reduce_scatters_grads():
    found, params, _ = compiled_ops(dict(data=1, fsdp=8))
    n_params = sum(math.prod(p.shape) for p in params)
    sharded_elements = sum(math.prod(p.shape) for p in params if "fsdp" in str(p.sharding.spec))
    assert sharded_elements > 0.9 * n_params  # nearly everything is split 8 ways
    gathered = sum(e for _, e, _ in found["all-gather"])
    scattered = sum(e for _, e, _ in found["reduce-scatter"])  # results: 1/8 shards
    assert gathered >= sharded_elements, (gathered, sharded_elements)
    assert scattered * 8 >= sharded_elements, (scattered, sharded_elements)
    all_reduced = sum(e for _, e, _ in found["all-reduce"])
    assert all_reduced < 0.05 * n_params, found["all-reduce"]  # small replicated params only


def test_model_parallel_all_reduces_activations():
    found, _, _ = compiled_ops(dict(data=4, model=2))
    rows_per_replica, d_model = 16 // 4, 64
    activations = [d for _, _, d in found["all-reduce"] if d == (rows_per_replica, SEQ, d_model)]
    assert len(activations) >= 2 * 2, found["all-reduce"]  # 2 per block forward, 2 blocks


def test_pipeline_sends_activations_between_stages():
    def stacked():
        return GPT(VOCAB, SEQ, 64, 4, 8, attention="xla", scan_layers=True, rngs=nnx.Rngs(0))

    found, _, dp = compiled_ops(dict(data=4, stage=2), global_batch=32, model=stacked)
    microbatch = (32 // 4 // dp.pipeline.microbatches, SEQ, 64)  # rows per device / M
    sends = [d for _, _, d in found["collective-permute"]]
    assert microbatch in sends, sends


def test_fsdp_gathers_a_stack_one_layer_at_a_time():
    """A Stack's (L, ...) kernels are gathered inside the layer scan, one (D, 4D) layer
    at a time, never whole: a device holds one layer's weights, not the model's."""

    def stacked():
        return GPT(VOCAB, SEQ, 64, 4, 8, attention="xla", scan_layers=True, rngs=nnx.Rngs(0))

    found, _, _ = compiled_ops(dict(data=1, fsdp=8), model=stacked)
    layer_gathers = [(c, d) for c, _, d in found["all-gather"] if d in ((64, 256), (256, 64))]
    assert layer_gathers and all(c != "ENTRY" for c, _ in layer_gathers), found["all-gather"]
    assert not [d for _, _, d in found["all-gather"] if d[:1] == (4,) and len(d) == 3]
