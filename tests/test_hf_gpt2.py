"""Hugging Face GPT-2 in and out: transformers (torch, on the CPU) is the reference.

A small ``GPT2LMHeadModel`` is built from a ``GPT2Config`` (nothing downloaded) and saved
with ``save_pretrained``; ``--init-from`` that folder with ``--init-map gpt2`` must give
the built-in GPT whose logits on the same tokens are transformers' within 1e-4, in a
layout that splits heads and layers. Then 5 steps are trained, exported with
``python -m jaxdist.export --map gpt2`` (in shards), loaded back by ``from_pretrained``,
and the logits compared again. The folder's context (n_positions 64) is longer than the
model's (32): the position table's first rows are used, and export writes 32.

Needs the ``hf`` extra (torch, transformers); skipped with the reason without it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'jaxdist[hf]'")
transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'jaxdist[hf]'")

from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.export import main as export_main  # noqa: E402
from jaxdist.train import config as config_lib  # noqa: E402
from jaxdist.train.trainer import setup, train  # noqa: E402

D, LAYERS, HEADS, VOCAB, T = 32, 2, 4, 257, 32
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, T))  # (B, T)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=2 * T, n_embd=D, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2's init leaves LayerNorms at 1 and 0: make them count
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    return folder


def hf_logits(folder) -> np.ndarray:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def settings(*extra: str):
    return config_lib.parse_args([
        "--model", "gpt", "--d-model", str(D), "--n-layers", str(LAYERS), "--n-heads",
        str(HEADS), "--seq-len", str(T), "--vocab-size", str(VOCAB), "--layer-norm-eps",
        "1e-5", "--data", "grammar", "--global-batch-size", "8", "--steps", "5",
        "--log-every", "5", "--checkpoint-every", "0", *extra,
    ])  # fmt: skip


def jaxdist_logits(run, state) -> np.ndarray:
    return np.asarray(run.dp.merge(state)(TOKENS))


def test_init_from_gives_transformers_logits_in_a_split_layout(hf_folder):
    # model=2 splits each head's q, k, v columns and the MLP; --scan-layers stacks the
    # blocks: the map's per-layer names are read into (L, ...) arrays
    config = settings("--init-from", str(hf_folder), "--init-map", "gpt2", "--num-devices",
                      "4", "--mesh", "data=2,model=2", "--scan-layers")  # fmt: skip
    run = setup(config)
    run.batches.close()
    run.health.close(finished=True)
    ours, theirs = jaxdist_logits(run, run.state), hf_logits(hf_folder)
    assert ours.shape == theirs.shape == (2, T, VOCAB)
    assert np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()


def test_five_steps_exported_load_in_transformers_with_the_same_logits(hf_folder, tmp_path):
    # with dropout: its checkpoints hold RNG keys (typed arrays) that export reads past
    config = settings("--init-from", str(hf_folder), "--init-map", "gpt2", "--num-devices",
                      "2", "--run-dir", str(tmp_path / "run"), "--dropout", "0.1")  # fmt: skip
    run = train(config, quiet=True)
    trained = jaxdist_logits(run, run.state)
    assert np.abs(trained - hf_logits(hf_folder)).max() > 1e-3  # the steps changed the model
    out = tmp_path / "export"
    args = [str(tmp_path / "run"), "--out", str(out), "--map", "gpt2", "--max-shard-size", "60KB"]
    assert export_main(args) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # written in shards
    assert "lm_head.weight" not in index["weight_map"]  # tied to wte, as GPT-2 saves it
    written = json.loads((out / "config.json").read_text())
    assert (written["n_positions"], written["layer_norm_epsilon"]) == (T, 1e-5)
    assert written["resid_pdrop"] == 0.1
    exported = hf_logits(out)
    assert np.abs(exported - trained).max() < 1e-4, np.abs(exported - trained).max()


def test_a_config_json_of_other_sizes_is_refused_naming_both(hf_folder):
    config = settings("--init-from", str(hf_folder), "--init-map", "gpt2", "--num-devices",
                      "2", "--n-heads", "2", "--layer-norm-eps", "1e-6")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        setup(config)
    message = str(err.value)
    assert "n_head is 4 there, 2 here" in message
    assert "layer_norm_epsilon is 1e-05 there, 1e-06 here" in message
