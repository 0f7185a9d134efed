"""A fault soak: runs of a group under ``python -m jaxdist.launch --max-restarts 1``, each
with one fault drawn at random, at a random step, and what each ended as.

Command:   python experiments/fault_soak.py [--runs 20] [--seed 0] [--out experiments/FAULTS.md]
           (as root: the disk-full and frozen cases mount a tmpfs and a loop device)
Hardware:  any Linux machine; 2 processes x 2 emulated CPU devices, the small MLP of the
           tests, 160 steps, a checkpoint every 10, ``--step-timeout 5
           --slow-phase-timeout 20 --heartbeat-timeout 30``.
Faults:    kill -9 of a random rank; SIGTERM to the launcher and every rank in one kill
           (a cgroup stopped); disk full (a tmpfs with room for 0 to 3 more checkpoints);
           a frozen file system (``fsfreeze`` of the run directory's ext4, thawed once the
           launcher saw the failure); a stalled data read (``JAXDIST_FAULT=stall-data``
           on a random rank, which fires again after a restart that resumes before it).
Columns:   the ending (the launcher's exit code; restarted or not); seconds from the fault
           to the first jaxdist line about it; the line; the failures.jsonl records; steps
           lost: the last step trained before the fault's ending minus the newest
           checkpoint then (what a resume trains again); the check of the three goals.
Goal:      in every run: no wait past the documented deadline (a hang is declared within
           --slow-phase-timeout or --step-timeout plus a poll, a death within seconds), no
           ending without its line and its record, no step lost beyond the newest
           checkpoint (a resume starts from it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from jaxdist.checkpoint.run_directory import checkpoint_steps

sys.path.insert(0, str(Path(__file__).parent))
import storage_faults  # noqa: E402  (a sibling script: its Watched)

MLP = ["--in-features", "12", "--num-classes", "5", "--hidden", "16", "--depth", "1"]
STEPS, EVERY = 160, 10
TRAIN = [*MLP, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--log-every", "1",
         "--global-batch-size", "16", "--step-timeout", "5", "--slow-phase-timeout", "20",
         "--heartbeat-timeout", "30"]  # fmt: skip
LIMIT_S = 240  # a run still going after this is a hang the harness ends
FAULTS = ("kill -9", "SIGTERM to the group", "disk full", "frozen file system", "stalled read")


@dataclass
class Result:
    fault: str
    ending: str
    seconds: float | None
    line: str
    records: str
    lost: int | None
    ok: bool
    why: str = ""


class Watched(storage_faults.Watched):
    """``python -m jaxdist.launch ARGS``, its output lines read as they come, with times."""

    def __init__(self, args: list[str], cwd: Path, env: dict):
        super().__init__(args, cwd, module="jaxdist.launch", env=env)

    def said(self, text: str, after: float = 0.0) -> tuple[float, str] | None:
        return next(((t, x) for t, x in list(self.lines) if t >= after and text in x), None)


def sh(*cmd: str) -> int:
    return subprocess.run(cmd, capture_output=True).returncode


def launch(run_dir: Path, cwd: Path, fault: str = "") -> Watched:
    args = ["--nproc", "2", "--cpu-devices-per-proc", "2", "--max-restarts", "1", "--"]
    args += [sys.executable, "-m", "jaxdist.train", *TRAIN, "--run-dir", str(run_dir)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return Watched(args, cwd, {**env, "JAXDIST_FAULT": fault} if fault else env)


def steps_logged(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    with contextlib.suppress(OSError, ValueError):
        return [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip()]
    return []


def wait_step(w: Watched, run_dir: Path, step: int) -> None:
    until = time.time() + LIMIT_S
    while time.time() < until and w.proc.poll() is None and len(steps_logged(run_dir)) < step:
        time.sleep(0.05)


def ranks(w: Watched) -> dict[int, int]:
    """rank -> pid of the launcher's processes now."""
    found = subprocess.run(["pgrep", "-P", str(w.proc.pid)], capture_output=True, text=True)
    pids = {}
    for pid in map(int, found.stdout.split()):
        with contextlib.suppress(OSError):
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"JAXDIST_PROCESS_ID="):
                    pids[int(item.split(b"=", 1)[1])] = pid
    return pids


