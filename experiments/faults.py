"""Each fault jaxdist's health checks are for, injected into a real 2-process run, with the
checks on and off: what is detected, how fast, what the message names, what is lost.

Command:   python experiments/faults.py [--timeout 60] [--out experiments/FAULTS.md]
           [--part health|storage|all]  (storage: the run directory's faults, as root;
           ``experiments/storage_faults.py``)
Hardware:  any CPU; 2 processes x 2 emulated devices on one machine, started by hand as
           a scheduler's srun would (no launcher to end the group for them).
Runs:      the default MLP, 60 steps, a checkpoint every 5; ``JAXDIST_FAULT`` (see
           ``jaxdist/health/fault_injection.py``) makes process 1 (or 0) misbehave at step 8.
           Health on:
           ``--step-timeout 5``; off: ``--no-health`` (JAX's own behaviour). Both with
           ``--heartbeat-timeout 30``, so that JAX's own detection, where there is one,
           comes within the harness's ``--timeout``.
Columns:   detected: a process exited non-zero by itself (a SIGKILLed one does not count)
           within the timeout; seconds from the injection (the faulty process prints its
           wall time) to that first exit; what it said: jaxdist's last error line, or
           (off) the first to exit's last line; steps lost: the last completed step minus
           the last checkpoint (what a restart redoes); processes still running at the
           timeout (killed by the harness).
Expected:  on: every fault detected within the 5 s deadline plus a few seconds (dead
           peers at once), the culprit named, nothing left running; off: hangs never end,
           mismatches and the bit flip train on silently, dead or frozen peers end in
           JAX's C++ abort after the heartbeat timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from jaxdist.checkpoint.run_directory import checkpoint_steps
from jaxdist.launch.group import free_port
from jaxdist.sinks.goodput import earlier_last_step

FAULTS = {
    "stuck data read (process 1)": {"fault": "stall-data@1:8"},
    "infinite loop (process 1)": {"fault": "spin@1:8"},
    "deadlocked callback (process 1)": {"fault": "deadlock@1:8"},
    "frozen process: SIGSTOP (process 1)": {"fault": "freeze@1:8"},
    "killed worker: SIGKILL (process 1)": {"fault": "kill@1:8"},
    "killed process 0: SIGKILL": {"fault": "kill@0:8"},
    "config mismatch (--global-batch-size)": {"batch_of_process_1": 32},
    "program mismatch (process 1's loss)": {"fault": "program@1"},
    "bit flip in one replica (process 1)": {"fault": "flip@1:8"},
}
TRAIN = ["--steps", "60", "--log-every", "1", "--checkpoint-every", "5", "--cpu-devices", "2"]
TRAIN += ["--heartbeat-timeout", "30", "--check-replicas-every", "5", "--compile-cache", "off"]


@dataclass
class Outcome:
    detected: bool
    seconds: float | None
    first_line: str
    steps_lost: int | None
    left: int
    codes: list


def run(name: str, spec: dict, health: bool, timeout: float, work: Path) -> Outcome:
    run_dir = work / f"{len(list(work.iterdir()))}"
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):
        args = [*TRAIN, "--run-dir", str(run_dir), "--step-timeout", "5"]
        if rank == 1 and "batch_of_process_1" in spec:
            args += ["--global-batch-size", str(spec["batch_of_process_1"])]
        args += [] if health else ["--no-health"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env.update(JAXDIST_FAULT=spec.get("fault", ""))
        env.pop("JAX_NUM_CPU_DEVICES", None)
        log = open(work / f"{run_dir.name}-rank{rank}.log", "w+b")  # noqa: SIM115
        logs.append(log)
        cmd = [sys.executable, "-m", "jaxdist.train", *args]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    started = time.time()
    first, exits = None, {}
    while time.time() - started < timeout and len(exits) < 2:
        for rank, proc in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = (proc.returncode, time.time())
                first = first if first is not None else rank
        time.sleep(0.05)
    left = sum(proc.poll() is None for proc in procs)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    texts = [Path(log.name).read_bytes().decode(errors="replace") for log in logs]
    injected = re.search(r"fault injected: .* time ([0-9.]+)", "".join(texts))
    fault_at = float(injected.group(1)) if injected else started
    # Detection: a process that ended by itself, non-zero (not the one SIGKILLed).
    failed = {r: e for r, e in exits.items() if e[0] not in (0, -9)}
    first_failed = min(failed, key=lambda r: failed[r][1]) if failed else None
    seconds = failed[first_failed][1] - fault_at if failed else None
    line = _message(texts, first_failed) if failed else "(none: trained on or hung)"
    # This machine's names stay out of the table.
    line = line.replace(str(run_dir), "RUN_DIR").replace(socket.gethostname(), "HOST")
    return Outcome(
        detected=bool(failed),
        seconds=seconds,
        first_line=line,
        steps_lost=_steps_lost(run_dir) if failed else None,
        left=left,
        codes=[exits.get(r, (None,))[0] for r in (0, 1)],
    )


def _message(texts: list[str], first: int) -> str:
    """What the processes said: the last error line jaxdist printed on any process, else
    the last line of the first to exit (JAX's own, without health checks)."""
    errors = [x for t in texts for x in t.splitlines() if "jaxdist: error:" in x]
    if errors:
        return errors[-1][:200]
    lines = [x for x in texts[first].splitlines() if x.strip() and not x.startswith("    @")]
    return lines[-1][:200] if lines else ""


def _steps_lost(run_dir: Path) -> int:
    """Steps trained after the newest checkpoint (0: stopped before the first step)."""
    return earlier_last_step(run_dir) - max(checkpoint_steps(run_dir), default=0)


def table(results: dict) -> str:
    head = "| fault | health | detected | seconds | exit codes | what it said"
    rows = [head + " | steps lost | left running |", "|" + "---|" * 8]
    for (name, health), o in results.items():
        seconds = f"{o.seconds:.1f}" if o.seconds is not None else "-"
        lost = "-" if o.steps_lost is None else str(o.steps_lost)
        line = o.first_line.replace("|", "/")
        rows.append(
            f"| {name} | {'on' if health else 'off'} | {'yes' if o.detected else 'no'} | "
            f"{seconds} | {o.codes} | {line} | {lost} | {o.left} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("FAULTS.md")))
    parser.add_argument("--only", default="", help="run the faults whose name contains this")
    parser.add_argument("--part", choices=("health", "storage", "all"), default="all")
    args = parser.parse_args()
    if args.part in ("storage", "all"):
        storage_part(Path(args.out), args.only)
    if args.part == "storage":
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxdist-faults-") as tmp:
        for name, spec in FAULTS.items():
            if args.only and args.only not in name:
                continue
            for health in (True, False):
                outcome = run(name, spec, health, args.timeout, Path(tmp))
                results[(name, health)] = outcome
                print(f"{name} health={'on' if health else 'off'}: {outcome}", flush=True)
    text = table(results)
    print(text)
    if not args.only:
        out = Path(args.out)
        kept = out.read_text().split(STORAGE_HEAD)[1] if out.exists() else ""
        text = FAULTS_MD.format(table=text, timeout=args.timeout)
        out.write_text(text + (STORAGE_HEAD + kept if kept else ""))


STORAGE_HEAD = "\n## The run directory's faults\n"


def storage_part(out: Path, only: str) -> None:
    """Runs ``storage_faults.CASES`` and writes their table after the health table."""
    sys.path.insert(0, str(Path(__file__).parent))
    import storage_faults

    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxdist-storage-") as tmp:
        for name, case in storage_faults.CASES.items():
            if only and only not in name:
                continue
            work = Path(tmp) / name.replace(" ", "-")
            work.mkdir()
            rows.append(case(work))
            print(rows[-1], flush=True)
        text = storage_faults.table(rows, Path(tmp))
    print(text)
    if not only:
        health = out.read_text().split(STORAGE_HEAD)[0] if out.exists() else ""
        out.write_text(f"{health.rstrip()}\n{STORAGE_HEAD}\n{STORAGE_MD}\n\n{text}\n")


STORAGE_MD = """Made by `python experiments/faults.py --part storage` (as root: it mounts a
tmpfs and a loop device; see `experiments/storage_faults.py` for each case's set-up). One process
(the launcher case: 2 ranks), the default MLP. Seconds run from the fault (the save that
failed: the newest checkpoint's time; the second start; the resume's start; the freeze;
the signal) to jaxdist's line; the line is the first `jaxdist: error:` (the launcher:
its last)."""


FAULTS_MD = """# Faults, with jaxdist's health checks on and off

Made by `python experiments/faults.py` (see its header for the set-up): 2 processes x 2
emulated CPU devices, started by hand as srun would, the default MLP, a checkpoint every
5 steps, the fault at step 8; `--step-timeout 5 --heartbeat-timeout 30`; a run still going
after {timeout:g} s is killed by the harness. Seconds run from the injection (for the two
mismatches, from the processes' start) to the first process that exits by itself; exit
codes `None`: still running at the end (a frozen process cannot exit by itself: under
`jaxdist.launch` or `srun --wait` it is killed once the others have exited).

{table}
"""

if __name__ == "__main__":
    main()
