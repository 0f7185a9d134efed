"""A small decoder-only language model in plain Flax Linen, annotated with the logical axis
names Flax and MaxText use. It stands for a user's model: nothing here knows about jaxdist,
so the trainer has only the annotations to lay the parameters out by."""

from __future__ import annotations

import jax
from flax import linen as nn

# Shapes: B batch, T positions, D d_model, H heads, K head size, F mlp, V vocab, L layers.

_zeros, _ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
_lecun = nn.initializers.lecun_normal()


def _init(names, init=_lecun):
    return nn.with_logical_partitioning(init, names)


def _layer_norm():
    return nn.LayerNorm(scale_init=_init(("norm",), _ones), bias_init=_init(("norm",), _zeros))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP. Takes and returns ``(x, None)`` so that
    ``nn.scan`` can use it as its body unchanged (carry x, nothing stacked out)."""

    n_heads: int
    d_mlp: int

    @nn.compact
    def __call__(self, x, _=None):  # x: (B, T, D)
        d_model = x.shape[-1]
        head = d_model // self.n_heads

        def qkv(name, use_bias=True):
            return nn.DenseGeneral(
                (self.n_heads, head),
                use_bias=use_bias,
                kernel_init=_init(("embed", "heads", "kv")),
                bias_init=_init(("heads", "kv"), _zeros),
                name=name,
            )

        h = _layer_norm()(x)
        # No key bias: it adds q.b to every logit of a query alike, which softmax cancels,
        # so it would get a zero gradient (float noise) and never train.
        q, k, v = qkv("query")(h), qkv("key", use_bias=False)(h), qkv("value")(h)  # (B, T, H, K)
        # "xla": plain einsums and softmax, which run on every backend (CPU included) and
        # which a trainer's partitioner can split by heads like any other op.
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        x = x + nn.DenseGeneral(
            d_model,
            axis=(-2, -1),
            kernel_init=_init(("heads", "kv", "embed")),
            bias_init=_init(("embed",), _zeros),
            name="out",
        )(att)  # (B, T, D)

        h = _layer_norm()(x)
        h = nn.Dense(
            self.d_mlp, kernel_init=_init(("embed", "mlp")), bias_init=_init(("mlp",), _zeros)
        )(h)  # (B, T, F)
        h = nn.Dense(
            d_model, kernel_init=_init(("mlp", "embed")), bias_init=_init(("embed",), _zeros)
        )(nn.gelu(h))  # (B, T, D)
        return x + h, None


class LinenLM(nn.Module):
    vocab: int
    max_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_mlp: int
    scan_layers: bool = False

    @nn.compact
    def __call__(self, tokens):  # tokens: (B, T) int32
        normal = nn.initializers.normal(0.02)
        embed = nn.Embed(self.vocab, self.d_model, embedding_init=_init(("vocab", "embed"), normal))
        pos = self.param(
            "pos_embedding", _init(("length", "embed"), normal), (self.max_len, self.d_model)
        )
        x = embed(tokens) + pos[: tokens.shape[1]]  # (B, T, D)
        if self.scan_layers:
            # One Block's parameters stacked on a leading (L,) axis, named "layers" so a
            # trainer can place it (e.g. over pipeline stages) like any other axis.
            blocks = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = blocks(self.n_heads, self.d_mlp, name="blocks")(x, None)
        else:
            for i in range(self.n_layers):
                x, _ = Block(self.n_heads, self.d_mlp, name=f"block_{i}")(x)
        x = _layer_norm()(x)
        # Tied output head: logits against the token embedding table.
        return embed.attend(x)  # (B, T, V)
