"""The run directory: ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``.

Named once for the whole group (and for every restart of it), checked at setup, made
only once the first step has trained (before, only to hold ``lock.py``'s lock, removed
with it), so that bad input, which fails before that (exit 2), leaves nothing behind.
An earlier run in it is never silently replaced: it is resumed from its newest
checkpoint (``--resume auto``), or refused unless ``--overwrite``. An earlier attempt of
this same run (its id in ``run_id``) that saved no checkpoint is not another run: it is
trained again from step 0. Process 0 writes; every process reads the same shared
directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.checkpoint.io_errors import storage_error
from jaxdist.errors import ConfigError, JaxdistError

CHECKPOINTS = "checkpoints"
# What an earlier run leaves (--overwrite removes them all)
RUN_FILES = ("metrics.jsonl", "config.yaml", CHECKPOINTS, "goodput.json", "tb", "profile")
# W&B's files and run id (--wandb): removed by --overwrite, not a sign of an earlier run
WANDB_FILES = ("wandb", "wandb_id")
# The id of the run that last wrote the directory (absent: a run without one). Not in
# RUN_FILES: it is always written with metrics.jsonl, and refusals name what users wrote.
RUN_ID = "run_id"


def run_id() -> str | None:
    """This run's id, the same on every process and after a restart: the SLURM job's
    (kept by a requeue), else ``jaxdist.launch``'s (kept by ``--max-restarts``). None for
    a command started otherwise: its restart cannot be told from a new run."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm{os.environ['SLURM_JOB_ID']}"
    return os.environ.get("JAXDIST_RUN_ID") or None


def run_dir_path(given: str, model_name: str, strategy: str) -> Path:
    """``given`` (``--run-dir``), else ``runs/<model>-<strategy>-<id>``: the id is
    ``run_id()``, or process 0's clock, agreed by every process."""
    if given:
        return Path(given)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name)
    dir_id = run_id() or _agreed(time.strftime("%Y%m%d-%H%M%S"))
    return Path("runs") / f"{name}-{strategy}-{dir_id}"


def _agreed(text: str, size: int = 256) -> str:
    """Process 0's ``text`` (its first ``size`` bytes), on every process (each would read
    its own clock)."""
    import jax

    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    padded = np.zeros(size, np.uint8)
    raw = text.encode()[:size]
    padded[: len(raw)] = np.frombuffer(raw, np.uint8)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return bytes(agreed.astype(np.uint8)).rstrip(b"\0").decode()


@dataclass(frozen=True)
class Plan:
    """What setup does with the run directory: start afresh or resume, and what to clear."""

    resume: bool  # restore the newest good checkpoint in checkpoints/
    clear: bool  # --overwrite of an earlier run: process 0 removes its files first
    # An earlier attempt of this run that saved no checkpoint: from step 0 again, over
    # its files (nothing is removed first; metrics.jsonl is replaced at the first step).
    restart: bool = False


def plan(run_dir: Path, resume: str, overwrite: bool) -> Plan:
    """Reads ``run_dir`` (every process, the same answer); ConfigError for a directory
    that holds an earlier run this run may not touch."""
    earlier = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not earlier:
        return Plan(resume=False, clear=False)
    if overwrite:
        return Plan(resume=False, clear=True)
    steps = checkpoint_steps(run_dir)
    if steps and resume == "auto":
        return Plan(resume=True, clear=False)
    if steps:
        raise ConfigError(
            f"--run-dir {run_dir} has checkpoints (newest: step {steps[0]}) and --resume is "
            "never: continue it with --resume auto, or start afresh with --overwrite"
        )
    if written_by_this_run(run_dir):  # a restart or requeue before the first checkpoint
        return Plan(resume=False, clear=False, restart=True)
    raise ConfigError(
        f"--run-dir {run_dir} holds an earlier run ({', '.join(earlier)}) and no checkpoint "
        "to resume from: replace it with --overwrite, or use another --run-dir"
    )


def written_by_this_run(run_dir: Path) -> bool:
    """Whether an earlier attempt of this run (the same ``run_id()``) wrote ``run_dir``."""
    mine = run_id()
    try:
        theirs = (run_dir / RUN_ID).read_text().strip()
    except OSError:  # none recorded: a run without an id, or from before ids were kept
        return False
    return mine is not None and theirs == mine


def record_run_id(run_dir: Path) -> None:
    """Marks ``run_dir`` as this run's, so that a restart of it is told from a new run."""
    mine, path = run_id(), run_dir / RUN_ID
    if mine is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(mine + "\n")


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints in ``run_dir``, newest first (orbax renames a
    step's directory to its number only when the save has finished)."""
    folder = run_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted((int(p.name) for p in folder.iterdir() if p.name.isdigit()), reverse=True)


def clear(run_dir: Path) -> None:
    """``--overwrite``: removes an earlier run's files (process 0, before anyone reads)."""
    for name in (*RUN_FILES, *WANDB_FILES, RUN_ID):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


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
        if _read_only_mount(target):
            raise ConfigError(f"{flag} {path}: {target} is on a read-only file system (mounted "
                              "read-only: no user may write there)")  # fmt: skip
        raise ConfigError(f"{flag} {path}: {target} is not writable by this user")


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def create(
    run_dir: Path, write_config: Callable[[Path], None], resumed_step: int | None = None
) -> Path:
    """Makes ``run_dir`` with the resolved ``config.yaml`` (``write_config(path)``) and
    this run's id. Fresh or restarted: no ``metrics.jsonl`` yet. Resumed from step
    k: ``metrics.jsonl`` keeps its records up to step k (later ones, logged by an attempt
    that did not save them, are trained again) and is appended to."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        record_run_id(run_dir)  # before metrics.jsonl: a directory with steps has its id
        metrics = run_dir / "metrics.jsonl"
        if resumed_step is None:
            metrics.unlink(missing_ok=True)
        else:
            keep = [r for r in read_metrics(metrics) if r.get("step", 0) <= resumed_step]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in keep))
        write_config(run_dir / "config.yaml")
    except OSError as err:  # checked at setup: something changed since (a full disk)
        named = storage_error(err, "write the run directory", run_dir)
        if named is not None:
            raise named from None
        raise JaxdistError(f"--run-dir {run_dir}: cannot write the run directory: {err}") from None
    return metrics


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none if absent; a torn last line is dropped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process killed mid-write
            continue
    return records
