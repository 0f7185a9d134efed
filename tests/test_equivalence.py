"""N-device data parallelism computes what one device computes.

The reference is a plain single-device loop written here, with optax and jax.grad
directly: no jaxdist step, strategy or optimizer code. It trains the same model from the
same initial params on the same global batches; its params and its losses (each step's
loss on the global batch, before the update) are what every run must log and end with."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import relative_error, small_config
from jaxdist.data.sampler import DistributedSampler
from jaxdist.data.synthetic import TeacherClassification
from jaxdist.train.build_model import build_model
from jaxdist.train.trainer import train


def reference(config):
    """(losses, params) of the plain loop."""
    m, o, t = config.model, config.optim, config.train
    model, _ = build_model(m, t.seed)  # the model only: same init as the trainer
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, o.lr, o.warmup_steps, t.steps, o.lr * o.min_lr_ratio
    )
    if o.optimizer == "adamw":
        opt = optax.adamw(schedule, weight_decay=o.weight_decay)
    else:
        opt = optax.chain(
            optax.add_decayed_weights(o.weight_decay), optax.sgd(schedule, o.momentum)
        )
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), opt)
    opt_state = tx.init(params)

    def loss(p, x, y):
        logits = nnx.merge(graphdef, p, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    data = TeacherClassification(config.data.num_examples, m.in_features, m.num_classes, t.seed)
    order = DistributedSampler(len(data), t.global_batch_size, seed=t.seed)
    device, losses = jax.devices()[0], []
    for step in range(t.steps):
        batch = data[order.global_indices(step)]
        x, y = jax.device_put((batch["x"], batch["y"]), device)
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return losses, params


def assert_matches(run, reference):
    """The run's logged losses and final params are the plain loop's."""
    want_losses, want_params = reference
    np.testing.assert_allclose([h["loss"] for h in run.history], want_losses, rtol=1e-5)
    got = jax.tree.leaves(run.dp.unreplicate(run.state).params)
    want = jax.tree.leaves(want_params)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert relative_error(g, w) < 1e-5, relative_error(g, w)


@pytest.mark.parametrize("grad_accum", [1, 2])
# 1 (the reference's own device count), 2 and all 8 (4: 15 s of the suite, no new case)
@pytest.mark.parametrize("num_devices", [1, 2, 8])
@pytest.mark.parametrize("strategy", ["pmap", "shard_map", "gspmd"])
def test_params_and_losses_equal_single_device_reference(strategy, num_devices, grad_accum):
    """The logged loss is the 1-device loss on the global batch (the mean of the
    microbatches' with grad-accum), and the params the 1-device params."""
    config = small_config(strategy=strategy, num_devices=num_devices, grad_accum=grad_accum)
    run = train(config, write=False)
    assert run.mesh.size == num_devices
    assert len(run.history) == config.train.steps  # a loss logged every step
    assert_matches(run, reference(config))


@pytest.mark.parametrize("strategy", ["pmap", "shard_map", "gspmd"])
def test_adamw_matches_reference(strategy):
    config = small_config(strategy=strategy, num_devices=8)
    config.optim.optimizer = "adamw"
    assert_matches(train(config, write=False), reference(config))


def test_reference_is_sensitive():
    """The comparison can fail: a 20% different learning rate gives different params and
    losses (from the second step on)."""
    config = small_config(strategy="gspmd", num_devices=8)
    run = train(config, write=False)
    other = small_config(strategy="gspmd", num_devices=8)
    other.optim.lr = 0.06
    losses, params = reference(other)
    got = jax.tree.leaves(run.dp.unreplicate(run.state).params)
    want = jax.tree.leaves(params)
    assert max(relative_error(g, w) for g, w in zip(got, want, strict=True)) > 1e-3
    assert relative_error([h["loss"] for h in run.history], losses) > 1e-5
