"""The built-in Llama (``--model llama``) against its equations, without transformers.

The reference is this file's own: the Llama written out in jax.numpy from the equations
(RMSNorm, RoPE in the rotate-half form with Llama 3's frequency scaling, grouped-query
attention with a sliding window, QK-norm, SwiGLU), nothing imported from jaxdist, on the
parameters the jaxdist model starts from, and 5 AdamW steps of ``jax.grad`` and optax
on one device. The jaxdist model must give its logits, and, trained by jaxdist on 1
device, on data=2,fsdp=2,model=2, scanned and through a 2-stage pipeline, its losses and
parameters. Then: attention over a ``seq`` axis (ring, gather) with grouped heads and a
window, the fused loss with an untied head, the FLOPs formula against XLA's count, and
the flags and config.json translations the model's settings go through.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist
from helpers import relative_error
from jaxdist.errors import ConfigError
from jaxdist.models.llama import Llama
from jaxdist.models.rope import Rope
from jaxdist.train.build_model import model_factory
from jaxdist.train.config import from_dict

VOCAB, T, D, LAYERS, HEADS, KV, HEAD_DIM, FFN, EPS = 100, 16, 32, 2, 4, 2, 16, 48, 1e-5
G, STEPS, LR = 8, 5, 3e-3
WINDOW = 6  # shorter than T: the window masks
LLAMA3 = dict(theta=500.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_positions=8)  # fmt: skip
# every switch on: GQA, head_dim != D / HEADS, QK-norm, all four biases, a window, untied
FULL = dict(n_kv_heads=KV, head_dim=HEAD_DIM, ffn_dim=FFN, rms_norm_eps=EPS, qk_norm=True,
            attention_bias="qkvo", sliding_window=WINDOW, tie_embeddings=False)  # fmt: skip


def build(scan_layers=False, rope=LLAMA3, **settings):
    settings = {**FULL, **settings}
    head_dim = settings["head_dim"] or D // HEADS
    return Llama(
        VOCAB, D, LAYERS, HEADS, rope=Rope(head_dim, **rope), scan_layers=scan_layers,
        attention="xla", rngs=nnx.Rngs(0), **settings,
    )  # fmt: skip


# --- the reference: the equations, in jax.numpy


def frequencies(head_dim, theta, rope_type="default", factor=1.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_positions=8192):  # fmt: skip
    """theta^(-2i/Dh); linear: / factor; llama3: long wavelengths / factor, short kept,
    the band between interpolated (Llama 3.1's scaling)."""
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    if rope_type == "linear":
        return freq / factor
    if rope_type == "llama3":
        wavelength = 2 * np.pi / freq
        smooth = (original_max_positions / wavelength - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        blended = (1 - smooth) * freq / factor + smooth * freq
        freq = np.where(wavelength > original_max_positions / low_freq_factor, freq / factor,
                        np.where(wavelength < original_max_positions / high_freq_factor, freq,
                                 blended))  # fmt: skip
    return freq


def rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x, angles):  # x (B, T, N, Dh); angles (T, Dh/2): pairs (i, i + Dh/2)
    half = x.shape[-1] // 2
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(p, tokens, s, rope):
    """tokens (B, T) -> logits (B, T, VOCAB); ``p``: parameters by the model's names,
    ``s``: the settings (FULL's keys), ``rope``: the frequencies' settings."""
    b, t = tokens.shape
    dh = s["head_dim"] or D // HEADS
    kv = s["n_kv_heads"] or HEADS
    angles = np.arange(t)[:, None] * frequencies(dh, **rope)[None]  # (T, Dh/2)
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    allowed = (j <= i) & ((i - j < s["sliding_window"]) if s["sliding_window"] else True)
    x = p["tok/embedding"][tokens]  # (B, T, D)

    def proj(name, h):
        out = h @ p[f"{name}/kernel"]
        return out + p[f"{name}/bias"] if f"{name}/bias" in p else out

    for layer in range(LAYERS):
        pre = f"blocks/{layer}"
        h = rms_norm(x, p[f"{pre}/attn_norm/scale"], s["rms_norm_eps"])
        q = proj(f"{pre}/q", h).reshape(b, t, HEADS, dh)
        k = proj(f"{pre}/k", h).reshape(b, t, kv, dh)
        v = proj(f"{pre}/v", h).reshape(b, t, kv, dh)
        if s["qk_norm"]:
            q = rms_norm(q, p[f"{pre}/q_norm/scale"], s["rms_norm_eps"])
            k = rms_norm(k, p[f"{pre}/k_norm/scale"], s["rms_norm_eps"])
        q, k = rotate(q, angles), rotate(k, angles)
        group = HEADS // kv  # query head n reads key/value head n // group
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(dh)
        weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        att = jnp.einsum("bnqk,bknd->bqnd", weights, v).reshape(b, t, HEADS * dh)
        x = x + proj(f"{pre}/o", att)
        h = rms_norm(x, p[f"{pre}/mlp_norm/scale"], s["rms_norm_eps"])
        x = x + proj(f"{pre}/down", jax.nn.silu(proj(f"{pre}/gate", h)) * proj(f"{pre}/up", h))
    h = rms_norm(x, p["norm/scale"], s["rms_norm_eps"])
    table = p["tok/embedding"] if s["tie_embeddings"] else p["lm_head/embedding"]
    return (h @ table.T)[..., :VOCAB]


def next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


def batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, (G, T + 1), dtype=np.int32)} for _ in range(STEPS)]


