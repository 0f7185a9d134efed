"""Who we are: the process group, and what only the main process does.

PyTorch's ``init_process_group`` / ``rank`` / ``world_size`` / ``barrier`` map to
``initialize()``, ``ProcessInfo.process_index`` / ``process_count`` and ``barrier()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

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


def use_cpu_devices(count: int) -> None:
    """Emulates ``count`` CPU devices. Only possible before JAX initialises its backend;
    afterwards it is accepted only if the backend already has exactly that many."""
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


def initialize(cpu_devices: int = 0) -> ProcessInfo:
    """Sets up the process group and returns who we are. Call once, before other JAX use.

    Today a single process (no coordinator). ``cpu_devices=8`` emulates 8 CPU devices.

    Example::

        info = jaxdist.initialize()
        print(info)  # process 0/1: 8 local of 8 cpu devices
    """
    use_cpu_devices(cpu_devices)
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
