"""Hugging Face Gemma 2 in and out of ``--model gemma``: transformers (torch, on the CPU)
is the reference.

The model (4 layers, d_model 32, 4 query heads over 2 key/value heads of 16 features,
vocabulary 300) has every Gemma 2 difference switched on so that each counts at 1e-5: a
sliding window of 8 positions over a sequence of 32 on layers 0 and 2 (layers 1 and 3
global), attention logits soft-capped at 5 and the output logits at 3 (Gemma 2's 50
and 30 would barely bend logits this small), ``query_pre_attn_scalar`` 12 (not
head_dim), the four norms moved off their zero start.

``--model-from-config DIR --init-from DIR --init-map gemma2`` must give transformers'
logits (eager attention) within 1e-5, unscanned under ``--mesh fsdp=2,model=2`` and as a
2-stage pipeline of stacked layers (the layer kinds travel with their layers) and split
over ``seq=2`` the all-to-all way; 5 steps
trained through the pipeline and exported must load in ``from_pretrained`` with the
trained model's logits. A map with two norms swapped, or a run whose layer pattern is
not the file's, must not pass.
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
from jaxdist.models.gemma import GLOBAL, SLIDING, layer_kinds  # noqa: E402
from jaxdist.train import config as config_lib  # noqa: E402
from jaxdist.train.trainer import setup, train  # noqa: E402
from jaxdist.weights.weight_map import SHIPPED  # noqa: E402

D, LAYERS, HEADS, VOCAB, T = 32, 4, 4, 300, 32
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, T))  # (B, T)
GEMMA = dict(num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=12,
             attn_logit_softcapping=5.0, final_logit_softcapping=3.0)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **GEMMA,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # the norms' w starts at 0 (scale 1 + w): moved so that they count
    return nudged_and_saved(model, tmp_path_factory.mktemp("gemma2"), ("norm",), 0.3)


def hf_logits(path) -> np.ndarray:
    return eager_logits(path, TOKENS)


def settings(path, *extra: str, init_map: str = "gemma2"):
    return config_lib.parse_args([
        "--model-from-config", str(path), "--init-from", str(path), "--init-map", init_map,
        "--seq-len", str(T), "--data", "grammar", "--global-batch-size", "8", "--steps", "5",
        "--log-every", "5", "--checkpoint-every", "0", "--num-devices", "4", *extra,
    ])  # fmt: skip


def logits_read_in(config) -> np.ndarray:
    run = setup(config)
    run.batches.close()
    run.health.close(finished=True)
    return np.asarray(run.dp.merge(run.state)(TOKENS))


def test_layer_kinds_follow_transformers_pattern():
    # Gemma2Config's default layer_types: "sliding_attention" if (i + 1) % 2 else "full"
    assert layer_kinds(4, 2, 8) == (SLIDING, GLOBAL, SLIDING, GLOBAL)
    assert layer_kinds(6, 3, 8) == (SLIDING, SLIDING, GLOBAL) * 2
    assert layer_kinds(3, 0, 8) == (SLIDING,) * 3
    assert layer_kinds(3, 2, 0) == (GLOBAL,) * 3  # no window: every layer global


@pytest.mark.parametrize(
    "mesh", ["fsdp=2,model=2", "stage=2,model=2", "seq=2,fsdp=2 --seq-attention all-to-all"]
)
def test_init_from_gives_transformers_logits(folder, mesh):
    # seq=2: each device attends 1 of the 2 key/value heads (2 of 4 query heads) over all
    # 32 positions, soft-capped and windowed as unsplit
    mesh, *extra = mesh.split()
    config = settings(folder, "--mesh", mesh, *extra)
    assert config.model.name == "gemma" and config.model.global_layer_every == 2
    ours, theirs = logits_read_in(config), hf_logits(folder)
    assert ours.shape == theirs.shape == (2, T, VOCAB)
    assert np.abs(ours - theirs).max() < 1e-5, np.abs(ours - theirs).max()
    assert np.abs(theirs).max() > 0.3


def test_five_pipelined_steps_exported_load_in_transformers_with_the_same_logits(folder, tmp_path):
    run_dir = tmp_path / "run"
    run = train(settings(folder, "--mesh", "stage=2,fsdp=2", "--run-dir", str(run_dir)),
                quiet=True)  # fmt: skip
    trained = np.asarray(run.dp.merge(run.state)(TOKENS))
    assert np.abs(trained - hf_logits(folder)).max() > 1e-2  # the steps moved it
    out = tmp_path / "export"
    assert export_main([str(run_dir), "--out", str(out), "--map", "gemma2"]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma2"
    assert written["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert {k: written[k] for k in GEMMA} == GEMMA
    exported = hf_logits(out)
    assert np.abs(exported - trained).max() < 1e-5, np.abs(exported - trained).max()


def test_a_map_with_two_norms_swapped_does_not_pass(folder, tmp_path):
    tree = yaml.safe_load((SHIPPED / "gemma2.yaml").read_text())
    swap = {"post_attn_norm": "mlp_norm", "mlp_norm": "post_attn_norm"}
    for rule in tree["params"]:
        for ours, theirs in swap.items():
            if rule["to"].endswith(f"/{ours}/scale"):
                rule["to"] = rule["to"].replace(ours, theirs)
                break
    path = tmp_path / "swapped.yaml"
    path.write_text(yaml.safe_dump(tree))
    wrong = logits_read_in(settings(folder, "--mesh", "fsdp=2", init_map=str(path)))
    assert np.abs(wrong - hf_logits(folder)).max() > 1e-3


def test_another_layer_pattern_or_one_not_a_pattern_is_refused(folder, tmp_path):
    with pytest.raises(ConfigError, match="--global-layer-every 3 disagrees with its config"):
        settings(folder, "--global-layer-every", "3")
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["full_attention", "sliding_attention"] * 2
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="is not every N-th layer full_attention"):
        settings(odd)


@pytest.mark.parametrize(
    "flags, says",
    [(["--attention", "cudnn"], "cuDNN's fused kernel does not"),
     (["--mesh", "seq=2,data=2"], "splits over seq the all-to-all way only")],
)  # fmt: skip
def test_what_gemma_cannot_run_is_refused_by_name(folder, flags, says):
    with pytest.raises(ConfigError, match=says):
        settings(folder, *flags)


@pytest.mark.parametrize(
    "model, says",
    [({"name": "llama", "attn_softcap": 50.0}, r"--attn-softcap 50.0: flag\(s\) of --model gemma"),
     ({"name": "gemma", "global_layer_every": 2}, "without --sliding-window-tokens")],
)  # fmt: skip
def test_a_gemma_flag_that_would_change_nothing_is_refused(model, says):
    from jaxdist.train.build_model import build_model

    with pytest.raises(ConfigError, match=says):
        build_model(config_lib.from_dict({"model": model}).model, seed=0)


def test_loss_chunks_give_the_plain_losses(folder):
    # the fused loss soft-caps its chunks' logits as the model's head does
    def losses(chunks: str):
        run = train(settings(folder, "--mesh", "data=4", "--steps", "3", "--log-every", "1",
                             "--loss-chunks", chunks), write=False, quiet=True)  # fmt: skip
        return [h["loss"] for h in run.history]

    np.testing.assert_allclose(losses("4"), losses("0"), rtol=1e-5)
