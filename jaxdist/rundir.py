"""The run directory (``config.yaml``, ``metrics.jsonl``): named at start, made only once
the first step has trained, so that bad input, which fails before that (exit 2), leaves
nothing behind. Process 0 only writes."""

from __future__ import annotations

import re
import time
from pathlib import Path

from jaxdist import config as config_lib
from jaxdist.config import Config


def run_dir_path(config: Config) -> Path:
    """``--run-dir``, else ``runs/<model>-<strategy>-<time>``."""
    if config.train.run_dir:
        return Path(config.train.run_dir)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", config.model.name)
    return Path("runs") / f"{name}-{config.train.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"


def create(run_dir: Path, config: Config) -> Path:
    """Makes ``run_dir`` with the resolved ``config.yaml`` (rerun it with ``--config``)
    and no ``metrics.jsonl`` yet: a fresh run, not an append to an older one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    config_lib.save(config, run_dir / "config.yaml")
    return run_dir / "metrics.jsonl"
