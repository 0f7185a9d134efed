"""How a run ends when it does not finish: one fixed exit code per cause, and one line per
abnormal end in ``RUN_DIR/failures.jsonl``.

The codes are the contract with schedulers: ``slurm/*.sh`` requeue a job that ended with
one of ``REQUEUE`` (the run can continue from its checkpoint on other or healthier
nodes), never one that ended on bad input, a mismatch or diverged replicas (running it
again would fail the same way). ``python -m jaxdist.launch`` passes them through.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

OK = 0
FAILED = 1  # training failed: a non-finite loss (--nan-policy halt) or an unexpected error
BAD_INPUT = 2  # a config value, a model, data or a checkpoint that cannot be used
STORAGE = 74  # the run directory could not be written: no space, quota, read-only (EX_IOERR)
PREEMPTED = 75  # stopped on SIGUSR1/SIGTERM after saving a checkpoint (EX_TEMPFAIL)
PEER_DIED = 76  # another process of the group died, never joined, or its host is gone
HANG = 77  # a step or phase did not complete within its deadline (hang-report.txt)
MISMATCH = 78  # the processes differ in config, versions, layout or compiled program
DIVERGED = 79  # data-parallel replicas of a parameter hold different values
TERMINATED = 143  # a second SIGTERM: 128 + 15, as a shell reports it

# cause (failures.jsonl) -> exit code
CODES = {
    "nonfinite": FAILED,
    "error": FAILED,
    "bad_input": BAD_INPUT,
    "corrupt_checkpoint": BAD_INPUT,
    "storage": STORAGE,
    "preempted": PREEMPTED,
    "dead_peer": PEER_DIED,
    "hang": HANG,
    "mismatch": MISMATCH,
    "replica_divergence": DIVERGED,
}
REQUEUE = (PREEMPTED, PEER_DIED, HANG)  # and a death by a signal (128 + S): a lost node
FILE = "failures.jsonl"


def requeues(code: int) -> bool:
    """Whether a job that ended with ``code`` can succeed when run again: a stop with a
    checkpoint, a dead process, a hang, or a task killed by a signal (a lost node, the OOM
    killer). Never 1, 2, 74, 78 or 79: they would fail the same way again (74: a full
    disk stays full until a person frees it)."""
    return code in REQUEUE or code >= 128


@dataclass(frozen=True)
class Failure:
    """One abnormal end (or, ``recovered``, a fault the run got past), as people read it.

    ``process``/``host``: the culprit where one is known (the dead or stuck process),
    else the process that detected it. ``detect_s``: seconds from the fault to its
    detection, where the fault's time is known (a hang: since the stuck process last made
    progress; a dead peer: since its last sign of life)."""

    cause: str
    message: str
    process: int | None = None
    host: str = ""
    step: int | None = None
    detect_s: float | None = None
    exit_code: int | None = None
    reported_by: int | str = 0  # a process index, or "launcher"
    recovered: bool = False  # e.g. a damaged checkpoint skipped for an older one
    time: str = ""
    traceback: str | None = None  # an error raised in the user's code: where, in full


def record(run_dir: Path | None, failure: Failure) -> None:
    """Appends ``failure`` to ``RUN_DIR/failures.jsonl``, making the directory if need be,
    except for bad input: a run refused before its first step leaves nothing behind.
    Where it cannot be written (the disk that failed the run is full), the record goes to
    stderr instead. Never raises: it runs on the way out of a failing process."""
    if run_dir is None:
        return
    if failure.cause == "bad_input" and not Path(run_dir).is_dir():
        return
    values = completed(asdict(failure))
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / FILE, "a") as out:
            out.write(json.dumps(values) + "\n")
            out.flush()
            os.fsync(out.fileno())
    except OSError as err:
        where = Path(run_dir) / FILE
        print(f"jaxdist: {where} cannot be written ({err.strerror}); its record: "
              f"{json.dumps(values)}", file=sys.stderr, flush=True)  # fmt: skip


def completed(values: dict) -> dict:
    """A record's fields with its time (now, if not set) and the exit code of its cause."""
    values = {**values, "time": values.get("time") or time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if values.get("exit_code") is None and not values.get("recovered"):
        values["exit_code"] = CODES.get(values.get("cause"))
    return values


def read(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hostname() -> str:
    return socket.gethostname()


def process_state(pid: int) -> str | None:
    """Linux's state letter of process ``pid`` (R, S, T stopped, Z zombie, ...): None
    when it does not exist, "?" where there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][:1]
    except FileNotFoundError:
        return None
    except OSError:
        return "?"


def process_gone(record: dict, host: str) -> bool:
    """Whether the process of ``record`` is known to have ended: only on this host (a
    process elsewhere cannot be seen; its silence alone then speaks)."""
    if record.get("host") != host or "pid" not in record:
        return False
    state = process_state(record["pid"])
    if state != "?":
        return state in (None, "Z", "X")  # a zombie is dead
    try:  # no /proc here: ask the kernel
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


LAUNCHER_DIR = "JAXDIST_FAILURE_DIR"  # set by python -m jaxdist.launch for its ranks


def tell_launcher(failure: Failure, recorded: bool = True) -> None:
    """Leaves ``failure`` where ``python -m jaxdist.launch`` looks when its group ends, so
    that it names the culprit (a frozen process never exits by itself: without this the
    first rank to exit, a healthy one, would be blamed); ``recorded=False``: its record
    could not be written, and the launcher writes it. Never raises."""
    folder = os.environ.get(LAUNCHER_DIR)
    if not folder:
        return
    rank = os.environ.get("JAXDIST_PROCESS_ID", str(failure.reported_by))
    with contextlib.suppress(OSError):
        told = {**asdict(failure), **({} if recorded else {"recorded": False})}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(told))


# Two SIGTERMs this close are one request: a group-wide kill (systemd, a container
# runtime, `kill -TERM <launcher> <ranks>`) gives each rank its own and the launcher's
# forward of the same stop, milliseconds apart.
SIGTERM_MERGE_S = 2.0
RUN_DIR_FILE = "run_dir"  # in the launcher's folder: where the group's run writes


def tell_launcher_run_dir(run_dir: Path | None) -> None:
    """Tells ``python -m jaxdist.launch`` where the run writes (process 0, at set-up):
    it records a death no process could report, and names the newest checkpoint after a
    forced stop. Never raises."""
    folder = os.environ.get(LAUNCHER_DIR)
    if folder and run_dir is not None:
        with contextlib.suppress(OSError):
            Path(folder, RUN_DIR_FILE).write_text(str(Path(run_dir).absolute()))


def launcher_run_dir(folder: Path) -> Path | None:
    with contextlib.suppress(OSError):
        text = Path(folder, RUN_DIR_FILE).read_text().strip()
        return Path(text) if text else None
    return None


def from_launcher_dir(folder: Path) -> dict[int, dict]:
    """What each rank left with ``tell_launcher``: {rank: failure}."""
    found = {}
    for path in Path(folder).glob("rank*.json"):
        with_suffix = path.stem.removeprefix("rank")
        if with_suffix.isdigit():
            try:
                found[int(with_suffix)] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
    return found


def culprit_line(first_rank: int, told: dict[int, dict], stopped: list[int]) -> str:
    """The launcher's line naming the culprit when it is not the first rank to exit, or
    "" (the first rank is to blame, or nobody said)."""
    if stopped:
        ranks = ", ".join(map(str, stopped))
        return f"culprit: rank {ranks} is stopped (frozen, e.g. by SIGSTOP) and never exited"
    said = told.get(first_rank) or next(iter(told.values()), None)
    if said and said.get("process") is not None and said["process"] != first_rank:
        who = f"rank {said['process']}, named by rank {said['reported_by']}"
        return f"culprit: {who}: {said['message']}"
    return ""
