"""``--loss-chunks``: the GPT's next-token loss without its (B, T, vocab) logits. Its value
and gradients equal optax's cross-entropy of the whole logits (written here with plain
jax.grad), and training with it equals training without it, on one device and on layouts
that split the batch, the vocabulary and the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import per_layer
from jaxdist import losses
from jaxdist.losses import fused_cross_entropy
from jaxdist.train import build_model
from jaxdist.train.build_model import loss_chunks
from jaxdist.train.config import ConfigError, from_dict
from jaxdist.train.trainer import train

B, T, D, ROWS, VOCAB = 2, 8, 16, 24, 20  # the table has 4 padded rows beyond the vocabulary


def inputs(dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k1, (B, T, D)).astype(dtype)
    table = (jax.random.normal(k2, (ROWS, D)) * 0.3).astype(dtype)
    labels = jax.random.randint(k3, (B, T), 0, VOCAB)
    return h, table, labels


def plain_loss(h, table, labels):
    logits = (h @ table.T)[..., :VOCAB].astype(jnp.float32)  # (B, T, vocab)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_value_and_gradients_equal_optax_on_the_whole_logits(chunks):
    h, table, labels = inputs(jnp.float32)
    want, (want_h, want_table) = jax.value_and_grad(plain_loss, (0, 1))(h, table, labels)
    fused = jax.value_and_grad(fused_cross_entropy, (0, 1))
    got, (got_h, got_table) = fused(h, table, labels, chunks, VOCAB)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-8)
    assert not np.any(got_table[VOCAB:])  # padded rows: no gradient
    # scaled by the incoming gradient, as a loss inside a larger function is
    twice = jax.grad(lambda h: 2 * fused_cross_entropy(h, table, labels, chunks, VOCAB))(h)
    np.testing.assert_allclose(twice, 2 * want_h, rtol=1e-5, atol=1e-8)


def test_soft_capped_logits_equal_optax_on_the_capped_whole_logits():
    # Gemma's final soft-cap, c tanh(s / c), inside the chunks: its gradient too
    h, table, labels = inputs(jnp.float32)

    def capped(h, table, labels):
        logits = 1.5 * jnp.tanh((h @ table.T)[..., :VOCAB] / 1.5)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    want, (want_h, want_table) = jax.value_and_grad(capped, (0, 1))(h, table, labels)
    got, (got_h, got_table) = jax.value_and_grad(fused_cross_entropy, (0, 1))(
        h, table, labels, 4, VOCAB, 1.5
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-8)
    assert abs(float(got) - float(plain_loss(h, table, labels))) > 1e-2  # the cap bites


def test_bfloat16_stays_close_to_the_plain_loss():
    h, table, labels = inputs(jnp.bfloat16)
    want, (want_h, _) = jax.value_and_grad(plain_loss, (0, 1))(h, table, labels)
    got, (got_h, _) = jax.value_and_grad(fused_cross_entropy, (0, 1))(h, table, labels, 4, VOCAB)
    assert got_h.dtype == jnp.bfloat16
    np.testing.assert_allclose(got, want, rtol=2e-2)
    np.testing.assert_allclose(np.float32(got_h), np.float32(want_h), rtol=5e-2, atol=2e-3)


def run(mesh: str, chunks: int):
    """3 SGD steps of the default GPT; (losses, host params under the unscanned names)."""
    model = {"name": "gpt", "loss_chunks": chunks, "seq_len": 32, "vocab_size": 300}
    train_cfg = {"steps": 3, "global_batch_size": 8, "log_every": 1, "tensorboard": False}
    train_cfg.update({"mesh": mesh} if mesh else {"num_devices": 1})
    optim = {"optimizer": "sgd", "lr": 0.3, "clip_norm": 0, "momentum": 0}
    config = from_dict({"model": model, "train": train_cfg, "optim": optim})
    result = train(config, write=False, quiet=True)
    return [h["loss"] for h in result.history], per_layer(result.dp.host_params(result.state))


@pytest.fixture(scope="module")
def unchunked():
    return run("", 0)


@pytest.mark.parametrize("mesh", ["", "data=4,model=2", "stage=2,data=4"])
def test_training_with_chunks_equals_training_without(unchunked, mesh, monkeypatch):
    traced = []  # the fused loss is what the step runs (traced once per compiled program)
    fused = losses.fused_cross_entropy
    monkeypatch.setattr(losses, "fused_cross_entropy", lambda *a: traced.append(a[3]) or fused(*a))
    got, params = run(mesh, 4)
    assert traced and set(traced) == {4}
    np.testing.assert_allclose(got, unchunked[0], rtol=1e-5)
    assert sorted(params) == sorted(unchunked[1])
    for name, want in unchunked[1].items():
        np.testing.assert_allclose(params[name], want, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"name": "gpt", "loss_chunks": 3}, "does not divide --seq-len 64"),
        (
            {"name": "mlp", "loss_chunks": 2},
            "only for --model gpt's or llama's own loss, not --model mlp",
        ),
    ],
)
def test_chunks_that_cannot_apply_are_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"model": model})


@pytest.mark.parametrize(
    "model, platform, chunks",
    [
        ({"name": "gpt", "seq_len": 1024}, "gpu", 8),  # the default on a GPU
        ({"name": "gpt", "seq_len": 1024}, "cuda", 8),  # a GPU the planner compiles for
        ({"name": "gpt", "seq_len": 1024}, "cpu", 0),
        ({"name": "gpt", "seq_len": 36}, "gpu", 0),  # 8 does not divide the sequence
        ({"name": "gpt", "seq_len": 64, "loss": "helpers:small_config"}, "gpu", 0),  # own loss
        ({"name": "mlp"}, "gpu", 0),
        ({"name": "gpt", "seq_len": 64, "loss_chunks": 0}, "gpu", 0),  # asked: kept
        ({"name": "gpt", "seq_len": 64, "loss_chunks": 4}, "cpu", 4),
    ],
)
def test_auto_chunks_are_eight_on_a_gpu_for_the_gpts_own_loss(model, platform, chunks):
    assert from_dict({"model": model}).model.loss_chunks == model.get("loss_chunks", -1)
    assert loss_chunks(from_dict({"model": model}).model, platform) == chunks
    # ZeRO-1: the plain loss (tests/test_shard_optimizer.py's GPU step has the bytes)
    assert loss_chunks(from_dict({"model": model}).model, platform, shard_optimizer=True) == (
        model.get("loss_chunks", 0)
    )


def test_auto_is_said_and_trains_as_eight_slices_on_a_gpu_platform(monkeypatch, capsys):
    """On a GPU's platform name (faked: the CPU devices report "gpu") the default takes
    the fused loss, says so, and trains what --loss-chunks 8 trains."""
    model = {"name": "gpt", "seq_len": 32, "vocab_size": 300}
    flags = {"steps": 3, "global_batch_size": 8, "log_every": 1, "tensorboard": False}
    config = from_dict({"model": model, "train": {**flags, "num_devices": 1}})
    monkeypatch.setattr(
        build_model, "loss_chunks", lambda cfg, _, zero: loss_chunks(cfg, "gpu", zero)
    )
    auto = [h["loss"] for h in train(config, write=False, quiet=True).history]
    assert "--loss-chunks auto: the GPT's loss in 8 slices" in capsys.readouterr().out
    config.model.loss_chunks = 8
    eight = [h["loss"] for h in train(config, write=False, quiet=True).history]
    assert auto == eight
