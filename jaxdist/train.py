"""``python -m jaxdist.train``: data-parallel training on every visible device.

``train()`` reads top to bottom: devices, mesh, model, optimizer, step, data, loop.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import jax

from jaxdist import config as config_lib
from jaxdist import strategies
from jaxdist.config import Config, ConfigError
from jaxdist.data import host_batches, make_source
from jaxdist.losses import DEFAULT_LOSS
from jaxdist.models import build_model
from jaxdist.optim import effective_lr, make_optimizer, make_schedule
from jaxdist.report import Reporter
from jaxdist.sharding import DeviceCountError, make_mesh
from jaxdist.step import init_state, make_train_step


def use_cpu_devices(count: int) -> None:
    """Emulates ``count`` CPU devices. Only possible before JAX initialises its backend."""
    if not count:
        return
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        devices = jax.devices()
        if devices[0].platform != "cpu" or len(devices) != count:
            raise ConfigError(
                f"--cpu-devices {count}: JAX's backend is already initialised with "
                f"{len(devices)} {devices[0].platform} devices; set it before any JAX operation "
                f"(or JAX_NUM_CPU_DEVICES={count} in the environment)"
            ) from None


def check_batch(global_batch_size: int, num_devices: int, grad_accum: int) -> int:
    """Returns the per-device batch; errors name the numbers that do not divide."""
    if global_batch_size % num_devices:
        raise ConfigError(
            f"--global-batch-size {global_batch_size} is not divisible by the "
            f"{num_devices} devices; use a multiple of {num_devices}"
        )
    per_device = global_batch_size // num_devices
    if per_device % grad_accum:
        raise ConfigError(
            f"per-device batch {per_device} (= {global_batch_size} / {num_devices} devices) "
            f"is not divisible by --grad-accum {grad_accum}"
        )
    return per_device


@dataclass
class Run:
    """Everything the loop needs, built once by ``setup``."""

    config: Config
    mesh: jax.sharding.Mesh
    task: str
    graphdef: object
    state: object  # device state, in the strategy's layout
    wired: strategies.Wired
    batches: object  # iterator of host-local numpy batches
    peak_lr: float
    history: list[dict] = field(default_factory=list)


def setup(config: Config) -> Run:
    cfg = config.train
    # --- devices and mesh
    use_cpu_devices(cfg.cpu_devices)
    mesh = make_mesh(cfg.num_devices)
    check_batch(cfg.global_batch_size, mesh.size, cfg.grad_accum)
    # --- model, loss, optimizer
    model, task = build_model(config.model, cfg.seed)
    schedule = make_schedule(config.optim, cfg.global_batch_size, cfg.steps)
    tx = make_optimizer(config.optim, schedule)
    graphdef, host_state = init_state(model, tx)
    # --- the one step, wired to devices by the strategy
    make_step = partial(make_train_step, graphdef, DEFAULT_LOSS[task], tx, schedule, cfg.grad_accum)
    wired = strategies.wire(cfg.strategy, make_step, mesh)
    # --- data: this process's rows of each global batch
    source = make_source(task, config.model, cfg.seed)
    batches = host_batches(
        source, cfg.global_batch_size, 0, jax.process_index(), jax.process_count()
    )
    return Run(
        config,
        mesh,
        task,
        graphdef,
        wired.put_state(host_state),
        wired,
        batches,
        effective_lr(config.optim, cfg.global_batch_size),
    )


def default_run_dir(config: Config) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", config.model.name)
    return Path("runs") / f"{name}-{config.train.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(config: Config, is_main: bool) -> Path:
    run_dir = Path(config.train.run_dir) if config.train.run_dir else default_run_dir(config)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run, not an append
        config_lib.save(config, run_dir / "config.yaml")
    return run_dir


def train(config: Config, *, write: bool = True, quiet: bool = False) -> Run:
    """Trains for ``config.train.steps`` optimizer steps; returns the finished Run.

    ``write=False`` keeps files out (tests); ``quiet=True`` prints nothing (benchmarks)."""
    cfg = config.train
    run = setup(config)
    is_main = jax.process_index() == 0
    run_dir = prepare_run_dir(config, is_main) if write else None
    report = Reporter(run_dir, cfg.steps, is_main and not quiet)
    per_device = cfg.global_batch_size // run.mesh.size
    report.print(
        f"jaxdist: {cfg.strategy} on {run.mesh.size} {run.mesh.devices.flat[0].platform} "
        f"device(s); global batch {cfg.global_batch_size} = {run.mesh.size} x {per_device} "
        f"(grad-accum {cfg.grad_accum}); effective lr {run.peak_lr:.3g} "
        f"({config.optim.lr_scaling} scaling)" + (f"; run dir {run_dir}" if run_dir else "")
    )

    # --- compile ahead, so step times exclude compilation
    batch = run.wired.put_batch(next(run.batches))
    t0 = time.perf_counter()
    step_fn = run.wired.step.lower(run.state, batch).compile()
    compile_s = time.perf_counter() - t0

    # --- loop
    seq_len = config.model.seq_len if run.task == "lm" else 0
    state, t_last, steps_since = run.state, time.perf_counter(), 0
    t_start = t_last
    for step in range(1, cfg.steps + 1):
        state, metrics = step_fn(state, batch)
        steps_since += 1
        if step < cfg.steps:
            batch = run.wired.put_batch(next(run.batches))
        if step % cfg.log_every == 0 or step == cfg.steps:
            values = run.wired.get_metrics(metrics)  # blocks until the step is done
            now = time.perf_counter()
            step_time = (now - t_last) / steps_since
            values.update(
                step=step, step_time_s=step_time, samples_per_s=cfg.global_batch_size / step_time
            )
            if seq_len:
                values["tokens_per_s"] = values["samples_per_s"] * seq_len
            run.history.append(values)
            report.log(values)
            t_last, steps_since = now, 0
    run.state = state
    report.close()
    last = run.history[-1]
    report.print(
        f"done: {cfg.steps} steps in {time.perf_counter() - t_start:.1f}s "
        f"(+{compile_s:.1f}s compile); loss {run.history[0]['loss']:.4f} -> {last['loss']:.4f}"
    )
    return run


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_lib.parse_args(argv)
        train(config)
    except (ConfigError, DeviceCountError) as err:
        print(f"jaxdist: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
