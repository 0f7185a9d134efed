"""One run per run directory: ``RUN_DIR/jaxdist.lock``, taken by process 0 at setup.

Two runs writing one directory interleave their metrics and break each other's saves,
so a second run on a live directory exits 2 at once, naming the holder (host, pid,
process group, run id, start time, when the lock was last renewed). The run renews it
every ``RENEW_S`` and releases it on every way out the trainer controls; one left by a
process that could not (SIGKILL, ``os._exit``) is taken over when its pid on this host is
gone or reused, or when it is this same run (a SLURM requeue or a launcher restart keep
the run id). A holder on another host cannot be checked from here: it is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax

from jaxdist.checkpoint import io_errors, run_directory
from jaxdist.errors import ConfigError

LOCK = "jaxdist.lock"
RENEW_S = 30.0  # how often a live run touches its lock's mtime
_CLAIM_STALE_S = 30.0  # a takeover claim this old was left by a starter killed mid-way


@dataclass
class _Held:
    path: Path
    text: str  # what this process wrote: removed only while the file still says it
    made: list[Path]  # directories made to hold the lock, deepest first
    stop: threading.Event = field(default_factory=threading.Event)


_HELD: dict[str, _Held] = {}  # by the lock's absolute path


_STORAGE = "storage: "  # a refusal that is a failed write (exit 74), not bad input


def take(run_dir: Path) -> None:
    """Process 0 takes ``run_dir``'s lock; its refusal reaches every process, and each
    raises it (ConfigError: all exit 2 together; a lock a full disk cannot hold:
    StorageError, all exit 74). ``release(run_dir)`` gives it back."""
    refusal = ""
    if jax.process_index() == 0:
        try:  # an unwritable --run-dir is named as setup's own check names it
            run_directory.check_writable(run_dir, "--run-dir", is_dir=True)
            acquire(run_dir)
        except ConfigError as err:
            refusal = str(err)
        except OSError as err:  # writable when checked, yet the lock could not be written
            full = io_errors.storage_error(err, f"write {LOCK} in", run_dir)  # a full disk
            refusal = f"{_STORAGE}{full.cause}" if full else (
                f"--run-dir {run_dir}: cannot write {LOCK}: {err}"
            )  # fmt: skip
    refusal = run_directory._agreed(refusal, size=4096)
    if refusal.startswith(_STORAGE):  # exit 74 on every process, as any failed write
        raise io_errors.StorageError(f"write {LOCK} in", run_dir, refusal[len(_STORAGE) :])
    if refusal:
        raise ConfigError(refusal)


def acquire(run_dir: Path) -> None:
    """Takes ``run_dir``'s lock for this process, making the directory if need be;
    ConfigError naming the holder if another run lives there."""
    path = Path(run_dir) / LOCK
    made = _make_dirs(Path(run_dir))
    now = time.time()
    text = json.dumps({
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_group": os.getpgid(0),
        "pid_start": _pid_start(os.getpid()),  # tells a reused pid from the holder
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
        "started_at": round(now, 3),
        "run_id": run_directory.run_id(),
        "processes": jax.process_count(),
    })  # fmt: skip
    tmp = path.with_name(f".{LOCK}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n")
        for _ in range(20):  # a lost round: another starter changed the lock; judge again
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # atomic create-if-absent (NFS too): one starter wins
                break
            if (theirs := _read(path)) is None:  # released meanwhile: create it
                continue
            note = _judge(path, theirs)  # raises for a live holder
            if _take_over(path, tmp, theirs):
                if note:
                    print(note, flush=True)
                break
        else:
            raise ConfigError(f"--run-dir {run_dir}: other runs kept changing {path}")
    except BaseException:
        _remove_made(made)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    release(run_dir)  # this process's own earlier lock (a set-up never run): its thread
    held = _HELD[str(path.absolute())] = _Held(path, text + "\n", made)
    threading.Thread(target=_renew, args=(held,), daemon=True, name="jaxdist-lock").start()


def release(run_dir: Path | None) -> None:
    """Gives back the lock this process holds on ``run_dir`` (if any): stops renewing
    it, removes it, and the directories taking it made, if they are empty."""
    held = _HELD.pop(str((Path(run_dir) / LOCK).absolute()), None) if run_dir else None
    if held is None:
        return
    held.stop.set()
    if _read(held.path) == held.text:  # else a restart of this same run took it over
        held.path.unlink(missing_ok=True)
    _remove_made(held.made)


def _judge(path: Path, text: str) -> str:
    """The note for taking over the lock that says ``text`` ("": silently);
    ConfigError naming its holder if that run may still live."""
    try:
        holder = json.loads(text)
        host, pid, started = holder["host"], int(holder["pid"]), holder["started"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"--run-dir {path.parent}: {path} is not a jaxdist lock; if no run uses the "
            "directory, delete it"
        ) from None
    mine, where = run_directory.run_id(), f"{path.parent} (host {host}, pid {pid}"
    if mine is not None and holder.get("run_id") == mine:  # a requeue or a restart
        return f"jaxdist: note: taking over the lock of run {mine}'s earlier attempt in {where})"
    if host == socket.gethostname():
        if pid == os.getpid() and holder.get("pid_start") == _pid_start(pid):
            return ""  # this very process's, from a set-up that never ran
        if not _alive(pid, holder.get("pid_start")):
            return (
                f"jaxdist: note: taking over the lock of an earlier run in {where}, started "
                f"{started}) whose process is gone"
            )
    now = time.time()
    with contextlib.suppress(TypeError):
        started += f" ({_ago(now - holder.get('started_at'))} ago)"
    try:
        renewed = f"lock renewed {_ago(now - path.stat().st_mtime)} ago"
    except OSError:
        renewed = "lock just released"
    raise ConfigError(
        f"--run-dir {path.parent} is in use by another run: host {host}, pid {pid} (process "
        f"group {holder.get('process_group')}, run id {holder.get('run_id') or 'none'}), "
        f"started {started}, {renewed}; wait for it to end, use another --run-dir, or, if "
        f"that run is gone, delete {path}"
    )


def _take_over(path: Path, tmp: Path, stale: str) -> bool:
    """Replaces the lock that said ``stale`` by ``tmp``; False if another starter changed
    it first. Race-safe: only the holder of the claim named after ``stale`` may replace
    that lock, and only once it has read, holding the claim, that the lock still says
    ``stale``: a second starter that judged it too gets the claim only after the winner's
    replace, reads the winner's lock and backs off; ``os.replace`` leaves no instant
    without a lock for a plain ``os.link`` to fill. Left open: a same-run holder releasing
    between that read and the replace while a third run starts, and a claim of a starter
    killed mid-way broken (after ``_CLAIM_STALE_S``) under a racing one."""
    claim = path.with_name(f"{LOCK}.takeover-{hashlib.sha256(stale.encode()).hexdigest()[:16]}")
    try:
        os.link(tmp, claim)
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - claim.stat().st_mtime > _CLAIM_STALE_S:
                claim.unlink()
        time.sleep(0.05)  # the other starter's takeover takes milliseconds
        return False
    try:
        if _read(path) != stale:
            return False
        os.replace(tmp, path)
        return True
    finally:
        claim.unlink(missing_ok=True)


def _renew(held: _Held) -> None:
    while not held.stop.wait(RENEW_S):
        with contextlib.suppress(OSError):
            os.utime(held.path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _make_dirs(run_dir: Path) -> list[Path]:
    """Makes ``run_dir`` and its missing parents; returns those it made, deepest first."""
    missing, folder = [], run_dir
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_made(made: list[Path]) -> None:
    """A run that stops before its first step leaves no directory behind."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # it holds the run's files (or another's): kept, with its parents
            return


def _alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid``, started at ``start``, still runs on this host. Without
    /proc (not Linux) it cannot be told: alive, so refused rather than wrongly taken."""
    now = _pid_start(pid)
    return not os.path.exists("/proc/self/stat") or (now is not None and now in (start, None))


def _pid_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat);
    None once it has ended (a zombie too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and ")"
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _ago(seconds: float) -> str:
    s = max(0.0, seconds)  # another host's clock may run ahead
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
