"""transformers on PyTorch as the reference of the Hugging Face families' tests: a model
with its starting norms (and biases) moved so that they count, saved; and its logits
with eager attention. Imported after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import numpy as np
import torch
import transformers


def nudged_and_saved(model, folder, names: tuple[str, ...], scale: float):
    """``model`` with every parameter whose name holds one of ``names`` moved by
    ``scale`` x a normal draw (norms start at 1 or 0, biases at 0), saved to ``folder``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.add_(scale * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def eager_logits(folder, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits (B, T, vocab) of ``tokens`` (B, T), eager attention."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()
