"""N-device data parallelism computes what one device computes.

The reference is a plain single-device loop written here, with optax and jax.grad
directly: no jaxdist step, strategy or optimizer code. It trains the same model from the
same initial params on the same global batches."""

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


def reference_params(config):
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
    device = jax.devices()[0]
    for step in range(t.steps):
        batch = data[order.global_indices(step)]
        x, y = jax.device_put((batch["x"], batch["y"]), device)
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def assert_params_match(run, reference):
    got = jax.tree.leaves(run.dp.unreplicate(run.state).params)
    want = jax.tree.leaves(reference)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert relative_error(g, w) < 1e-5, relative_error(g, w)


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("strategy", ["pmap", "shard_map", "gspmd"])
def test_params_equal_single_device_reference(strategy, num_devices, grad_accum):
    config = small_config(strategy=strategy, num_devices=num_devices, grad_accum=grad_accum)
    run = train(config, write=False)
    assert run.mesh.size == num_devices
    assert_params_match(run, reference_params(config))


@pytest.mark.parametrize("strategy", ["pmap", "shard_map", "gspmd"])
def test_adamw_matches_reference(strategy):
    config = small_config(strategy=strategy, num_devices=8)
    config.optim.optimizer = "adamw"
    assert_params_match(train(config, write=False), reference_params(config))


def test_reference_is_sensitive():
    """The comparison can fail: a 20% different learning rate gives different params."""
    config = small_config(strategy="gspmd", num_devices=8)
    run = train(config, write=False)
    other = small_config(strategy="gspmd", num_devices=8)
    other.optim.lr = 0.06
    got = jax.tree.leaves(run.dp.unreplicate(run.state).params)
    want = jax.tree.leaves(reference_params(other))
    assert max(relative_error(g, w) for g, w in zip(got, want, strict=True)) > 1e-3


def test_metrics_loss_is_global_mean():
    """The logged loss is the 1-device loss on the global batch, on every strategy."""
    losses = {}
    for strategy in ["pmap", "shard_map", "gspmd"]:
        run = train(small_config(strategy=strategy, num_devices=8), write=False)
        losses[strategy] = [h["loss"] for h in run.history]
    single = train(small_config(strategy="gspmd", num_devices=1), write=False)
    for values in losses.values():
        np.testing.assert_allclose(values, [h["loss"] for h in single.history], rtol=1e-5)
