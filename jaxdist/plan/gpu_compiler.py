"""XLA's GPU compiler on a machine without a GPU: JAX's CUDA plugin (``jax-cuda12-plugin``
and ``jax-cuda12-pjrt``, about 480 MB, no NVIDIA libraries needed to compile). It is
installed apart from the environment, in ``~/.cache/jaxdist/gpu-compiler/jaxlib-X``
(``$JAXDIST_GPU_COMPILER`` to choose), and put on the planner workers' path only: the
rest of the process never sees a CUDA plugin (no "no GPU found" warnings, no change to
the CPU backend). An environment that has a CUDA plugin already (a GPU machine) uses it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jaxlib

from jaxdist.errors import ConfigError

PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
INSTALL = "python -m jaxdist.plan --install-gpu-compiler"


def directory() -> Path:
    """Where the plugin goes for this jaxlib (the plugin's version must equal jaxlib's)."""
    chosen = os.environ.get("JAXDIST_GPU_COMPILER")
    if chosen:
        return Path(chosen)
    return Path.home() / ".cache" / "jaxdist" / "gpu-compiler" / f"jaxlib-{jaxlib.__version__}"


def in_environment() -> bool:
    """A CUDA plugin importable here already (jax[cuda12] or jax[cuda13])."""
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in ("12", "13"))


def python_path() -> str:
    """What the workers add to PYTHONPATH ("" when the environment has the plugin);
    ConfigError, naming the command that installs it, when there is none."""
    if in_environment():
        return ""
    if (directory() / "jax_plugins").is_dir():
        return str(directory())
    raise ConfigError(
        "planning for a GPU needs XLA's GPU compiler (JAX's CUDA plugin, about 480 MB, no "
        f"GPU needed): install it once with `{INSTALL}`, or plan for --target cpu:N"
    )


def install(quiet: bool = False) -> Path:
    """pip-installs the plugin matching this jaxlib into ``directory()``, whole or not at
    all (into a temporary folder, then renamed)."""
    target = directory()
    if (target / "jax_plugins").is_dir():
        if not quiet:
            print(f"jaxdist: the GPU compiler is installed in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    version = jaxlib.__version__
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "plugin"
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(staging)]
        cmd += [f"{name}=={version}" for name in PACKAGES]
        if not quiet:
            print(f"jaxdist: installing {', '.join(PACKAGES)} {version} into {target}")
        done = subprocess.run(cmd, capture_output=quiet, text=True)
        if done.returncode != 0:
            detail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
            raise ConfigError(f"could not install the GPU compiler: pip exited "
                              f"{done.returncode} {' '.join(detail)}")  # fmt: skip
        if not (target / "jax_plugins").is_dir():  # else another install finished first
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target