def tx():
    return optax.adamw(LR, weight_decay=0.1)


def initial_params(**settings) -> dict[str, np.ndarray]:
    model = build(**settings)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in flat}


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


def loss_fn(model, batch):
    tokens = batch["tokens"]
    return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])


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


# --- the trainer's side: the fused loss, FLOPs, flags


def test_the_fused_loss_reads_an_untied_head():
    from jaxdist.losses import make_fused_next_token_loss

    model, batch = build(), {"tokens": jnp.asarray(batches()[0]["tokens"])}
    plain = loss_fn(model, batch)
    fused, _ = make_fused_next_token_loss(4)(model, batch)
    np.testing.assert_allclose(fused, plain, rtol=1e-6)


def test_the_flops_formula_is_xla_s_count_of_the_step():
    """6N + 12 L H Dh T per token against XLA's cost analysis of the unscanned model's
    loss and gradient on one device: within 3%, the rest XLA's elementwise work. Wide
    enough that a formula with d_model for H Dh (half of it here) or every parameter
    counted as a matmul (the untied embedding) would be off by more."""
    from jaxdist.flops import llama_flops_per_token

    dims = dict(d=128, heads=4, head_dim=64, kv=2, ffn=384, t=128, vocab=512, layers=2)
    model = Llama(
        dims["vocab"], dims["d"], dims["layers"], dims["heads"], n_kv_heads=dims["kv"],
        head_dim=dims["head_dim"], ffn_dim=dims["ffn"], tie_embeddings=False, attention="xla",
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.zeros((2, dims["t"] + 1), jnp.int32)

    def loss(p):
        return loss_fn(nnx.merge(graphdef, p), {"tokens": tokens})

    counted = jax.jit(jax.value_and_grad(loss)).lower(params).compile().cost_analysis()
    counted = counted[0] if isinstance(counted, list | tuple) else counted
    n = sum(x.size for x in jax.tree.leaves(params)) - dims["vocab"] * dims["d"]  # untied
    formula = llama_flops_per_token(n, dims["layers"], dims["heads"], dims["head_dim"], dims["t"])
    tokens_per_step = 2 * dims["t"]
    assert counted["flops"] / (formula * tokens_per_step) == pytest.approx(1.0, abs=0.03)


def test_the_trainer_reports_the_llama_formula():
    from jaxdist.train.trainer import train

    model = {"name": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1,
             "seq_len": 16, "tie_embeddings": False}  # fmt: skip
    config = from_dict({"model": model, "data": {"path": "grammar"},
                        "train": dict(steps=2, global_batch_size=8, num_devices=2)})  # fmt: skip
    run = train(config, write=False, quiet=True)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(run.dp.merge(run.state), nnx.Param)))
    n = params - 384 * 32  # the untied embedding: 257 byte ids padded to 384 rows
    assert run.flops.analytic == (6 * n + 12 * 1 * 4 * 8 * 16) * 8 * 16
    assert run.flops.formula == "6N + 12LHDhT"


