"""Which sinks the trainer's run reports to (``jaxdist.sinks``), and the event that
starts its loop."""

from __future__ import annotations

from functools import partial

import jax

import jaxdist
from jaxdist import config as config_lib
from jaxdist import config_checks, rundir
from jaxdist.config import Config
from jaxdist.loop import Run
from jaxdist.sinks import Sinks, Started


def make_sinks(config: Config, run: Run, quiet: bool, clock_start: float) -> Sinks:
    """Where the run's events go. Process 0: metrics.jsonl, goodput.json, TensorBoard
    (with a run directory) and the terminal (unless quiet); the profiler on process 0,
    or on every process with --profile-all-processes."""
    from jaxdist.sinks import GoodputFile, Ledger, MetricsFile, Profiler, TensorBoard, Terminal

    cfg, run_dir = config.train, run.run_dir
    resumed = run.begin.step or None  # metrics.jsonl is kept up to that step
    sinks = []
    is_main = jaxdist.is_main_process()
    write = run_dir is not None and is_main
    if write:
        sinks.append(MetricsFile(partial(rundir.create, run_dir, config, resumed)))
    goodput = GoodputFile(run_dir, clock_start) if write else Ledger(clock_start)
    sinks.append(goodput)
    if write and cfg.tensorboard:
        sinks.append(TensorBoard(run_dir / "tb"))
    if cfg.profile and run_dir is not None and (is_main or cfg.profile_all_processes):
        start, stop = config_checks.profile_range(cfg.profile, cfg.steps)
        index = jax.process_index()
        log_dir = run_dir / "profile" / (f"process_{index}" if index else "")
        sinks.append(Profiler(log_dir, start, stop))
    if is_main and not quiet:
        sinks.append(Terminal(goodput))
    return Sinks(sinks)


def started(config: Config, run: Run) -> Started:
    cfg, task = config.train, run.task
    return Started(
        total_steps=cfg.steps,
        first_step=run.begin.step + 1,
        config=config_lib.to_dict(config),
        samples_per_step=cfg.global_batch_size,
        tokens_per_step=cfg.global_batch_size * config.model.seq_len if task == "lm" else 0,
    )
