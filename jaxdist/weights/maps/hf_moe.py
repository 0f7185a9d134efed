"""What Mixtral's and Qwen3-MoE's config.json say beyond a Llama's (``hf_llama`` calls
these for ``model_type`` mixtral and qwen3_moe, read into ``--model llama`` with
``--moe-experts``):

- the experts: ``num_local_experts`` (Mixtral; transformers 5 writes Qwen3-MoE's
  ``num_experts`` under that name too) as ``--moe-experts``, ``num_experts_per_tok`` as
  ``--moe-top-k``; each expert's width, Mixtral's ``intermediate_size`` and Qwen3-MoE's
  ``moe_intermediate_size``, as ``--moe-ffn-dim`` (Qwen3-MoE's ``intermediate_size`` is
  its dense MLP's, ``--ffn-dim``, kept for the round trip: no layer here uses it);
- the router: softmax over all experts, the top-k renormalised (Mixtral always,
  Qwen3-MoE's ``norm_topk_prob``);
- refused by name: a layer without experts (Qwen3-MoE's ``mlp_only_layers``, a
  ``decoder_sparse_step`` other than 1), Mixtral's training-time ``router_jitter_noise``;
  neither family has a shared expert (the maps' ``requires``: ``--moe-shared-experts 0``);
- not read: ``router_aux_loss_coef``. transformers pools its balance loss over the whole
  batch (and counts it k times jaxdist's); jaxdist's ``--moe-balance-coef`` weighs one per
  sequence: another loss, so the coefficient stays the run's choice, and export leaves
  the key to transformers' default.
"""

from __future__ import annotations

from jaxdist.errors import ConfigError

FAMILIES = ("mixtral", "qwen3_moe")
# transformers' class defaults (5.x) of the keys read, for a file that leaves them out;
# head_dim None: hidden_size / num_attention_heads
DEFAULTS = {
    "mixtral": {"head_dim": None, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 1e6,
                "max_position_embeddings": 4096 * 32, "sliding_window": None,
                "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
    "qwen3_moe": {"head_dim": None, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0,
                  "max_position_embeddings": 32768, "attention_bias": False,
                  "use_sliding_window": False, "sliding_window": 4096,
                  "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
}  # fmt: skip


def normalized(config: dict, where: str) -> dict:
    """``config`` (defaults filled) in the form the maps' templates write, or a
    ConfigError naming what the model does not compute."""
    family = config["model_type"]
    out = dict(config)
    if family == "qwen3_moe":
        # transformers 5 saves num_experts as num_local_experts (its attribute_map);
        # the Hub's files say num_experts; its class default is 128
        out["num_experts"] = out.get("num_experts", out.pop("num_local_experts", 128))
        out.pop("max_window_layers", None)  # Qwen3-MoE's window is on every layer or none
        out.pop("layer_types", None)  # not read by Qwen3-MoE either
        dense = out["mlp_only_layers"] or []
        if dense or out["decoder_sparse_step"] != 1:
            raise ConfigError(
                f"{where}: mlp_only_layers {dense} / decoder_sparse_step "
                f"{out['decoder_sparse_step']}: layers with a dense MLP in place of the "
                "experts; the model here routes every layer through its experts "
                "(mlp_only_layers [] and decoder_sparse_step 1 only)"
            )
        out["mlp_only_layers"] = []
    if out.get("router_jitter_noise"):
        raise ConfigError(
            f"{where}: router_jitter_noise {out['router_jitter_noise']}: transformers' "
            "training-time noise on the router's input, which jaxdist does not add; set it 0"
        )
    return out


def read_setting(name: str, said: str, value) -> dict[str, tuple] | None:
    """The model settings an MoE key's value gives; None for a key not the MoE's own."""
    if name == "hf_expert_dim":
        return {"moe_ffn_dim": (value, said)}
    return None


def settings(names: dict, ffn_dim: int) -> dict:
    """The ``hf_*`` values mixtral.yaml's and qwen3_moe.yaml's ``config_json`` name, from
    a run's settings (``ffn_dim`` resolved)."""
    return {"hf_expert_dim": names.get("moe_ffn_dim") or ffn_dim}
