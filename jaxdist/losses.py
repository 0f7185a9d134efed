"""Default losses and evaluation metrics by task.

Losses: ``loss_fn(model, batch) -> (loss, aux_metrics)``, the mean over this call's batch
rows, computed in float32 whatever the compute dtype. Classification reads the batch
entries named by ``make_classification_loss(inputs, labels)`` (``--npz-inputs``,
``--npz-labels``); ``classification_loss`` reads ``x`` and ``y``."""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from jaxdist.data.text import EOT


def make_classification_loss(inputs: str = "x", labels: str = "y"):
    """Cross-entropy of ``model(batch[inputs])`` against ``batch[labels]``, and accuracy."""

    def classification_loss(model, batch):
        logits = model(batch[inputs]).astype(jnp.float32)  # (B, C)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[labels]).mean()
        accuracy = (logits.argmax(-1) == batch[labels]).mean()
        return loss, {"accuracy": accuracy}

    return classification_loss


classification_loss = make_classification_loss()


def next_token_loss(model, batch):
    tokens = batch["tokens"]  # (B, T + 1): inputs tokens[:, :-1], targets tokens[:, 1:]
    logits = model(tokens[:, :-1]).astype(jnp.float32)  # (B, T, vocab)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, {}


def default_loss(task: str, inputs: str = "x", labels: str = "y"):
    """The task's loss; classification reads the entries ``inputs`` and ``labels``."""
    return make_classification_loss(inputs, labels) if task == "classify" else next_token_loss


# Evaluation: ``eval_fn(model, batch) -> {name: (B,)}`` per-example values; the eval step
# sums them over real (unpadded) rows. Shown as eval_<name> = sum / count, except
# ``nats``/``bytes``, which give bits per byte = sum(nats) / ln 2 / sum(bytes).


def make_classification_eval(inputs: str = "x", labels: str = "y"):
    """Per-example cross-entropy and correctness of ``model(batch[inputs])``."""

    def classification_eval(model, batch):
        logits = model(batch[inputs]).astype(jnp.float32)  # (B, C)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[labels])  # (B,)
        correct = (logits.argmax(-1) == batch[labels]).astype(jnp.float32)
        return {"loss": loss, "accuracy": correct}

    return classification_eval


classification_eval = make_classification_eval()


def next_token_eval(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1]).astype(jnp.float32)  # (B, T, vocab)
    nats = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # (B, T)
    # Byte-level text: every target below EOT (256) is one byte of text; specials (end of
    # document) cost bits but are not bytes. Bits per byte = all bits / bytes.
    is_byte = (tokens[:, 1:] < EOT).astype(jnp.float32)
    return {"loss": nats.mean(-1), "nats": nats.sum(-1), "bytes": is_byte.sum(-1)}


def default_eval(task: str, inputs: str = "x", labels: str = "y"):
    """The task's per-example evaluation, reading the same entries as ``default_loss``."""
    return make_classification_eval(inputs, labels) if task == "classify" else next_token_eval


def eval_metrics(sums: dict[str, float], byte_level: bool) -> dict[str, float]:
    """Summed eval values -> ``eval_loss``, ``eval_accuracy``, ``eval_bpb``, ``eval_count``."""
    count = sums["count"]
    out = {"eval_count": round(count)}
    for name, total in sums.items():
        if name not in ("count", "nats", "bytes"):
            out[f"eval_{name}"] = total / count
    if byte_level and sums.get("bytes"):
        out["eval_bpb"] = sums["nats"] / math.log(2) / sums["bytes"]
    return out
