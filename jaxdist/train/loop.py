"""The training loop of ``python -m jaxdist.train``: steps, per-step health checks, log
records and evaluation, on a ``Run`` that ``jaxdist.train.setup`` built. What it reports
goes out as events (``jaxdist.sinks.events``) to the run's sinks."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

import jaxdist
from jaxdist import data as data_lib
from jaxdist import flops as flops_lib
from jaxdist.checkpoint import run_directory
from jaxdist.checkpoint.io_errors import StorageError
from jaxdist.cluster import failures
from jaxdist.cluster.preemption import StopFlag
from jaxdist.losses import eval_metrics
from jaxdist.sinks import Sinks
from jaxdist.sinks.events import (
    CheckpointSaved,
    Compiled,
    EvalMetrics,
    StepFlops,
    StepMetrics,
    StepStarting,
    Stopped,
)
from jaxdist.train import build_data, resume
from jaxdist.train.config import Config
from jaxdist.train.run_health import RunHealth


@dataclass
class Run:
    """Everything the loop needs, built once by ``setup``."""

    config: Config
    info: jaxdist.ProcessInfo
    mesh: jax.sharding.Mesh
    task: str
    dp: jaxdist.Parallel
    state: jaxdist.TrainState  # on the devices, in the strategy's layout
    data: build_data.Data
    batches: data_lib.Prefetcher  # device batches, built ahead in a background thread
    peak_lr: float
    stop: StopFlag  # SIGUSR1/SIGTERM: every process stops after the same step
    run_dir: Path | None  # None: no files, no checkpoints
    begin: resume.Start  # the step the loop starts after (0, or a restored checkpoint's)
    health: RunHealth  # the watchdog's phases, replica checks, injected faults
    history: list[dict] = field(default_factory=list)
    skipped: int = 0  # steps whose update --nan-policy skip left out
    compile_s: float = 0.0  # the first step, with compilation
    elapsed_s: float = 0.0  # the whole loop
    flops: StepFlops | None = None  # FLOPs per step and peak, known after the first step
    saves: int = 0  # checkpoints started
    evaluations: int = 0


@dataclass
class Dispatched:
    """A step handed to the devices, not checked yet."""

    step: int
    metrics: dict  # device arrays
    batch: dict  # the first step's FLOPs are read from its program
    wait_s: float  # waiting for its batch
    logged: bool  # a metrics.jsonl record


@dataclass
class Window:
    """The steps since the last log record: their count, wall time and data wait."""

    start_s: float  # perf_counter at the previous record (pauses added: saves, evaluations)
    steps: int = 0
    waited_s: float = 0.0


def loop(run: Run, sinks: Sinks) -> int | None:
    """The training loop from the step after ``run.begin.step``; returns the step it
    stopped after on a stop signal (a checkpoint of it saved), or None.

    The host keeps one step queued ahead of the devices: step k is checked (and logged)
    after step k + 1 is dispatched, so the host's bookkeeping overlaps the devices' work.
    Only what needs step k's result or its state now waits for it: the first step (it
    compiles), the last, a checkpoint, an evaluation, a replica check."""
    cfg = run.config.train
    state, pending = run.state, None
    t_start = time.perf_counter()
    window = Window(t_start)
    first = run.begin.step + 1
    watch = run.health.watch  # a phase's deadline runs from its start (the first: compiles)
    for step in range(first, cfg.steps + 1):
        sinks.emit(StepStarting(step))
        watch.phase("data", step, slow=step == first)
        batch, wait_s = next(run.batches)  # built and on the devices already, normally
        state = run.health.faults.before_step(step, state)
        watch.phase("step", step, slow=step == first)
        state, metrics = run.dp.step(state, batch)
        if pending is not None:  # the step before, while this one is queued behind it
            finish_step(run, sinks, pending, window)
        stop_after = run.stop.stop_after(step)  # the same step on every process
        stopping = stop_after is not None and step >= stop_after
        last = step == cfg.steps or stopping
        eval_now = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
        logged = step == first or step % cfg.log_every == 0 or last or eval_now
        pending = Dispatched(step, metrics, batch, wait_s, bool(logged))
        saving = last or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        compare = run.health.wants_check(step, saving=saving)
        if step == first:  # the replica check compiles with the first step (compile time)
            watch.phase("check", step, slow=True)
            run.health.prepare_checks(run.dp, state)
        if step == first or last or eval_now or saving or compare:  # this step's end, now
            finish_step(run, sinks, pending, window, state if eval_now else None)
            pending = None
        # Replica checks: step time, or the checkpoint's when before a save.
        checked_s = check_replicas(run, state, step) if compare else 0.0
        if saving:  # not step time; the last: on disk
            window.start_s += save(run, state, step, sinks, wait=last, checked_s=checked_s)
        if stopping:
            run.state, run.elapsed_s = state, time.perf_counter() - t_start
            return step
    # Every step has been checked: the last one is always logged.
    run.state, run.elapsed_s = state, time.perf_counter() - t_start
    return None


def finish_step(run: Run, sinks: Sinks, done: Dispatched, window: Window, state=None) -> None:
    """Checks a dispatched step (waits for it) and, if due, emits its log record;
    ``state``: the state after it, for an evaluation at this step."""
    check(run, done.step, done.metrics)
    window.steps, window.waited_s = window.steps + 1, window.waited_s + done.wait_s
    if not done.logged:
        return
    ended_s = time.perf_counter()  # the step is over: the window's wall time ends here
    compiling = done.step == run.begin.step + 1  # the first step also compiles: timed apart
    if compiling:
        run.flops = flops_lib.for_run(run, done.batch)  # its compiled step: cached
        run.compile_s = ended_s - window.start_s
        sinks.emit(Compiled(done.step, run.compile_s, run.flops))
    values = log_values(run, done.metrics, done.step, window, ended_s, compiling)
    if state is not None:
        values.update(evaluate_at(run, state, done.step, sinks))
    run.history.append(values)
    timed_s = run.compile_s if compiling else ended_s - window.start_s
    sinks.emit(StepMetrics(done.step, values, window.steps, timed_s, window.waited_s, compiling))
    # The next window starts where this one ended: the host's logging overlaps the queued
    # step and is part of step time. An evaluation and the first step's FLOPs are not.
    paused = compiling or state is not None
    window.start_s, window.steps, window.waited_s = (
        time.perf_counter() if paused else ended_s,
        0,
        0.0,
    )


def save(run: Run, state, step: int, sinks: Sinks, *, wait: bool, checked_s: float) -> float:
    """Starts a checkpoint of ``state`` (every process; the loop waits only while the
    arrays are copied off the devices), or with ``wait`` finishes it before returning;
    returns the seconds the loop was blocked, the replica check just before it
    (``checked_s``) included."""
    if run.run_dir is None:
        return 0.0
    started = time.perf_counter() - checked_s
    extra = resume.extra(run.config, step, run.data)
    run.health.watch.phase("save", step)
    with run.stop.busy():
        checkpoints = run.run_dir / run_directory.CHECKPOINTS
        for _ in range(2):  # again if what failed was an earlier checkpoint's write
            try:
                keep, deadline_s = run.config.train.keep, run.config.dist.slow_phase_timeout
                run.dp.save(state, checkpoints, extra=extra, keep=keep, deadline_s=deadline_s)
                if wait:
                    run.dp.wait_for_saves()
                break
            except StorageError as err:
                saving_failed(run, err, last=wait and err.step == step)
                if err.step == step:
                    break
    run.saves += 1
    blocked_s = time.perf_counter() - started
    sinks.emit(CheckpointSaved(step, blocked_s=blocked_s))
    return blocked_s


def saving_failed(run: Run, err: StorageError, *, last: bool) -> None:
    """A checkpoint that could not be written ends the run (exit 74), naming the newest
    complete one, which is untouched; with ``--checkpoint-failures continue`` training
    goes on (said, and recorded in failures.jsonl) unless it was the last checkpoint."""
    if run.config.train.checkpoint_failures == "stop" or last:
        raise err  # the command names the newest complete checkpoint (ending.py)
    steps = run_directory.checkpoint_steps(run.run_dir)
    newest = f"step {steps[0]}" if steps else "none"
    message = (
        f"{err}; training goes on (--checkpoint-failures continue); the newest complete "
        f"checkpoint: {newest}"
    )
    jaxdist.print_main(f"jaxdist: warning: {message}")
    if jaxdist.is_main_process():
        failures.record(
            run.run_dir,
            failures.Failure(
                "storage", message, step=err.step, host=failures.hostname(), recovered=True
            ),  # fmt: skip
        )


def check(run: Run, step: int, metrics) -> None:
    """Raises for a step with bad rows or (``--nan-policy halt``) a non-finite update;
    counts the steps ``--nan-policy skip`` left out. Waits for the step: its end is
    progress for the watchdog."""
    if run.dp.check(metrics, step):
        run.skipped += 1
    run.health.watch.completed(step)


def check_replicas(run: Run, state, step: int) -> float:
    """The replica fingerprints (``--check-replicas-every``, and before a checkpoint);
    returns the seconds it took (not step time). The first compiles: a slow phase."""
    started = time.perf_counter()
    run.health.watch.phase("check", step, slow=run.health.first_check)
    run.health.check_replicas(run.dp, state, step)
    return time.perf_counter() - started


def log_values(run: Run, metrics, step: int, window: Window, ended_s: float, compiling) -> dict:
    """One metrics.jsonl record: the step's metrics, speed, MFU, device memory and data
    wait, for the ``window`` of steps that ended at ``ended_s``."""
    cfg = run.config.train
    values = run.dp.metrics(metrics)  # the step has finished: it was checked
    step_time = run.compile_s if compiling else (ended_s - window.start_s) / window.steps
    values.update(
        step=step,
        step_time_s=step_time,
        samples_per_s=cfg.global_batch_size / step_time,
        skipped_steps=run.skipped,
    )
    if run.task == "lm":
        values["tokens_per_s"] = values["samples_per_s"] * run.config.model.seq_len
    if not compiling:  # the time the step waited for input, per step and as a share
        values["data_wait_s"] = window.waited_s / window.steps
        values["data_wait_frac"] = window.waited_s / (ended_s - window.start_s)
        mfu = run.flops.mfu(step_time) if run.flops else None
        if mfu is not None:
            values["mfu"] = mfu
    memory_gb = flops_lib.device_memory_gb()
    if memory_gb is not None:
        values["memory_gb"] = memory_gb
    return values


def evaluate_at(run: Run, state, step: int, sinks: Sinks) -> dict[str, float]:
    """The held-out metrics (``eval_*``), timed and emitted."""
    started = time.perf_counter()
    with run.stop.busy():
        held_out = evaluate(run, state)
    values = {k.removeprefix("eval_"): v for k, v in held_out.items()}
    sinks.emit(EvalMetrics(step, values, time.perf_counter() - started))
    return held_out


def evaluate(run: Run, state) -> dict[str, float]:
    """The held-out metrics: every example counted once (padding masked), on any mesh."""
    cfg = run.config.train
    sampler = jaxdist.EvalSampler(
        len(run.data.eval), cfg.eval_batch_size or cfg.global_batch_size, mesh=run.mesh
    )
    totals: dict[str, float] = {}
    batches = data_lib.eval_batches(run.data.eval, sampler)
    for host_batch in itertools.islice(batches, cfg.eval_batches or None):
        # Each batch is progress; the first of the run compiles the evaluation step.
        run.health.watch.phase("eval", run.evaluations, slow=not run.evaluations)
        sums = run.dp.evaluate(state, jaxdist.shard_batch(host_batch, run.mesh))
        run.evaluations += 1
        for name, value in sums.items():  # summed in float64 on the host
            totals[name] = totals.get(name, 0.0) + value
    return eval_metrics(totals, run.data.byte_level)


def finish(run: Run, sinks, stopped_at: int | None) -> None:
    """After the loop: the last checkpoint on disk, the params saved, the summary."""
    cfg = run.config.train
    run.batches.close()
    run.stop.close()
    run.health.watch.phase("save", stopped_at or cfg.steps)  # the last step trained
    run.dp.wait_for_saves()  # the last checkpoint is on disk before we say done
    if cfg.save_params and stopped_at is None:
        # every process: sharded arrays are gathered; a stack saved per layer, as checkpoints
        params = run.dp.host_params(run.state, per_layer=True)
        if jaxdist.is_main_process():
            Path(cfg.save_params).parent.mkdir(parents=True, exist_ok=True)
            np.savez(cfg.save_params, **params)
    sinks.emit(Stopped(run.history[-1]["step"] if run.history else run.begin.step,
                       early=stopped_at is not None))  # fmt: skip
    sinks.close()
