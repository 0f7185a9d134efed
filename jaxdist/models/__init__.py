"""Model registry: built-in names and user factories ``package.module:function``.

Models know nothing of devices or strategies. Each comes with a *task* that picks
the synthetic data and the default loss: ``classify`` (x (B, F) -> logits (B, C)) or
``lm`` (tokens (B, T) -> logits (B, T, vocab)).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from jaxdist.config import ConfigError, ModelConfig

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ModelSpec:
    factory: Callable[[ModelConfig, nnx.Rngs], nnx.Module]
    task: str  # "classify" or "lm"


def _mlp(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxdist.models.mlp import MLP

    return MLP(
        cfg.in_features, cfg.hidden, cfg.depth, cfg.num_classes, dtype=compute_dtype(cfg), rngs=rngs
    )


def _gpt(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxdist.models.gpt import GPT

    return GPT(
        cfg.vocab_size or BYTE_VOCAB,
        cfg.seq_len,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        dtype=compute_dtype(cfg),
        attention=attention_kernel(cfg),
        rngs=rngs,
    )


BUILTIN = {"mlp": ModelSpec(_mlp, "classify"), "gpt": ModelSpec(_gpt, "lm")}


def attention_kernel(cfg: ModelConfig) -> str:
    """``auto``: cuDNN's fused flash attention on GPU in bf16 (jax.nn.dot_product_attention
    itself defaults to the XLA kernel, about half the speed on an H100), else XLA."""
    if cfg.attention != "auto":
        return cfg.attention
    import jax

    return "cudnn" if jax.default_backend() == "gpu" and cfg.dtype == "bfloat16" else "xla"


def compute_dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def import_object(ref: str, what: str):
    """Imports ``package.module:name``; a clear ConfigError when it cannot."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {ref!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{what} {ref!r}: cannot import module {module_name!r}: {err}") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{what} {ref!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def resolve(cfg: ModelConfig) -> ModelSpec:
    """Built-in name or user factory. A user factory takes ``(model_config, rngs)`` or
    ``(rngs)`` and returns an ``nnx.Module`` or a ``linen.Module``; its task is
    ``model.task`` (``auto``: classification)."""
    if cfg.name in BUILTIN:
        return BUILTIN[cfg.name]
    if ":" not in cfg.name:
        raise ConfigError(
            f"model.name: {cfg.name!r} is not one of {', '.join(BUILTIN)} "
            "and not a factory 'package.module:function'"
        )
    factory = import_object(cfg.name, "--model")
    if not callable(factory):
        raise ConfigError(f"--model {cfg.name!r} is not callable")
    takes_config = len(inspect.signature(factory).parameters) >= 2

    def build(model_cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return factory(model_cfg, rngs) if takes_config else factory(rngs)

    return ModelSpec(build, "classify")


def model_task(cfg: ModelConfig) -> str:
    """``classify`` or ``lm``: which data and default loss the model takes."""
    return resolve(cfg).task if cfg.task == "auto" else cfg.task


def build_model(cfg: ModelConfig, seed: int):
    """(module, task): the module may be NNX or Linen (``jaxdist.as_nnx`` adapts it)."""
    return resolve(cfg).factory(cfg, nnx.Rngs(seed)), model_task(cfg)
