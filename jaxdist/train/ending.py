"""How ``python -m jaxdist.train`` ends: every way out has its fixed exit code
(``jaxdist.cluster.failures``), one line on stderr, and, when it is abnormal and the run
directory exists, a line in ``RUN_DIR/failures.jsonl`` (written by process 0: these
errors are seen alike by every process). Hangs and dead peers end elsewhere, from the
threads that find them (``jaxdist.health.hang_report``, ``jaxdist.cluster.peers``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

import jax

from jaxdist.checkpoint import io_errors
from jaxdist.checkpoint.checkpointer import CorruptCheckpointError
from jaxdist.cluster import failures, leaving
from jaxdist.cluster.preemption import Preempted
from jaxdist.errors import JaxdistError, ModelError
from jaxdist.health.agreement import MismatchError
from jaxdist.health.replica_check import ReplicaDivergenceError
from jaxdist.parallel.step_checks import NonFiniteError
from jaxdist.train import config as config_lib

# The first that matches: (exception, cause in failures.jsonl, "error" in its line)
ENDINGS = (
    (MismatchError, "mismatch", True),
    (ReplicaDivergenceError, "replica_divergence", True),
    (CorruptCheckpointError, "corrupt_checkpoint", True),
    (io_errors.StorageError, "storage", True),
    (JaxdistError, "bad_input", True),
    (NonFiniteError, "nonfinite", True),
    (Preempted, "preempted", False),
)


@contextlib.contextmanager
def in_run_dir(run_dir: Path | None):
    """An error raised inside carries ``run_dir``: where its failure is recorded."""
    try:
        yield
    except Exception as err:
        if getattr(err, "run_dir", None) is None:
            err.run_dir = run_dir
        raise


def run(train_fn, argv: list[str] | None, clock_start: float) -> int:
    """Parses ``argv``, calls ``train_fn(config, clock_start=...)``; returns the exit code.
    An error that is none of ``ENDINGS`` propagates (a traceback: a bug)."""
    try:
        train_fn(config_lib.parse_args(argv), clock_start=clock_start)
    except Exception as err:
        # a write that failed outside jaxdist's own guards (a sink, a user's callback)
        named = io_errors.storage_error(err)
        if named is not None:
            named.run_dir, named.step = getattr(err, "run_dir", None), getattr(err, "step", None)
            err = named
        if isinstance(err, io_errors.StorageError):
            err = io_errors.say_newest(err, getattr(err, "run_dir", None))
        for kind, cause, is_error in ENDINGS:
            if isinstance(err, kind):
                return end(cause, err, is_error)
        raise
    return failures.OK


def code_of(err: BaseException) -> int | None:
    """The exit code ``err`` ends the command with, or None (not one of ``ENDINGS``)."""
    if isinstance(err, Exception) and io_errors.storage_error(err) is not None:
        return failures.STORAGE
    return next((failures.CODES[c] for kind, c, _ in ENDINGS if isinstance(err, kind)), None)


def end(cause: str, err: Exception, is_error: bool) -> int:
    code = failures.CODES[cause]
    label = "error: " if is_error else ""
    trace, where = user_traceback(err)
    if cause != "preempted":  # a stop is agreed by all; a failure is told to the others
        leaving.announce_ending(code, cause, f"{err}{where}")
    print(f"{rank_prefix()}jaxdist: {label}{err}{where}", file=sys.stderr, flush=True)
    run_dir = getattr(err, "run_dir", None)
    step = getattr(err, "step", None)
    culprit = getattr(err, "process", None)
    failure = failures.Failure(
        cause=cause,
        message=str(err),
        process=_process_index() if culprit is None else culprit,
        host=failures.hostname(),
        step=step,
        detect_s=0.0 if cause in ("mismatch", "bad_input") else None,
        exit_code=code,
        reported_by=_process_index(),
        traceback=trace,
    )
    if _process_index() == 0:
        failures.record(run_dir, failure)
    failures.tell_launcher(failure)
    return code


def user_traceback(err: Exception) -> tuple[str | None, str]:
    """(the full traceback of an error raised in the user's model or loss, "; its
    traceback: FILE" for the one line), or (None, "") for every other error. The file
    is in the system's temporary folder: a run refused before its first step writes
    nothing in its run directory."""
    if not isinstance(err, ModelError) or err.__cause__ is None:
        return None, ""
    text = "".join(traceback.format_exception(err.__cause__))
    path = Path(tempfile.gettempdir()) / f"jaxdist-traceback-{os.getpid()}.txt"
    try:
        path.write_text(text)
    except OSError:
        return text, ""
    return text, f"; its traceback: {path}"


def rank_prefix() -> str:
    """``[rank N] `` once the process group exists with several processes, else ``""``."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        return f"[rank {jax.process_index()}] "
    return ""


def _process_index() -> int:
    return jax.process_index() if jax.distributed.is_initialized() else 0
