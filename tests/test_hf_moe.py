"""Hugging Face Mixtral and Qwen3-MoE in and out of ``--model llama --moe-experts``:
transformers (torch, on the CPU) is the reference.

Two small models (2 layers, d_model 32, vocabulary 300, float32), built by transformers
from their config classes (nothing downloaded) and saved with ``save_pretrained``, which
writes one tensor per expert (the Hub's form):

- mixtral: 4 experts of width 24, top 2 renormalised, 2 key/value heads for 4 query
  heads, a sliding window of 8 over a sequence of 32;
- qwen3_moe: 8 experts of width 24 (its dense ``intermediate_size`` 40 used by no
  layer), top 2 not renormalised (``norm_topk_prob`` false), QK-norm, head_dim 16.

The norms, the routers and the experts are moved off their small initial values so that
each counts at 1e-5 (routers decisive, experts' outputs of the residual's size).
``--model-from-config DIR --init-from DIR --init-map FAMILY`` must give transformers'
logits (eager attention) within 1e-5 under ``fsdp=2,model=2`` and, with experts split
over an ``expert`` axis, ``expert=2,fsdp=2,model=2``; 3 trained steps exported with
``--map FAMILY`` must load in ``from_pretrained`` with the trained logits. A map with
each expert's gate and up swapped, or a folder with two experts swapped, must not pass;
what the model does not compute is refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'jaxdist[hf]'")
transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'jaxdist[hf]'")

from helpers import read_in  # noqa: E402
from hf_reference import eager_logits, nudged_and_saved  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.export import main as export_main  # noqa: E402
from jaxdist.train import config as config_lib  # noqa: E402
from jaxdist.train.trainer import train  # noqa: E402
from jaxdist.weights.weight_map import SHIPPED  # noqa: E402

D, LAYERS, HEADS, VOCAB, T = 32, 2, 4, 300, 32
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, T))  # (B, T)
FAMILIES = {  # family -> (config class, its settings beyond the shared sizes)
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=24, num_key_value_heads=2,
                                      sliding_window=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=24, intermediate_size=40,
                                         norm_topk_prob=False, num_key_value_heads=2,
                                         head_dim=16)),
}  # fmt: skip
# what each family's flags are, written by hand: --model-from-config must give these
BY_HAND = {
    "mixtral": ["--moe-experts", "4", "--moe-top-k", "2", "--moe-ffn-dim", "24",
                "--moe-norm-topk", "--n-kv-heads", "2", "--sliding-window-tokens", "8",
                "--head-dim", "8", "--rms-norm-eps", "1e-5", "--rope-theta", "1e6"],
    "qwen3_moe": ["--moe-experts", "8", "--moe-top-k", "2", "--moe-ffn-dim", "24",
                  "--ffn-dim", "40", "--no-moe-norm-topk", "--n-kv-heads", "2",
                  "--head-dim", "16", "--qk-norm"],
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a folder ``save_pretrained`` wrote, made once per module."""
    out = {}
    for family, (name, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, name)(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, **extra,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        # in memory both name the router mlp.gate and the experts mlp.experts.*
        moved = ("norm", "mlp.gate.weight", "experts")
        out[family] = nudged_and_saved(model, tmp_path_factory.mktemp(family), moved, 0.3)
    return out


def settings(folder, *extra: str, init_map: str = "", from_config: bool = True, devices=4):
    family = json.loads((folder / "config.json").read_text())["model_type"]
    source = ["--model-from-config", str(folder)] if from_config else ["--model", "llama"]
    return config_lib.parse_args([
        *source, "--init-from", str(folder), "--init-map", init_map or family,
        "--seq-len", str(T), "--data", "grammar", "--global-batch-size", "8", "--steps", "3",
        "--log-every", "3", "--checkpoint-every", "0", "--num-devices", str(devices), *extra,
    ])  # fmt: skip


def logits_read_in(config) -> np.ndarray:
    run = read_in(config)
    return np.asarray(run.dp.merge(run.state)(TOKENS))


def off(ours, theirs) -> float:
    assert ours.shape == theirs.shape == (2, T, VOCAB)
    return float(np.abs(ours - theirs).max())


def test_save_pretrained_writes_one_tensor_per_expert(folders):
    from jaxdist.weights import Reader

    names = set(Reader(folders["mixtral"]).shapes)
    assert {f"model.layers.1.block_sparse_moe.experts.{j}.w2.weight" for j in range(4)} <= names
    assert not any("gate_up_proj" in n for n in names)  # the fused form is memory's only
    names = set(Reader(folders["qwen3_moe"]).shapes)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names


@pytest.mark.parametrize("mesh", ["fsdp=2,model=2", "expert=2,fsdp=2,model=2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_from_gives_transformers_logits(folders, family, mesh, monkeypatch):
    # model=2 splits the heads and each expert's width (12 of 24), fsdp=2 its D (16 of
    # 32); expert=2 puts half of the experts on each device, read from their tensors only
    from jaxdist.weights import Reader

    reads, read = [], Reader.read
    monkeypatch.setattr(Reader, "read", lambda self, name, index=(): (
        reads.append((name, index)) or read(self, name, index)))  # fmt: skip
    config = settings(folders[family], "--mesh", mesh, devices=2 ** len(mesh.split(",")))
    assert config.model.moe_experts == FAMILIES[family][1].get("num_local_experts", 8)
    run = read_in(config)
    ours = np.asarray(run.dp.merge(run.state)(TOKENS))
    theirs = eager_logits(folders[family], TOKENS)
    spec = run.dp.named_targets["params/blocks/0/moe/gate"].sharding.spec  # (E, D, F)
    assert (spec[0] == "expert") == mesh.startswith("expert"), spec
    experts = [index for name, index in reads if ".experts." in name]
    # each (F, D) or (D, F) expert tensor read by quarters: (12, 16) or (16, 12)
    assert experts and all(sorted(s.stop - s.start for s in i) == [12, 16] for i in experts)
    assert off(ours, theirs) < 1e-5, off(ours, theirs)
    assert np.abs(theirs).max() > 0.3  # logits that are not all near zero


@pytest.mark.parametrize("family, mesh", [("mixtral", "fsdp=2,model=2"),
                                          ("qwen3_moe", "data=2,model=2")])  # fmt: skip
def test_trained_steps_exported_load_in_transformers_with_the_same_logits(
    folders, family, mesh, tmp_path
):
    run_dir = tmp_path / "run"
    run = train(settings(folders[family], "--mesh", mesh, "--run-dir", str(run_dir)),
                quiet=True)  # fmt: skip
    trained = np.asarray(run.dp.merge(run.state)(TOKENS))
    assert off(trained, eager_logits(folders[family], TOKENS)) > 1e-2  # the steps moved it
    out = tmp_path / "export"
    assert export_main([str(run_dir), "--out", str(out), "--map", family]) == 0
    written = json.loads((out / "config.json").read_text())
    theirs = json.loads((folders[family] / "config.json").read_text())
    keys = ["model_type", "num_experts_per_tok", "intermediate_size", "sliding_window"]
    keys += ["moe_intermediate_size", "norm_topk_prob", "head_dim"] if family != "mixtral" else []
    assert {k: written[k] for k in keys} == {k: theirs[k] for k in keys}
    assert written.get("num_local_experts", written.get("num_experts")) == theirs[
        "num_local_experts"]  # fmt: skip
    exported = eager_logits(out, TOKENS)  # transformers' own loader
    assert off(exported, trained) < 1e-5, off(exported, trained)
    # read back in: --model-from-config of the export is the run's model
    again = settings(out, "--mesh", mesh)
    assert off(logits_read_in(again), trained) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_from_config_is_the_model_of_the_flags_by_hand(folders, family):
    by_config = settings(folders[family]).model
    sizes = ["--d-model", str(D), "--n-heads", str(HEADS), "--n-layers", str(LAYERS),
             "--vocab-size", str(VOCAB), "--no-tie-embeddings"]  # fmt: skip
    by_hand = settings(folders[family], *BY_HAND[family], *sizes, from_config=False).model
    mine = {**dataclasses.asdict(by_config), "model_from_config": ""}
    assert mine == dataclasses.asdict(by_hand)
    # the router's aux-loss coefficient is not read: jaxdist's balance loss is per sequence
    default = config_lib.parse_args([]).model
    assert by_config.moe_balance_coef == default.moe_balance_coef


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_map_with_each_expert_s_gate_and_up_swapped_does_not_pass(folders, family, tmp_path):
    tree = yaml.safe_load((SHIPPED / f"{family}.yaml").read_text())
    swap = {"moe/gate": "moe/up", "moe/up": "moe/gate"}
    rules = []
    for rule in tree["params"]:
        if rule["to"] == "blocks/{i}/moe/{p}":  # qwen3_moe: one rule for the three
            for ours, theirs in (("gate", "up"), ("up", "gate"), ("down", "down")):
                rules.append({**rule, "from": rule["from"].replace("{p:gate|up|down}", ours),
                              "to": f"blocks/{{i}}/moe/{theirs}"})  # fmt: skip
            continue
        for ours, theirs in swap.items():
            if rule["to"].endswith(ours):
                rule = {**rule, "to": rule["to"].replace(ours, theirs)}
                break
        rules.append(rule)
    path = tmp_path / "swapped.yaml"
    path.write_text(yaml.safe_dump({**tree, "params": rules}))
    wrong = logits_read_in(settings(folders[family], "--mesh", "fsdp=2", init_map=str(path)))
    assert off(wrong, eager_logits(folders[family], TOKENS)) > 1e-3


def test_two_experts_swapped_in_the_file_give_other_logits(folders, tmp_path):
    """The stack's order is the experts' numbers: experts 0 and 1 of layer 0 renamed
    into each other's places give other logits."""
    from safetensors.numpy import load_file, save_file

    folder = folders["mixtral"]
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.block_sparse_moe.experts."
    for w in ("w1", "w2", "w3"):
        a, b = f"{prefix}0.{w}.weight", f"{prefix}1.{w}.weight"
        tensors[a], tensors[b] = tensors[b], tensors[a]
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    save_file(tensors, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    (swapped / "config.json").write_text((folder / "config.json").read_text())
    wrong = logits_read_in(settings(swapped, "--mesh", "fsdp=2"))
    assert off(wrong, eager_logits(folder, TOKENS)) > 1e-3


def test_a_missing_expert_is_refused_naming_it(folders, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = folders["qwen3_moe"]
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    holed = tmp_path / "holed"
    holed.mkdir()
    save_file(tensors, str(holed / "model.safetensors"), metadata={"format": "pt"})
    (holed / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"blocks/1/moe/up <- .*: no j=5"):
        logits_read_in(settings(holed, "--mesh", "fsdp=2"))


@pytest.mark.parametrize(
    "family, change, says",
    [("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers \\[0\\]"),
     ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
     ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
     ("mixtral", {"hidden_act": "gelu"}, "hidden_act is 'gelu'")],
)  # fmt: skip
def test_what_the_model_does_not_compute_is_refused_by_name(folders, tmp_path, family, change,
                                                            says):  # fmt: skip
    config = {**json.loads((folders[family] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=says):
        config_lib.parse_args(["--model-from-config", str(tmp_path)])


def test_a_flag_that_disagrees_or_a_model_the_format_cannot_hold_is_refused(folders, tmp_path):
    with pytest.raises(ConfigError, match="--moe-top-k 1 disagrees with its config.json's "
                       "num_experts_per_tok 2"):  # fmt: skip
        settings(folders["mixtral"], "--moe-top-k", "1")
    run_dir = tmp_path / "run"  # Mixtral always renormalises its top k
    train(settings(folders["qwen3_moe"], "--mesh", "fsdp=2", "--steps", "1", "--log-every",
                   "1", "--run-dir", str(run_dir)), quiet=True)  # fmt: skip
    assert export_main([str(run_dir), "--out", str(tmp_path / "m"), "--map", "mixtral"]) == 2
    assert not (tmp_path / "m").exists()
