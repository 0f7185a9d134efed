"""``python -m jaxdist.launch --nproc N -- <command ...>``: torchrun for JAX on one machine.

Starts N processes of the command with the coordinator environment set
(``JAXDIST_COORDINATOR`` on a free loopback port, ``JAXDIST_NUM_PROCESSES``,
``JAXDIST_PROCESS_ID``), prefixes each output line with ``[rank R]``, and fails fast: when
one process fails, the others are ended within ``--grace`` seconds and the launcher exits
with the code of the process that failed first. SIGTERM and SIGUSR1 are forwarded to every
process, which saves and stops: exit 75 when all did (``jaxdist.launch.stop_signals``).
Ctrl-C and SIGHUP end them all; so does the launcher's own death, ``kill -9`` included.
``--max-restarts R`` starts the whole group again after a failure. The group itself is
``jaxdist.launch.group``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from jaxdist.launch import stop_signals
from jaxdist.launch.group import free_port
from jaxdist.launch.group import run as run_group
from jaxdist.launch.rank_output import Output

__all__ = ["free_port", "main", "run"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class Interrupted(KeyboardInterrupt):
    """SIGHUP to the launcher: handled as Ctrl-C, exit 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run(command: list[str], args) -> int:
    out = Output("launch")
    # One name for the run across restarts: the trainer's default run directory (so a
    # restarted group resumes from the checkpoints of the one before).
    os.environ.setdefault("JAXDIST_RUN_ID", time.strftime("%Y%m%d-%H%M%S"))
    for attempt in range(args.max_restarts + 1):
        if attempt:
            out.say(f"restart {attempt}/{args.max_restarts}")
        try:
            first = run_group(
                command,
                args.nproc,
                out,
                grace=args.grace,
                stop_grace=args.stop_grace,
                cpu_devices_per_proc=args.cpu_devices_per_proc,
                gpus_per_proc=args.gpus_per_proc,
            )
        except stop_signals.StopRequested as request:  # never restarted: a stop, not a failure
            return stop_signals.exit_code(request, out)
        except KeyboardInterrupt as stop:
            return 128 + stop.signum if isinstance(stop, Interrupted) else EXIT_INTERRUPTED
        if first is None:
            return 0
        if first.preempted:  # the allocation is ending: the scheduler, not us, runs it again
            return first.code
    return first.code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxdist.launch",
        description="Start N local processes of a command joined by jax.distributed.",
        usage="python -m jaxdist.launch --nproc N [options] -- command ...",
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
    parser.add_argument(
        "--cpu-devices-per-proc",
        type=int,
        default=0,
        help="emulate K CPU devices in each process (CPU platform)",
    )
    parser.add_argument(
        "--gpus-per-proc", type=int, default=0, help="give process r the GPUs r*K .. r*K+K-1"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start the whole group again after a failure (not a preemption), up to R times",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when ending processes, and that the "
        "others get to stop by themselves after one stopped for preemption (exit 75)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=stop_signals.STOP_GRACE_S,
        help="after SIGTERM or SIGUSR1 to the launcher: seconds the processes get to save "
        "a checkpoint and exit by themselves before they are ended (exit 143); keep it "
        "below the scheduler's own kill deadline",
    )
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("no command given after --")
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    signal.signal(signal.SIGHUP, _interrupt)  # a closed terminal
    stop_signals.install()  # `kill launcher`, Kubernetes, scancel, SLURM's --signal=USR1
    return run(command, args)


def _interrupt(signum, frame):
    raise Interrupted(signum)
