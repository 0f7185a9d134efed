"""``python -m jaxdist.train``: data-parallel training on every visible device.

``train()`` reads top to bottom: devices, mesh, model, optimizer, step, data, loop.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import jax
import numpy as np

import jaxdist
from jaxdist import config as config_lib
from jaxdist import data as data_lib
from jaxdist.config import Config, ConfigError
from jaxdist.losses import DEFAULT_EVAL, DEFAULT_LOSS, eval_metrics
from jaxdist.models import build_model, import_object, model_task
from jaxdist.optim import effective_lr, make_optimizer, make_schedule
from jaxdist.preempt import EXIT_PREEMPTED, StopFlag
from jaxdist.process import EXIT_PEER_FAILURE, exit_now
from jaxdist.report import Reporter


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
    info: jaxdist.ProcessInfo
    mesh: jax.sharding.Mesh
    task: str
    dp: jaxdist.DataParallel
    state: jaxdist.TrainState  # on the devices, in the strategy's layout
    data: data_lib.Data
    batches: data_lib.Prefetcher  # device batches, built ahead in a background thread
    peak_lr: float
    history: list[dict] = field(default_factory=list)
    compile_s: float = 0.0  # the first step, with compilation
    elapsed_s: float = 0.0  # the whole loop


def setup(config: Config) -> Run:
    """Built on jaxdist's public API only, as a user's own loop would be."""
    cfg = config.train
    # --- process group, devices and mesh
    d = config.dist
    info = jaxdist.initialize(
        cpu_devices=cfg.cpu_devices,
        coordinator=d.coordinator,
        num_processes=d.num_processes,
        process_id=d.process_id,
        local_device_ids=d.local_device_ids,
        init_timeout=d.init_timeout,
        heartbeat_timeout=d.heartbeat_timeout,
    )
    print(f"[rank {info.process_index}] {info}", flush=True)  # one line per process
    if cfg.num_devices and info.process_count > 1 and cfg.num_devices != info.device_count:
        raise ConfigError(
            f"--num-devices {cfg.num_devices}: with {info.process_count} processes every "
            f"device takes part; use all {info.device_count}"
        )
    mesh = jaxdist.make_mesh(data=cfg.num_devices or -1)
    check_batch(cfg.global_batch_size, mesh.size, cfg.grad_accum)
    if cfg.eval_every:
        check_batch(cfg.eval_batch_size or cfg.global_batch_size, mesh.size, 1)
    # --- data: sources checked before anything compiles
    task = model_task(config.model)
    data = load_data(config, task, info)
    # --- model, loss, optimizer, and the data-parallel step
    model_config = config.model
    if task == "lm" and not model_config.vocab_size:
        model_config = dataclasses.replace(model_config, vocab_size=data.vocab_size)
    model, _ = build_model(model_config, cfg.seed)
    loss_fn = import_object(config.model.loss, "--loss") if config.model.loss else None
    schedule = make_schedule(config.optim, cfg.global_batch_size, cfg.steps)
    dp = jaxdist.DataParallel(
        model,
        make_optimizer(config.optim, schedule),
        loss_fn or DEFAULT_LOSS[task],
        mesh=mesh,
        strategy=cfg.strategy,
        grad_accum=cfg.grad_accum,
        seed=cfg.seed,
        schedule=schedule,
        example_input=data_lib.model_input(task, data.train[[0]]),
        eval_fn=DEFAULT_EVAL[task],
    )
    # --- input: this process's rows of each global batch, on the devices ahead of use
    sampler = jaxdist.DistributedSampler(
        len(data.train), cfg.global_batch_size, seed=cfg.seed, last_batch=config.data.last_batch
    )
    batches = data_lib.Prefetcher(
        data_lib.host_batches(data.train, sampler),
        put=partial(jaxdist.shard_batch, mesh=mesh),
        depth=config.data.prefetch,
    )
    peak_lr = effective_lr(config.optim, cfg.global_batch_size)
    return Run(config, info, mesh, task, dp, dp.init_state(), data, batches, peak_lr)


def load_data(config: Config, task: str, info: jaxdist.ProcessInfo) -> data_lib.Data:
    """The train and held-out sources, with the checks that need their sizes."""
    cfg = config.train
    data = data_lib.build(config, task, progress=info.process_index == 0)
    if cfg.eval_every and data.eval is None:
        raise ConfigError(
            f"--eval-every {cfg.eval_every}: {data.description} has no held-out "
            "set; give one with --eval-data"
        )
    if len(data.train) < cfg.global_batch_size:
        unit = f"windows of {config.model.seq_len + 1} tokens" if task == "lm" else "examples"
        raise ConfigError(
            f"--data {data.description}: {len(data.train)} {unit} are fewer than one global "
            f"batch of {cfg.global_batch_size}"
        )
    return data


def evaluate(run: Run, state) -> dict[str, float]:
    """The held-out metrics: every example counted once (padding masked), on any mesh."""
    cfg = run.config.train
    sampler = jaxdist.EvalSampler(len(run.data.eval), cfg.eval_batch_size or cfg.global_batch_size)
    totals: dict[str, float] = {}
    for host_batch in data_lib.eval_batches(run.data.eval, sampler):
        sums = run.dp.evaluate(state, jaxdist.shard_batch(host_batch, run.mesh))
        for name, value in sums.items():  # summed in float64 on the host
            totals[name] = totals.get(name, 0.0) + value
    return eval_metrics(totals, run.data.byte_level)


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
    is_main = jaxdist.is_main_process()
    run_dir = prepare_run_dir(config, is_main) if write else None
    report = Reporter(run_dir, cfg.steps, is_main and not quiet)
    per_device = cfg.global_batch_size // run.mesh.size
    report.print(
        f"jaxdist: {cfg.strategy} on {run.mesh.size} {run.info.platform} device(s) in "
        f"{run.info.process_count} process(es); global batch {cfg.global_batch_size} = "
        f"{run.mesh.size} x {per_device} (grad-accum {cfg.grad_accum}); effective lr "
        f"{run.peak_lr:.3g} ({config.optim.lr_scaling} scaling)"
        + (f"; run dir {run_dir}" if run_dir else "")
    )
    stop = StopFlag()
    try:
        stopped_at = loop(run, report, stop)
    except Exception as err:
        run.batches.close()
        if run.info.process_count == 1:
            raise
        # A collective failed: a peer died. Exit now; JAX's shutdown barrier would otherwise
        # wait a whole heartbeat timeout and then abort.
        print(
            f"[rank {run.info.process_index}] jaxdist: error: {type(err).__name__}: {err}; "
            "a peer process probably died",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER_FAILURE)
    run.batches.close()
    report.close()
    if cfg.save_params and is_main:
        np.savez(cfg.save_params, **run.dp.host_params(run.state))
    first, last = run.history[0]["loss"], run.history[-1]["loss"]
    report.print(
        f"done: {run.history[-1]['step']} steps in {run.elapsed_s:.1f}s (first step, "
        f"with compilation: {run.compile_s:.1f}s); loss {first:.4f} -> {last:.4f}"
    )
    if stopped_at is not None:
        raise Preempted(stopped_at)
    return run


def loop(run: Run, report: Reporter, stop: StopFlag) -> int | None:
    """The training loop; returns the step it stopped at early on a signal, or None."""
    cfg = run.config.train
    seq_len = run.config.model.seq_len if run.task == "lm" else 0
    state, previous_loss = run.state, None
    steps_since, waited_s = 0, 0.0  # since the last log line
    t_start = t_last = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        batch, wait_s = next(run.batches)  # built and on the devices already, normally
        state, metrics = run.dp.step(state, batch)
        if previous_loss is not None:
            # At most one step ahead of the devices: then time spent waiting for data is
            # time the devices might have idled, not time the loop ran ahead.
            jax.block_until_ready(previous_loss)
        previous_loss = metrics["loss"]
        steps_since, waited_s = steps_since + 1, waited_s + wait_s
        if step == 1:  # the first step also compiles: timed apart
            jax.block_until_ready(metrics)
            t_last = time.perf_counter()
            run.compile_s, steps_since, waited_s = t_last - t_start, 0, 0.0
        eval_now = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
        if step % cfg.log_every == 0 or step == cfg.steps or eval_now:
            values = run.dp.metrics(metrics)  # waits for the step to finish
            now = time.perf_counter()
            step_time = run.compile_s if step == 1 else (now - t_last) / steps_since
            values.update(
                step=step, step_time_s=step_time, samples_per_s=cfg.global_batch_size / step_time
            )
            if seq_len:
                values["tokens_per_s"] = values["samples_per_s"] * seq_len
            if step > 1:  # the time the step waited for input, per step and as a share
                values["data_wait_s"] = waited_s / steps_since
                values["data_wait_frac"] = waited_s / (now - t_last)
            if eval_now:
                values.update(evaluate(run, state))
                now = time.perf_counter()  # evaluation is not training time
            run.history.append(values)
            report.log(values)
            t_last, steps_since, waited_s = now, 0, 0.0
            if step < cfg.steps and stop.agreed():
                run.state, run.elapsed_s = state, time.perf_counter() - t_start
                return step
    run.state, run.elapsed_s = state, time.perf_counter() - t_start
    return None


class Preempted(Exception):
    def __init__(self, step: int):
        super().__init__(f"stopped at step {step} on SIGUSR1 (preemption); exit {EXIT_PREEMPTED}")


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_lib.parse_args(argv)
        train(config)
    except jaxdist.JaxdistError as err:
        print(f"{rank_prefix()}jaxdist: error: {err}", file=sys.stderr, flush=True)
        return 2
    except Preempted as stop:
        print(f"{rank_prefix()}jaxdist: {stop}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return 0


def rank_prefix() -> str:
    """``[rank N] `` once the process group exists with several processes, else ``""``."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        return f"[rank {jax.process_index()}] "
    return ""


if __name__ == "__main__":
    exit_now(main())
