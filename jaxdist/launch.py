"""``python -m jaxdist.launch --nproc N -- <command ...>``: torchrun for JAX on one machine.

Starts N processes of the command with the coordinator environment set
(``JAXDIST_COORDINATOR`` on a free loopback port, ``JAXDIST_NUM_PROCESSES``,
``JAXDIST_PROCESS_ID``), prefixes each output line with ``[rank R]``, and fails fast: when
one process fails, the others are ended within ``--grace`` seconds and the launcher exits
with the failed process's code. Ctrl-C ends them all. ``--max-restarts R`` starts the whole
group again after a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exit_code(returncode: int) -> int:
    """A child killed by signal S (returncode -S) exits the launcher with 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def rank_env(rank: int, nproc: int, port: int, args) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        JAXDIST_COORDINATOR=f"127.0.0.1:{port}",
        JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",  # loopback only, not [::]
        JAXDIST_NUM_PROCESSES=str(nproc),
        JAXDIST_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",  # lines arrive as they are printed, not at exit
    )
    if args.cpu_devices_per_proc:
        env.update(JAXDIST_PLATFORM="cpu", JAX_NUM_CPU_DEVICES=str(args.cpu_devices_per_proc))
    if args.gpus_per_proc:
        first = rank * args.gpus_per_proc
        ids = range(first, first + args.gpus_per_proc)
        env["JAXDIST_LOCAL_DEVICE_IDS"] = ",".join(map(str, ids))
    return env


def _pump(rank: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[rank {rank}] {line}" if not line.startswith("[rank") else line)
            sys.stdout.flush()


class Group:
    """N processes of one command; each in its own session so that we can end its tree."""

    def __init__(self, command: list[str], args):
        port = free_port()
        self.lock = threading.Lock()
        self.procs = []
        self.pumps = []
        for rank in range(args.nproc):
            proc = subprocess.Popen(
                command,
                env=rank_env(rank, args.nproc, port, args),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            pump = threading.Thread(target=_pump, args=(rank, proc.stdout, self.lock), daemon=True)
            pump.start()
            self.procs.append(proc)
            self.pumps.append(pump)

    def wait(self) -> tuple[int, int | None]:
        """Blocks until all succeed (0, None) or one fails (its code, its rank)."""
        while True:
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    return exit_code(code), rank
            if all(code == 0 for code in codes):
                return 0, None
            time.sleep(0.1)

    def end(self, grace: float) -> None:
        """SIGTERM every live process tree, then SIGKILL what is left after ``grace`` s.
        (After jax.distributed.initialize SIGTERM alone may not end a process.)"""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):  # already gone
                        os.killpg(proc.pid, sig)
            deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5)
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
        for pump in self.pumps:
            pump.join(timeout=1)


def say(text: str) -> None:
    print(f"[launch] {text}", flush=True)


def run(command: list[str], args) -> int:
    for attempt in range(args.max_restarts + 1):
        if attempt:
            say(f"restart {attempt}/{args.max_restarts}")
        group = Group(command, args)
        try:
            code, rank = group.wait()
        except KeyboardInterrupt:
            say("interrupted: ending all processes")
            group.end(args.grace)
            return EXIT_INTERRUPTED
        if rank is None:
            group.end(args.grace)
            return 0
        say(f"rank {rank} failed with exit code {code}: ending the other processes")
        group.end(args.grace)
    return code


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
        help="start the whole group again after a failure, up to R times",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when ending processes",
    )
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("no command given after --")
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill launcher` ends the group as Ctrl-C does
    return run(command, args)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
