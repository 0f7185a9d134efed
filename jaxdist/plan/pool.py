"""Worker processes that compile candidates (``jaxdist.plan.worker``), each with a time
limit and a memory limit: a candidate past either is reported as such and its worker
replaced, so one pathological layout costs its limit, not the plan.

Workers open only CPU devices (``JAX_PLATFORMS=cpu``: a GPU target compiles for a
topology, not a device), with the CUDA plugin on their path for a GPU target and the
CPU target's device count otherwise (``environment``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from jaxdist.errors import JaxdistError
from jaxdist.plan.targets import Target

POLL_S = 0.05


def environment(target: Target, plugin_path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # no CUDA libraries to check: compile only
    env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "2")
    env["JAX_NUM_CPU_DEVICES"] = str(target.num_devices if not target.is_gpu else 1)
    if plugin_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_path, env.get("PYTHONPATH")]))
    return env


@dataclass
class _Worker:
    proc: subprocess.Popen
    log: object  # its stderr, kept for a failure's last lines
    task: object = None
    started: float = 0.0
    ready: bool = False
    buffer: bytes = field(default=b"")


class Pool:
    """``run(tasks)`` yields ``(task, result)`` as results come; ``task.tree`` is sent."""

    def __init__(self, target: str, workers: int, env: dict, timeout_s: float, memory_gib: float):
        self.target, self.size, self.env = target, workers, env
        self.timeout_s, self.memory_bytes = timeout_s, memory_gib * 2**30
        self.workers: list[_Worker] = []

    def __enter__(self):
        return self

    def start(self) -> None:
        """Starts the workers (importing JAX takes them seconds: start them early)."""
        if not self.workers:
            self.workers = [self._start() for _ in range(self.size)]

    def __exit__(self, *exc):
        for w in self.workers:
            _kill(w)

    def _start(self) -> _Worker:
        log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with its worker)
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.plan.worker", self.target],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env,
        )  # fmt: skip
        os.set_blocking(proc.stdout.fileno(), False)
        return _Worker(proc, log)

    def run(self, next_task: Callable[[], object | None]) -> Iterator[tuple[object, dict]]:
        """``next_task()`` gives the next task, or None when there is none for now; the
        run ends when it gives None and no worker is busy."""
        if not self.workers:
            return
        while True:
            busy = False
            for i, w in enumerate(self.workers):
                result = self._poll(w)
                if result is not None:
                    task, w.task = w.task, None
                    if result.get("status") == "worker died":  # replaced; its task failed
                        self.workers[i] = w = self._start()
                        result = {"status": result["as"], "why": result["why"]}
                    if task is not None:
                        yield task, result
                if w.ready and w.task is None:
                    task = next_task()
                    if task is not None:
                        w.task, w.started = task, time.monotonic()
                        w.proc.stdin.write((json.dumps(task.tree) + "\n").encode())
                        w.proc.stdin.flush()
                busy = busy or w.task is not None or not w.ready
            if not busy:
                return
            time.sleep(POLL_S)

    def _poll(self, w: _Worker) -> dict | None:
        line = self._read_line(w)
        if line is not None:
            result = json.loads(line)
            if result.get("status") == "ready":
                w.ready = True
                return None
            return result
        if w.proc.poll() is not None:
            return self._died(w, f"the worker exited ({w.proc.returncode}): {_tail(w.log)}")
        if w.task is None:
            return None
        if time.monotonic() - w.started > self.timeout_s:
            return self._died(w, f"timed out after {self.timeout_s:.0f} s", "timed out")
        rss = _rss_bytes(w.proc.pid)
        if rss > self.memory_bytes:
            gib = rss / 2**30
            return self._died(w, f"over the worker memory limit ({gib:.1f} GiB)", "worker memory")
        return None

    def _died(self, w: _Worker, why: str, status: str = "failed") -> dict | None:
        _kill(w)
        if w.task is None:  # a worker that died between tasks (or at start)
            if not w.ready:
                raise JaxdistError(f"a planner worker could not start: {why}")
            w.ready = False
        return {"status": "worker died", "as": status, "why": why}

    def _read_line(self, w: _Worker) -> str | None:
        try:
            chunk = w.proc.stdout.read()
        except (OSError, ValueError):
            chunk = None
        if chunk:
            w.buffer += chunk
        if b"\n" in w.buffer:
            line, w.buffer = w.buffer.split(b"\n", 1)
            return line.decode()
        return None


def _kill(w: _Worker) -> None:
    if w.proc.poll() is None:
        w.proc.kill()
    w.proc.wait()
    w.log.close()


def _tail(log, lines: int = 5) -> str:
    log.seek(0)
    text = log.read().decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def _rss_bytes(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0
