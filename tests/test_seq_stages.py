"""``seq`` with ``stage``: pipelines of sequence-split microbatches. Each stage's layers
run on microbatches whose positions are split over seq, attention (ring, gather or
all-to-all) exchanging keys and values between the seq devices of that stage.
References: a plain one-device flax/optax loop written here (no jaxdist), data=8, the
stage-only program's memory analysis; the refusal where the step has no per-replica
region (a model axis).

SGD, as ``test_sequence_parallel.py`` says why: a gradient summed too often or too rarely
over seq shows, where Adam's normalisation would hide it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from helpers import relative_error
from jaxdist.losses import next_token_loss
from jaxdist.models.gpt import GPT

T, ROWS, STEPS, LAYERS = 32, 8, 3, 4  # 4 layers: interleaved's 2 stages x 2 chunks


def model(seq_attention="ring", scan=True, t=T, d=32):
    return GPT(260, t, d, LAYERS, 4, seq_attention=seq_attention, scan_layers=scan,
               rngs=nnx.Rngs(0))  # fmt: skip


def batches():
    rng = np.random.default_rng(0)  # (B, T + 1): inputs and the shifted targets
    return [{"tokens": rng.integers(0, 257, (ROWS, T + 1)).astype(np.int32)} for _ in range(STEPS)]


def jaxdist_run(mesh, seq_attention="ring", **options):
    """(losses, params by the unstacked names) of 3 SGD steps."""
    dp = jaxdist.DataParallel(
        lambda: model(seq_attention), optax.sgd(0.5), next_token_loss, mesh=mesh, **options
    )
    state, losses = dp.init_state(), []
    for batch in batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return losses, dp.host_params(state, per_layer=True)


def plain_loop():
    """One device, plain flax + optax, the blocks unstacked, jax.nn.dot_product_attention."""
    graphdef, params = nnx.split(model(scan=False), nnx.Param)
    opt = optax.sgd(0.5)
    opt_state = opt.init(params)

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])  # (B, T, vocab)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches():
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch["tokens"]))
        losses.append(float(loss))
    flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}
    return losses, flat


# one worker for the module: its fixture is made once, not once per worker
pytestmark = pytest.mark.xdist_group("seq_stages")


@pytest.fixture(scope="module")
def references():
    return {"plain": plain_loop(), "data=8": jaxdist_run(jaxdist.make_mesh(data=8))}


@pytest.mark.parametrize(
    "schedule, way",
    [("gpipe", "ring"), ("1f1b", "all-to-all"), ("interleaved", "gather")],
)
def test_stage2_seq2_data2_trains_as_a_plain_loop_and_data8(references, schedule, way):
    mesh = jaxdist.make_mesh(data=2, stage=2, seq=2)
    options = dict(microbatches=2, pipeline_schedule=schedule)
    if schedule == "interleaved":
        options["virtual_stages"] = 2
    losses, params = jaxdist_run(mesh, way, **options)
    for name, (want_losses, want) in references.items():
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=name)
        assert sorted(params) == sorted(want)
        for key, value in want.items():
            assert relative_error(params[key], value) < 1e-5, (name, key)


def test_each_stage_holds_half_the_positions_of_its_microbatches():
    """The same rows per pipeline replica (4): with seq=2 each device keeps T/2 positions
    of every activation, so the step's temporaries shrink by about half (measured 0.54 at
    T=128: the parameters' gradient and the ring's K/V blocks stay), and the ring's
    sends over seq appear beside the stages' own."""
    batch = {"tokens": jax.ShapeDtypeStruct((ROWS, 129), np.int32)}

    def compiled(devices, **axes):
        mesh = jaxdist.make_mesh(**axes, devices=jax.devices()[:devices])
        dp = jaxdist.DataParallel(
            lambda: model(t=128), optax.sgd(0.5), next_token_loss, mesh=mesh,
            microbatches=2,
        )  # fmt: skip
        return dp.program(batch).compile()

    split, whole = compiled(8, data=2, stage=2, seq=2), compiled(4, data=2, stage=2)
    ratio = split.memory_analysis().temp_size_in_bytes / whole.memory_analysis().temp_size_in_bytes
    assert 0.4 < ratio < 0.7, ratio

    def sends(program):  # XLA:CPU's synchronous form, or a GPU's async start
        text = program.as_text()
        return text.count("collective-permute(") + text.count("collective-permute-start(")

    assert sends(split) > sends(whole) + 4, (sends(split), sends(whole))


def test_seq_with_stages_and_a_model_axis_is_refused_by_name():
    """With model > 1 the step has no per-replica region: attention's shard_map over seq
    would sit inside the stages' one, which does not lower."""
    mesh = jaxdist.make_mesh(stage=2, seq=2, model=2)
    said = "seq=2 with stage=2: pipeline stages run a sequence split over seq per replica"
    with pytest.raises(jaxdist.ConfigError, match=said + r".*model axis \(model=2\)"):
        jaxdist_run(mesh, microbatches=2)
