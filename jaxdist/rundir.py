"""The run directory (``config.yaml``, ``metrics.jsonl``): named at start, checked at
setup, made only once the first step has trained, so that bad input, which fails before
that (exit 2), leaves nothing behind. Process 0 only writes."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from jaxdist import config as config_lib
from jaxdist.config import Config
from jaxdist.errors import ConfigError, JaxdistError


def run_dir_path(config: Config) -> Path:
    """``--run-dir``, else ``runs/<model>-<strategy>-<time>``."""
    if config.train.run_dir:
        return Path(config.train.run_dir)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", config.model.name)
    return Path("runs") / f"{name}-{config.train.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_writable(path: Path, flag: str, *, is_dir: bool) -> None:
    """ConfigError naming ``path`` unless it can be written: as a directory (``is_dir``)
    or a file, existing or made later with its missing parents. Creates nothing: the
    nearest existing ancestor must be a directory this process may write in."""
    if os.path.lexists(path):
        if not path.exists():
            raise ConfigError(f"{flag} {path}: it is a broken symbolic link")
        if path.is_dir() != is_dir:
            kind, wanted = ("a directory", "a file") if path.is_dir() else ("a file", "a directory")
            raise ConfigError(f"{flag} {path}: it is {kind}, not {wanted}")
        target = path
    else:
        target = path.parent
        while not os.path.lexists(target):
            target = target.parent
        if not target.is_dir():
            raise ConfigError(f"{flag} {path}: {target} is a file, not a directory")
    if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        raise ConfigError(f"{flag} {path}: {target} is not writable by this user")


def create(run_dir: Path, config: Config) -> Path:
    """Makes ``run_dir`` with the resolved ``config.yaml`` (rerun it with ``--config``)
    and no ``metrics.jsonl`` yet: a fresh run, not an append to an older one."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml"):  # replaced, whoever owned them
            (run_dir / name).unlink(missing_ok=True)
        config_lib.save(config, run_dir / "config.yaml")
    except OSError as err:  # checked at setup: something changed since
        raise JaxdistError(f"--run-dir {run_dir}: cannot write the run directory: {err}") from None
    return run_dir / "metrics.jsonl"
