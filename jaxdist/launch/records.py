"""What the launcher writes into the run directory for its ranks, and reads from it.

A rank records its own failure in ``RUN_DIR/failures.jsonl`` (``jaxdist.cluster.failures``)
and tells the launcher about it (``tell_launcher``). Two cases leave the record to the
launcher: a rank killed by a signal when no survivor could say so (``unreported``), and
a failure whose record the rank could not write (``unwritten``: the file system of the
run directory did not answer, which may be the very fault). The launcher's own writes
run in a child process it waits for at most ``WRITE_S``: a frozen file system blocks
the child, never the launcher, and the record lands once the file system answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from jaxdist.cluster import failures
from jaxdist.launch.exits import Exit

WRITE_S = 5.0
# appends its standard input to the file argv[1], synced: the launcher's bounded write
_APPEND = (
    "import os, sys; f = open(sys.argv[1], 'a'); f.write(sys.stdin.read()); f.flush(); "
    "os.fsync(f.fileno())"
)


def unreported(folder: Path, died: list[Exit], say) -> None:
    """A rank killed by a signal (``kill -9``, the OOM killer) when no process could say
    so (process 0's death takes the coordination service, and the survivors may be ended
    first): its record, ``reported_by: "launcher"``."""
    run_dir = failures.launcher_run_dir(folder)
    if not died or run_dir is None or failures.from_launcher_dir(folder):
        return
    first = died[0]
    failure = failures.Failure(
        cause="dead_peer",
        message=f"process {first.global_rank} died: {first} (recorded by the launcher: "
        "no process of the group could)",
        process=first.global_rank,
        host=failures.hostname(),
        exit_code=first.code,
        reported_by="launcher",
    )
    if append(run_dir, asdict(failure)):
        say(f"recorded in {run_dir / failures.FILE}: {failure.message}")


def unwritten(folder: Path, say) -> None:
    """The records ranks told the launcher they could not write (``recorded: false``)."""
    run_dir = failures.launcher_run_dir(folder)
    for rank, told in sorted(failures.from_launcher_dir(folder).items()):
        if run_dir is None or told.pop("recorded", True):
            continue
        where = run_dir / failures.FILE
        if append(run_dir, told):
            say(f"recorded rank {rank}'s failure in {where} (it could not: {told['cause']})")
        else:
            say(f"{where} does not answer: rank {rank}'s record is written once it does")


def append(run_dir: Path, values: dict) -> bool:
    """Appends one record; whether it was written within ``WRITE_S`` (if not, the child
    writing it is left to finish when the file system answers)."""
    values = failures.completed(values)
    writer = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _APPEND, str(Path(run_dir) / failures.FILE)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,  # outlives the launcher if the file system never answers
    )  # fmt: skip
    try:
        writer.communicate(json.dumps(values) + "\n", timeout=WRITE_S)
    except subprocess.TimeoutExpired:
        return False
    return writer.returncode == 0


def newest_checkpoint(folder: Path) -> str:
    """ "the newest checkpoint: step N in DIR" (or that there is none), for the line that
    ends a forced stop; "" when the run's directory is not known."""
    run_dir = failures.launcher_run_dir(folder)
    if run_dir is None:
        return ""
    checkpoints = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in checkpoints.glob("*") if p.name.isdigit())
    if not steps:
        return f"no checkpoint in {checkpoints}"
    return f"the newest checkpoint: step {steps[-1]} in {checkpoints}"
