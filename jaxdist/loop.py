"""The training loop of ``python -m jaxdist.train``: steps, per-step health checks, log
records and evaluation, on a ``Run`` that ``jaxdist.train.setup`` built."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import jax

import jaxdist
from jaxdist import data as data_lib
from jaxdist import resume, rundir
from jaxdist.config import Config
from jaxdist.losses import eval_metrics
from jaxdist.preempt import StopFlag
from jaxdist.report import Reporter


@dataclass
class Run:
    """Everything the loop needs, built once by ``setup``."""

    config: Config
    info: jaxdist.ProcessInfo
    mesh: jax.sharding.Mesh
    task: str
    dp: jaxdist.Parallel
    state: jaxdist.TrainState  # on the devices, in the strategy's layout
    data: data_lib.Data
    batches: data_lib.Prefetcher  # device batches, built ahead in a background thread
    peak_lr: float
    stop: StopFlag  # SIGUSR1/SIGTERM: every process stops after the same step
    run_dir: Path | None  # None: no files, no checkpoints
    begin: resume.Start  # the step the loop starts after (0, or a restored checkpoint's)
    history: list[dict] = field(default_factory=list)
    skipped: int = 0  # steps whose update --nan-policy skip left out
    compile_s: float = 0.0  # the first step, with compilation
    elapsed_s: float = 0.0  # the whole loop
    saves: int = 0  # checkpoints started
    save_blocked_s: float = 0.0  # time the loop waited for them (copies off the devices)


def loop(run: Run, report: Reporter) -> int | None:
    """The training loop from the step after ``run.begin.step``; returns the step it
    stopped after on a stop signal (a checkpoint of it saved), or None."""
    cfg = run.config.train
    state, pending = run.state, None  # pending: (step, metrics) not checked yet
    steps_since, waited_s = 0, 0.0  # since the last log line
    t_start = t_last = time.perf_counter()
    first = run.begin.step + 1
    for step in range(first, cfg.steps + 1):
        batch, wait_s = next(run.batches)  # built and on the devices already, normally
        state, metrics = run.dp.step(state, batch)
        stop_after = run.stop.stop_after(step)  # the same step on every process
        stopping = stop_after is not None and step >= stop_after
        if pending is not None:
            # One step behind: reading the previous step's health waits for it, so the loop
            # stays at most one step ahead of the devices (time spent waiting for data is
            # then time the devices might have idled) and a bad step stops the run at once.
            check(run, *pending)
        pending = (step, metrics)
        steps_since, waited_s = steps_since + 1, waited_s + wait_s
        last = step == cfg.steps or stopping
        eval_now = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
        if step == first or step % cfg.log_every == 0 or last or eval_now:
            check(run, *pending)  # waits for this step
            pending = None
            if step == first:  # the first step also compiles: timed apart
                t_last = time.perf_counter()
                run.compile_s, steps_since, waited_s = t_last - t_start, 0, 0.0
            values = log_values(run, state, metrics, step, steps_since, waited_s, t_last)
            run.history.append(values)
            report.log(values)
            t_last, steps_since, waited_s = time.perf_counter(), 0, 0.0
        if last or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            if pending is not None:  # a checkpoint holds checked steps only
                check(run, *pending)
                pending = None
            with run.stop.busy():
                save(run, state, step, wait=stopping)
        if stopping:
            run.state, run.elapsed_s = state, time.perf_counter() - t_start
            return step
    # Every step has been checked: the last one is always logged.
    run.state, run.elapsed_s = state, time.perf_counter() - t_start
    return None


def save(run: Run, state, step: int, *, wait: bool) -> None:
    """Starts a checkpoint of ``state`` (every process; the loop waits only while the
    arrays are copied off the devices), or with ``wait`` finishes it before returning."""
    if run.run_dir is None:
        return
    started = time.perf_counter()
    extra = resume.extra(run.config, step, len(run.data.train))
    run.dp.save(state, run.run_dir / rundir.CHECKPOINTS, extra=extra, keep=run.config.train.keep)
    if wait:
        run.dp.wait_for_saves()
    run.saves += 1
    run.save_blocked_s += time.perf_counter() - started


def check(run: Run, step: int, metrics) -> None:
    """Raises for a step with bad rows or (``--nan-policy halt``) a non-finite update;
    counts the steps ``--nan-policy skip`` left out."""
    if run.dp.check(metrics, step):
        run.skipped += 1


def log_values(run: Run, state, metrics, step, steps_since, waited_s, t_last) -> dict:
    """One metrics.jsonl record: the step's metrics, speed, data wait and evaluation."""
    cfg = run.config.train
    values = run.dp.metrics(metrics)  # the step has finished: it was checked
    now = time.perf_counter()
    first = steps_since == 0  # the loop's first step: timed with its compilation
    step_time = run.compile_s if first else (now - t_last) / steps_since
    values.update(
        step=step,
        step_time_s=step_time,
        samples_per_s=cfg.global_batch_size / step_time,
        skipped_steps=run.skipped,
    )
    if run.task == "lm":
        values["tokens_per_s"] = values["samples_per_s"] * run.config.model.seq_len
    if not first:  # the time the step waited for input, per step and as a share
        values["data_wait_s"] = waited_s / steps_since
        values["data_wait_frac"] = waited_s / (now - t_last)
    eval_every = cfg.eval_every
    if eval_every and (step % eval_every == 0 or step == cfg.steps):
        with run.stop.busy():
            values.update(evaluate(run, state))
    return values


def evaluate(run: Run, state) -> dict[str, float]:
    """The held-out metrics: every example counted once (padding masked), on any mesh."""
    cfg = run.config.train
    sampler = jaxdist.EvalSampler(
        len(run.data.eval), cfg.eval_batch_size or cfg.global_batch_size, mesh=run.mesh
    )
    totals: dict[str, float] = {}
    for host_batch in data_lib.eval_batches(run.data.eval, sampler):
        sums = run.dp.evaluate(state, jaxdist.shard_batch(host_batch, run.mesh))
        for name, value in sums.items():  # summed in float64 on the host
            totals[name] = totals.get(name, 0.0) + value
    return eval_metrics(totals, run.data.byte_level)
