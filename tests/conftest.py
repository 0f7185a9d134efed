"""8 emulated CPU devices for every test, set before JAX initialises its backend."""

import atexit
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
# Prepared corpora go to a fresh cache per test session (and subprocesses inherit it).
os.environ["JAXDIST_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-test-cache-")
atexit.register(shutil.rmtree, os.environ["JAXDIST_CACHE"], ignore_errors=True)
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8, jax.devices()