@pytest.mark.parametrize(
    "model, message",
    [
        ({"name": "gpt", "n_kv_heads": 2}, "--n-kv-heads 2: flag(s) of --model llama, which "
         "--model gpt does not read"),
        ({"name": "llama", "layer_norm_eps": 1e-5}, "--layer-norm-eps 1e-05: flag(s) of --model "
         "gpt, which --model llama does not read"),
        ({"name": "mlp", "qk_norm": True}, "--qk-norm True: the built-in GPT's and Llama's "
         "flag(s), which --model mlp cannot see"),
        ({"name": "llama", "rope_factor": 8.0}, "--rope-factor 8.0: --rope-type default does "
         "not read it"),
        ({"name": "llama", "n_kv_heads": 3}, "--n-kv-heads 3 does not divide --n-heads 4"),
    ],
)  # fmt: skip
def test_flags_a_model_cannot_read_are_refused_in_one_line(model, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        model_factory(from_dict({"model": model}).model, seed=0)


# --- config.json -> flags (jaxdist/weights/maps/hf_llama.py), on files written here

SIZES = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4}  # fmt: skip


def settings_of(tmp_path, **config):
    import json

    from jaxdist.weights.maps import hf_llama

    (tmp_path / "config.json").write_text(json.dumps({**SIZES, **config}))
    return {k: v for k, (v, _) in hf_llama.model_settings(str(tmp_path)).items()}


def test_a_legacy_llama3_config_reads_as_transformers_reads_it(tmp_path):
    # transformers 4's form: rope_scaling beside a top-level rope_theta, no head_dim
    got = settings_of(tmp_path, model_type="llama", num_key_value_heads=2, rope_theta=5e5,
                      rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0},
                      max_position_embeddings=4096)  # fmt: skip
    assert got["rope_type"] == "llama3" and got["rope_theta"] == 5e5
    assert got["rope_original_max_positions"] == 4096  # transformers' fallback
    assert (got["head_dim"], got["n_kv_heads"], got["tie_embeddings"]) == (8, 2, False)
    assert (got["qk_norm"], got["attention_bias"], got["sliding_window_tokens"]) == (
        False, "none", 0)  # fmt: skip
    qwen2 = settings_of(tmp_path, model_type="qwen2", use_sliding_window=False,
                        sliding_window=4096)  # fmt: skip
    assert qwen2["attention_bias"] == "qkv" and qwen2["sliding_window_tokens"] == 0
    assert qwen2["n_kv_heads"] == 32  # transformers' Qwen2 default where the file has none


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(model_type="llama", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
         "RoPE type 'yarn': jaxdist's Llama computes default, linear, llama3 only"),
        (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8,
              max_window_layers=1), "layer_types mixes sliding_attention and full_attention"),
        (dict(model_type="llama", hidden_act="gelu"), "hidden_act is 'gelu'"),
        (dict(model_type="gemma"), "model_type 'gemma' is not one --model llama reads"),
    ],
)  # fmt: skip
def test_a_config_the_model_cannot_be_is_refused_by_name(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        settings_of(tmp_path, **config)


def test_a_map_s_requires_are_the_settings_its_format_holds():
    """What no tensor shows is checked by the map's ``requires`` on the way in and out
    (``--init-from``, export): a window into Llama's format, no biases into Qwen2's."""
    from jaxdist.weights.weight_map import check_requires, load

    windowed = {"qk_norm": False, "sliding_window_tokens": 8, "attention_bias": "none"}
    with pytest.raises(ConfigError, match="sliding_window_tokens is 8 in the model, the "
                       "format holds 0"):  # fmt: skip
        check_requires(load("llama"), windowed, "the model")
    check_requires(load("mistral"), windowed, "the model")  # Mistral's holds any window
    with pytest.raises(ConfigError, match="attention_bias is 'none' in the run's model, the "
                       "format holds 'qkv'"):  # fmt: skip
        check_requires(load("qwen2"), windowed, "the run's model")
