"""Which sinks the trainer's run reports to (``jaxdist.sinks``), and what opens its
loop: the lines saying what runs where, and the ``Started`` event."""

from __future__ import annotations

from functools import partial

import jax

import jaxdist
from jaxdist.checkpoint import run_directory
from jaxdist.parallel.device_mesh import batch_shards
from jaxdist.sinks import Note, Resumed, Sinks, Started
from jaxdist.sinks.events import DataChanged
from jaxdist.train import config as config_lib
from jaxdist.train import config_checks
from jaxdist.train.config import Config
from jaxdist.train.loop import Run
from jaxdist.train.optim import warmup_note


def make_sinks(config: Config, run: Run, quiet: bool, clock_start: float) -> Sinks:
    """Where the run's events go. Process 0: metrics.jsonl, goodput.json, TensorBoard and
    W&B (with a run directory) and the terminal (unless quiet); the profiler on process
    0, or on every process with --profile-all-processes."""
    from jaxdist.sinks import GoodputFile, Ledger, MetricsFile, Profiler, TensorBoard, Terminal

    cfg, run_dir = config.train, run.run_dir
    resumed = run.begin.step or None  # metrics.jsonl is kept up to that step
    sinks = []
    is_main = jaxdist.is_main_process()
    write = run_dir is not None and is_main
    if write:
        sinks.append(
            MetricsFile(
                partial(run_directory.create, run_dir, partial(config_lib.save, config), resumed)
            )
        )
    goodput = GoodputFile(run_dir, clock_start) if write else Ledger(clock_start)
    sinks.append(goodput)
    if write and cfg.tensorboard:
        sinks.append(TensorBoard(run_dir / "tb"))
    if write and cfg.wandb:  # the same scalars to W&B; prepare_sinks checked the package
        from jaxdist.sinks.wandb_run import WandbRun, parse_target

        sinks.append(WandbRun(run_dir, *parse_target(cfg.wandb)))
    if cfg.profile and run_dir is not None and (is_main or cfg.profile_all_processes):
        start, stop = config_checks.profile_range(cfg.profile, cfg.steps)
        index = jax.process_index()
        log_dir = run_dir / "profile" / (f"process_{index}" if index else "")
        sinks.append(Profiler(log_dir, start, stop))
    if is_main and not quiet:
        sinks.append(Terminal(goodput))
    return Sinks(sinks, background=True)  # files and lines written off the loop's thread


def prepare_sinks(cfg: config_lib.TrainConfig, run_dir) -> None:
    """At set-up, on process 0 (which reports), before data is prepared: what a sink
    needs that may be missing (--wandb: its package, a login) is a ConfigError now,
    not at the first logged step."""
    if cfg.wandb and run_dir is not None:  # no run directory: no W&B
        from jaxdist.sinks import wandb_run

        wandb_run.prepare()


def started(config: Config, run: Run) -> Started:
    cfg, task = config.train, run.task
    return Started(
        total_steps=cfg.steps,
        first_step=run.begin.step + 1,
        config=config_lib.to_dict(config),
        samples_per_step=cfg.global_batch_size,
        tokens_per_step=cfg.global_batch_size * config.model.seq_len if task == "lm" else 0,
    )


def announce(run: Run, sinks) -> None:
    """The lines that open a run: layout and batch, health's deadlines, a resume."""
    cfg, run_dir = run.config.train, run.run_dir
    shards = batch_shards(run.mesh)
    sinks.emit(
        Note(
            f"jaxdist: {cfg.strategy} on {run.mesh.size} {run.info.platform} device(s) in "
            f"{run.info.process_count} process(es); global batch {cfg.global_batch_size} = "
            f"{shards} x {cfg.global_batch_size // shards} (grad-accum {cfg.grad_accum}); "
            f"effective lr {run.peak_lr:.3g} ({run.config.optim.lr_scaling} scaling)"
            + (f"; {run.dp.pipeline.describe()}" if run.dp.pipeline else "")
            + (f"; run dir {run_dir}" if run_dir else "")
        )
    )
    sinks.emit(Note(f"jaxdist: {run.health.describe()}"))
    cut = warmup_note(run.config.optim, cfg.steps)
    if cut:
        sinks.emit(Note(f"jaxdist: {cut}"))
    if held_out := eval_note(run):
        sinks.emit(Note(f"jaxdist: {held_out}"))
    if run.begin.step or run.begin.earlier_last_step:  # resumed, or restarted from step 0
        sinks.emit(Resumed(run.begin.step, earlier_last_step=run.begin.earlier_last_step))
    for role, saved, found in run.begin.data_changed:  # --data-changed ok: on the record
        sinks.emit(DataChanged(run.begin.step, role, saved, found))
    if run.begin.step:
        sinks.emit(Note(f"resumed from the checkpoint of step {run.begin.step} in {run_dir}"))
    sinks.emit(started(run.config, run))


def eval_note(run: Run) -> str | None:
    """The start-up line of ``--eval-batches``: how much of the held-out set is read."""
    cfg = run.config.train
    if not cfg.eval_batches:
        return None
    if not cfg.eval_every:
        return f"--eval-batches {cfg.eval_batches} does nothing without --eval-every"
    size = cfg.eval_batch_size or cfg.global_batch_size
    total = jaxdist.EvalSampler(len(run.data.eval), size, mesh=run.mesh).steps  # last padded
    if cfg.eval_batches >= total:
        return f"--eval-batches {cfg.eval_batches}: all {total} held-out batches of {size}"
    return (
        f"each evaluation reads the first {cfg.eval_batches} of the held-out set's {total} "
        f"batches of {size} (--eval-batches): eval_loss is theirs, not the whole set's"
    )
