"""What tests/test_readme_commands.py runs in place of a page's line it cannot run here.

A line marked ``# needs: ...`` that the commands after it depend on (a download from the
Hugging Face Hub) has a stand-in: something local that leaves what those commands read.
``hf download ORG/NAME --local-dir DIR`` (the README's fine-tuning example): a tiny
random model of NAME's family, built by transformers (2 layers, d_model 64, grouped
heads, the head tied as Qwen3-0.6B ties it), with a byte-level BPE of 512 ids trained by
``tokenizers`` on the repository's README, both written by ``save_pretrained`` into DIR
as the Hub's folder holds them (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` naming ``<|endoftext|>`` as its end of
document). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from readme_blocks import ROOT, Command, flag

# (program, subcommand) -> what the stand-in needs installed: (extra, module) pairs
STAND_INS = {("hf", "download"): (("hf", "transformers"), ("text", "tokenizers"))}
FAMILIES = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig",
            "mistral": "MistralConfig"}  # fmt: skip
EOS = "<|endoftext|>"


def stand_in_of(command: Command):
    """The stand-in's key for a skipped line that has one, else None."""
    tokens = command.tokens
    key = tuple(tokens[:2])
    return key if command.skip and key in STAND_INS else None


def needs(command: Command) -> list[tuple[str, str]]:
    """The (extra, module) pairs the line's stand-in imports (none for other lines)."""
    key = stand_in_of(command)
    return list(STAND_INS[key]) if key else []


def run_stand_in(command: Command, work: Path) -> Path:
    """Does what the line would have left: the folder of a tiny model. Returns it."""
    tokens = command.tokens
    repo, folder = tokens[2], flag(tokens, "--local-dir")
    assert folder, f"{command.where}: a download without --local-dir leaves no folder here"
    family = next((f for f in FAMILIES if f in repo.lower()), None)
    if family is None:
        pytest.fail(f"{command.where}: no stand-in for {repo}'s family; have {set(FAMILIES)}")
    return tiny_model(work / folder, family)


def tiny_model(folder: Path, family: str) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train([str(ROOT / "README.md")], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = getattr(transformers, FAMILIES[family])(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=fast.eos_token_id,
        bos_token_id=None,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder
