"""The trainer's side of the built-in Llama: the fused loss reading an untied head, the
FLOPs formula against XLA's count and in the trainer's report, and the flags a model
cannot read refused in one line (the model itself: test_llama.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.errors import ConfigError
from jaxdist.models.llama import Llama
from jaxdist.train.build_model import model_factory
from jaxdist.train.config import from_dict
from llama_equations import batches, build, loss_fn


def test_the_fused_loss_reads_an_untied_head():
    from jaxdist.losses import make_fused_next_token_loss

    model, batch = build(), {"tokens": jnp.asarray(batches()[0]["tokens"])}
    plain = loss_fn(model, batch)
    fused, _ = make_fused_next_token_loss(4)(model, batch)
    np.testing.assert_allclose(fused, plain, rtol=1e-6)


def test_the_flops_formula_is_xla_s_count_of_the_step():
    """6N + 12 L H Dh T per token against XLA's cost analysis of the unscanned model's
    loss and gradient on one device: within 3%, the rest XLA's elementwise work. Wide
    enough that a formula with d_model for H Dh (half of it here) or every parameter
    counted as a matmul (the untied embedding) would be off by more."""
    from jaxdist.flops import llama_flops_per_token

    dims = dict(d=128, heads=4, head_dim=64, kv=2, ffn=384, t=128, vocab=512, layers=2)
    model = Llama(
        dims["vocab"], dims["d"], dims["layers"], dims["heads"], n_kv_heads=dims["kv"],
        head_dim=dims["head_dim"], ffn_dim=dims["ffn"], tie_embeddings=False, attention="xla",
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.zeros((2, dims["t"] + 1), jnp.int32)

    def loss(p):
        return loss_fn(nnx.merge(graphdef, p), {"tokens": tokens})

    counted = jax.jit(jax.value_and_grad(loss)).lower(params).compile().cost_analysis()
    counted = counted[0] if isinstance(counted, list | tuple) else counted
    n = sum(x.size for x in jax.tree.leaves(params)) - dims["vocab"] * dims["d"]  # untied
    formula = llama_flops_per_token(n, dims["layers"], dims["heads"], dims["head_dim"], dims["t"])
    tokens_per_step = 2 * dims["t"]
    assert counted["flops"] / (formula * tokens_per_step) == pytest.approx(1.0, abs=0.03)


def test_the_trainer_reports_the_llama_formula():
    from jaxdist.train.trainer import train

    model = {"name": "llama", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1,
             "seq_len": 16, "tie_embeddings": False}  # fmt: skip
    config = from_dict({"model": model, "data": {"path": "grammar"},
                        "train": dict(steps=2, global_batch_size=8, num_devices=2)})  # fmt: skip
    run = train(config, write=False, quiet=True)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(run.dp.merge(run.state), nnx.Param)))
    n = params - 384 * 32  # the untied embedding: 257 byte ids padded to 384 rows
    assert run.flops.analytic == (6 * n + 12 * 1 * 4 * 8 * 16) * 8 * 16
    assert run.flops.formula == "6N + 12LHDhT"


@pytest.mark.parametrize(
    "model, message",
    [
        ({"name": "gpt", "n_kv_heads": 2}, "--n-kv-heads 2: flag(s) of --model llama, which "
         "--model gpt does not read"),
        ({"name": "llama", "layer_norm_eps": 1e-5}, "--layer-norm-eps 1e-05: flag(s) of --model "
         "gpt, which --model llama does not read"),
        ({"name": "mlp", "qk_norm": True}, "--qk-norm True: the built-in GPT's and Llama's "
         "flag(s), which --model mlp cannot see"),
        ({"name": "llama", "rope_factor": 8.0}, "--rope-factor 8.0: --rope-type default does "
         "not read it"),
        ({"name": "llama", "n_kv_heads": 3}, "--n-kv-heads 3 does not divide --n-heads 4"),
    ],
)  # fmt: skip
def test_flags_a_model_cannot_read_are_refused_in_one_line(model, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        model_factory(from_dict({"model": model}).model, seed=0)
