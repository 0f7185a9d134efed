"""What happens once a hang is declared (``jaxdist.health.watchdog``): on every live process,
its threads' Python stacks go to stderr and to the coordination store; the reporter
(the lowest-numbered process that is not silent) waits a few seconds for them, writes
``RUN_DIR/hang-report.txt`` naming the culprit and appends to ``failures.jsonl``; then
every process exits with ``failures.HANG`` (77).

Stacks are read with ``sys._current_frames()``, from the watchdog thread: it runs while
the main thread is blocked in a collective or in native code (they release the GIL).
"""

from __future__ import annotations

import json
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from jaxdist.cluster import failures, leaving, peers, store
from jaxdist.health.watchdog import Watchdog, where

STACKS = "jaxdist/health/stacks/"
REPORTED = "jaxdist/health/reported"
REPORT_FILE = "hang-report.txt"
COLLECT_S = 5.0  # how long the reporter waits for the other processes' stacks
WRITE_S = 5.0  # how long it waits for the run directory to take the report
OWN_THREADS = ("jaxdist-watchdog", "jaxdist-kv")  # ours, always there: not shown


def handle(watch: Watchdog, declared: dict) -> None:
    """Dumps, reports and exits 77 (a dead peer: names it, exits 76); runs in the
    watchdog thread."""
    if declared.get("dead"):
        peers.end_for_dead_peer(declared["silent"], declared["reason"])
    leaving.expect_exit(failures.HANG)  # a launcher's SIGTERM meanwhile changes nothing
    silent = frozen_peers(watch)  # now: from here on no process beats any more
    mine = thread_stacks()
    prefix = f"[rank {watch.index}] " if watch.count > 1 else ""
    text = "\n".join(prefix + line for line in mine["text"].splitlines())
    print(f"{prefix}jaxdist: hang: {declared['reason']}; stacks:\n{text}", file=sys.stderr)
    sys.stderr.flush()
    if watch.count > 1:
        watch.kv(store.put, f"{STACKS}{watch.index}", json.dumps(mine))
    if min(set(range(watch.count)) - set(silent)) == watch.index:  # the reporter
        report(watch, declared, mine, silent)
    elif watch.count > 1:
        _wait_for(watch, REPORTED, COLLECT_S + 5)
    leaving.exit_now(failures.HANG)


def frozen_peers(watch: Watchdog) -> dict[int, float]:
    """Peers whose beat has not moved for a while (seconds each), the store's host
    (process 0) when the store does not answer. Read when the hang is declared; a peer
    already quiet for 2 polls but not yet for ``frozen_after_s`` (frozen just before a
    deadline ran out: a 3 s step deadline, frozen at that step's start) is watched until
    its beat moves or it has been quiet that long, so that it is told apart either way."""
    frozen_after_s = max(3.0, 4 * watch.poll_s)
    deadline = time.monotonic() + frozen_after_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        undecided = [
            p
            for p in watch.peers.values()
            if p.record.get("phase") != "done"
            and 2 * watch.poll_s < p.silent_for(now) <= frozen_after_s
        ]
        if not undecided:
            break
        time.sleep(watch.poll_s / 2)
        watch.read_peers()
    now = time.monotonic()
    silent = {
        i: p.silent_for(now)
        for i, p in watch.peers.items()
        if p.record.get("phase") != "done" and p.silent_for(now) > frozen_after_s
    }
    if watch.kv_stuck_since is not None:
        silent.setdefault(0, now - watch.kv_stuck_since)
    return silent


def report(watch: Watchdog, declared: dict, mine: dict, silent: dict[int, float]) -> None:
    stacks = {watch.index: mine}
    if watch.count > 1:
        stacks.update(_collect(watch, set(range(watch.count)) - set(silent) - {watch.index}))
    records = {i: p.record for i, p in watch.peers.items()}
    records[watch.index] = watch.record()
    culprit, why = name_culprit(records, stacks, silent)
    if declared.get("writing"):  # a background write that never ends: name its path
        why += f": {declared['writing']}; the file system does not answer"
    text = render(watch, declared, records, stacks, why, silent)
    where = _write_report(watch.run_dir, text)
    record = records.get(culprit, {})
    failure = failures.Failure(
        cause="hang",
        message=f"{why} ({declared['reason']})",
        process=culprit,
        host=record.get("host", ""),
        step=record.get("step"),
        detect_s=silent.get(culprit, record.get("in_phase_s")),
        reported_by=watch.index,
    )
    print(f"jaxdist: error: hang: {why}{where}", file=sys.stderr, flush=True)
    recorded = _bounded(lambda: failures.record(watch.run_dir, failure))
    if not recorded:
        print(f"jaxdist: failures.jsonl not written: {json.dumps(asdict(failure))}",
              file=sys.stderr, flush=True)  # fmt: skip
    failures.tell_launcher(failure, recorded)
    if watch.count > 1:
        watch.kv(store.put, REPORTED, "1")
        time.sleep(min(1.0, watch.poll_s * 2))  # the others read it before the store goes


