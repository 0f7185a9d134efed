"""Hugging Face Llama, Qwen2, Qwen3 and Mistral in and out: transformers (torch, on the
CPU) is the reference.

For each family a small model (2 layers, d_model 32, vocabulary 300) is built by
transformers from its config class (nothing downloaded), its norms and biases moved off
their initial values so that they count, and saved with ``save_pretrained``:

- llama: Llama 3's ``llama3`` RoPE scaling, 2 key/value heads for 4 query heads, an
  untied head;
- qwen2: q, k and v biases, the head tied to the embedding;
- qwen3: QK-norm, 2 key/value heads, head_dim 16 (not d_model / heads = 8);
- mistral: a sliding window of 8 positions over a sequence of 32, 2 key/value heads.

``--model-from-config DIR --init-from DIR --init-map FAMILY`` must give the built-in
Llama whose logits on the same tokens are transformers' (eager attention) within 1e-5,
under ``--mesh fsdp=2,model=2`` and in pipeline stages (``stage=2,model=2``). Then 5 steps are
trained (the llama through a 2-stage pipeline), exported with ``python -m jaxdist.export
--map FAMILY``, loaded by ``AutoModelForCausalLM.from_pretrained``, and its logits must
be the trained model's. A map without one of its transposes must not pass.

Needs the ``hf`` extra (torch, transformers); skipped with the reason without it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'jaxdist[hf]'")
transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'jaxdist[hf]'")

from hf_reference import eager_logits, nudged_and_saved  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.export import main as export_main  # noqa: E402
from jaxdist.train import config as config_lib  # noqa: E402
from jaxdist.train.trainer import setup, train  # noqa: E402
from jaxdist.weights.weight_map import SHIPPED  # noqa: E402

D, LAYERS, HEADS, VOCAB, T = 32, 2, 4, 300, 32
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, T))  # (B, T)
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500.0}  # fmt: skip
FAMILIES = {  # family -> (config class, its settings beyond the shared sizes)
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                  rope_parameters=dict(ROPE_LLAMA3))),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8,
                                      tie_word_embeddings=False)),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """family -> a folder ``save_pretrained`` wrote, made once per module."""
    folders = {}
    for family, (name, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, name)(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, bos_token_id=None, eos_token_id=None, **extra,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        # norms start at 1 and biases at 0: moved so that they count
        folder = tmp_path_factory.mktemp(family)
        folders[family] = nudged_and_saved(model, folder, ("norm", "bias"), 0.2)
    return folders


def hf_logits(folder) -> np.ndarray:
    return eager_logits(folder, TOKENS)


def settings(folder, family: str, *extra: str):
    return config_lib.parse_args([
        "--model-from-config", str(folder), "--init-from", str(folder), "--init-map", family,
        "--seq-len", str(T), "--data", "grammar", "--global-batch-size", "8", "--steps", "5",
        "--log-every", "5", "--checkpoint-every", "0", *extra,
    ])  # fmt: skip


def read_in(config):
    """The run ``setup`` makes of ``config``, closed again: its model's parameters are
    the file's."""
    run = setup(config)
    run.batches.close()
    run.health.close(finished=True)
    return run


def jaxdist_logits(run, state) -> np.ndarray:
    return np.asarray(run.dp.merge(state)(TOKENS))


@pytest.mark.parametrize(
    "family, mesh",
    [("llama", "fsdp=2,model=2"), ("qwen2", "fsdp=2,model=2"), ("qwen3", "fsdp=2,model=2"),
     ("mistral", "fsdp=2,model=2"), ("llama", "stage=2,model=2"), ("qwen2", "stage=2,model=2"),
     ("qwen3", "stage=2,model=2"), ("mistral", "stage=2,model=2")],
)  # fmt: skip
def test_init_from_gives_transformers_logits(hf_folders, family, mesh):
    # model=2 splits heads (q 2 of 4, k and v 1 of 2 each), the MLP and the vocabulary;
    # stage=2 stacks the blocks, a layer per stage: the map's per-layer names read into
    # (L, ...) arrays split over stage
    folder = hf_folders[family]
    run = read_in(settings(folder, family, "--num-devices", "4", "--mesh", mesh))
    ours, theirs = jaxdist_logits(run, run.state), hf_logits(folder)
    assert ours.shape == theirs.shape == (2, T, VOCAB)
    assert np.abs(ours - theirs).max() < 1e-5, np.abs(ours - theirs).max()
    assert np.abs(theirs).max() > 0.3  # logits that are not all near zero


