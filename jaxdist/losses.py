"""Default losses and evaluation metrics by task.

Losses: ``loss_fn(model, batch) -> (loss, aux_metrics)``, the mean over this call's batch
rows, computed in float32 whatever the compute dtype. Classification reads the batch
entries named by ``make_classification_loss(inputs, labels)`` (``--npz-inputs``,
``--npz-labels``); ``classification_loss`` reads ``x`` and ``y``."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from jaxdist.data.text import EOT
from jaxdist.models.documents import kept_targets


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
    nats = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # (B, T)
    # --document-mask: no target after an EOS (it begins the next document:
    # jaxdist.models.documents); a cut position counts 0 in the mean over all B x T, so
    # that the loss is the same sum of rows however the batch is split (a mean over the
    # kept positions of each replica's rows would weigh replicas unevenly)
    keep = kept_targets(tokens[:, :-1], getattr(model, "document_eos", None))
    if keep is None:
        return with_auxiliary(model, nats.mean())
    return with_auxiliary(model, (nats * keep).mean())


def with_auxiliary(model, loss):
    """(loss + the model's auxiliary loss, metrics) after its forward pass: a model with
    an ``auxiliary_loss()`` method (the built-in Llama's MoE: load balance and z-loss)
    returns (term, metrics); ``lm_loss`` is then the next-token loss alone."""
    auxiliary = getattr(model, "auxiliary_loss", None)
    if auxiliary is None:
        return loss, {}
    term, metrics = auxiliary()
    if not metrics:  # nothing auxiliary in this model (a dense Llama)
        return loss + term, {}
    return loss + term, {"lm_loss": loss, **metrics}


def make_fused_next_token_loss(chunks: int):
    """``next_token_loss`` of a GPT (``--loss-chunks``) without its (B, T, vocab) logits:
    the tied head and the cross-entropy run ``chunks`` slices of the sequence at a time,
    and each slice's gradient is formed at once (``fused_cross_entropy``). For a 124M
    GPT at 16 x 1024 the logits are 16384 x 50304: 1.65 GB in bf16 and 3.3 GB more in
    float32, written and read several times a step (experiments/PERF.md, lever 4)."""

    def fused_next_token_loss(model, batch):
        tokens = batch["tokens"]  # (B, T + 1)
        h = model.features(tokens[:, :-1])  # (B, T, D), the compute dtype
        # the head's table: the token embedding (tied), or the Llama's own untied head
        head = getattr(model, "lm_head", None) or model.tok
        table = head.embedding[...].astype(head.dtype or h.dtype)  # (rows, D)
        softcap = getattr(model, "final_softcap", 0.0)  # Gemma's logits, c tanh(s / c)
        labels = tokens[:, 1:]  # --document-mask: -1 (no target) after each EOS
        keep = kept_targets(tokens[:, :-1], getattr(model, "document_eos", None))
        labels = labels if keep is None else jnp.where(keep > 0, labels, -1)
        loss = fused_cross_entropy(h, table, labels, chunks, model.vocab_size, softcap)
        return with_auxiliary(model, loss)

    return fused_next_token_loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fused_cross_entropy(h, table, labels, chunks: int, vocab: int, softcap: float = 0.0):
    """Mean over (B, T) of the cross-entropy of ``h @ table.T`` (its first ``vocab``
    columns; soft-capped, c tanh(s / c), where ``softcap`` c > 0) against ``labels``;
    h (B, T, D), table (rows, D), labels (B, T) int; a label < 0 is no target (it counts
    0 in the mean)."""
    return _fused_loss_and_grads(h, table, labels, chunks, vocab, softcap)[0]


def _fused_loss_and_grads(h, table, labels, chunks: int, vocab: int, softcap: float = 0.0):
    """The loss and its gradients with respect to h and table, ``chunks`` slices of T
    at a time (the batch axis, which data parallelism splits, stays whole in each)."""
    b, t, d = h.shape
    rows = table.shape[0]
    n = b * t  # every position: a cut one (label < 0) counts 0, as next_token_loss's
    h_chunks = h.reshape(b, chunks, t // chunks, d).swapaxes(0, 1)  # (C, B, T/C, D)
    label_chunks = labels.reshape(b, chunks, t // chunks).swapaxes(0, 1)  # (C, B, T/C)

    def chunk(d_table, xs):
        h_c, labels_c = xs
        kept = (labels_c >= 0).astype(jnp.float32)
        labels_c = jnp.maximum(labels_c, 0)
        logits = jnp.einsum("btd,vd->btv", h_c, table, preferred_element_type=jnp.float32)
        logits = logits[..., :vocab]  # (B, T/C, vocab), float32
        if softcap:
            logits = softcap * jnp.tanh(logits / softcap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels_c[..., None], axis=-1)[..., 0]
        # d(mean loss)/d(logits) = (softmax - one_hot) / n, in the compute dtype as the
        # unfused path's logits gradient is; padded rows of the table get none
        grad = (jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(labels_c, vocab)) / n
        grad = grad * kept[..., None]
        if softcap:  # through c tanh(s / c): times 1 - tanh^2
            grad = grad * (1.0 - jnp.square(logits / softcap))
        grad = jnp.pad(grad.astype(h.dtype), ((0, 0), (0, 0), (0, rows - vocab)))
        d_h = jnp.einsum("btv,vd->btd", grad, table)
        d_table += jnp.einsum("btv,btd->vd", grad, h_c, preferred_element_type=jnp.float32)
        return d_table, (((lse - picked) * kept).sum(), d_h)

    d_table = jnp.zeros(table.shape, jnp.float32)
    d_table, (nats, d_h) = jax.lax.scan(chunk, d_table, (h_chunks, label_chunks))
    d_h = d_h.swapaxes(0, 1).reshape(b, t, d)
    return nats.sum() / n, (d_h, d_table.astype(table.dtype))


def _fused_backward(chunks, vocab, softcap, grads, g):
    d_h, d_table = grads  # computed in the forward pass: scaled by the incoming gradient
    return (d_h * g.astype(d_h.dtype), d_table * g.astype(d_table.dtype), None)


fused_cross_entropy.defvjp(_fused_loss_and_grads, _fused_backward)


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
    keep = kept_targets(tokens[:, :-1], getattr(model, "document_eos", None))
    if keep is None:
        return {"loss": nats.mean(-1), "nats": nats.sum(-1), "bytes": is_byte.sum(-1)}
    nats, is_byte = nats * keep, is_byte * keep  # --document-mask: the targets kept
    loss = nats.sum(-1) / jnp.maximum(keep.sum(-1), 1.0)
    return {"loss": loss, "nats": nats.sum(-1), "bytes": is_byte.sum(-1)}


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
