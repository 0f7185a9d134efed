"""``python -m jaxdist.train``: data-parallel training on every visible device.
``train()`` reads top to bottom: devices, mesh, model, optimizer, step, data, loop."""

from __future__ import annotations

import dataclasses
import gc
import time
from functools import partial
from pathlib import Path

import jax

import jaxdist
from jaxdist import data as data_lib
from jaxdist.checkpoint import lock, run_directory
from jaxdist.cluster import failures, leaving, peers
from jaxdist.cluster.preemption import Preempted, StopFlag
from jaxdist.cluster.shutdown import exit_now
from jaxdist.losses import default_eval
from jaxdist.parallel import axis_names, strategies
from jaxdist.parallel.device_mesh import batch_shards, parse_mesh
from jaxdist.parallel.strategies import pipeline
from jaxdist.sinks.goodput import process_clock_start
from jaxdist.train import build_data, ending, resume
from jaxdist.train import config as config_lib
from jaxdist.train.build_model import STACKED, model_factory, model_loss, model_task
from jaxdist.train.config import Config, ConfigError
from jaxdist.train.loop import Run, finish, loop
from jaxdist.train.optim import effective_lr, make_optimizer, make_schedule
from jaxdist.train.rules_file import load_rules
from jaxdist.train.run_health import RunHealth
from jaxdist.train.run_sinks import announce, make_sinks, prepare_sinks


def check_batch(global_batch_size: int, num_devices: int, grad_accum: int) -> int:
    """Returns the per-device batch (``num_devices``: the batch shards, data x fsdp x expert);
    errors name the numbers that do not divide."""
    if global_batch_size % num_devices:
        raise ConfigError(
            f"--global-batch-size {global_batch_size} is not divisible by the "
            f"{num_devices} devices (batch shards); use a multiple of {num_devices}"
        )
    per_device = global_batch_size // num_devices
    if per_device % grad_accum:
        raise ConfigError(
            f"per-device batch {per_device} (= {global_batch_size} / {num_devices} devices) "
            f"is not divisible by --grad-accum {grad_accum}"
        )
    return per_device


def setup(config: Config, write: bool = False) -> Run:
    """Built on jaxdist's public API only, as a user's own loop would be. ``write``: the
    run has a run directory (checked now), checkpoints, and resumes from them."""
    cfg = config.train
    # --- process group, devices, stop signals, health, run directory and mesh
    d = config.dist
    info = jaxdist.initialize(
        cpu_devices=cfg.cpu_devices,
        coordinator=d.coordinator,
        num_processes=d.num_processes,
        process_id=d.process_id,
        local_device_ids=d.local_device_ids,
        init_timeout=d.init_timeout,
        heartbeat_timeout=d.heartbeat_timeout,
        coordinator_bind_address=d.coordinator_bind_address,
        health=d.health,
        process_group=d.process_group,
    )
    stop = StopFlag()  # before data is prepared: a signal during set-up stops cleanly too
    health = RunHealth(config.dist, info)  # the watchdog watches set-up too
    print(f"[rank {info.process_index}] {info}", flush=True)  # one line per process
    run_dir = None
    try:
        resume.use_compile_cache(cfg.compile_cache, info.platform)
        run_dir, plan = resume.prepare_run_dir(config, write)
        health.watch.run_dir = run_dir
        if info.process_index == 0:  # a launcher records a death no process could
            failures.tell_launcher_run_dir(run_dir)
        with ending.in_run_dir(run_dir):
            # the same config, versions and counts on every process
            health.agree_setup(config_lib.to_dict(config), info)
            return _setup_run(config, info, stop, health, run_dir, plan)
    except BaseException:
        health.close(finished=False)  # this process goes on (a test, a notebook): unwatched
        lock.release(run_dir)  # and the lock goes, with a directory made only to hold it
        raise


