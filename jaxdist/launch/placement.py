"""Where a launcher's processes sit in the whole group, and the environment each is given.

Alone on one machine (the default) the coordinator runs on a free loopback port and the
launcher's processes are the whole group. As node R of N machines, with K processes on
each, its processes are global ranks R*K .. R*K+K-1 of N*K and all point at the one
coordinator that global rank 0 runs on node 0.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from jaxdist.cluster import failures

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets (gRPC's and JAX's form)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """This launcher's place in the group: the defaults are one machine, alone."""

    host: str = LOOPBACK  # where global rank 0 runs the coordinator
    port: int = 0  # its port; 0: a free port of this machine, chosen when the group starts
    bind: str = ""  # the address it listens on: host's, never every interface
    first_rank: int = 0  # the global rank of this launcher's first process
    world: int = 0  # processes in the whole group; 0: this launcher's own count
    node: int | None = None  # this machine's node rank; None when it is the only one

    def started(self, nproc: int) -> Placement:
        """With the port and the group's size decided."""
        port = self.port or free_port(self.host)
        return dataclasses.replace(self, port=port, world=self.world or nproc)

    @property
    def coordinator(self) -> str:
        return host_port(self.host, self.port)


def rank_env(
    local_rank: int,
    place: Placement,
    *,
    cpu_devices_per_proc: int = 0,
    gpus_per_proc: int = 0,
    failure_dir: str = "",
) -> dict[str, str]:
    """The environment ``jaxdist.initialize()`` reads to join the group (``jaxdist.cluster``)
    for this launcher's process ``local_rank`` of a ``Placement.started`` place."""
    env = dict(os.environ)
    env.update(
        JAXDIST_COORDINATOR=place.coordinator,
        # only global rank 0 reads it: the host's own address, not [::]
        JAX_COORDINATOR_BIND_ADDRESS=place.bind or place.coordinator,
        JAXDIST_NUM_PROCESSES=str(place.world),
        JAXDIST_PROCESS_ID=str(place.first_rank + local_rank),
        PYTHONUNBUFFERED="1",  # lines arrive as they are printed, not at exit
    )
    if failure_dir:  # where a failing rank says who is to blame (jaxdist.cluster.failures)
        env[failures.LAUNCHER_DIR] = failure_dir
    if cpu_devices_per_proc:
        env.update(JAXDIST_PLATFORM="cpu", JAX_NUM_CPU_DEVICES=str(cpu_devices_per_proc))
    if gpus_per_proc:  # this machine's GPUs: numbered by the local rank
        first = local_rank * gpus_per_proc
        ids = range(first, first + gpus_per_proc)
        env["JAXDIST_LOCAL_DEVICE_IDS"] = ",".join(map(str, ids))
    return env
