"""``python -m jaxdist.train ... --dry-run``: the run's step compiled for the devices
present, without data or a run directory, and what it needs per device against what
the devices have. For the user about to wait in a queue: exit 0 if it fits, 2 if not."""

from __future__ import annotations

import jax

import jaxdist
from jaxdist.errors import JaxdistError
from jaxdist.train import compile_only
from jaxdist.train.config import Config
from jaxdist.units import size


class DoesNotFit(JaxdistError):
    """The step needs more memory per device than the devices have (exit 2)."""


def dry_run(config: Config) -> compile_only.Measured:
    cfg, d = config.train, config.dist
    info = jaxdist.initialize(
        cpu_devices=cfg.cpu_devices, coordinator=d.coordinator, num_processes=d.num_processes,
        process_id=d.process_id, local_device_ids=d.local_device_ids,
        init_timeout=d.init_timeout, heartbeat_timeout=d.heartbeat_timeout,
        coordinator_bind_address=d.coordinator_bind_address, health=False,
        process_group=d.process_group,
    )  # fmt: skip
    devices = jax.devices()[: cfg.num_devices] if cfg.num_devices else jax.devices()
    m = compile_only.measure(config, devices, lambda device: device.process_index)
    capacity = compile_only.capacity_bytes(jax.local_devices())
    fits = capacity is None or m.peak_bytes <= capacity
    if info.process_index == 0:
        print(describe(config, devices, m, capacity, fits), flush=True)
    if not fits:
        raise DoesNotFit(
            f"--dry-run: the step needs {size(m.peak_bytes)} per device, more than the "
            f"{size(capacity)} a {devices[0].device_kind} device has: use more devices, "
            "--mesh fsdp=N, --grad-accum, --remat full or a smaller batch "
            "(python -m jaxdist.plan compares them)"
        )
    return m


def describe(config: Config, devices, m: compile_only.Measured, capacity, fits: bool) -> str:
    cfg = config.train
    room = f"of {size(capacity)} usable" if capacity else "(capacity unknown)"
    verdict = "fits" if fits else "DOES NOT FIT"
    comm = ", ".join(f"{k} {size(v)}" for k, v in sorted(m.by_kind.items()) if v) or "none"
    return "\n".join([
        f"jaxdist: dry run: --model {config.model.name} on {len(devices)} "
        f"{devices[0].device_kind} devices, --mesh {cfg.mesh or f'data={len(devices)}'}, "
        f"--global-batch-size {cfg.global_batch_size}, --grad-accum {cfg.grad_accum}",
        f"  memory per device: arguments {size(m.argument_bytes)}, temporaries "
        f"{size(m.temp_bytes)}, outputs {size(m.output_bytes)} ({size(m.alias_bytes)} "
        f"reusing the arguments), peak {size(m.peak_bytes)} {room}: {verdict}",
        f"  matmul FLOPs per step: {m.matmul_flops:.3e} per device, "
        f"{m.matmul_flops * len(devices):.3e} in all (loops counted their trip count times)",
        f"  collectives per step per device: {comm}",
        f"  compiled in {m.compile_s:.1f} s (traced and lowered in {m.lower_s:.1f} s)",
    ])  # fmt: skip
