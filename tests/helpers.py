"""Shared test helpers: configs and the subprocess runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxdist.train.config import from_dict


def small_config(**train):
    """A 5-step MLP run, small enough to compile in well under a second."""
    base = {"steps": 5, "global_batch_size": 16, "log_every": 1, "seed": 3}
    base.update(train)
    return from_dict(
        {
            "model": {"name": "mlp", "in_features": 12, "hidden": 24, "depth": 2, "num_classes": 5},
            # SGD: unlike Adam it is not scale-invariant, so a gradient N times too large shows.
            "optim": {
                "optimizer": "sgd",
                "lr": 0.05,
                "warmup_steps": 2,
                "min_lr_ratio": 0.1,
                "weight_decay": 0.01,
            },
            "train": base,
        }
    )


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_module(module: str, *args, cwd=None, timeout=300, env_extra=None, env_drop=()):
    """``python -m module args...`` on the CPU platform, output captured, no stdin. The
    command's own flags decide the device count (the suite's 8 is not inherited);
    ``env_drop``: variables a user's shell would not have."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    for name in ("JAX_NUM_CPU_DEVICES", *env_drop):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_cli(*args, cwd=None, timeout=300):
    """``python -m jaxdist.train args...``."""
    return run_module("jaxdist.train", *args, cwd=cwd, timeout=timeout)


def load_experiment(name: str):
    """Imports ``experiments/<name>.py`` (a script folder, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def launch(*args, cwd=None, timeout=300, env_extra=None):
    """``python -m jaxdist.launch ...`` as a subprocess; returns (proc, seconds)."""
    import time

    start = time.monotonic()
    proc = run_module("jaxdist.launch", *args, cwd=cwd, timeout=timeout, env_extra=env_extra)
    return proc, time.monotonic() - start


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it runs nothing and holds no port.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:  # reaped since the kill
        return False


def named_leaves(tree) -> dict[str, object]:
    """An nnx.State or a nested dict -> {"a/b/c": leaf}."""
    pure = nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
    leaves = jax.tree_util.tree_leaves_with_path(pure)
    return {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in leaves}


def flat(tree) -> dict[str, np.ndarray]:
    """An nnx.State or a nested dict -> {"a/b/c": float64 numpy}."""
    return {k: np.asarray(v, np.float64) for k, v in named_leaves(tree).items()}


def metrics_of(run_dir) -> list[dict]:
    """A run's ``metrics.jsonl`` records."""
    return _jsonl(Path(run_dir) / "metrics.jsonl")


def failures_of(run_dir) -> list[dict]:
    """A run's ``failures.jsonl`` records."""
    return _jsonl(Path(run_dir) / "failures.jsonl")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def saved_params(path) -> dict[str, np.ndarray]:
    """The params ``--save-params`` wrote (an .npz), by path."""
    with np.load(path) as f:
        return {name: f[name] for name in f.files}


def per_layer(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A stack's (L, ...) arrays "blocks/layers/fc/kernel" as the unscanned model names
    them: "blocks/0/fc/kernel", ... (what checkpoints hold)."""
    out = {}
    for name, value in params.items():
        if name.startswith("blocks/layers/"):
            out.update({name.replace("/layers/", f"/{i}/", 1): v for i, v in enumerate(value)})
        else:
            out[name] = value
    return out


def next_within(iterator, seconds=20.0):
    """``next(iterator)`` in a thread: (returned, raised); a test failure if it blocks."""
    out = {}

    def call():
        try:
            out["value"] = next(iterator)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"next() still blocked after {seconds} s"
    return out.get("value"), out.get("error")


def read_in(config):
    """The run ``jaxdist.train.trainer.setup`` makes of ``config``, its data and health
    closed again: its state is what the run starts from (``--init-from``'s weights)."""
    from jaxdist.train.trainer import setup

    run = setup(config)
    run.batches.close()
    run.health.close(finished=True)
    return run