EXPORTED = {  # family -> (layout, what its config.json must say)
    "llama": ("stage=2,fsdp=2", {"rope_parameters": ROPE_LLAMA3, "tie_word_embeddings": False,
                                 "num_key_value_heads": 2}),
    "qwen2": ("data=2,model=2", {"tie_word_embeddings": True, "use_sliding_window": False}),
    "qwen3": ("fsdp=2,model=2", {"head_dim": 16, "attention_bias": False}),
    "mistral": ("data=2,model=2", {"sliding_window": 8}),
}  # fmt: skip


@pytest.mark.parametrize("family", list(EXPORTED))
def test_five_steps_exported_load_in_transformers_with_the_same_logits(
    hf_folders, family, tmp_path
):
    layout, written = EXPORTED[family]
    run_dir = tmp_path / "run"
    config = settings(hf_folders[family], family, "--num-devices", "4", "--mesh", layout,
                      "--run-dir", str(run_dir))  # fmt: skip
    run = train(config, quiet=True)
    trained = jaxdist_logits(run, run.state)
    assert np.abs(trained - hf_logits(hf_folders[family])).max() > 1e-2  # the steps moved it
    out = tmp_path / "export"
    assert export_main([str(run_dir), "--out", str(out), "--map", family]) == 0
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["model_type"] == family
    assert {k: config_json[k] for k in written} == written
    exported = hf_logits(out)  # transformers' own loader, eager attention
    assert np.abs(exported - trained).max() < 1e-5, np.abs(exported - trained).max()
    if family == "llama":  # a format whose architecture the run's model breaks: refused
        assert export_main([str(run_dir), "--out", str(tmp_path / "q"), "--map", "qwen2"]) == 2
        assert not (tmp_path / "q").exists()


def test_a_map_missing_a_transpose_does_not_pass(hf_folders, tmp_path):
    """q_proj is square here (4 heads x 8 = 32 = d_model): read untransposed it fits and
    gives other logits; k_proj (16 x 32) untransposed does not fit and is refused."""
    folder = hf_folders["llama"]
    tree = yaml.safe_load((SHIPPED / "llama.yaml").read_text())
    projections = next(r for r in tree["params"] if "self_attn.{p:[qkvo]}_proj.weight" in r["from"])
    for untransposed, error in (("q", None), ("k", "shapes that do not fit")):
        rest = "".join(p for p in "qkvo" if p != untransposed)
        split = [{**projections, "from": projections["from"].replace("[qkvo]", f"[{rest}]")},
                 {"from": f"model.layers.{{i}}.self_attn.{untransposed}_proj.weight",
                  "to": f"blocks/{{i}}/{untransposed}/kernel"}]  # fmt: skip
        broken = {**tree, "params": [r for r in tree["params"] if r is not projections] + split}
        path = tmp_path / f"without-{untransposed}.yaml"
        path.write_text(yaml.safe_dump(broken))
        config = config_lib.parse_args([
            "--model-from-config", str(folder), "--init-from", str(folder), "--init-map",
            str(path), "--seq-len", str(T), "--data", "grammar", "--num-devices", "1",
        ])  # fmt: skip
        if error is None:
            run = read_in(config)
            wrong = np.abs(jaxdist_logits(run, run.state) - hf_logits(folder)).max()
            assert wrong > 1e-3, wrong
        else:
            with pytest.raises(ConfigError, match=error) as err:
                read_in(config)
            assert "k_proj.weight -> blocks/0/k/kernel" in str(err.value)


def test_flags_that_disagree_with_the_folder_are_refused_naming_both(hf_folders):
    folder = hf_folders["llama"]
    with pytest.raises(ConfigError) as err:
        settings(folder, "llama", "--n-kv-heads", "4", "--rope-theta", "10000")
    message = str(err.value)
    assert "--n-kv-heads 4 disagrees with its config.json's num_key_value_heads 2" in message
    assert "--rope-theta 10000.0 disagrees with its config.json's rope rope_theta 500.0" in message
    # the same file read with flags set by hand: --init-from checks its config.json
    config = config_lib.parse_args([
        "--model", "llama", "--d-model", str(D), "--n-heads", str(HEADS), "--n-layers",
        str(LAYERS), "--vocab-size", str(VOCAB), "--ffn-dim", "48", "--no-tie-embeddings",
        "--seq-len", str(T), "--data", "grammar", "--num-devices", "1", "--init-from",
        str(folder), "--init-map", "llama",
    ])  # fmt: skip
    with pytest.raises(ConfigError) as err:
        read_in(config)
    assert "num_key_value_heads is 2 there, 4 here" in str(err.value)
    assert "rope_parameters is" in str(err.value)
