"""optax optimizer with warmup + cosine decay, gradient clipping and LR scaling rules."""

from __future__ import annotations

import math

import optax

from jaxdist.train.config import OptimConfig


def effective_lr(cfg: OptimConfig, global_batch_size: int) -> float:
    """Peak LR for this global batch. The linear scaling rule (Goyal et al.) multiplies
    lr by global/base, e.g. base 64 -> global 512 on 8 devices: 8x; sqrt: sqrt(8) = 2.83x."""
    base = cfg.base_batch_size or global_batch_size
    ratio = global_batch_size / base
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]
    return cfg.lr * factor


def warmup_note(cfg: OptimConfig, steps: int) -> str | None:
    """The start-up line of a warm-up cut to fit the run, or None."""
    if cfg.warmup_steps <= steps - 1:
        return None
    return (
        f"--warmup-steps {cfg.warmup_steps} is cut to {max(steps - 1, 0)} for a run of "
        f"{steps} steps (--steps): the learning rate peaks at the last step's start, so "
        "runs of other lengths follow other schedules"
    )


def make_schedule(cfg: OptimConfig, global_batch_size: int, steps: int) -> optax.Schedule:
    peak = effective_lr(cfg, global_batch_size)
    warmup = min(cfg.warmup_steps, steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else peak,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),  # total length, warmup included
        end_value=peak * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    if cfg.optimizer == "adamw":
        parts.append(optax.adamw(schedule, weight_decay=cfg.weight_decay))
    else:
        parts += [
            optax.add_decayed_weights(cfg.weight_decay),
            optax.sgd(schedule, momentum=cfg.momentum or None),
        ]
    return optax.chain(*parts)