def _setup_run(config, info, stop, health, run_dir, plan) -> Run:
    cfg = config.train
    if info.process_index == 0:  # the one that writes: an unwritable path fails now
        check_outputs(run_dir, cfg.save_params)
        prepare_sinks(cfg, run_dir)  # --wandb without its package or login: exit 2 now
    if cfg.num_devices and info.process_count > 1 and cfg.num_devices != info.device_count:
        raise ConfigError(
            f"--num-devices {cfg.num_devices}: with {info.process_count} processes every "
            f"device takes part; use all {info.device_count}"
        )
    mesh = make_mesh(cfg)
    strategies.layout(cfg.strategy, mesh, shard_optimizer=cfg.shard_optimizer)  # pmap's refusals
    shards = batch_shards(mesh)
    check_batch(cfg.global_batch_size, shards, cfg.grad_accum)
    if cfg.eval_every:
        check_batch(cfg.eval_batch_size or cfg.global_batch_size, shards, 1)
    # --- model factory, then data: checked before anything compiles
    task = model_task(config.model)
    model_factory(config.model, cfg.seed)  # its arguments checked before data is prepared
    resume.check_init_from(config.model, plan)  # and --init-from's file and map, if read
    data = load_data(config, task, info)
    # --- model, loss, optimizer, and the data-parallel step, the same on every process
    dp = make_step(config, task, data, mesh, health.faults.wrap_loss)
    health.agree_program(dp, data.batch_shapes(cfg.global_batch_size), run_dir)
    # The model is built inside jax.jit, or the newest good checkpoint restored into the
    # mesh's layout (from any layout or process count).
    begin = resume.start(dp, run_dir, plan, config, data)
    # --- input: this process's rows of each global batch from the next step on
    sampler = jaxdist.DistributedSampler(  # this data-parallel rank's rows
        len(data.train),
        cfg.global_batch_size,
        seed=cfg.seed,
        last_batch=config.data.last_batch,
        mesh=mesh,
    )
    batches = data_lib.Prefetcher(
        health.faults.wrap_batches(
            data_lib.host_batches(data.train, sampler, begin.step, config.data.data_workers),
            begin.step,
        ),
        put=partial(jaxdist.shard_batch, mesh=mesh),
        depth=config.data.prefetch,
    )
    peak_lr = effective_lr(config.optim, cfg.global_batch_size)
    return Run(
        config=config, info=info, mesh=mesh, task=task, dp=dp, state=begin.state, data=data,
        batches=batches, peak_lr=peak_lr, stop=stop, run_dir=run_dir, begin=begin,
        health=health,
    )  # fmt: skip


def check_outputs(run_dir: Path | None, save_params: str) -> None:
    if run_dir is not None:
        run_directory.check_writable(run_dir, "--run-dir", is_dir=True)
    if save_params:
        run_directory.check_writable(Path(save_params), "--save-params", is_dir=False)


def make_mesh(cfg: config_lib.TrainConfig, devices=None):
    """``--mesh data=2,fsdp=2,model=2`` over ``devices`` (default all; or the first
    ``--num-devices``); empty: every device on data. The product must be their count."""
    sizes = parse_mesh(cfg.mesh)
    devices = list(jax.devices() if devices is None else devices)
    if not sizes:
        return jaxdist.make_mesh(data=cfg.num_devices or -1, devices=devices)
    devices = devices[: cfg.num_devices] if cfg.num_devices else devices
    mesh = jaxdist.make_mesh(**{"data": -1, **sizes}, devices=devices)
    if mesh.size != len(devices):
        raise ConfigError(
            f"--mesh {cfg.mesh} has {mesh.size} devices but {len(devices)} are used; the "
            "product of the axis sizes must be the device count"
        )
    return mesh


def make_step(
    config: Config, task: str, data: build_data.Data, mesh, wrap_loss=lambda f: f
) -> jaxdist.Parallel:
    """The step, in the mesh's layout. The model goes in as a factory: Parallel builds it
    inside ``jax.jit``, directly in the strategy's layout."""
    cfg, d, model_config = config.train, config.data, config.model
    model_config = build_data.model_for(model_config, data, task)  # vocabulary, EOS
    if mesh.shape["stage"] > 1 and model_config.name in STACKED:  # stages split a stack
        model_config = dataclasses.replace(model_config, scan_layers=True)
    rules, logical_rules = load_rules(cfg.rules) if cfg.rules else (None, None)
    names = {**(logical_rules or {}), **axis_names.parse(cfg.axis_names)}  # the flag wins
    build = model_factory(model_config, cfg.seed)  # checks the factory's arguments now
    platform = mesh.devices.flat[0].platform
    loss = model_loss(model_config, task, d.npz_inputs, d.npz_labels, platform, cfg.shard_optimizer)
    loss_fn = wrap_loss(loss)
    schedule = make_schedule(config.optim, cfg.global_batch_size, cfg.steps)
    microbatches, why = cfg.microbatches, ""  # explicit: Parallel refuses one not dividing
    if not microbatches and mesh.shape["stage"] > 1:
        rows = cfg.global_batch_size // batch_shards(mesh) // cfg.grad_accum
        microbatches, why = pipeline.auto_microbatches(mesh.shape["stage"], rows)
    dp = jaxdist.Parallel(
        build,
        make_optimizer(config.optim, schedule),
        loss_fn,
        mesh=mesh,
        strategy=cfg.strategy,
        grad_accum=cfg.grad_accum,
        seed=cfg.seed,
        schedule=schedule,
        example_input=data_lib.model_input(task, data.train[[0]], d.npz_inputs),
        eval_fn=default_eval(task, d.npz_inputs, d.npz_labels),
        linen_train_arg=config.model.linen_train_arg or None,
        sync_batch_stats=cfg.sync_batch_stats,
        nan_policy=cfg.nan_policy,
        batch_check=data.row_check,
        rules=rules,
        axis_names=names,
        microbatches=microbatches,
        shard_optimizer=cfg.shard_optimizer,
        pipeline_schedule=cfg.pipeline_schedule,
        virtual_stages=cfg.virtual_stages,
        offload=tuple(filter(None, (x.strip() for x in cfg.offload.split(",")))),
    )
    if dp.pipeline and dp.pipeline.microbatches and why:  # the first log line says why
        dp.pipeline = dataclasses.replace(dp.pipeline, why=why)
    return dp


