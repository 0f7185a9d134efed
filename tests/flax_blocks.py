"""Models written the way Flax's documentation and examples write them, and the plain
one-device optax loops they are compared with. Nothing here imports jaxdist: the models
are what a user brings, the loops what the user would run without it.

- ``LinenScanLM``: Linen blocks under ``nn.scan(nn.remat(Block), ...)``, the stacked
  parameters' leading axis named "layers" (``metadata_params``), as Flax's Linen
  scan-over-layers guides write it;
- ``NNXScanLM``: ``nnx.Embed``; blocks of ``nnx.RMSNorm`` and causal
  ``nnx.MultiHeadAttention``, made by ``nnx.split_rngs`` + ``nnx.vmap`` and run by
  ``nnx.scan`` as Flax's NNX transforms guide stacks layers; ``nnx.LayerNorm`` and an
  ``nnx.Linear`` head; their kernels and scales annotated with ``nnx.with_partitioning``;
- ``BatchNormMLP``: two ``nnx.BatchNorm`` and three ``nnx.Dropout`` (NNX basics).

Shapes: B batch (``ROWS``), T positions (``SEQ``), D ``D_MODEL``, H ``HEADS``, K head
size D/H, F ``D_MLP``, V ``VOCAB``, L ``LAYERS``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx, traverse_util

VOCAB, SEQ, D_MODEL, HEADS, D_MLP, LAYERS = 64, 8, 16, 4, 32, 2
ROWS, STEPS, LR = 16, 5, 0.5  # plain SGD, no clipping: a wrong gradient scale shows

_LECUN = nn.initializers.lecun_normal()  # Linen's and NNX's default kernel init

# --- Linen: nn.scan over nn.remat blocks


def _logical(names, init=_LECUN):
    return nn.with_logical_partitioning(init, names)


class LinenBlock(nn.Module):
    """Pre-norm MLP block, ``(x, None) -> (x, None)``: the body ``nn.scan`` wants (x
    carried, nothing stacked out). Linen attention: test_layout_defaults.py's DocsLM."""

    @nn.compact
    def __call__(self, x, _):  # x: (B, T, D)
        h = nn.Dense(D_MLP, kernel_init=_logical(("embed", "mlp")))(nn.LayerNorm()(x))
        return x + nn.Dense(D_MODEL, kernel_init=_logical(("mlp", "embed")))(nn.gelu(h)), None


class LinenScanLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):  # (B, T) int32 -> (B, T, V) logits
        embedding_init = _logical(("vocab", "embed"), nn.initializers.normal(0.02))
        x = nn.Embed(VOCAB, D_MODEL, embedding_init=embedding_init)(tokens)
        blocks = nn.scan(
            nn.remat(LinenBlock),  # keeps each block's input, recomputes the rest
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
            metadata_params={nn.PARTITION_NAME: "layers"},  # (L, ...) named "layers"
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(VOCAB, kernel_init=_logical(("embed", "vocab")))(nn.LayerNorm()(x))


# --- NNX: MultiHeadAttention, Embed, LayerNorm/RMSNorm; stacked by vmap, run by scan


def _partitioned(names, init=_LECUN):
    return nnx.with_partitioning(init, names)


class NNXBlock(nnx.Module):
    """Pre-norm causal self-attention (the Linen model's blocks are the MLPs)."""

    def __init__(self, rngs: nnx.Rngs):
        ones = nnx.initializers.ones_init()
        self.norm = nnx.RMSNorm(D_MODEL, scale_init=_partitioned(("norm",), ones), rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            HEADS,
            D_MODEL,
            kernel_init=_partitioned(("embed", "heads")),  # q, k, v (D, H, K): flat (D, H*K)
            out_kernel_init=_partitioned(("heads", "embed")),  # out (H, K, D): flat (H*K, D)
            use_bias=False,  # a key bias gets a zero gradient (softmax cancels it): noise
            decode=False,
            rngs=rngs,
        )

    def __call__(self, x):  # (B, T, D) -> (B, T, D)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))  # (B, 1, T, T)
        return x + self.attention(self.norm(x), mask=mask)


class NNXScanLM(nnx.Module):
    """Every block parameter stacked on a leading (L,) axis named "layers"."""

    def __init__(self, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            VOCAB, D_MODEL, embedding_init=_partitioned(("vocab", "embed"), normal), rngs=rngs
        )

        @nnx.split_rngs(splits=LAYERS)  # each layer its own keys
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_blocks(rngs):
            return NNXBlock(rngs)

        self.blocks = create_blocks(rngs)
        ones, zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()
        self.norm = nnx.LayerNorm(
            D_MODEL,
            scale_init=_partitioned(("norm",), ones),
            bias_init=_partitioned(("norm",), zeros),
            rngs=rngs,
        )
        self.head = nnx.Linear(
            D_MODEL, VOCAB, kernel_init=_partitioned(("embed", "vocab")), rngs=rngs
        )

    def __call__(self, tokens):  # (B, T) -> (B, T, V)
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(self.norm(forward(self.embed(tokens), self.blocks)))


# --- NNX: BatchNorm and several Dropouts


class BatchNormMLP(nnx.Module):
    """(B, 8) -> (B, 3) logits: Linear, BatchNorm, relu, Dropout, twice; a last Dropout.
    The Linears before a BatchNorm have no bias: BatchNorm cancels it, so its gradient
    would be rounding noise that no two programs share."""

    def __init__(self, rngs: nnx.Rngs):
        kernel = _partitioned(("embed", "mlp"))
        self.linear1 = nnx.Linear(8, 32, use_bias=False, kernel_init=kernel, rngs=rngs)
        self.bn1 = nnx.BatchNorm(32, momentum=0.8, rngs=rngs)
        self.dropout1 = nnx.Dropout(0.3, rngs=rngs)
        self.linear2 = nnx.Linear(32, 32, use_bias=False, kernel_init=kernel, rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, momentum=0.8, rngs=rngs)
        self.dropout2 = nnx.Dropout(0.3, rngs=rngs)
        self.dropout3 = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        x = self.dropout1(nnx.relu(self.bn1(self.linear1(x))))
        x = self.dropout2(nnx.relu(self.bn2(self.linear2(x))))
        return self.head(self.dropout3(x))


def build(model_class) -> nnx.Module:
    """An NNX model built once, in one compiled program, as Flax's sharding guide builds
    one (``nnx.jit``). Its annotations are logical names, not mesh axes, so it is placed
    nowhere yet (``use_eager_sharding(False)``): a trainer lays it out by the names."""
    with nnx.use_eager_sharding(False):
        return nnx.jit(lambda: model_class(nnx.Rngs(0)))()


# --- data and losses


def token_batches():
    """Counting sequences mod V from random starts: learnable, so 5 steps move the loss.
    ``STEPS`` dicts of "ids" (B, T + 1) int32."""
    starts = np.random.default_rng(0).integers(0, VOCAB, (STEPS, ROWS, 1))
    return [{"ids": ((s + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)} for s in starts]


def lm_loss(model, batch):
    ids = batch["ids"]
    logits = model(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def class_batches():
    """``STEPS`` dicts of "x" (B, 8) float32 and "y" (B,) int32 in 3 classes."""
    x = np.random.default_rng(1).normal(size=(STEPS, ROWS, 8)).astype(np.float32)
    y = (x[..., 0] > 0).astype(np.int32) + (x[..., 1] > 1)
    return [{"x": x[i], "y": y[i]} for i in range(STEPS)]


def class_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# --- the plain loops: one device, flax, jax.grad and optax.sgd


def nnx_loop(model: nnx.Module, loss_fn, batches, seed=None, lr=LR):
    """``STEPS`` SGD steps of a copy of ``model`` as Flax's NNX guides train one
    (``nnx.Optimizer``, ``nnx.value_and_grad``, ``nnx.jit``), on one device. ``seed``:
    before step k every RNG stream restarts from ``fold_in(key(seed), k)`` (``nnx.reseed``,
    which gives streams of one name, e.g. each Dropout's, keys of their own).
    Returns (losses, {path: array} of the params and batch statistics)."""
    model = nnx.clone(model)  # Variables of its own (a merged split would share them)
    model.train()
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
    streams = {v.tag for _, v in nnx.to_flat_state(nnx.state(model, nnx.RngKey))}

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = []
    for step, batch in enumerate(batches):
        if seed is not None:
            key = jax.random.fold_in(jax.random.key(seed), step)
            nnx.reseed(model, **dict.fromkeys(streams, key))
        losses.append(float(train_step(model, optimizer, batch)))
    state = nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    return losses, {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in state}


def linen_loop(module: nn.Module, initial: dict, loss_fn, batches):
    """``STEPS`` SGD steps of a Linen ``module`` from ``initial`` ({flat name: array}),
    with ``module.apply``, ``jax.value_and_grad`` and optax, on one device:
    (losses, {flat name: array})."""
    params = jax.device_put(traverse_util.unflatten_dict(initial, sep="/"), jax.devices()[0])
    tx = optax.sgd(LR)

    @jax.jit
    def step(params, opt_state, batch):
        def loss(p):  # loss_fn calls its model on inputs: here, the module applied to p
            return loss_fn(lambda x: module.apply({"params": p}, x), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    final = traverse_util.flatten_dict(jax.device_get(params), sep="/")
    return losses, {name: np.asarray(value) for name, value in final.items()}
