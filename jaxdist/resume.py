"""The trainer's side of checkpoints: where the run lives, whether it resumes, what a
checkpoint records besides the state, and the compilation cache that makes a restart
fast. The state itself is saved and restored by ``Parallel.save`` / ``Parallel.restore``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import jax

import jaxdist
from jaxdist import config as config_lib
from jaxdist import rundir
from jaxdist.config import Config
from jaxdist.data.text import default_cache_dir
from jaxdist.sinks.goodput import earlier_last_step


@dataclass(frozen=True)
class Start:
    """Where the loop starts: the state, its step, and what an earlier attempt did."""

    state: jaxdist.TrainState
    step: int  # optimizer steps already taken (0: a fresh run)
    earlier_last_step: int  # the last step earlier attempts reached (resumed runs; else 0)


def use_compile_cache(setting: str) -> Path | None:
    """JAX's persistent compilation cache: a restarted or requeued run loads its compiled
    programs instead of compiling them again (shared/jax-notes fact 10: 4.5 s -> 0.4 s for
    a 60-layer gradient on CPU). Programs that compile in under 0.5 s are not written."""
    if setting == "off":
        return None
    # --compile-cache, else JAX's own variable (slurm/*.sh set it), else the jaxdist cache
    path = Path(
        setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir() / "xla"
    )
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def prepare_run_dir(config: Config, write: bool) -> tuple[Path | None, rundir.Plan]:
    """The run directory (None: ``write=False``) and whether to resume from it. Every
    process checks; process 0 clears an earlier run on ``--overwrite``, then all wait."""
    if not write:
        return None, rundir.Plan(resume=False, clear=False)
    cfg = config.train
    run_dir = rundir.run_dir_path(config)
    plan = rundir.plan(run_dir, cfg.resume, cfg.overwrite)
    if plan.clear and jaxdist.is_main_process():
        rundir.clear(run_dir)
    jaxdist.barrier("jaxdist-run-dir")
    return run_dir, plan


def start(dp: jaxdist.Parallel, run_dir: Path | None, plan: rundir.Plan, config: Config) -> Start:
    """The initial state, or the newest good checkpoint's (resharded to this layout)."""
    if not plan.resume:
        return Start(dp.init_state(), 0, 0)
    restored = dp.restore(run_dir / rundir.CHECKPOINTS)
    if restored is None:
        return Start(dp.init_state(), 0, 0)
    state, extra = restored
    step = int(jax.device_get(state.step).reshape(-1)[0])
    _say_what_changed(extra.get("data", {}), config, step)
    return Start(state, step, earlier_last_step(run_dir))


def extra(config: Config, step: int, examples: int) -> dict:
    """What a checkpoint records besides the state: the data position (with the seed and
    the global batch, the sampler's order is a function of the step) and the config."""
    cfg = config.train
    return {
        "data": {
            "step": step,
            "seed": cfg.seed,
            "global_batch_size": cfg.global_batch_size,
            "examples": examples,
            "epoch": step * cfg.global_batch_size // examples,
        },
        "config": config_lib.to_dict(config),
    }


def _say_what_changed(saved: dict, config: Config, step: int) -> None:
    """A resumed run whose batch or seed differs from the checkpoint's trains on other
    rows from here, and its learning rate follows --lr-scaling: say so, never silently."""
    cfg = config.train
    notes = []
    if saved.get("global_batch_size", cfg.global_batch_size) != cfg.global_batch_size:
        notes.append(
            f"the global batch is {cfg.global_batch_size}, the checkpoint's was "
            f"{saved['global_batch_size']}: batches from step {step + 1} differ from the "
            f"earlier run's, and the learning rate follows --lr-scaling "
            f"{config.optim.lr_scaling}"
        )
    if saved.get("seed", cfg.seed) != cfg.seed:
        notes.append(f"--seed {cfg.seed} differs from the checkpoint's {saved['seed']}")
    for note in notes:
        jaxdist.print_main(f"jaxdist: note: resuming at step {step}: {note}")
