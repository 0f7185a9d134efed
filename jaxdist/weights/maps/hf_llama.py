"""Hugging Face's config.json <-> the built-in Llama's settings (``--model llama``), for
the families whose maps ship beside this file: llama, qwen2, qwen3, mistral; mixtral and
qwen3_moe (``--moe-experts``, their own keys in ``hf_moe``); and gemma2 (``--model
gemma``, its own keys in ``hf_gemma``).

Both directions go through the family's map (``<family>.yaml``): its ``config_json``
says which key holds which setting (``hidden_size: ${d_model}``), so
``--model-from-config`` reads the file by the same correspondence that export writes
it, and its ``check_keys`` are what ``--init-from`` compares. A constant of the template
that is also a check key (``hidden_act: silu``) is what the model computes: a file with
another value is refused by name. The map's ``requires`` are the settings the family's
architecture fixes (Qwen3's QK-norm). What a template cannot say is here:

- keys a config.json may leave out: transformers' class defaults (``DEFAULTS``);
- RoPE: transformers 5's ``rope_parameters``, or the older ``rope_scaling`` beside a
  top-level ``rope_theta``, read as one dict with exactly the keys of its type
  (``rope_type`` default, linear or llama3; others refused by name);
- the sliding window: Mistral's ``sliding_window``; Qwen's ``use_sliding_window`` with
  ``max_window_layers`` or ``layer_types``. A window on some layers but not all is
  refused: the model's blocks are one ``Stack`` of identical layers;
- ``attention_bias`` (Llama, Qwen3: q, k, v and o together) as ``--attention-bias``.

Settings named ``hf_*`` in the templates are derived from the model's (``settings``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from jaxdist.errors import ConfigError
from jaxdist.weights.maps import hf_gemma, hf_moe

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", *hf_moe.FAMILIES, "gemma2")
MODEL = {"gemma2": "gemma"}  # a family's built-in model, where it is not --model llama
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads")  # fmt: skip
# transformers' class defaults (5.x) of the other keys read, for a file that leaves them
# out; head_dim None: hidden_size / num_attention_heads
_COMMON = {"head_dim": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "hidden_act": "silu", "rope_theta": 10000.0}  # fmt: skip
_QWEN = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
DEFAULTS = {
    "llama": {**_COMMON, "num_key_value_heads": None, "attention_bias": False,
              "mlp_bias": False, "max_position_embeddings": 2048},
    "qwen2": {**_COMMON, **_QWEN, "num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {**_COMMON, **_QWEN, "num_key_value_heads": 32, "head_dim": 128,
              "attention_bias": False, "max_position_embeddings": 32768},
    "mistral": {**_COMMON, "num_key_value_heads": 8, "sliding_window": 4096,
                "max_position_embeddings": 4096 * 32},
    **hf_moe.DEFAULTS,
    "gemma2": hf_gemma.DEFAULTS,
}  # fmt: skip
# each RoPE type's keys, beside rope_type and rope_theta
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# rope_parameters key -> the model setting
ROPE_SETTINGS = {"rope_theta": "rope_theta", "factor": "rope_factor",
                 "low_freq_factor": "rope_low_freq_factor",
                 "high_freq_factor": "rope_high_freq_factor",
                 "original_max_position_embeddings": "rope_original_max_positions"}  # fmt: skip
ROPE_DEFAULTS = {"rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                 "rope_original_max_positions": 8192}  # fmt: skip


def read(source: str | Path, where: str) -> tuple[dict, Path]:
    """(config.json's contents, its path) of a folder or of the file itself; ``where``
    names the flag in errors."""
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{where}: no such folder with a config.json, nor such a file")
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{where}: {path} is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {path} is not a JSON object")
    return config, path


def normalized(config: dict, where: str) -> dict:
    """``config`` as transformers reads it, in the form the maps' templates write: class
    defaults filled, head_dim and num_key_value_heads resolved, ``rope_parameters`` one
    dict of its type's keys, ``sliding_window`` W where every layer has one, else None."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(
            f"{where}: model_type {family!r} is not one --model llama reads "
            f"({', '.join(f for f in FAMILIES if f not in MODEL)}) nor --model gemma (gemma2)"
        )
    missing = [k for k in SIZES if k not in config]
    if missing:
        raise ConfigError(f"{where}: no {', '.join(missing)} in config.json")
    out = {**DEFAULTS[family], **config}
    if family in hf_moe.FAMILIES:
        out = hf_moe.normalized(out, where)
    heads = out["num_attention_heads"]
    out["head_dim"] = out["head_dim"] or out["hidden_size"] // heads
    out["num_key_value_heads"] = out["num_key_value_heads"] or heads
    out["rope_parameters"] = _rope(out, where)
    if family in ("qwen2", "qwen3", "mistral", *hf_moe.FAMILIES):
        out["sliding_window"] = _window(out, family, where)
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = out["sliding_window"] is not None
    if family == "gemma2":
        out = hf_gemma.normalized(out, where)
    return out


