"""The observability API as the README calls it from your own loop, after a plain
``import jaxdist``: ``jaxdist.sinks.*`` and ``jaxdist.flops.*``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import optax
from flax import nnx

import jaxdist

# In a fresh interpreter: in this one, the trainer's modules have imported jaxdist.flops
# already, which makes it an attribute of jaxdist whatever jaxdist/__init__.py does.
FRESH = """
import sys
import jaxdist
assert "tensorboard" not in sys.modules  # loaded on use
print(jaxdist.flops.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16"))
print(jaxdist.sinks.Sinks.__name__, jaxdist.sinks.TensorBoard.__name__)
print(jaxdist.sinks.GoodputFile.__name__)
"""


def test_import_jaxdist_reaches_flops_and_the_sinks_loading_them_on_use():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["989000000000000.0", "Sinks", "TensorBoard", "GoodputFile"]


def test_the_readmes_flops_calls_count_a_step(tmp_path):
    """``jaxdist.flops.xla_step_flops(dp.program(batch), n_devices)`` for a linear model
    on 8 devices: at least its forward and weight-gradient matmuls, 2 x 2 B d k FLOPs
    over the whole batch (counted per device, times the devices); no peak on a CPU."""
    rows, d, k = 64, 32, 16
    mesh = jaxdist.make_mesh()

    def loss_fn(model, batch, rngs):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {}

    model = nnx.Linear(d, k, rngs=nnx.Rngs(0))
    dp = jaxdist.DataParallel(model, optax.sgd(0.1), loss_fn, mesh=mesh)
    host = {"x": np.ones((rows, d), np.float32), "y": np.zeros((rows, k), np.float32)}
    batch = jaxdist.shard_batch(host, mesh)
    flops = jaxdist.flops.xla_step_flops(dp.program(batch), mesh.size)
    assert 4 * rows * d * k <= flops < 2 * 4 * rows * d * k, flops
    kind = mesh.devices.flat[0].device_kind
    assert jaxdist.flops.peak_flops(kind, "float32") is None
