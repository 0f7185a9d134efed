"""The built-in models' own flags and their defaults, and the check that refuses one set
for a model that cannot read it (``check_gpt_flags``, called as the model is built)."""

from __future__ import annotations

from jaxdist.errors import ConfigError
from jaxdist.train.architecture import ModelConfig

# The built-in models' own flags and their defaults: set for a model that cannot read them
# (the MLP; a factory without a config parameter; the other built-in transformer), they
# would change nothing. The GPT and the Llama share the first group.
SHARED_FLAGS = {"scan_layers": False, "remat": "none", "dropout": 0.0, "attention": "auto",
                "seq_attention": "ring", "document_mask": False, "reset_positions": False,
                "document_eos_id": -1}  # fmt: skip
GPT_FLAGS = {**SHARED_FLAGS, "layer_norm_eps": 1e-6}
MOE_FLAGS = {"moe_experts": 0, "moe_top_k": 2, "moe_ffn_dim": 0, "moe_shared_experts": 0,
             "moe_dense_layers": 0, "moe_router": "softmax", "moe_norm_topk": True,
             "moe_route_scale": 1.0, "moe_capacity_factor": 0.0, "moe_balance_coef": 0.01,
             "moe_z_coef": 0.001}  # fmt: skip
LLAMA_FLAGS = {
    **SHARED_FLAGS, "n_kv_heads": 0, "head_dim": 0, "ffn_dim": 0, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_type": "default", "rope_factor": 1.0,
    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
    "rope_original_max_positions": 8192, "qk_norm": False, "attention_bias": "none",
    "sliding_window_tokens": 0, "tie_embeddings": True, "model_from_config": "",
    **MOE_FLAGS,
}  # fmt: skip
GEMMA_FLAGS = {**LLAMA_FLAGS, "attn_softcap": 0.0, "final_softcap": 0.0, "query_scale_dim": 0,
               "global_layer_every": 0}  # fmt: skip
# the built-in models that read flags
READS = {"gpt": GPT_FLAGS, "llama": LLAMA_FLAGS, "gemma": GEMMA_FLAGS}


def check_gpt_flags(cfg: ModelConfig, reads_config: bool) -> None:
    """``ConfigError`` for a built-in model's flag given to a model that cannot see it:
    the GPT's to the MLP or to a factory without a config parameter, the Llama's to
    the GPT and the GPT's own to the Llama (one line naming them)."""
    check_documents(cfg)
    flags = {**GPT_FLAGS, **GEMMA_FLAGS}
    given = {k: f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k, v in flags.items()
             if getattr(cfg, k) != v}  # fmt: skip
    if cfg.name in READS:
        unseen = [k for k in given if k not in READS[cfg.name]]
        if unseen:
            # each flag's first reader: the Llama's flags are Gemma's too
            owners = list(dict.fromkeys(next(m for m in READS if k in READS[m]) for k in unseen))
            raise ConfigError(
                f"{', '.join(given[k] for k in unseen)}: flag(s) of --model "
                f"{' and '.join(owners)}, which --model {cfg.name} does not read, so they "
                "would change nothing; drop them"
            )
        return
    if given and not reads_config:
        owner = (
            "GPT's"
            if set(given) <= set(GPT_FLAGS)
            else "GPT's and Llama's"
            if set(given) <= {*GPT_FLAGS, *LLAMA_FLAGS}
            else "GPT's, Llama's and Gemma's"
        )
        raise ConfigError(
            f"{', '.join(given.values())}: the built-in {owner} flag(s), which --model "
            f"{cfg.name} cannot see (it builds its own blocks and takes no config parameter), "
            "so they would change nothing; drop them, or give the factory a config parameter "
            "that reads them (for stacked blocks: jaxdist.models.Stack, nnx.scan or Linen's "
            "nn.scan)"
        )


def check_documents(cfg: ModelConfig) -> None:
    """``ConfigError`` for ``--document-mask`` where it cannot apply, by name."""
    if (cfg.reset_positions or cfg.document_eos_id >= 0) and not cfg.document_mask:
        raise ConfigError("--reset-positions and --document-eos-id go with --document-mask")
    if not cfg.document_mask:
        return
    if cfg.name == "gemma":
        raise ConfigError(
            "--document-mask with --model gemma: Gemma's own soft-capped attention takes "
            "no segment ids; use --model llama or gpt, or drop --document-mask"
        )
    if cfg.attention == "cudnn":
        raise ConfigError(
            "--document-mask with --attention cudnn: jax.nn.dot_product_attention's cuDNN "
            "path takes no segment ids; use --attention xla (or auto, which then is XLA's)"
        )
