"""How a failed write is named (``jaxdist.checkpoint.io_errors``), for each cause a file
system gives: the errno of an ``OSError`` and orbax/TensorStore's text form, found
anywhere in an exception's chain. tests/test_storage_faults.py runs real full and stalled
file systems under the trainer."""

from __future__ import annotations

import errno
import logging
import re

import pytest

from jaxdist.checkpoint.io_errors import (
    QuietStorageTracebacks,
    StorageError,
    storage_error,
    writing,
)

# What orbax raised for a full tmpfs (its text, shortened)
ORBAX_FULL = (
    'RESOURCE_EXHAUSTED: Failed writing: "/runs/x/checkpoints/10.orbax-checkpoint-tmp/state/d/'
    "32d3\": Failed to write 21336 bytes to file 12: No space left on device [os_error_code='28']"
)


@pytest.mark.parametrize(
    ("code", "cause"),
    [
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.EDQUOT, "disk quota exceeded"),
        (errno.ENOENT, "no such file or directory (the run directory was removed?)"),
    ],
)
def test_each_cause_is_named_with_its_path(code, cause):
    err = storage_error(OSError(code, "os text", "/runs/x/metrics.jsonl"))
    assert isinstance(err, StorageError)
    assert str(err).startswith(f"cannot write /runs/x/metrics.jsonl: {cause}"), str(err)


def test_a_full_disk_says_how_full_with_the_numbers(tmp_path):
    err = storage_error(OSError(errno.ENOSPC, "No space left", str(tmp_path / "a" / "b")))
    amount = r"[\d.]+ (?:[KMGT]i)?B"  # jaxdist.units.size: 11.6 MiB, 3 B
    assert re.fullmatch(
        rf"cannot write {tmp_path}/a/b: no space left on device: {amount} of {amount} used",
        str(err),
    ), str(err)


def test_orbax_text_deep_in_a_chain_is_found_and_named_by_the_caller():
    try:
        try:
            raise ValueError(ORBAX_FULL)
        except ValueError as inner:
            raise RuntimeError("Save Finalize thread failed") from inner
    except RuntimeError as outer:
        err = storage_error(outer, "write checkpoint 10 to", "/runs/x/checkpoints/10", 10)
    assert str(err).startswith("cannot write checkpoint 10 to /runs/x/checkpoints/10: no space")
    assert err.step == 10


def test_other_errors_pass_through_unchanged():
    assert storage_error(ValueError("a shape mismatch")) is None
    assert storage_error(OSError(errno.ECONNREFUSED, "refused")) is None
    with pytest.raises(KeyError), writing("write", "/runs/x"):
        raise KeyError("not a write")
    with (
        pytest.raises(StorageError, match="cannot write /runs/x/tb: read-only"),
        writing("write", "/runs/x/tb"),
    ):
        raise OSError(errno.EROFS, "Read-only file system")


def test_only_storage_failures_are_dropped_from_orbax_and_asyncio_logs():
    quiet = QuietStorageTracebacks()

    def record(message, exc=None, level=logging.ERROR):
        info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("absl", level, "orbax/x.py", 1, message, (), info)

    assert not quiet.filter(record("commit failed", ValueError(ORBAX_FULL)))
    assert not quiet.filter(record(f"exception was never retrieved: {ORBAX_FULL}"))
    assert quiet.filter(record("commit failed", ValueError("a bug")))
    assert quiet.filter(record("fine", level=logging.WARNING))
