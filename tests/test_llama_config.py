"""A Hugging Face config.json read as the built-in Llama's settings
(jaxdist/weights/maps/hf_llama.py), on files written here, as transformers reads them;
what the model cannot be refused by name; a map's ``requires``."""

from __future__ import annotations

import pytest

from jaxdist.errors import ConfigError

SIZES = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4}  # fmt: skip


def settings_of(tmp_path, **config):
    import json

    from jaxdist.weights.maps import hf_llama

    (tmp_path / "config.json").write_text(json.dumps({**SIZES, **config}))
    return {k: v for k, (v, _) in hf_llama.model_settings(str(tmp_path)).items()}


def test_a_legacy_llama3_config_reads_as_transformers_reads_it(tmp_path):
    # transformers 4's form: rope_scaling beside a top-level rope_theta, no head_dim
    got = settings_of(tmp_path, model_type="llama", num_key_value_heads=2, rope_theta=5e5,
                      rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0},
                      max_position_embeddings=4096)  # fmt: skip
    assert got["rope_type"] == "llama3" and got["rope_theta"] == 5e5
    assert got["rope_original_max_positions"] == 4096  # transformers' fallback
    assert (got["head_dim"], got["n_kv_heads"], got["tie_embeddings"]) == (8, 2, False)
    assert (got["qk_norm"], got["attention_bias"], got["sliding_window_tokens"]) == (
        False, "none", 0)  # fmt: skip
    qwen2 = settings_of(tmp_path, model_type="qwen2", use_sliding_window=False,
                        sliding_window=4096)  # fmt: skip
    assert qwen2["attention_bias"] == "qkv" and qwen2["sliding_window_tokens"] == 0
    assert qwen2["n_kv_heads"] == 32  # transformers' Qwen2 default where the file has none


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(model_type="llama", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
         "RoPE type 'yarn': jaxdist's Llama computes default, linear, llama3 only"),
        (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8,
              max_window_layers=1), "layer_types mixes sliding_attention and full_attention"),
        (dict(model_type="llama", hidden_act="gelu"), "hidden_act is 'gelu'"),
        (dict(model_type="gemma"), "model_type 'gemma' is not one --model llama reads"),
    ],
)  # fmt: skip
def test_a_config_the_model_cannot_be_is_refused_by_name(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        settings_of(tmp_path, **config)


def test_a_map_s_requires_are_the_settings_its_format_holds():
    """What no tensor shows is checked by the map's ``requires`` on the way in and out
    (``--init-from``, export): a window into Llama's format, no biases into Qwen2's."""
    from jaxdist.weights.weight_map import check_requires, load

    windowed = {
        "qk_norm": False,
        "sliding_window_tokens": 8,
        "attention_bias": "none",
        "moe_experts": 0,
    }
    with pytest.raises(ConfigError, match="sliding_window_tokens is 8 in the model, the "
                       "format holds 0"):  # fmt: skip
        check_requires(load("llama"), windowed, "the model")
    check_requires(load("mistral"), windowed, "the model")  # Mistral's holds any window
    with pytest.raises(ConfigError, match="attention_bias is 'none' in the run's model, the "
                       "format holds 'qkv'"):  # fmt: skip
        check_requires(load("qwen2"), windowed, "the run's model")
    with pytest.raises(ConfigError, match="moe_experts is 4 in the model, the format holds 0"):
        check_requires(load("mistral"), {**windowed, "moe_experts": 4}, "the model")
