"""8 emulated CPU devices for every test, set before JAX initialises its backend."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8, jax.devices()