def _rope(config: dict, where: str) -> dict:
    given = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(given, dict) or set(given) & {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{where}: rope_parameters per layer type: one RoPE for all layers only")
    rope_type = given.get("rope_type", given.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise ConfigError(
            f"{where}: RoPE type {rope_type!r}: jaxdist's Llama computes "
            f"{', '.join(ROPE_KEYS)} only"
        )
    if given.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor: jaxdist's RoPE rotates whole heads")
    out = {"rope_type": rope_type, "rope_theta": given.get("rope_theta", config["rope_theta"])}
    for key in ROPE_KEYS[rope_type]:
        if key == "original_max_position_embeddings":  # transformers' fallback
            out[key] = given.get(key, config["max_position_embeddings"])
        elif key in given:
            out[key] = given[key]
        else:
            raise ConfigError(f"{where}: RoPE type {rope_type} needs {key}")
    return out


def _window(config: dict, family: str, where: str) -> int | None:
    """The window of every layer, or None; a window on some layers only is refused."""
    layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not config["use_sliding_window"]:
        window = None  # transformers ignores the number then
    if types is None:  # Qwen2/3: sliding from layer max_window_layers on; the others: all
        start = config.get("max_window_layers", 0) if family in ("qwen2", "qwen3") else 0
        sliding = window is not None
        types = ["sliding_attention" if sliding and i >= start else "full_attention"
                 for i in range(layers)]  # fmt: skip
    if len(set(types)) > 1:
        raise ConfigError(
            f"{where}: layer_types mixes sliding_attention and full_attention layers; "
            "jaxdist's Llama runs one stack of identical layers, all sliding or none"
        )
    return window if types and types[0] == "sliding_attention" else None


def model_settings(source: str) -> dict[str, tuple]:
    """``--model-from-config SOURCE``: model setting -> (value, where the file says it)."""
    from jaxdist.weights.weight_map import load

    where = f"--model-from-config {source}"
    config, path = read(source, where)
    theirs = normalized(config, where)
    family = theirs["model_type"]
    weight_map = load(family)
    model = MODEL.get(family, "llama")
    out: dict[str, tuple] = {"name": (model, f"model_type {family!r} (--model {model})")}
    for key, template in weight_map.config_json.items():
        name = _setting(template)
        if name is None:  # a constant: what the model computes, where it is checked
            if key in weight_map.check_keys and theirs.get(key, template) != template:
                raise ConfigError(
                    f"{where}: {key} is {theirs[key]!r} in {path}; --model {model} computes "
                    f"{template!r}"
                )
        elif key in theirs:
            out.update(_read_setting(name, key, theirs[key]))
    for key, value in weight_map.requires.items():  # the family's architecture
        if not isinstance(value, list):
            out.setdefault(key, (value, f"model_type {family!r} (its {key})"))
    return out


def _setting(template) -> str | None:
    found = re.fullmatch(r"\$\{(\w+)\}", template) if isinstance(template, str) else None
    return found.group(1) if found else None


def _read_setting(name: str, key: str, value) -> dict[str, tuple]:
    """The model settings one config.json value gives."""
    said = f"config.json's {key} {value!r}"
    for family in (hf_gemma, hf_moe):
        own = family.read_setting(name, said, value)
        if own is not None:
            return own
    if name == "hf_rope_parameters":
        out = {setting: (default, f"{said} (none)") for setting, default in ROPE_DEFAULTS.items()}
        out["rope_type"] = (value["rope_type"], said)
        for rope_key, setting in ROPE_SETTINGS.items():
            if rope_key in value:
                got = value[rope_key]
                out[setting] = (got, f"config.json's rope {rope_key} {got!r}")
        return out
    if name == "hf_attention_bias":  # q, k, v and o together
        return {"attention_bias": ("qkvo" if value else "none", said)}
    if name == "hf_sliding_window":
        return {"sliding_window_tokens": (value or 0, said)}
    if name.startswith("hf_"):  # derived from what is read elsewhere (max positions)
        return {}
    return {name: (value, said)}


def settings(names: dict) -> dict:
    """A Llama's settings (a run's model config) with its defaults resolved (head_dim,
    n_kv_heads, ffn_dim: 0 means another setting) and the ``hf_*`` values the maps'
    ``config_json`` templates name."""
    d_model, heads = names.get("d_model", 0), names.get("n_heads", 1)
    window = names.get("sliding_window_tokens") or 0
    rope_type = names.get("rope_type", "default")
    rope = {"rope_type": rope_type, "rope_theta": names.get("rope_theta", 10000.0)}
    for key in ROPE_KEYS.get(rope_type, ()):
        setting = ROPE_SETTINGS[key]
        rope[key] = names.get(setting, ROPE_DEFAULTS[setting])
    context = names.get("seq_len", 0)
    if rope_type == "llama3":  # the context the scaling stretches to, not the run's own
        context = max(context, int(rope["factor"] * rope["original_max_position_embeddings"]))
    head_dim = names.get("head_dim") or d_model // heads
    gemma = hf_gemma.settings(names, head_dim) if names.get("name") == "gemma" else {}
    ffn_dim = names.get("ffn_dim") or 4 * d_model
    return {
        **names,
        "head_dim": head_dim,
        "n_kv_heads": names.get("n_kv_heads") or heads,
        "ffn_dim": ffn_dim,
        **hf_moe.settings(names, ffn_dim),
        "hf_rope_parameters": rope,
        "hf_attention_bias": names.get("attention_bias") == "qkvo",
        "hf_sliding_window": window or None,
        "hf_use_sliding_window": bool(window),
        "hf_max_positions": context,
        **gemma,
    }