def load_data(config: Config, task: str, info: jaxdist.ProcessInfo) -> build_data.Data:
    """The train and held-out sources, with the checks that need their sizes."""
    cfg = config.train
    data = build_data.build(config, task, progress=info.process_index == 0)
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


def train(
    config: Config, *, write: bool = True, quiet: bool = False, clock_start: float | None = None
) -> Run:
    """Trains for ``config.train.steps`` optimizer steps; returns the finished Run.

    ``write=False`` keeps files out (tests); ``quiet=True`` prints nothing (benchmarks);
    ``clock_start``: the ``time.perf_counter()`` reading goodput's wall time starts at
    (default: now; the command passes its process's start)."""
    clock_start = time.perf_counter() if clock_start is None else clock_start
    run = setup(config, write)
    # Set-up's objects (modules, traced programs) live on: while the loop runs, collections
    # skip them (a full collection of them paused it for ~85 ms). Unfrozen after it, so
    # that a process training again (tests, notebooks) can free this run's cycles.
    gc.collect()  # set-up time, before the run's clock says it started
    gc.freeze()
    try:
        return _run(run, config, quiet, clock_start)
    finally:
        gc.unfreeze()
        lock.release(run.run_dir)  # the run ended (or stopped, or failed): the next may start


def _run(run: Run, config: Config, quiet: bool, clock_start: float) -> Run:
    """The loop of a set-up run, its reporting and its ending."""
    sinks = make_sinks(config, run, quiet, clock_start)
    run.health.watch_writes(run.dp, sinks)  # a stalled file system is a hang too
    announce(run, sinks)  # what runs where, the deadlines, a resume
    try:
        with ending.in_run_dir(run.run_dir):
            stopped_at = loop(run, sinks)
        finish(run, sinks, stopped_at)
    except BaseException as err:
        # The run's own ending (seen alike by every process: bad input, a non-finite step,
        # a checkpoint's agreed failure...), or else a failed collective: a peer died?
        code = ending.code_of(err)
        if code is not None:
            leaving.expect_exit(code)  # a peer's exit or a SIGTERM meanwhile changes nothing
        run.batches.close()
        run.stop.close()
        sinks.close(failing=True)
        multi = run.info.process_count > 1
        if multi and isinstance(err, Exception) and code is None:
            # A collective failed: a peer died. Name it and exit now; JAX's shutdown
            # barrier would otherwise wait a whole heartbeat timeout and then abort.
            lock.release(run.run_dir)  # that exit skips every finally
            peers.on_collective_error(err)
        run.health.close(finished=False)
        raise
    run.health.close(finished=True)
    if stopped_at is not None:
        checkpoints = run.run_dir / run_directory.CHECKPOINTS if run.run_dir else None
        raise Preempted(stopped_at, run.stop.requested_by, checkpoints, run.run_dir)
    return run


def main(argv: list[str] | None = None) -> int:
    """The command: its exit code (``jaxdist.cluster.failures``; ``jaxdist.train.ending``)."""
    return ending.run(_command, argv, clock_start=process_clock_start())


def _command(config: Config, clock_start: float):
    from jaxdist.train.dry_run import dry_run  # it builds on this module: imported here

    return dry_run(config) if config.train.dry_run else train(config, clock_start=clock_start)


if __name__ == "__main__":
    exit_now(main())
