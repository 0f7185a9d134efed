"""The command line's model registry (``--model``): built-in names and user factories
``package.module:function``, built from the ``model`` config section.

Models know nothing of devices or strategies. Each comes with a *task* that picks
the synthetic data and the default loss: ``classify`` (x (B, F) -> logits (B, C)) or
``lm`` (tokens (B, T) -> logits (B, T, vocab)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.data.text import BYTE_VOCAB
from jaxdist.errors import ConfigError
from jaxdist.losses import default_loss, make_fused_next_token_loss
from jaxdist.models import fp8
from jaxdist.train.config import ModelConfig
from jaxdist.train.factories import bind, import_object, parse_model_args, signature
from jaxdist.train.own_flags import READS, check_gpt_flags


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

    return GPT(  # the GPT pads its embedding rows to a multiple of 128 itself
        cfg.vocab_size or BYTE_VOCAB,
        cfg.seq_len,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        dtype=compute_dtype(cfg),
        attention=attention_kernel(cfg),
        scan_layers=cfg.scan_layers,
        remat=cfg.remat,
        dropout=cfg.dropout,
        seq_attention=cfg.seq_attention,
        layer_norm_eps=cfg.layer_norm_eps,
        **documents(cfg),
        rngs=rngs,
    )


def _llama(cfg: ModelConfig, rngs: nnx.Rngs, **family) -> nnx.Module:
    from jaxdist.models.llama import Llama
    from jaxdist.models.rope import Rope

    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    rope = Rope(
        head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor, cfg.rope_original_max_positions,
    )  # fmt: skip
    model = family.pop("model", Llama)
    return model(
        cfg.vocab_size or BYTE_VOCAB,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=head_dim,
        ffn_dim=cfg.ffn_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope=rope,
        qk_norm=cfg.qk_norm,
        attention_bias=cfg.attention_bias,
        sliding_window=cfg.sliding_window_tokens,
        tie_embeddings=cfg.tie_embeddings,
        dtype=compute_dtype(cfg),
        attention=attention_kernel(cfg),
        scan_layers=cfg.scan_layers,
        remat=cfg.remat,
        dropout=cfg.dropout,
        seq_attention=cfg.seq_attention,
        moe=moe_settings(cfg),
        **documents(cfg),
        rngs=rngs,
        **family,
    )


def documents(cfg: ModelConfig) -> dict:
    """The GPT's and Llama's ``document_eos`` and ``reset_positions`` (``--document-mask``)."""
    if not cfg.document_mask:
        return {}
    return {"document_eos": cfg.document_eos_id if cfg.document_eos_id >= 0 else BYTE_VOCAB - 1,
            "reset_positions": cfg.reset_positions}  # fmt: skip


def moe_settings(cfg: ModelConfig):
    """The Llama's ``MoESettings`` from ``--moe-*``, or None (dense) without experts."""
    if not cfg.moe_experts:
        return None
    from jaxdist.models.moe import MoESettings

    return MoESettings(
        cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_dim, cfg.moe_shared_experts,
        cfg.moe_dense_layers, cfg.moe_router, cfg.moe_norm_topk, cfg.moe_route_scale,
        cfg.moe_capacity_factor, cfg.moe_balance_coef, cfg.moe_z_coef,
    )  # fmt: skip


