"""What a config value may be: its type (``coerce``) and its range (``RANGES``, one entry
for every numeric field), checked by ``validate``. A bad value is a ``ConfigError`` naming
the key, its flag and the allowed values (exit code 2).

Types are strict: a bool is not a number, a number is not a bool, and a string is not a
number (CLI flags arrive already parsed by argparse). One exception: a float field takes
a string that reads as a number, since YAML 1.1 reads ``1e-3`` (no dot) as a string.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from jaxdist.errors import ConfigError
from jaxdist.parallel import axis_names
from jaxdist.train import architecture_checks
from jaxdist.train.factories import NUMBER, parse_model_args

MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed
MAX_TIMEOUT_S = 1_000_000  # ~11 days; JAX takes its timeouts as int32 seconds


@dataclass(frozen=True)
class Bound:
    """Allowed values: from ``low`` to ``high``, each end included unless ``*_open``."""

    low: int | float = -math.inf  # ints print as ints
    high: int | float = math.inf
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low}, {self.high}{right}"


def at_least(low: float) -> Bound:
    return Bound(low)


POSITIVE = Bound(0, low_open=True)
SHARE = Bound(0, 1, high_open=True)  # a fraction that must leave something

# Every int and float field of the config, and the values that make sense for it.
RANGES: dict[str, Bound] = {
    "model.in_features": at_least(1),
    "train.microbatches": at_least(0),
    "train.virtual_stages": at_least(1),
    "model.hidden": at_least(1),
    "model.depth": at_least(1),
    "model.num_classes": at_least(1),
    "model.vocab_size": at_least(0),  # 0: the data's
    "model.seq_len": at_least(1),
    "model.d_model": at_least(1),
    "model.n_layers": at_least(1),
    "model.n_heads": at_least(1),
    "model.dropout": SHARE,  # 1 would drop every activation
    "model.loss_chunks": at_least(-1),  # -1: auto (jaxdist.train.build_model.loss_chunks)
    "model.layer_norm_eps": POSITIVE,
    "model.document_eos_id": at_least(-1),  # -1: the data's
    "model.n_kv_heads": at_least(0),  # 0: n_heads
    "model.head_dim": at_least(0),  # 0: d_model / n_heads
    "model.ffn_dim": at_least(0),  # 0: 4 x d_model
    "model.rms_norm_eps": POSITIVE,
    "model.rope_theta": POSITIVE,
    "model.rope_factor": POSITIVE,
    "model.rope_low_freq_factor": POSITIVE,
    "model.rope_high_freq_factor": POSITIVE,
    "model.rope_original_max_positions": at_least(1),
    "model.sliding_window_tokens": at_least(0),  # 0: no window
    "model.attn_softcap": at_least(0),  # 0: none
    "model.final_softcap": at_least(0),
    "model.query_scale_dim": at_least(0),  # 0: head_dim
    "model.global_layer_every": at_least(0),  # 0: every layer within the window
    "model.moe_experts": at_least(0),  # 0: dense
    "model.moe_top_k": at_least(1),
    "model.moe_ffn_dim": at_least(0),  # 0: --ffn-dim
    "model.moe_shared_experts": at_least(0),
    "model.moe_dense_layers": at_least(0),
    "model.moe_route_scale": POSITIVE,
    "model.moe_capacity_factor": at_least(0),  # 0: dropless
    "model.moe_balance_coef": at_least(0),
    "model.moe_z_coef": at_least(0),
    "data.eval_fraction": SHARE,
    "data.prefetch": at_least(1),
    "data.data_workers": at_least(0),  # 0: none (the thread prefetcher only)
    "data.num_examples": at_least(1),
    "data.eval_examples": at_least(1),
    "optim.lr": at_least(0),  # 0: a frozen run (evaluating a model, checking the data)
    "optim.base_batch_size": at_least(0),  # 0: the global batch
    "optim.warmup_steps": at_least(0),
    "optim.min_lr_ratio": Bound(0, 1),  # the LR decays to lr * ratio: never negative
    "optim.weight_decay": at_least(0),
    "optim.momentum": SHARE,  # 1 never forgets a gradient
    "optim.clip_norm": at_least(0),  # 0: no clipping
    "train.steps": Bound(1, MAX_INT32),  # the step counter is int32
    "train.global_batch_size": at_least(1),
    "train.grad_accum": at_least(1),
    "train.seed": Bound(0, MAX_SEED),
    "train.log_every": at_least(1),
    "train.cpu_devices": at_least(0),
    "train.num_devices": at_least(0),  # 0: all
    "train.eval_every": at_least(0),  # 0: never
    "train.eval_batch_size": at_least(0),  # 0: the global batch
    "train.eval_batches": at_least(0),  # 0: the whole held-out set
    "train.checkpoint_every": at_least(0),  # 0: at the end and on preemption only
    "train.keep": at_least(1),
    "train.peak_tflops": at_least(0),  # 0: from the device table
    "dist.num_processes": at_least(0),  # 0: from the environment
    "dist.process_id": at_least(-1),  # -1: from the environment
    "dist.init_timeout": Bound(0, MAX_TIMEOUT_S, low_open=True),
    "dist.heartbeat_timeout": Bound(1, MAX_TIMEOUT_S),  # whole seconds to JAX
    "dist.step_timeout": Bound(0, MAX_TIMEOUT_S),  # 0: auto
    "dist.slow_phase_timeout": Bound(0, MAX_TIMEOUT_S, low_open=True),
    "dist.check_replicas_every": at_least(0),  # 0: never
}


def flag_name(f: dataclasses.Field) -> str:
    """The CLI flag of a config field: ``train.global_batch_size`` -> ``--global-batch-size``."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Checks and converts one value; the error names the key and what it takes."""
    if typing.get_origin(typ) is Literal:
        allowed = typing.get_args(typ)
        if isinstance(value, bool) or value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if isinstance(typ, types.UnionType):
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if typ is float and isinstance(value, str) and NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-3 as a string
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if typ is bool and isinstance(value, bool):
        return value
    if typ is int and number and (isinstance(value, int) or value.is_integer()):
        return int(value)
    if typ is float and number:
        return _float(value)
    if typ is str and (isinstance(value, str) or (number and isinstance(value, int))):
        return str(value)
    wanted = {bool: "a bool (true or false)", int: "an int", float: "a number"}.get(typ, "text")
    raise ConfigError(f"{key}: {value!r} ({type(value).__name__}) is not {wanted}")


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float: the finite check names it
        return math.inf


