"""Default losses by task. Signature: ``loss_fn(model, batch) -> (loss, aux_metrics)``,
the mean over this call's batch rows, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def classification_loss(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)  # (B, C)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = (logits.argmax(-1) == batch["y"]).mean()
    return loss, {"accuracy": accuracy}


def next_token_loss(model, batch):
    tokens = batch["tokens"]  # (B, T + 1): inputs tokens[:, :-1], targets tokens[:, 1:]
    logits = model(tokens[:, :-1]).astype(jnp.float32)  # (B, T, vocab)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, {}


DEFAULT_LOSS = {"classify": classification_loss, "lm": next_token_loss}