def _gemma(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    from jaxdist.models.gemma import Gemma

    return _llama(
        cfg, rngs, model=Gemma, attn_softcap=cfg.attn_softcap, final_softcap=cfg.final_softcap,
        query_scale_dim=cfg.query_scale_dim, global_layer_every=cfg.global_layer_every,
    )  # fmt: skip


BUILTIN = {
    "mlp": ModelSpec(_mlp, "classify"),
    "gpt": ModelSpec(_gpt, "lm"),
    "llama": ModelSpec(_llama, "lm"),
    "gemma": ModelSpec(_gemma, "lm"),
}
# The built-in models whose blocks are a Stack under --scan-layers (always with stages)
STACKED = ("gpt", "llama", "gemma")


def attention_kernel(cfg: ModelConfig) -> str:
    """``auto``: cuDNN's fused flash attention on GPU in bf16 (jax.nn.dot_product_attention
    itself defaults to the XLA kernel, about half the speed on an H100), else XLA. Gemma:
    XLA's (no fused kernel soft-caps logits; cudnn is refused by the config check)."""
    if cfg.attention != "auto":
        return cfg.attention
    if cfg.name == "gemma":
        return "xla"
    if cfg.document_mask:  # cuDNN's path takes no segment ids: said as it is built
        if jax.default_backend() == "gpu" and jax.process_index() == 0:
            said = "an explicit per-document mask; cuDNN's kernel takes no segment ids"
            print(f"jaxdist: --document-mask: attention on XLA's path ({said})", flush=True)
        return "xla"
    return "cudnn" if jax.default_backend() == "gpu" and cfg.dtype == "bfloat16" else "xla"


AUTO_LOSS_CHUNKS = 8  # on GPUs (experiments/PERF.md, lever 4)


def loss_chunks(cfg: ModelConfig, platform: str, shard_optimizer: bool = False) -> int:
    """``--loss-chunks``, with auto (-1) resolved for devices of ``platform``: 8 slices on
    GPUs for the built-in GPT's own loss where 8 divides the sequence, else 0. Not with
    ``--shard-optimizer``: there XLA reduce-scatters the tied embedding's two gradients
    (the lookup's, the fused head's) apart, twice its bytes on the wire."""
    if cfg.loss_chunks >= 0:
        return cfg.loss_chunks
    gpu = platform in ("gpu", "cuda", "rocm")
    fits = cfg.name in STACKED and not cfg.loss and cfg.seq_len % AUTO_LOSS_CHUNKS == 0
    return AUTO_LOSS_CHUNKS if gpu and fits and not shard_optimizer else 0


def model_loss(
    cfg: ModelConfig, task: str, inputs: str, labels: str, platform: str, shard_optimizer: bool
):
    """The loss the step runs: ``--loss``'s, else the task's default, which for the
    GPT is the fused loss in ``loss_chunks(...)`` slices where that is not 0 (auto's
    choice said in one line, process 0)."""
    chunks = loss_chunks(cfg, platform, shard_optimizer)
    if chunks:  # the GPT's loss without its logits (config_checks)
        if cfg.loss_chunks < 0 and jax.process_index() == 0:
            print(f"jaxdist: --loss-chunks auto: the GPT's loss in {chunks} slices of the "
                  "sequence (no whole logits; the same numbers; 0: the plain loss)",
                  flush=True)  # fmt: skip
        return make_fused_next_token_loss(chunks)
    if cfg.loss:
        return import_object(cfg.loss, "--loss")
    return default_loss(task, inputs, labels)


def compute_dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def model_task(cfg: ModelConfig) -> str:
    """``classify`` or ``lm``: which data and default loss the model takes. A user
    factory's is ``model.task`` (``auto``: classification)."""
    if cfg.task != "auto":
        return cfg.task
    return BUILTIN[cfg.name].task if cfg.name in BUILTIN else "classify"


def model_factory(cfg: ModelConfig, seed: int) -> Callable[[], object]:
    """The model as a zero-argument builder, its arguments checked now: DataParallel calls
    it inside ``jax.jit``, so the parameters are made where they will live.

    A user factory ``package.module:function`` (or a model class) is called by parameter
    name: ``rngs`` gets ``nnx.Rngs(seed)``, ``config`` (or ``model_config``, ``cfg``) the
    ModelConfig, any other parameter a value from ``--model-args`` or its default. It
    returns an ``nnx.Module`` or a ``linen.Module``. With ``--fp8`` the model's linear
    layers compute in float8 (``jaxdist.models.fp8``)."""
    build = _factory(cfg, seed)
    return Fp8Builder(build) if cfg.fp8 else build


class Fp8Builder:
    """A builder whose model's ``nnx.Linear`` layers compute in float8; the first build
    says which in one line (process 0)."""

    def __init__(self, build: Callable[[], object]):
        self.build, self.said = build, False

    def __call__(self):
        model = self.build()
        if not isinstance(model, nnx.Module):
            raise ConfigError(
                f"--fp8 converts an NNX model's nnx.Linear layers; this model is a "
                f"{type(model).__name__} (Linen): give its nn.Dense layers "
                "dot_general=jaxdist.fp8_dot_general instead of --fp8"
            )
        conversion = fp8.convert(model)
        if not self.said and jax.process_index() == 0:
            print(conversion.describe(), flush=True)
        self.said = True
        return model


CONFIG_NAMES = ("config", "model_config", "cfg")  # a factory's parameter for the ModelConfig


def takes_config(factory) -> bool:
    """Whether ``factory`` has a parameter that gets the ModelConfig (or ``**kwargs``, or
    no signature to read: the benefit of the doubt)."""
    sig = signature(factory)
    if sig is None:
        return True
    params = sig.parameters.values()
    return any(p.name in CONFIG_NAMES or p.kind is p.VAR_KEYWORD for p in params)


def _factory(cfg: ModelConfig, seed: int) -> Callable[[], object]:
    if cfg.name in BUILTIN:
        check_gpt_flags(cfg, reads_config=cfg.name in READS)
        if cfg.model_args:
            raise ConfigError(
                f"--model-args {cfg.model_args!r}: only for a factory package.module:function; "
                f"--model {cfg.name} takes its sizes from their own flags"
            )
        build = BUILTIN[cfg.name].factory
        return lambda: build(cfg, nnx.Rngs(seed))
    if ":" not in cfg.name:
        raise ConfigError(
            f"model.name: {cfg.name!r} is not one of {', '.join(BUILTIN)} "
            "and not a factory 'package.module:function'"
        )
    factory = import_object(cfg.name, "--model")
    if not callable(factory):
        raise ConfigError(f"--model {cfg.name!r} is not callable")
    supplied = {"rngs": lambda: nnx.Rngs(seed)}
    supplied.update(dict.fromkeys(CONFIG_NAMES, lambda: cfg))
    check_gpt_flags(cfg, reads_config=takes_config(factory))
    extra = parse_model_args(cfg.model_args)
    return bind(factory, f"--model {cfg.name}", supplied, extra, fallback="rngs")


def build_model(cfg: ModelConfig, seed: int):
    """(module, task), built now: the module may be NNX or Linen (``jaxdist.as_nnx``
    adapts it)."""
    return model_factory(cfg, seed)(), model_task(cfg)