def finish(fault: str, w: Watched, run_dir: Path, at: float, marker: str) -> Result:
    """Waits for the end (a run past ``LIMIT_S`` is ended: a hang), noting the newest
    complete checkpoint when the launcher first saw a rank end; then reads what was said
    and recorded, and the steps lost."""
    until, newest = at + LIMIT_S, None
    while w.proc.poll() is None and time.time() < until:
        if newest is None and w.said("[launch] rank", after=at):
            newest = (checkpoint_steps(run_dir) or [0])[0]
        time.sleep(0.05)
    hung = w.proc.poll() is None
    if hung:
        os.killpg(w.proc.pid, signal.SIGKILL)
    code = w.proc.wait()
    w._reader.join(5)
    newest = (checkpoint_steps(run_dir) or [0])[0] if newest is None else newest
    said = w.said(marker, after=at)
    restart = w.said("[launch] restart")
    before = [x for t, x in w.lines if not restart or t < restart[0]]
    last = max((int(m.group(1)) for x in before if (m := re.search(r"step (\d+)/", x))), default=0)
    resumed = w.said("resumed from the checkpoint of step", after=restart[0] if restart else 0)
    base = int(re.search(r"step (\d+)", resumed[1].split("checkpoint of")[1]).group(1)) if (
        resumed and restart) else newest  # fmt: skip
    records = [f"{r['cause']} (process {r.get('process')})" for r in _records(run_dir)]
    result = Result(
        fault, f"exit {code}" + (", after a restart" if restart else ""),
        said and said[0] - at, said[1] if said else "", "; ".join(records), last - base, True,
    )  # fmt: skip
    return _judge(result, code, not hung, base, newest)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "failures.jsonl"
    with contextlib.suppress(OSError):
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return []


def _judge(r: Result, code: int, in_time: bool, base: int, newest: int) -> Result:
    problems = []
    if not in_time:
        problems.append(f"still running {LIMIT_S} s after the fault")
    if code != 0 and not r.line:
        problems.append("ended without its line")
    if (code != 0 or "restart" in r.ending) and not r.records:
        problems.append("ended without a record")
    if base < newest:
        problems.append(f"resumed from step {base}, not the newest checkpoint {newest}")
    r.ok, r.why = not problems, "; ".join(problems)
    return r


def kill(work: Path, rng: random.Random) -> Result:
    run_dir, victim, step = work / "run", rng.randrange(2), rng.randrange(15, STEPS - 20)
    w = launch(run_dir, work)
    wait_step(w, run_dir, step)
    at = time.time()
    with contextlib.suppress(ProcessLookupError, KeyError):
        os.kill(ranks(w)[victim], signal.SIGKILL)
    fault = f"kill -9 of rank {victim} at step {step}"
    result = finish(fault, w, run_dir, at, f"jaxdist: error: process {victim}")
    if not result.line:  # named by the survivor, whatever the launcher does after
        result.ok, result.why = False, f"{result.why}; no survivor named it".strip("; ")
    return result


def sigterm(work: Path, rng: random.Random) -> Result:
    run_dir, step = work / "run", rng.randrange(15, STEPS - 20)
    w = launch(run_dir, work)
    wait_step(w, run_dir, step)
    at = time.time()
    for pid in [w.proc.pid, *ranks(w).values()]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    result = finish(f"SIGTERM to the group at step {step}", w, run_dir, at, "[launch] stopped")
    if result.ending != "exit 75":
        result.ok, result.why = False, f"{result.why}; not 75".strip("; ")
    return result


