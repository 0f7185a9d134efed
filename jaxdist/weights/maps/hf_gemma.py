"""What Gemma 2's config.json says beyond a Llama's (``hf_llama`` calls these for
``model_type`` gemma2, read into ``--model gemma``):

- ``layer_types``: each layer ``sliding_attention`` or ``full_attention``; the model
  computes one pattern, every N-th layer global (``--global-layer-every N``: Gemma 2's
  is 2), so a file's list must be that pattern for some N (all full: N = 1; all
  sliding: N = 0), else it is refused, naming the list;
- ``attn_logit_softcapping`` and ``final_logit_softcapping``: null is 0 (none);
- ``query_pre_attn_scalar``: the attention logits' 1/sqrt scale (``--query-scale-dim``).
"""

from __future__ import annotations

from jaxdist.errors import ConfigError
from jaxdist.models.gemma import GLOBAL, layer_kinds

# transformers' Gemma2Config defaults (5.x) for a file that leaves a key out
DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
            "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "layer_types": None, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0}  # fmt: skip
KINDS = {GLOBAL: "full_attention"}  # a layer kind's name; every other kind slides


def normalized(config: dict, where: str) -> dict:
    """``config`` (defaults filled) with ``layer_types`` a list of the model's pattern
    and ``sliding_window`` None where no layer slides."""
    layers = config["num_hidden_layers"]
    types = config["layer_types"]
    if types is None:  # transformers': layer i slides unless (i + 1) % 2 == 0
        types = [_name(k) for k in layer_kinds(layers, 2, 1)]
    if len(types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    every = global_every(types, where)
    window = config["sliding_window"] if "sliding_attention" in types else None
    if every != 1 and not window:
        raise ConfigError(f"{where}: sliding_attention layers without a sliding_window")
    return {**config, "layer_types": list(types), "sliding_window": window}


def global_every(types: list[str], where: str) -> int:
    """The N of ``--global-layer-every`` whose pattern ``types`` is."""
    for every in (0, *range(1, len(types) + 1)):
        if types == [_name(k) for k in layer_kinds(len(types), every, 1)]:
            return every
    raise ConfigError(
        f"{where}: layer_types {types} is not every N-th layer full_attention and the "
        "others sliding_attention, the one pattern --model gemma computes"
    )


def _name(kind: int) -> str:
    return KINDS.get(kind, "sliding_attention")


def read_setting(name: str, said: str, value) -> dict[str, tuple] | None:
    """The model settings a Gemma key's value gives; None for a key not Gemma's own."""
    if name == "hf_layer_types":
        return {"global_layer_every": (global_every(value, said), said)}
    if name in ("hf_attn_softcap", "hf_final_softcap"):
        return {name[3:]: (value or 0.0, said)}
    if name == "hf_query_scale":
        return {"query_scale_dim": (value, said)}
    return None


def settings(names: dict, head_dim: int) -> dict:
    """The ``hf_*`` values gemma2.yaml's ``config_json`` names, from a run's settings."""
    window = names.get("sliding_window_tokens") or 0
    kinds = layer_kinds(names.get("n_layers", 0), names.get("global_layer_every", 0), window)
    sliding = any(k != GLOBAL for k in kinds)
    return {
        "hf_layer_types": [_name(k) for k in kinds],
        "hf_sliding_window": window if sliding else None,
        "hf_attn_softcap": names.get("attn_softcap") or None,
        "hf_final_softcap": names.get("final_softcap") or None,
        "hf_query_scale": names.get("query_scale_dim") or head_dim,
    }
