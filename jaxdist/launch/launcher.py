"""``python -m jaxdist.launch --nproc N -- <command ...>``: torchrun for JAX, on one machine
or on several (``--nnodes``, torchrun's flags; ``jaxdist.launch.nodes``).

Starts N processes of the command with the coordinator environment set
(``JAXDIST_COORDINATOR`` on a free loopback port, ``JAXDIST_NUM_PROCESSES``,
``JAXDIST_PROCESS_ID``), prefixes each output line with ``[rank R]``, and fails fast: when
one process fails, the others are ended within ``--grace`` seconds and the launcher exits
with the code of the process that failed first. SIGTERM and SIGUSR1 are forwarded to every
process, which saves and stops: exit 75 when all did (``jaxdist.launch.stop_signals``).
Ctrl-C and SIGHUP end them all; so does the launcher's own death, ``kill -9`` included.
``--max-restarts R`` starts the whole group again after a failure. The group itself is
``jaxdist.launch.group``.

On several machines the same command runs on each: ``--nnodes N --node-rank R
--master-addr H --master-port P --nproc-per-node K``. Node R's processes are global ranks
R*K .. R*K+K-1 of N*K, joined at the coordinator H:P; the launchers meet first at node
0's rendezvous (H, ``--rdzv-port``, P + 1), and a node that never comes, a failure on any
node, or a node's launcher lost ends every node's processes (``jaxdist.launch.nodes``).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time

from jaxdist.errors import ConfigError
from jaxdist.launch import nodes, stop_signals
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


def run(command: list[str], args, machines: nodes.Nodes | None = None) -> int:
    """The launcher's exit code: this machine's processes run to their end (and, with
    ``machines``, those of the other machines)."""
    out = Output("launch")
    # One name for the run across restarts: the trainer's default run directory (so a
    # restarted group resumes from the checkpoints of the one before).
    os.environ.setdefault("JAXDIST_RUN_ID", time.strftime("%Y%m%d-%H%M%S"))
    if machines is None:
        return _guarded(out, _attempts, command, args, out)
    start = functools.partial(_guarded, out, _attempts, command, args, out)
    return _guarded(out, nodes.run, machines, out, start)


def _guarded(out: Output, body, *args) -> int:
    """``body(*args)``, or the exit code of a stop signal or an interrupt that came."""
    try:
        return body(*args)
    except stop_signals.StopRequested as request:  # never restarted: a stop, not a failure
        return stop_signals.exit_code(request, out)
    except KeyboardInterrupt as stop:
        return 128 + stop.signum if isinstance(stop, Interrupted) else EXIT_INTERRUPTED


def _attempts(command: list[str], args, out: Output, place=None, peers=None) -> int:
    for attempt in range(args.max_restarts + 1):
        if attempt:
            out.say(f"restart {attempt}/{args.max_restarts}")
        # torchrun's TORCHELASTIC_RESTART_COUNT: which start of the group this is
        os.environ["JAXDIST_RESTART_COUNT"] = str(attempt)
        first = run_group(
            command,
            args.nproc,
            out,
            grace=args.grace,
            stop_grace=args.stop_grace,
            place=place,
            peers=peers,
            cpu_devices_per_proc=args.cpu_devices_per_proc,
            gpus_per_proc=args.gpus_per_proc,
        )
        if first is None:
            return 0
        if first.preempted:  # the allocation is ending: the scheduler, not us, runs it again
            return first.code
    return first.code


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxdist.launch",
        description="Start K processes of a command on this machine, joined by jax.distributed;\n"
        "with --nnodes N, the same on each of N machines: one group of N*K processes.",
        usage="python -m jaxdist.launch --nproc-per-node K [--nnodes N --node-rank R "
        "--master-addr HOST] [options] -- command ...",
        epilog="two machines, 8 GPUs each (node 0 at 10.0.0.1):\n"
        "  node 0: python -m jaxdist.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 "
        "--nproc-per-node 8 --gpus-per-proc 1 -- python -m jaxdist.train\n"
        "  node 1: the same with --node-rank 1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc", type=int, metavar="K",
        required=True, help="processes to start on this machine")  # fmt: skip
    add("--cpu-devices-per-proc", type=int, default=0, metavar="K",
        help="emulate K CPU devices in each process (CPU platform)")  # fmt: skip
    add("--gpus-per-proc", type=int, default=0, metavar="K",
        help="give this machine's process r its GPUs r*K .. r*K+K-1")  # fmt: skip
    add("--max-restarts", type=int, default=0, metavar="R",
        help="start the whole group again after a failure (not a preemption), up to R times; "
        "one machine only")  # fmt: skip
    add("--grace", type=float, default=5.0, metavar="S",
        help="seconds between SIGTERM and SIGKILL when ending processes, and that the "
        "others get to stop by themselves after one stopped for preemption (exit 75)")  # fmt: skip
    add("--stop-grace", type=float, default=stop_signals.STOP_GRACE_S, metavar="S",
        help="after SIGTERM or SIGUSR1 to the launcher: seconds the processes get to save "
        "a checkpoint and exit by themselves before they are ended (exit 143); keep it "
        "below the scheduler's own kill deadline")  # fmt: skip
    machines = parser.add_argument_group(
        "several machines", "run the same command on each machine, with its own --node-rank"
    )
    add = machines.add_argument
    add("--nnodes", type=int, default=1, metavar="N",
        help="machines in the group (default 1: this one)")  # fmt: skip
    add("--node-rank", "--node_rank", dest="node_rank", type=int, default=0, metavar="R",
        help="this machine, 0 .. N-1; node 0 runs the coordinator and the rendezvous")  # fmt: skip
    add("--master-addr", "--master_addr", dest="master_addr", default="", metavar="HOST",
        help="node 0's address, the same on every node; the coordinator and the "
        "rendezvous listen on it alone")  # fmt: skip
    add("--master-port", "--master_port", dest="master_port", type=int, default=29500,
        metavar="PORT", help="the coordinator's port on node 0 (default 29500)")  # fmt: skip
    add("--rdzv-port", "--rdzv_port", dest="rdzv_port", type=int, default=0, metavar="PORT",
        help="the launchers' rendezvous port on node 0 (default: --master-port + 1)")  # fmt: skip
    add("--init-timeout", type=float, default=300.0, metavar="S",
        help="seconds every node has to join before every node gives up, naming the "
        "missing ones (exit 76)")  # fmt: skip
    return parser


def checked(args, command: list[str]) -> nodes.Nodes | None:
    """The flags, or a ConfigError naming the bad value; the machines with --nnodes > 1."""
    if not command:
        raise ConfigError("no command given after --")
    if args.nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.nnodes == 1:
        if args.node_rank != 0:
            raise ConfigError(f"--node-rank {args.node_rank} is not in [0, 1) (--nnodes 1)")
        return None
    return nodes.checked(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser().parse_args(argv[:split]), argv[split + 1 :]
    try:
        machines = checked(args, command)
    except ConfigError as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGHUP, _interrupt)  # a closed terminal
    stop_signals.install()  # `kill launcher`, Kubernetes, scancel, SLURM's --signal=USR1
    return run(command, args, machines)


def _interrupt(signum, frame):
    raise Interrupted(signum)
