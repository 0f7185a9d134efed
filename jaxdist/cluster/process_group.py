"""Who we are: the process group, and what only the main process does.

PyTorch's ``init_process_group`` / ``rank`` / ``world_size`` / ``barrier`` map to
``initialize()``, ``ProcessInfo.process_index`` / ``process_count`` and ``barrier()``.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

import jax

from jaxdist.cluster import cpu_backend, environment, failures, leaving, peers, shutdown, store
from jaxdist.cluster.environment import ClusterSpec
from jaxdist.cluster.service import claim_process_zero, service_address
from jaxdist.errors import JaxdistError


@dataclass(frozen=True)
class ProcessInfo:
    process_index: int  # PyTorch's rank (of the process, not of the device)
    process_count: int  # PyTorch's world_size counts devices; this counts processes
    local_device_count: int  # devices this process drives
    device_count: int  # devices in the whole job
    platform: str  # "cpu", "gpu" or "tpu"

    def __str__(self) -> str:
        return (
            f"process {self.process_index}/{self.process_count}: "
            f"{self.local_device_count} local of {self.device_count} {self.platform} devices"
        )


def use_cpu_devices(count: int, num_processes: int = 1) -> None:
    """Emulates ``count`` CPU devices (0: as JAX's configuration has it) in each of
    ``num_processes``, and sizes the CPU thread pool for their collectives. Only possible
    before JAX initialises its backend; afterwards it is accepted only if the backend
    already has exactly that many."""
    configured = jax.config.jax_num_cpu_devices  # JAX_NUM_CPU_DEVICES, or -1: one
    cpu_backend.size_thread_pool(count or max(configured, 1), num_processes)
    if not count:
        return
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        devices = jax.devices()
        if devices[0].platform != "cpu" or len(devices) != count:
            raise JaxdistError(
                f"--cpu-devices {count}: JAX's backend is already initialised with "
                f"{len(devices)} {devices[0].platform} devices; set it before any JAX operation "
                f"(or JAX_NUM_CPU_DEVICES={count} in the environment)"
            ) from None


def select_platform(name: str | None) -> None:
    """``JAXDIST_PLATFORM=cpu`` (or gpu, tpu) picks the platform before JAX starts."""
    if name:
        jax.config.update("jax_platforms", {"gpu": "cuda"}.get(name, name))


def _join(
    spec: ClusterSpec, init_timeout: float, heartbeat_timeout: float, bind: str, health: bool
) -> None:
    """jax.distributed.initialize, bounded: if the group has not formed within
    ``init_timeout`` s we exit with a clear message. (JAX's own timeout aborts the process
    with SIGABRT and a C++ stack trace, so ours fires first; it runs while JAX waits,
    because JAX releases the GIL.) With ``health``, a second process claiming the same
    process id is named within seconds (``jaxdist.cluster.service``, ``jaxdist.cluster.peers``)."""
    waited_for = (
        f"the coordinator {spec.coordinator}" if spec.coordinator else "the SLURM coordinator"
    )
    bind_address = service_address(spec, bind)
    if health:
        peers.install_abort_handler(spec.process_id, spec.num_processes)
        if spec.process_id == 0 and bind_address:
            claim_process_zero(spec, bind_address)

    def give_up():
        listens = f"; it listens on {bind_address}" if bind_address else ""
        print(
            f"[rank {spec.process_id}] jaxdist: error: the process group did not form within "
            f"--init-timeout {init_timeout:g}s: process {spec.process_id} of "
            f"{spec.num_processes} waited for {waited_for} ({spec.source}{listens}). A "
            "process that never started, or one given the same process id as another, "
            "keeps the group from forming",
            file=sys.stderr,
            flush=True,
        )
        leaving.exit_now(failures.PEER_DIED)  # the group did not form

    watchdog = threading.Timer(init_timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    kwargs = dict(
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        initialization_timeout=int(init_timeout) + 30,
        heartbeat_timeout_seconds=int(heartbeat_timeout),
        coordinator_bind_address=bind_address or None,
    )
    if spec.source == "slurm":
        jax.distributed.initialize(**kwargs)  # JAX reads SLURM's environment itself
    else:  # the group is decided; JAX's own detection (mpirun, SLURM) would narrow the
        # devices of a process given none to one GPU, its local rank's
        kwargs["cluster_detection_method"] = "deactivate"
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id, **kwargs)
    watchdog.cancel()
    peers.joined(store.coordinator_address())
    shutdown.exit_fast_on_uncaught_error(spec.process_id)
    shutdown.exit_on_sigterm()


def initialize(
    cpu_devices: int = 0,
    *,
    coordinator: str = "",
    num_processes: int = 0,
    process_id: int = -1,
    local_device_ids: str = "",
    init_timeout: float = 300,
    heartbeat_timeout: float = 100,
    coordinator_bind_address: str = "",
    health: bool = True,
    process_group: str = "auto",
) -> ProcessInfo:
    """Sets up the process group and returns who we are. Call once, before other JAX use.

    Where the group comes from, first that applies (``jaxdist.cluster.environment``): a
    SLURM step with several tasks; ``mpirun``; a Kubernetes Indexed Job or JobSet; the
    explicit arguments; ``JAXDIST_COORDINATOR`` / ``JAXDIST_NUM_PROCESSES`` /
    ``JAXDIST_PROCESS_ID`` (set by ``python -m jaxdist.launch``) or PyTorch's
    ``MASTER_ADDR`` / ``MASTER_PORT`` / ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``; else one
    process. ``process_group="single"``: one process whatever the environment says.
    ``cpu_devices=8`` emulates 8 CPU devices per process; ``JAXDIST_PLATFORM`` picks the
    platform. CPU processes talk through gloo. In a group, SIGTERM then ends the process at
    once with exit code 143, as it would without JAX, unless a
    ``jaxdist.cluster.preemption.StopFlag`` takes it as a request to stop cleanly.

    Process 0's coordination service listens on ``coordinator_bind_address``, else on
    the address of the coordinator host given (not on every interface, JAX's default:
    the service has no authentication); under SLURM on JAX's default unless given.
    ``health``: a process aborted by JAX's coordination client says why, naming the
    process that died or the duplicate process id (``jaxdist.cluster.peers``).

    Example::

        info = jaxdist.initialize()
        print(info)  # process 0/2: 4 local of 8 cpu devices
    """
    select_platform(os.environ.get("JAXDIST_PLATFORM"))
    spec = environment.resolve(
        os.environ, coordinator, num_processes, process_id, local_device_ids, process_group
    )
    use_cpu_devices(cpu_devices, spec.num_processes)
    if spec.multi_process and not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _join(spec, init_timeout, heartbeat_timeout, coordinator_bind_address, health)
    elif health and not spec.multi_process:  # one process: an XLA abort is still named
        peers.install_abort_handler(0, 1)
        peers.joined("")
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
        platform=jax.devices()[0].platform,
    )


def is_main_process() -> bool:
    """True on process 0, the one that writes files and prints."""
    return jax.process_index() == 0


def print_main(*args, **kwargs) -> None:
    """``print`` on the main process only (PyTorch: ``if rank == 0: print(...)``)."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def barrier(name: str) -> None:
    """Blocks until every process reaches the barrier of the same ``name``."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