def validate(config) -> None:
    """Every numeric value finite and in its range (``RANGES``), then the checks that
    involve several fields."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                _check_number(f"{section.name}.{f.name}", flag_name(f), value)
    parse_model_args(config.model.model_args)  # bad syntax: exit 2 before anything runs
    if config.train.profile:
        profile_range(config.train.profile, config.train.steps)
    if config.train.wandb:  # PROJECT[/RUN]: a name W&B refuses exits 2 before anything runs
        from jaxdist.sinks.wandb_run import parse_target

        parse_target(config.train.wandb)
    model = config.model
    family = model.name in architecture_checks.LLAMA_FAMILY
    if model.d_model % model.n_heads and not (family and model.head_dim):
        raise ConfigError(
            f"model.d_model={model.d_model} is not divisible by model.n_heads={model.n_heads}"
            + (f" (with --model {model.name}, give --head-dim)" if family else "")
        )
    architecture_checks.check(model, config.train.mesh)
    axis_names.parse(config.train.axis_names)  # a bad map exits 2 before anything runs
    check_process_group(config.dist)


def check_process_group(dist) -> None:
    """``--process-group single`` is one process: a group given by hand contradicts it."""
    given = [
        f"{flag} {value}"
        for flag, value, unset in (
            ("--coordinator", dist.coordinator, ""),
            ("--num-processes", dist.num_processes, 0),
            ("--process-id", dist.process_id, -1),
        )
        if value != unset
    ]
    if dist.process_group == "single" and given:
        raise ConfigError(f"--process-group single is one process: drop {', '.join(given)}")


def _check_number(key: str, flag: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{key} ({flag}): must be a finite number, got {value}")
    bound = RANGES[key]  # every numeric field has one (tests/test_bad_input.py checks)
    if not bound.holds(value):
        raise ConfigError(f"{key} ({flag}): must be {bound}, got {value}")


def profile_range(text: str, total_steps: int) -> tuple[int, int]:
    """``--profile "START:STOP"`` -> (START, STOP) with 1 <= START <= STOP <= the last
    step; a ConfigError naming the numbers otherwise."""
    start_text, sep, stop_text = text.partition(":")
    if not sep or not start_text.strip().isdigit() or not stop_text.strip().isdigit():
        raise ConfigError(f"--profile {text!r}: expected START:STOP (steps), e.g. 10:15")
    start, stop = int(start_text), int(stop_text)
    if not 1 <= start <= stop:
        raise ConfigError(f"--profile {text}: needs 1 <= START <= STOP, got {start}:{stop}")
    if stop > total_steps:
        raise ConfigError(
            f"--profile {text}: step {stop} is beyond the last step, {total_steps} (--steps)"
        )
    return start, stop
