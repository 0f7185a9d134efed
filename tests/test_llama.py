"""The built-in Llama (``--model llama``) against its equations, without transformers.

The reference is llama_equations.py: the Llama written out in jax.numpy from the
equations, nothing imported from jaxdist, on the parameters the jaxdist model starts
from, and 5 AdamW steps of ``jax.grad`` and optax on one device. The jaxdist model must
give its logits, and, trained by jaxdist on 1 device, on data=2,fsdp=2,model=2, scanned
and through a 2-stage pipeline, its losses and parameters. Then attention over a ``seq``
axis (ring, gather) with grouped heads and a window. The trainer's side (the fused loss,
FLOPs, flags): test_llama_trainer.py; config.json's translations: test_llama_config.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist
from helpers import relative_error
from llama_equations import (
    FULL,
    HEADS,
    KV,
    LLAMA3,
    VOCAB,
    G,
    T,
    batches,
    build,
    initial_params,
    loss_fn,
    next_token_loss,
    reference_logits,
    tx,
)


@pytest.fixture(scope="module")
def reference():
    """(losses, params) of 5 AdamW steps of the equations on one device."""
    params = {k: jnp.asarray(v) for k, v in initial_params().items()}
    opt = tx()
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens):
        def loss(p):
            return next_token_loss(reference_logits(p, tokens[:, :-1], FULL, LLAMA3), tokens[:, 1:])

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for batch in batches():
        params, state, value = step(params, state, batch["tokens"])
        losses.append(float(value))
    return losses, {k: np.asarray(v) for k, v in params.items()}


def jaxdist_run(mesh, scan_layers=False, **options):
    """(losses, params by the unstacked model's names) of jaxdist's 5 steps on ``mesh``."""
    dp = jaxdist.DataParallel(lambda: build(scan_layers), tx(), loss_fn, mesh=mesh, **options)
    state, losses = dp.init_state(), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    return losses, dp.host_params(state, per_layer=True)


def assert_same(got, want, rtol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    assert sorted(got[1]) == sorted(want[1])
    for name, value in want[1].items():
        assert relative_error(got[1][name], value) < rtol, name


@pytest.mark.parametrize(
    "settings, rope",
    [
        ({}, LLAMA3),  # every switch on
        (dict(n_kv_heads=0, head_dim=0, qk_norm=False, attention_bias="none", sliding_window=0,
              tie_embeddings=True), dict(theta=10000.0)),  # plain: MHA, tied, default RoPE
        (dict(attention_bias="qkv", sliding_window=1), dict(theta=1e4, rope_type="linear",
                                                            factor=4.0)),
    ],
    ids=["full", "plain", "linear-window1"],
)  # fmt: skip
def test_forward_equals_the_equations(settings, rope):
    model = build(rope=rope, **settings)
    tokens = batches()[0]["tokens"][:, :-1]
    params = {k: jnp.asarray(v) for k, v in initial_params(rope=rope, **settings).items()}
    want = reference_logits(params, tokens, {**FULL, **settings}, rope)
    got = model(tokens)
    assert got.shape == (G, T, VOCAB)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # what each switch changes is seen: the window and the RoPE scaling move the logits
    if settings == {}:
        assert np.abs(reference_logits(params, tokens, {**FULL, "sliding_window": 0}, rope)
                      - want).max() > 1e-3  # fmt: skip
        assert np.abs(reference_logits(params, tokens, FULL, dict(theta=500.0)) - want).max() > 1e-3


def test_five_adamw_steps_equal_the_equations_on_1_device_and_a_split_layout(reference):
    one = jaxdist_run(jaxdist.make_mesh(data=1, devices=jax.devices()[:1]))
    assert_same(one, reference)
    split = jaxdist_run(jaxdist.make_mesh(data=2, fsdp=2, model=2))
    assert_same(split, reference)
    assert reference[0][-1] < reference[0][0]  # it trains


def test_scanned_and_pipelined_give_the_same_numbers(reference):
    scanned = jaxdist_run(jaxdist.make_mesh(data=2, fsdp=2, model=2), scan_layers=True)
    assert_same(scanned, reference)
    mesh = jaxdist.make_mesh(data=2, stage=2, model=2)  # a layer per stage, 2 microbatches
    staged = jaxdist_run(mesh, scan_layers=True, microbatches=2)
    assert_same(staged, reference)


# --- attention over a seq axis: grouped heads and a window


def under(mesh, fn):
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return jax.jit(traced)


@pytest.mark.parametrize("way", ["ring", "gather"])
@pytest.mark.parametrize("window", [0, 3, 6, 100])  # none, under a block, over one, all
def test_attention_over_seq_with_grouped_heads_and_a_window(way, window):
    from jaxdist.models.attention import attention

    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, T, HEADS, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, T, KV, 8)).astype(np.float32) for _ in range(2))
    want = attention(q, k, v, window=window)  # no mesh: jax.nn.dot_product_attention
    mesh = jaxdist.make_mesh(seq=4, devices=jax.devices()[:4])  # blocks of 4 positions
    on_mesh = [jax.device_put(x, NamedSharding(mesh, P())) for x in (q, k, v)]
    got = under(mesh, lambda q, k, v: attention(q, k, v, seq_attention=way, window=window))
    np.testing.assert_allclose(got(*on_mesh), want, atol=1e-5)
    # the backward pass too (the ring's skipped and masked hops among it)
    split_grad = under(mesh, jax.grad(
        lambda q, k, v: (attention(q, k, v, seq_attention=way, window=window) ** 2).sum(),
        argnums=(0, 1, 2)))  # fmt: skip
    plain_grad = jax.grad(lambda q, k, v: (attention(q, k, v, window=window) ** 2).sum(),
                          argnums=(0, 1, 2))  # fmt: skip
    for got_, want_ in zip(split_grad(*on_mesh), plain_grad(q, k, v), strict=True):
        np.testing.assert_allclose(got_, want_, atol=1e-4)