def disk_full(work: Path, rng: random.Random, checkpoint_bytes: int) -> Result:
    fs, room = work / "fs", rng.choice([0.3, 1.3, 2.3, 3.3])
    fs.mkdir()
    assert sh("mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(fs)) == 0, "needs root"
    try:
        free = shutil.disk_usage(fs).free - 64 * 1024  # the run's own small files
        (fs / "ballast").write_bytes(b"\0" * max(0, free - int(room * checkpoint_bytes)))
        run_dir = fs / "run"
        w = launch(run_dir, work)
        fault = f"disk full (room for {room} checkpoints)"
        result = finish(fault, w, run_dir, time.time(), "no space left")
        failed = re.search(r"checkpoint (\d+)", result.line)
        began = failed and w.said(f"step {failed.group(1)}/")
        if began:  # seconds from the start of the save that failed
            result.seconds = w.said("no space left")[0] - began[0]
        return result
    finally:
        sh("umount", "-l", str(fs))


def frozen(work: Path, rng: random.Random) -> Result:
    image, mnt, step = work / "fs.img", work / "mnt", rng.randrange(15, STEPS - 20)
    mnt.mkdir()
    sh("truncate", "-s", "64M", str(image))
    assert sh("mkfs.ext4", "-q", str(image)) == 0
    assert sh("mount", "-o", "loop", str(image), str(mnt)) == 0, "needs root"
    try:
        run_dir = mnt / "run"
        w = launch(run_dir, work)
        wait_step(w, run_dir, step)
        assert sh("fsfreeze", "-f", str(mnt)) == 0
        at = time.time()
        until = at + LIMIT_S
        while time.time() < until and not w.said("[launch] rank", after=at):
            time.sleep(0.1)
        sh("fsfreeze", "-u", str(mnt))  # the restarted group finds it working again
        fault = f"frozen file system at step {step}"
        return finish(fault, w, run_dir, at, "jaxdist: error: hang")
    finally:
        sh("fsfreeze", "-u", str(mnt))
        sh("umount", "-l", str(mnt))


def stalled(work: Path, rng: random.Random) -> Result:
    run_dir, victim, step = work / "run", rng.randrange(2), rng.randrange(15, STEPS - 20)
    w = launch(run_dir, work, f"stall-data@{victim}:{step}")
    wait_step(w, run_dir, step - 5)  # the prefetcher reads ahead: the stall stops the log early
    fault = f"stalled data read on rank {victim} at step {step}"
    return finish(fault, w, run_dir, time.time(), "jaxdist: error: hang")


def measure_checkpoint(work: Path) -> int:
    """The bytes one checkpoint of the run takes (a short run's newest)."""
    run_dir = work / "measure"
    w = launch(run_dir, work)
    wait_step(w, run_dir, 2 * EVERY + 2)
    os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.wait()
    step = checkpoint_steps(run_dir)[0]
    return sum(f.stat().st_size for f in (run_dir / "checkpoints" / str(step)).rglob("*"))


def table(results: list[Result], work_root: str) -> str:
    head = "| # | fault | ending | seconds | what it said | records | steps lost | goals |"
    out = [head, "|---" * 8 + "|"]
    for i, r in enumerate(results, 1):
        line = r.line.replace(work_root, "WORK").replace("|", "/")
        line = re.sub(r"host [^,]+, pid \d+", "host HOST, pid PID", line)[:220]
        seconds = "-" if r.seconds is None else f"{r.seconds:.1f}"
        goals = "met" if r.ok else f"NOT met: {r.why}"
        lost = "-" if r.lost is None else str(r.lost)
        out.append(f"| {i} | {r.fault} | {r.ending} | {seconds} | {line} | {r.records} | "
                   f"{lost} | {goals} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="jaxdist-soak-")
    checkpoint_bytes = measure_checkpoint(Path(root))
    results = []
    for i in range(args.runs):
        kind = rng.choice(FAULTS)
        work = Path(root, f"run{i}")
        work.mkdir()
        case = {"kill -9": kill, "SIGTERM to the group": sigterm, "frozen file system": frozen,
                "stalled read": stalled}.get(kind)  # fmt: skip
        result = case(work, rng) if case else disk_full(work, rng, checkpoint_bytes)
        results.append(result)
        print(f"{i + 1}/{args.runs} {result.fault}: {result.ending}, goals "
              f"{'met' if result.ok else 'NOT met: ' + result.why}", flush=True)  # fmt: skip
    text = table(results, root)
    met = sum(r.ok for r in results)
    summary = f"{met} of {len(results)} runs met every goal (seed {args.seed})."
    print(text, "\n" + summary, sep="\n")
    if args.out:
        with open(args.out, "a") as out:
            out.write(f"\n{text}\n\n{summary}\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
