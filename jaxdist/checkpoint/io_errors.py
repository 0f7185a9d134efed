"""Failures to write the run directory, named: which path, which operation, which cause.

A full disk, a quota, a file system remounted read-only, lost permissions or a removed
directory reach jaxdist as an ``OSError`` (our own writes: metrics.jsonl, goodput.json,
config.yaml) or as orbax's and TensorStore's ``ValueError`` text (``RESOURCE_EXHAUSTED:
Failed writing: "PATH": ... [os_error_code='28']``), often raised on a background thread
and then again, wrapped, wherever it is next awaited. ``storage_error`` finds the cause
in either form; the command ends on it with one line and exit code 74
(``jaxdist.cluster.failures.STORAGE``), not a page of thread tracebacks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

from jaxdist.units import size

# errno -> how the cause reads. Each is something a person fixes (frees space, remounts,
# restores the directory); the same command then resumes from the newest checkpoint.
CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory (the run directory was removed?)",
    errno.ENOTDIR: "a path component is not a directory",
    errno.EIO: "input/output error",
    errno.EFBIG: "file too large",
    errno.ESTALE: "stale file handle (a network file system lost the file)",
}
_OS_CODE = re.compile(r"os_error_code='(\d+)'")
_FAILED_PATH = re.compile(r'(?:Failed writing|Error writing|Failed to open)[^"]*"([^"]+)"')


class StorageError(Exception):
    """A write to the run directory failed (exit code 74). ``path``: what was written;
    ``operation``: e.g. "write checkpoint 10"; ``step``: the training step, if known;
    ``process``: the process whose write failed, when the group agreed on it (a
    checkpoint's outcome: ``outcome``)."""

    def __init__(self, operation: str, path, cause: str, step=None, *, process=None):
        self.operation, self.path, self.cause, self.step = operation, path, cause, step
        self.process = process
        where = f" {path}" if path else ""
        who = "" if process is None else f"process {process} "
        super().__init__(f"{who}cannot {operation}{where}: {cause}")


def find(err: BaseException) -> tuple[int, str | None] | None:
    """(errno, path or None) of the first storage cause in ``err``'s chain, or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, StorageError):
            return None  # named already
        if isinstance(err, OSError) and err.errno in CAUSES:
            return err.errno, err.filename
        code = _OS_CODE.search(str(err))
        if code and int(code.group(1)) in CAUSES:
            path = _FAILED_PATH.search(str(err))
            return int(code.group(1)), path.group(1) if path else None
        err = err.__cause__ or err.__context__
    return None


def storage_error(err: BaseException, operation: str = "write", path=None, step=None):
    """``err`` as a ``StorageError`` (the given ``path``, else the one the error names),
    or None when it is not a storage failure."""
    if isinstance(err, StorageError):
        return err
    found = find(err)
    if found is None:
        return None
    code, named = found
    where = path or named
    return StorageError(operation, where, describe(code, where), step)


def describe(code: int, path) -> str:
    """The cause with its numbers: ``no space left on device: 11.6 of 12.0 MB used``."""
    cause = CAUSES.get(code, os.strerror(code))
    if code in (errno.ENOSPC, errno.EDQUOT) and path:
        usage = _usage(Path(path))
        if usage:
            cause = f"{cause}: {usage}"
    return cause


def _usage(path: Path) -> str:
    """``11.6 MiB of 12.0 MiB used`` for the file system holding ``path`` (its nearest
    existing ancestor: the failed file may never have been made), or "" if unreadable."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ""
    return f"{size(usage.used)} of {size(usage.total)} used"


def say_newest(err: StorageError, run_dir: Path | None) -> StorageError:
    """``err`` with what survives: the newest complete checkpoint, which a failed write
    leaves untouched and the same command resumes from once the cause is gone."""
    if run_dir is None or "newest complete checkpoint" in str(err):
        return err
    from jaxdist.checkpoint.run_directory import checkpoint_steps  # it imports this module

    steps = checkpoint_steps(Path(run_dir))
    newest = f"step {steps[0]} (the same command resumes from it" if steps else (
        "none (the same command starts again"
    )  # fmt: skip
    err.args = (f"{err}; the newest complete checkpoint: {newest} once the cause is gone)",)
    return err


@contextlib.contextmanager
def writing(operation: str, path=None, step=None):
    """Runs the body; a storage failure in it leaves as a ``StorageError`` naming
    ``operation`` and ``path`` (the chain dropped: its tracebacks say nothing more)."""
    try:
        yield
    except Exception as err:
        named = storage_error(err, operation, path, step)
        if named is None:
            raise
        raise named from None


class QuietStorageTracebacks(logging.Filter):
    """Drops orbax's and asyncio's ERROR records of a storage failure (a traceback per
    background thread and per abandoned future: 1,675 lines for one full disk); jaxdist
    names the failure once, where it is awaited."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        err = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        named = isinstance(err, StorageError)  # the group's agreed failure, re-raised
        return not (named or (err is not None and find(err)) or _OS_CODE.search(text))


def quiet_orbax_storage_errors() -> None:
    """Installs ``QuietStorageTracebacks`` on absl's logger (orbax logs through it) and
    asyncio's, and ``_quiet_closed_loop`` as ``sys.unraisablehook``, once."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietStorageTracebacks) for f in logger.filters):
            logger.addFilter(QuietStorageTracebacks())
    if sys.unraisablehook is not _quiet_closed_loop:
        _quiet_closed_loop.previous = sys.unraisablehook
        sys.unraisablehook = _quiet_closed_loop


def _quiet_closed_loop(unraisable) -> None:
    """A save abandoned on a failed write leaves TensorStore's pending writes completing
    into orbax's closed asyncio loop; each reports ``RuntimeError: Event loop is closed``
    through ``sys.unraisablehook`` (two asyncio frames, dozens of them). Only exactly
    those are dropped: anything else is reported as before."""
    frames = traceback.extract_tb(unraisable.exc_traceback)
    if (
        unraisable.exc_type is RuntimeError
        and str(unraisable.exc_value) == "Event loop is closed"
        and frames
        and frames[0].name == "call_soon_threadsafe"
    ):
        return
    _quiet_closed_loop.previous(unraisable)
