"""The built-in Llama with experts (``--moe-experts``) against the equations: the Llama of
``llama_equations`` with each layer's SwiGLU replaced by ``moe_reference``'s per-token
experts (numpy picks each token's top k, each chosen expert applied in turn), its loss the
next-token loss plus the per-sequence balance and z-losses averaged over layers. Three
AdamW steps of that reference on one device are what jaxdist's step gives on one device,
on a split layout, pipelined (GPipe and 1F1B) and with gradient accumulation, the aux
metrics included. The trainer's side (flags, metrics.jsonl, capacity drops, refusals):
``test_moe_trainer.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdist
from helpers import relative_error
from jaxdist.losses import next_token_loss as jaxdist_loss
from jaxdist.models.moe import MoESettings
from llama_equations import FULL, LAYERS, LLAMA3, batches, build, next_token_loss, reference_logits
from llama_equations import tx as adamw
from moe_reference import choices
from moe_reference import reference as experts_reference

STEPS = 3
# shared expert and the dense first layer on: every part of the MoE model is compared
MOE = MoESettings(4, 2, ffn_dim=24, n_shared=1, balance_coef=0.3, z_coef=0.1)


def moe_model(scan_layers=False, moe=MOE):
    return build(scan_layers, moe=moe)


def layer_params(p, layer):
    """The reference's names for layer ``layer``'s MoE: router, gate, up, down, shared/..."""
    prefix = f"blocks/{layer}/moe/"
    return {k.removeprefix(prefix): v for k, v in p.items() if k.startswith(prefix)}


def reference_loss(p, tokens, fixed=None, moe=MOE):
    """(loss, (next-token loss, balance, z, each layer's (experts, keep))): the routing is
    numpy's from concrete activations, or ``fixed`` (so that jax.grad can differentiate
    the rest: the choice of experts is piecewise constant)."""
    routed, balance, z = [], [], []

    def mlp(layer, h):
        sub = layer_params(p, layer)
        pick = choices(sub, h, moe.router, moe.capacity_factor) if fixed is None else fixed[layer]
        routed.append(pick)
        y, lb, zl = experts_reference(sub, h, *pick, moe.router, moe.norm_topk, moe.route_scale)
        balance.append(jnp.mean(lb))
        z.append(jnp.mean(zl))
        return y

    lm = next_token_loss(reference_logits(p, tokens[:, :-1], FULL, LLAMA3, mlp), tokens[:, 1:])
    balance, z = jnp.mean(jnp.stack(balance)), jnp.mean(jnp.stack(z))
    return lm + moe.balance_coef * balance + moe.z_coef * z, (lm, balance, z, routed)


def flat_params(model) -> dict[str, jnp.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): jnp.asarray(v.get_value()) for path, v in flat}


# one worker for the module: its fixture is made once, not once per worker
pytestmark = pytest.mark.xdist_group("moe_llama")


@pytest.fixture(scope="module")
def reference():
    """(losses, balance losses, params) of 3 AdamW steps of the reference on one device."""
    params = flat_params(moe_model())
    opt = adamw()
    state = opt.init(params)
    losses, balances = [], []
    for batch in batches()[:STEPS]:
        tokens = jnp.asarray(batch["tokens"])
        routed = reference_loss(params, tokens)[1][3]  # the routing, from concrete values
        (value, (_, balance, _, _)), grads = jax.value_and_grad(reference_loss, has_aux=True)(
            params, tokens, routed
        )
        updates, state = opt.update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        losses.append(float(value))
        balances.append(float(balance))
    return losses, balances, {k: np.asarray(v) for k, v in params.items()}


def jaxdist_run(mesh, scan_layers=False, **options):
    """(losses, balance losses, params by the unstacked names) of jaxdist's 3 steps."""
    dp = jaxdist.DataParallel(
        lambda: moe_model(scan_layers), adamw(), jaxdist_loss, mesh=mesh, **options
    )
    state, losses, balances = dp.init_state(), [], []
    for batch in batches()[:STEPS]:
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        metrics = dp.metrics(metrics)
        losses.append(metrics["loss"])
        balances.append(metrics["moe/balance_loss"])
    return losses, balances, dp.host_params(state, per_layer=True)


def assert_same(got, want, rtol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)  # the losses, aux included
    np.testing.assert_allclose(got[1], want[1], rtol=rtol)  # the balance losses alone
    assert sorted(got[2]) == sorted(want[2])
    for name, value in want[2].items():
        assert relative_error(got[2][name], value) < rtol, name


def test_forward_and_aux_equal_the_equations():
    model = moe_model()
    tokens = jnp.asarray(batches()[0]["tokens"])
    want, (lm, balance, z, _) = reference_loss(flat_params(model), tokens)
    got, metrics = jaxdist_loss(model, {"tokens": tokens})
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(metrics["lm_loss"], lm, rtol=1e-5)
    np.testing.assert_allclose(metrics["moe/balance_loss"], balance, rtol=1e-5)
    np.testing.assert_allclose(metrics["moe/z_loss"], z, rtol=1e-5)
    # the aux terms count: without them the loss is off by far more than the tolerance
    assert abs(float(got) - float(lm)) > 1e-2
    # the reference can fail: routing to the experts one rank lower moves the loss
    _, (_, _, _, routed) = reference_loss(flat_params(model), tokens)
    shifted = [((e + 1) % MOE.n_experts, k) for e, k in routed]
    assert abs(float(reference_loss(flat_params(model), tokens, shifted)[0]) - float(want)) > 1e-3


def test_three_adamw_steps_equal_the_equations(reference):
    one = jaxdist_run(jaxdist.make_mesh(data=1, devices=jax.devices()[:1]))
    assert_same(one, reference)
    assert_same(jaxdist_run(jaxdist.make_mesh(data=2, fsdp=2, model=2)), reference)


@pytest.mark.parametrize(
    "mesh, options",
    [
        (dict(data=2, stage=2, model=2), dict(microbatches=2)),
        (dict(data=4, stage=2), dict(microbatches=2, pipeline_schedule="1f1b")),
        (dict(data=8), dict(grad_accum=1)),
        (dict(data=2, fsdp=2, devices=jax.devices()[:4]), dict(grad_accum=2)),
    ],
    ids=["gpipe", "1f1b", "data8", "grad-accum"],
)
def test_pipelines_and_micro_batches_carry_the_aux_with_the_rows(reference, mesh, options):
    """Per-sequence aux travels with its rows through stages and micro-batches: the
    balance loss of the whole batch, not of a micro-batch's, whatever the split."""
    assert_same(jaxdist_run(jaxdist.make_mesh(**mesh), scan_layers=True, **options), reference)


def test_dense_first_layers_and_generation_through_the_cache():
    """--moe-dense-layers: a dense stack before the experts' one; the KV cache's forward
    (both stacks, one token at a time) gives the full forward's logits."""
    moe = MoESettings(4, 2, ffn_dim=24, dense_layers=1)
    model = build(True, moe=moe)
    assert model.dense_blocks is not None and model.moe_layers == LAYERS - 1
    tokens = jnp.asarray(batches()[0]["tokens"][:2, :8])
    full = model.head(model.features(tokens))
    cache = model.init_cache(2, 8)
    steps = []
    for t in range(8):
        h, cache = model.cached_features(tokens[:, t : t + 1], cache, jnp.full((2,), t))
        steps.append(model.head(h))
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "mesh, scan, options",
    [
        (dict(expert=4, data=2), False, {}),
        (dict(expert=2, fsdp=2, model=2), False, {}),
        (dict(expert=4, data=2), False, dict(strategy="shard_map")),
        (dict(seq=2, expert=2, data=2), False, {}),  # the sequence split as well (ring)
    ],
    ids=["expert4-data2", "expert2-fsdp2-model2", "shard_map-expert4", "seq2-expert2-data2"],
)
def test_expert_parallel_layouts_equal_the_equations(reference, mesh, scan, options):
    """Each device holds E/N experts and tokens travel to them by all-to-all: the same
    losses, balance losses and weights as the equations on one device."""
    assert_same(jaxdist_run(jaxdist.make_mesh(**mesh), scan_layers=scan, **options), reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_experts_split_inside_pipeline_stages_equal_the_equations(reference, schedule):
    """stage=2,expert=2,data=2: the experts' all-to-all runs inside each stage, per
    replica (the gspmd step's region manual over data, fsdp and expert)."""
    mesh = jaxdist.make_mesh(stage=2, expert=2, data=2)
    options = dict(microbatches=2, pipeline_schedule=schedule)
    assert_same(jaxdist_run(mesh, scan_layers=True, **options), reference)


def test_experts_with_stages_and_a_model_axis_are_refused_by_name():
    """With model > 1 the step is not per replica, and the experts' shard_map would sit
    inside the stages' one, which does not lower."""
    match = "expert=2 with stage=2: pipeline stages run experts split over expert per replica"
    with pytest.raises(jaxdist.ConfigError, match=match):
        mesh = jaxdist.make_mesh(stage=2, expert=2, model=2)
        jaxdist_run(mesh, scan_layers=True, microbatches=2)
