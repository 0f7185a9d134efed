"""Layouts that work by default:

- the built-in GPT pads its token embedding to a multiple of 128 rows (257 -> 384), so
  ``--mesh ...,model=2`` splits it; the padded rows take no probability mass (its loss is
  a plain model's over the real 257 rows);
- ``--mesh stage=S`` picks the microbatch count that divides each replica's rows;
- Flax's own annotations (``nn.MultiHeadDotProductAttention`` names its 3-d kernels with
  2 names, as ``nn.DenseGeneral`` does) train on every mesh as on one device, and fsdp
  stores a dimension it cannot split on another one, while model still refuses.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_layouts_linen as linen_test
from flax import linen as nn
from flax import nnx
from test_layouts_linen import (
    LR,
    VOCAB,
    assert_same_training,
    batches,
    flat_state,
    linen_names,
    loss_fn,
    mesh_axes,
)

import jaxdist
from jaxdist.losses import next_token_loss
from jaxdist.models.gpt import GPT, padded_vocab
from jaxdist.parallel.layout import LayoutError, state_shardings
from jaxdist.parallel.strategies.pipeline import auto_microbatches
from jaxdist.train.config import parse_args
from jaxdist.train.trainer import main, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import peer_plain_jax as plain  # noqa: E402  the plain-JAX GPT (test_bench_gpt.py)

# --- 1. the GPT's vocabulary, padded


def test_padded_vocab_rounds_up_to_a_multiple():
    assert padded_vocab(257, 128) == 384 and padded_vocab(50257, 128) == 50304
    assert padded_vocab(384, 128) == 384 and padded_vocab(257, 1) == 257


# data=2,fsdp=2,model=2 (the vocabulary over model, the embedding over fsdp) trains in
# test_matrix.py, and its layout is test_layouts.py's
@pytest.mark.parametrize("mesh", ["data=4,model=2"])
def test_the_default_gpt_trains_split_over_model(mesh):
    """The command's defaults (byte-level stdlib text, vocabulary 257) but --mesh."""
    run = train(parse_args(["--model", "gpt", "--mesh", mesh, "--steps", "2"]), write=False)
    losses = [h["loss"] for h in run.history]
    assert losses and all(np.isfinite(losses)), losses
    embedding = run.state.params["tok"]["embedding"].get_value()
    assert embedding.shape == (384, 64)
    want = jax.P("model", "fsdp" if "fsdp" in mesh else None)
    assert embedding.sharding.spec == want  # vocab -> model: 192 rows a device
    assert embedding.sharding.shard_shape(embedding.shape)[0] == 192


def test_padded_rows_take_no_probability_mass():
    """The padded GPT's loss is a plain-JAX GPT's (no jaxdist) holding only the first 257
    embedding rows, even with the padded rows made large enough to dominate a softmax
    they were part of."""
    model = GPT(257, 16, 32, 2, 4, attention="xla", rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert params["tok"]["embedding"].shape == (384, 32)
    params["tok"]["embedding"] = params["tok"]["embedding"].at[257:].set(30.0)
    nnx.update(model, params)
    tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, 257)
    assert model(tokens[:, :-1]).shape == (3, 16, 257)
    got, _ = next_token_loss(model, {"tokens": tokens})
    unpadded = jax.tree.map(jnp.asarray, params)
    unpadded["tok"]["embedding"] = params["tok"]["embedding"][:257]  # (257, 32)
    want = plain.loss_fn(unpadded, tokens, n_heads=4, dtype=jnp.float32, attention="xla")
    np.testing.assert_allclose(got, want, rtol=1e-6)


# --- 2. pipeline microbatches


@pytest.mark.parametrize("stages, rows, want", [(2, 8, 8), (2, 4, 4), (2, 12, 6), (2, 7, 7),
                                                (2, 1, 1), (4, 24, 12)])  # fmt: skip
def test_auto_microbatches_is_the_largest_dividing_count_up_to_4_per_stage(stages, rows, want):
    assert auto_microbatches(stages, rows)[0] == want


PIPELINE = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--steps", "2"]
PIPELINE += ["--mesh", "stage=2,data=4", "--global-batch-size", "16"]


