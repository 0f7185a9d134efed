"""Dead peers and who may be process 0, with processes started by hand as a scheduler
would (no launcher to end the group for them): the survivors of a SIGKILLed worker or
process 0 exit 76 within seconds, their last line naming the dead process, never a C++
abort trace; two processes given process id 0 both stop within seconds, saying so. The
coordination service listens on the coordinator address given, not on every interface.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from group_helpers import ENV, MLP
from helpers import failures_of
from jaxdist.launch.group import free_port


def start(tmp_path: Path, rank: int, port: int, args: list[str], env: dict, name: str = ""):
    """One process of a group of 2, from PyTorch's variables, output to ``NAME.log``
    (default ``rank<R>``)."""
    out = open(tmp_path / f"{name or f'rank{rank}'}.log", "wb")  # noqa: SIM115
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    return subprocess.Popen(
        [sys.executable, "-m", "jaxdist.train", "--cpu-devices", "2", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**ENV, **group, "RANK": str(rank), **env},
    )


def log(tmp_path: Path, rank: int, name: str = "") -> str:
    return (tmp_path / f"{name or f'rank{rank}'}.log").read_bytes().decode(errors="replace")


@pytest.fixture
def group(tmp_path):
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net has them) with a socket listening on ``port``;
    JAX's default, every interface, would be all zeros."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


@pytest.mark.parametrize("victim", [1, 0])
def test_survivors_name_the_dead_process(tmp_path, group, victim):
    port = free_port()
    run_dir = tmp_path / "run"
    args = [*MLP, "--steps", "200", "--log-every", "1", "--run-dir", str(run_dir)]
    args += ["--global-batch-size", "16", "--compile-cache", "off"]
    fault = {"JAXDIST_FAULT": f"kill@{victim}:8"}
    group += [start(tmp_path, rank, port, args, fault) for rank in (0, 1)]
    # Looked at while process 0 still lives (it starts the service and compiles for
    # seconds before step 1; the kill is at step 8): given by hand (MASTER_ADDR=127.0.0.1),
    # the service listens there only, not on [::]
    deadline = time.monotonic() + 120
    while not (addresses := listening(port)):
        assert time.monotonic() < deadline and group[0].poll() is None, log(tmp_path, 0)
        time.sleep(0.05)
    assert set(addresses) <= LOOPBACK, addresses
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, log(tmp_path, 0)
        time.sleep(0.1)
    dead, survivor = group[victim], group[1 - victim]
    assert dead.wait(timeout=60) == -9
    killed_at = time.monotonic()
    assert survivor.wait(timeout=30) == 76, log(tmp_path, 1 - victim)[-3000:]
    assert time.monotonic() - killed_at < 15  # the heartbeat timeout is 100 s
    # the survivor's last jaxdist line (gRPC and JAX's preemption barrier may still
    # print lines of their own after it, as many as they like)
    said = f"[rank {1 - victim}] jaxdist: error: process {victim} (host "
    ours = [ln for ln in log(tmp_path, 1 - victim).splitlines() if " jaxdist: " in ln]
    last = ours[-1] if ours else log(tmp_path, 1 - victim)[-3000:]
    assert last.startswith(said), last
    assert " died" in last and f"pid {dead.pid}" in last, last
    (failure,) = failures_of(run_dir)
    assert (failure["cause"], failure["process"], failure["exit_code"]) == ("dead_peer", victim, 76)
    assert failure["reported_by"] == 1 - victim


def test_two_processes_given_process_id_0_both_stop_within_seconds(tmp_path, group):
    port = free_port()
    args = [*MLP, "--steps", "5", "--run-dir", str(tmp_path / "run"), "--init-timeout", "300"]
    started = time.monotonic()
    group += [start(tmp_path, 0, port, args, {}, name=name) for name in ("a", "b")]
    codes = [proc.wait(timeout=60) for proc in group]
    texts = [log(tmp_path, 0, name) for name in ("a", "b")]
    assert codes == [2, 2], texts
    assert time.monotonic() - started < 30  # not the 300 s --init-timeout
    # One was refused the coordinator's address, the other turned away by the service.
    both = "\n".join(texts)
    assert "Two processes were probably given process id 0" in both, both[-3000:]
    assert "a second process was given the same process id 0" in both, both[-3000:]
    for text in texts:  # the last word is jaxdist's, not JAX's C++ trace
        assert text.strip().splitlines()[-1].startswith("[rank 0] jaxdist: error:"), text
    assert not (tmp_path / "run").exists()


def test_the_launcher_keeps_the_service_on_loopback(tmp_path, launcher):
    run_dir = tmp_path / "run"
    args = [*MLP, "--steps", "400", "--run-dir", str(run_dir), "--compile-cache", "off"]
    run = launcher(
        "--nproc", "2", "--cpu-devices-per-proc", "1", "--",
        sys.executable, "-m", "jaxdist.train", *args,
    )  # fmt: skip
    run.wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the first step")
    environ = Path(f"/proc/{run.ranks()[0]}/environ").read_bytes().split(b"\0")
    coordinator = next(e for e in environ if e.startswith(b"JAXDIST_COORDINATOR="))
    port = int(coordinator.rsplit(b":", 1)[1])
    assert listening(port) and set(listening(port)) <= LOOPBACK, listening(port)
