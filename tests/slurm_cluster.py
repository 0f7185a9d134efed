"""A real SLURM cluster on this one machine: munge, slurmctld and 8 slurmd (node1..node8).

Each slurmd is started as ``slurmd -N nodeK`` on its own port; the node names resolve to
127.0.0.1 through /etc/hosts, because JAX takes the coordinator's host name from the first
node of the step's node list. Needs root and Debian's ``slurmctld slurmd slurm-client
munge`` (``.ci/run`` installs them). Every daemon this module starts, it stops.

    python tests/slurm_cluster.py     # start, show sinfo, stop: a manual check
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NODES = [f"node{i}" for i in range(1, 9)]
HOSTS_MARK = "# jaxdist test cluster"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def missing() -> str | None:
    """Why the cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their user)"
    absent = [d for d in DAEMONS if not shutil.which(d)]
    if absent:
        packages = "slurmctld slurmd slurm-client munge"
        return f"not installed: {', '.join(absent)} (apt-get install {packages})"
    return None


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _conf(root: Path, spool: Path, ctld_port: int, node_ports: list[int]) -> str:
    ports = ",".join(map(str, node_ports))
    return f"""\
ClusterName=jaxdisttest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only cred_expire s after its requeue (120 by default;
# 5 is the least allowed): 10 keeps the requeue test short and step launches safe.
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
# Pending jobs (a requeued one whose wait is over) are tried every second, not every 60.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
# An ended job stays visible to scontrol for 10 minutes (the tests read its final state).
MinJobAge=600
NodeName={",".join(NODES)} NodeAddr=127.0.0.1 CPUs=16 RealMemory=4000 Port={ports}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _add_hosts() -> bool:
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    if HOSTS_MARK in text:
        return False
    hosts.write_text(text.rstrip("\n") + f"\n127.0.0.1 {' '.join(NODES)} {HOSTS_MARK}\n")
    return True


def _remove_hosts() -> None:
    hosts = Path("/etc/hosts")
    lines = [x for x in hosts.read_text().splitlines() if HOSTS_MARK not in x]
    hosts.write_text("\n".join(lines) + "\n")


def _munge_works() -> bool:
    cred = subprocess.run(["munge", "-n"], capture_output=True)
    if cred.returncode:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True).returncode == 0


def _start_munge(stack: contextlib.ExitStack) -> None:
    if _munge_works():
        return  # a munged is already running: use it, and leave it running
    if not Path("/etc/munge/munge.key").exists():  # Debian's postinst usually makes it
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    proc = subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "--foreground"])
    stack.callback(_stop, proc)
    _wait(_munge_works, 20, "munged to answer")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(ready, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {seconds}s waiting for {what}")
        time.sleep(0.5)


@contextlib.contextmanager
def cluster(root: Path):
    """Starts the cluster; yields the environment that its client commands need."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    # slurmstepd makes Unix sockets in the spool: their path must stay under 108 bytes,
    # which a test's temporary directory (pytest-xdist adds a level) can exceed.
    spool = Path(tempfile.mkdtemp(prefix="jdslurm-"))
    for node in NODES:
        (spool / node).mkdir()
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, spool, ctld_port, node_ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, spool, ignore_errors=True)
        if _add_hosts():
            stack.callback(_remove_hosts)
        _start_munge(stack)
        ctld = subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env)
        stack.callback(_stop, ctld)
        for node in NODES:
            slurmd = subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(conf)], env=env)
            stack.callback(_stop, slurmd)

        def all_idle() -> bool:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True
            ).stdout.split("\n")
            return sum("idle" in line for line in out) == len(NODES)

        _wait(all_idle, 90, f"{len(NODES)} idle nodes (logs in {root})")
        yield env


if __name__ == "__main__":
    if reason := missing():
        raise SystemExit(f"cannot start: {reason}")
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp)) as env:
        print(subprocess.run(["sinfo", "-N"], env=env, capture_output=True, text=True).stdout)