@pytest.mark.parametrize("flags, rows", [([], 4), (["--grad-accum", "2"], 2)])
def test_the_default_microbatches_fit_a_small_batch(flags, rows, capsys, tmp_path):
    """16 rows / 4 data shards (/ grad-accum 2): fewer than 8 rows a replica per step."""
    rc = main([*PIPELINE, *flags, "--run-dir", str(tmp_path / "r")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    first = next(x for x in out.splitlines() if x.startswith("jaxdist:"))
    assert f"pipeline: 2 stages x {rows} microbatches (GPipe)" in first, first
    assert f"largest count <= 8 (4 per stage) dividing the {rows} rows each" in first, first


def test_microbatches_that_do_not_divide_are_refused(capsys, tmp_path):
    rc = main([*PIPELINE, "--microbatches", "3", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "4 rows per device per step (global batch 16 / 4 batch shards / grad-accum 1) " in err
    assert "do not split into 3 microbatches" in err


# --- 3. Flax's own annotations

D, D_MLP, ATT_HEADS = 64, 256, 4  # 4 heads: fsdp=8 cannot split the attention-out's rows


def _xavier(*names):
    return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


def _dense(features, *names):
    return nn.DenseGeneral(features, kernel_init=_xavier(*names))


class DocsLM(nn.Module):
    """A Linen LM annotated as Flax's guides write one; nothing of jaxdist."""

    @nn.compact
    def __call__(self, tokens):
        normal = nn.initializers.normal(0.02)
        embedding_init = nn.with_logical_partitioning(normal, ("vocab", "embed"))
        x = nn.Embed(VOCAB, D, embedding_init=embedding_init)(tokens)
        # q, k, v kernels (embed, heads, head_dim), out (heads, head_dim, embed): 2 names.
        # No biases: the key's gets a zero gradient (softmax cancels it), i.e. float noise
        # that no two programs share (tests/linen_lm.py).
        attention = nn.MultiHeadDotProductAttention(
            num_heads=ATT_HEADS,
            kernel_init=_xavier("embed", "kv"),
            use_bias=False,
            deterministic=True,
        )
        x = x + attention(nn.LayerNorm()(x), mask=nn.make_causal_mask(tokens))
        h = nn.gelu(_dense(D_MLP, "embed", "mlp")(nn.LayerNorm()(x)))
        x = x + _dense(D, "mlp", "embed")(h)
        return _dense(VOCAB, "embed", "vocab")(nn.LayerNorm()(x))


def docs_train_on(sizes):
    """(initial, losses, final params, dp, state) through jaxdist.Parallel on ``sizes``."""
    mesh = jaxdist.make_mesh(**sizes)
    example = batches()[0]["ids"][:1, :-1]
    dp = jaxdist.Parallel(DocsLM(), optax.sgd(LR), loss_fn, mesh=mesh, example_input=example)
    state = dp.init_state()
    initial, losses = linen_names(dp.host_params(state)), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    return initial, losses, linen_names(dp.host_params(state)), dp, state


def docs_plain_loop(initial):
    """One device, Linen's apply, jax.grad and optax.sgd only, from jaxdist's initial
    values (as test_layouts_linen.plain_loop: the bridge draws its init key its own way)."""
    return linen_test.sgd_loop(DocsLM(), initial)


ATTENTION = linen_test.PREFIX + "MultiHeadDotProductAttention_0/"
QUERY, OUT = ATTENTION + "query/kernel", ATTENTION + "out/kernel"
# (planned spec of the query kernel, of the attention-out kernel): embed -> fsdp on the
# first dimension; fsdp=8 cannot split out's 4 heads, so it stores embed's last dimension.
DOCS_LAYOUTS = {
    "data=8": (dict(data=8), (None, None, None), (None, None, None)),
    "data=4,model=2": (dict(data=4, model=2), (None, None, None), (None, None, None)),
    "fsdp=8": (dict(data=1, fsdp=8), ("fsdp", None, None), (None, None, "fsdp")),
    "data=2,fsdp=2,model=2": (
        dict(data=2, fsdp=2, model=2),
        ("fsdp", None, None),
        ("fsdp", None, None),
    ),
}


@pytest.mark.parametrize("layout", list(DOCS_LAYOUTS))
def test_flax_docs_model_trains_on_every_mesh_as_on_one_device(layout, capsys):
    sizes, query, out = DOCS_LAYOUTS[layout]
    initial, losses, params, dp, _ = docs_train_on(sizes)
    assert losses[-1] < losses[0] - 0.1, losses  # it learns: the comparison means something
    assert_same_training((losses, params), docs_plain_loop(initial), layout)
    planned = flat_state(dp.state_sharding.params)
    assert mesh_axes(planned[QUERY], 3) == query
    assert mesh_axes(planned[OUT], 3) == out
    said = re.findall(r"jaxdist: layout: (\d+) parameter\(s\)", capsys.readouterr().out)
    assert said == (["1"] if layout == "fsdp=8" else []), said  # once, only where it gave way


def annotated_linear(d_in, d_out, bias_names=None):
    kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    bias_init = nnx.initializers.zeros_init()
    if bias_names:
        bias_init = nnx.with_partitioning(bias_init, bias_names)

    def build():  # names only, placed by state_shardings (as the GPT is built)
        with nnx.use_eager_sharding(False):
            return nnx.Linear(
                d_in, d_out, kernel_init=kernel_init, bias_init=bias_init, rngs=nnx.Rngs(0)
            )

    return nnx.state(nnx.eval_shape(build))


def test_fsdp_stores_a_dimension_it_cannot_split_on_another(capsys):
    got = state_shardings(annotated_linear(12, 128), jaxdist.make_mesh(data=1, fsdp=8))
    assert got["kernel"].spec == jax.P(None, "fsdp")  # embed 12 -> fsdp=8 on mlp's 128
    assert "1 parameter(s) name a dimension that fsdp=8 does not divide" in capsys.readouterr().out
    # model keeps its dimension; fsdp finds no other free one it divides: replicated
    got = state_shardings(annotated_linear(6, 256), jaxdist.make_mesh(data=1, fsdp=4, model=2))
    assert got["kernel"].spec == jax.P(None, "model")  # embed 6 -> fsdp=4: nowhere free


def test_model_that_does_not_divide_is_still_an_error():
    message = r"kernel of shape \(12, 63\): dimension 63 is not divisible by mesh axis model "
    with pytest.raises(LayoutError, match=message + r"of size 2 .*--axis-names"):
        state_shardings(annotated_linear(12, 63), jaxdist.make_mesh(data=4, model=2))


def test_an_annotation_longer_than_the_array_is_still_an_error():
    state = annotated_linear(4, 8, bias_names=("embed", "mlp"))  # bias (8,): 2 names
    with pytest.raises(LayoutError, match=r"bias of shape \(8,\): 2 axes \('embed', 'mlp'\)"):
        state_shardings(state, jaxdist.make_mesh(data=8))