def _write_report(run_dir: Path | None, text: str) -> str:
    """Writes ``hang-report.txt`` unless the run directory's file system does not answer
    within ``WRITE_S`` (the hang may be that file system): then the report goes to stderr.
    Returns where it went, for the error line."""
    if run_dir is None:
        return ""
    path, written = run_dir / REPORT_FILE, []

    def write() -> None:
        if run_dir.is_dir():  # none yet: a hang before the first step leaves no files
            path.write_text(text)
            written.append(path)

    if not _bounded(write):
        print(text, file=sys.stderr, flush=True)
        return f"; {path} could not be written within {WRITE_S:g}s: the report is above"
    return f"; report in {path}" if written else ""


def _bounded(fn, seconds: float | None = None) -> bool:
    """Runs ``fn`` on a daemon thread; whether it finished (without error) in time."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
            done.set()
        except Exception:  # noqa: BLE001 - a report that cannot be written is said so
            pass

    threading.Thread(target=run, name="jaxdist-report-write", daemon=True).start()
    return done.wait(WRITE_S if seconds is None else seconds)


def _collect(watch: Watchdog, expected: set[int]) -> dict[int, dict]:
    """The other processes' stacks: those of ``expected``, or what came within
    ``COLLECT_S``."""
    deadline = time.monotonic() + COLLECT_S
    found: dict[int, dict] = {}
    while time.monotonic() < deadline:
        for key, value in (watch.kv(store.get_dir, STACKS) or {}).items():
            found[int(key.rsplit("/", 1)[1])] = json.loads(value)
        if expected <= set(found):
            break
        time.sleep(0.1)
    found.pop(watch.index, None)
    return found


def _wait_for(watch: Watchdog, key: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not watch.kv(store.try_get, key):
        time.sleep(0.1)


def name_culprit(records: dict[int, dict], stacks: dict[int, dict], silent: dict[int, float]):
    """(process, why): a silent process; else the one furthest behind that is not
    waiting for its devices; else the one whose threads are in user code; else none
    stands out (the lowest-numbered process is named, and the reason says so)."""
    for index in sorted(silent):
        r = records.get(index, {})
        return index, (
            f"process {index} ({where(r)}) stopped reporting {silent[index]:.1f}s ago, in "
            f"phase {r.get('phase', '?')} of step {r.get('step', '?')}: it is frozen (e.g. "
            "SIGSTOP) or its host is gone"
        )
    live = {i: r for i, r in records.items() if r.get("phase") != "done"}
    behind = min(r["done"] for r in live.values())
    not_waiting = [
        i for i, r in sorted(live.items()) if r["done"] == behind and r["phase"] != "step"
    ]
    if not_waiting:
        i = not_waiting[0]
        r = live[i]
        others = "; the others wait for it" if len(live) > 1 else ""
        return i, (
            f"process {i} ({where(r)}) is stuck in phase {r['phase']} of step {r['step']} "
            f"({r['in_phase_s']:.1f}s){others}" + _user_code_note(stacks.get(i))
        )
    in_user = [i for i in sorted(stacks) if stacks[i]["user_frames"] and i in live]
    if in_user and len(in_user) < len(live):
        i = in_user[0]
        return i, (
            f"process {i} ({where(live[i])}) is in step {live[i]['step']} with a thread in "
            "user code" + _user_code_note(stacks[i])
        )
    return min(live), (
        f"no single process stands out: all are in step {behind + 1} or wait for it; see "
        "every process's stacks"
    )


def _user_code_note(stack: dict | None) -> str:
    if not stack or not stack["user_frames"]:
        return ""
    return f"; its thread is in user code at {stack['user_frames'][0]}"


def render(watch, declared, records, stacks, why, silent) -> str:
    lines = [
        f"jaxdist hang report, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
        f"declared by process {declared['by']}: {declared['reason']}",
        f"culprit: {why}",
        f"deadlines: {watch.deadlines.describe()}",
        "",
        "process  host  pid  phase  step  in phase (s)  last completed step  silent (s)",
    ]
    for i in sorted(records):
        r = records[i]
        lines.append(
            f"{i}  {r.get('host')}  {r.get('pid')}  {r.get('phase')}  {r.get('step')}  "
            f"{r.get('in_phase_s')}  {r.get('done')}  {silent.get(i, 0.0):.1f}"
        )
    for i in range(watch.count):
        lines += ["", f"--- stacks of process {i} ---"]
        lines.append(stacks[i]["text"] if i in stacks else "(none: the process did not answer)")
    return "\n".join(lines) + "\n"


def thread_stacks() -> dict:
    """This process's threads' stacks as text, and the user-code frames among them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    text, user = [], []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "?")
        if name.startswith(OWN_THREADS):
            continue
        entries = traceback.extract_stack(frame)
        text.append(f'thread "{name}" (most recent call last):')
        text.extend(line.rstrip("\n") for line in traceback.format_list(entries))
        user.extend(
            f"{e.filename}:{e.lineno} in {e.name} (thread {name})"
            for e in reversed(entries)
            if _is_user_file(e.filename)
        )
    return {"text": "\n".join(text), "user_frames": user}


_LIBRARY_DIRS = tuple(
    str(Path(p).resolve())
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
) + (str(Path(__file__).resolve().parents[1]),)  # the jaxdist package, every folder


def _is_user_file(filename: str) -> bool:
    """Not Python's library, an installed package, or jaxdist itself."""
    if filename.startswith("<"):
        return False
    return not str(Path(filename).resolve()).startswith(_LIBRARY_DIRS)
