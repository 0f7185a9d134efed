"""Process 0's coordination service: where it listens, and that only one process runs it.

The service has no authentication. JAX binds it to every interface (``[::]:PORT``) by
default; jaxdist binds it to the address of the coordinator host given (``--coordinator
node1:1234`` -> node1's address; ``127.0.0.1`` -> loopback only), or to
``--coordinator-bind-address`` / ``JAX_COORDINATOR_BIND_ADDRESS``. Under SLURM JAX picks
the coordinator itself: its default stands unless ``--coordinator-bind-address`` is given.

Two processes given process id 0 (``RANK=0`` twice) otherwise wait for each other until
``--init-timeout`` and blame the coordinator. Here the process that would run the service
first takes a lock named after its address on this machine, and checks that the address
is one of this machine's. The second claimant fails either check, says so, and registers
with the service as process 0 itself: the coordination service then turns the first one
away at once (it keeps the newer registration), and that one says why (``jaxdist.cluster.peers``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import sys
import tempfile

from jaxdist.cluster import failures, leaving
from jaxdist.cluster.environment import ClusterSpec

_held: list = []  # the claim's lock file, open for the life of the process


def service_address(spec: ClusterSpec, given: str) -> str:
    """``HOST:PORT`` the service binds, or "" for JAX's default."""
    given = given or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "")
    if given or spec.coordinator is None:  # SLURM: JAX finds the coordinator itself
        return given
    host, _, port = spec.coordinator.rpartition(":")
    ip = resolve(host.strip("[]"))
    if ip is None:
        return ""  # JAX will fail to reach it and say so; nothing to bind here
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None


def claim_process_zero(spec: ClusterSpec, bind_address: str) -> None:
    """Exits 2, at once, rather than become process 0 when another process on this machine already
    is, for this address, or when the address is not this machine's."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    problem = _not_local(host, port) or _claimed(host, port)
    if problem is None:
        return
    message = (
        f"process id {spec.process_id} of {spec.num_processes} ({spec.source}): {problem}. "
        "Two processes were probably given process id 0 (RANK, --process-id, "
        "JAXDIST_PROCESS_ID); the other one is being stopped too"
    )
    leaving.expect_exit(failures.BAD_INPUT, last_word=message)
    print(f"[rank {spec.process_id}] jaxdist: error: {message}", file=sys.stderr, flush=True)
    _turn_the_other_away(spec)
    leaving.exit_now(failures.BAD_INPUT)


def _not_local(host: str, port: str) -> str | None:
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return None
    except ValueError:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return (
                f"the coordinator address {host}:{port} is not an address of this machine "
                f"({socket.gethostname()}), so process 0 cannot run here"
            )
    return None


def _claimed(host: str, port: str) -> str | None:
    path = os.path.join(tempfile.gettempdir(), f"jaxdist-coordinator-{host}-{port}.lock")
    handle = open(path, "a")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return f"another process on this machine already runs the coordinator at {host}:{port}"
    _held.append(handle)
    return None


def _turn_the_other_away(spec: ClusterSpec) -> None:
    """Registers with the running service as ``spec.process_id``: the service turns the
    earlier registrant away. Our own registration then waits for the rest of the group
    and fails after a few seconds (an abort, which exits 2: ``expect_exit``)."""
    from jax._src.lib import _jax

    try:
        client = _jax.get_distributed_runtime_client(
            spec.coordinator, spec.process_id, init_timeout=3, heartbeat_timeout=3
        )
        client.connect()
    except Exception:
        pass
