"""The pipeline schedules 1f1b and interleaved (``--pipeline-schedule``) against GPipe and
against plain loops written without jaxdist.

- A stack of 4 blocks with dropout on stage=2,data=4 (1f1b under the shard_map strategy,
  the others under gspmd): every schedule trains as the plain flax/optax loop of
  ``dropout_contract`` (microbatch j's layers fold j into their keys) and as GPipe,
  within 1e-5; the loop under the neighbouring rule (one mask for every microbatch)
  differs, so the comparison can fail.
- The stacked GPT: 1f1b under data x stage x model with ``--remat full``, interleaved
  (V = 2) under data x stage x fsdp with ``--remat block``, each as the plain one-device
  optax loop, within 1e-5.
- Memory, through the command's flags: the compiled step's temporaries per device with
  1f1b are under half of GPipe's at M = 4 S (measured: 3.4 against 14.6 MiB).
- The bubble formulas, the chunk order of the interleaved stages, and the refusals."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_dropout_contract as contract
from flax import nnx

import jaxdist
import test_layouts as layouts
from dropout_contract import stack_by_microbatch
from helpers import relative_error
from jaxdist.errors import ConfigError
from jaxdist.models.gpt import GPT
from jaxdist.models.stack import Stack
from jaxdist.parallel.strategies.pipeline import Pipeline, bubble_fraction
from jaxdist.parallel.strategies.pipeline_interleaved import moved_chunks, relay
from jaxdist.train import compile_only
from jaxdist.train.config import parse_args
from test_layouts import SEQ, VOCAB

M = 4  # microbatches of the dropout model: 8 rows per data replica, 2 per microbatch
W = contract.W


class Block(nnx.Module):
    """A residual block with dropout; tanh keeps 4 of them from growing the activations
    (with ReLU the parameters reached 1e9 in 3 steps, past float32's 1e-5 agreement)."""

    def __init__(self, rngs: nnx.Rngs):
        # Annotated (as replicated): a Stack adds the "layers" name the stage axis splits.
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None))
        bias = nnx.with_partitioning(nnx.initializers.zeros_init(), (None,))
        self.linear = nnx.Linear(W, W, kernel_init=kernel, bias_init=bias, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.linear(x)))


class Piped(nnx.Module):
    """A dropout before a stack of 4 blocks with dropout: 2 stages x 2 chunks of 1 layer."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(contract.F, W, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        with nnx.use_eager_sharding(False):
            self.blocks = Stack(Block, 4, rngs=rngs)
        self.head = nnx.Linear(W, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks(self.drop(self.inp(x))))[:, 0]


@functools.cache
def piped_loss(fold: bool):
    """The model's loss with its stack run as the contract's plain microbatch loop."""

    def loss(model, batch):
        h = stack_by_microbatch(model.blocks.layers, model.drop(model.inp(batch["x"])), M, fold)
        return contract.mse(model.head(h)[:, 0], batch)

    return loss


def assert_same(got, want, rtol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        assert relative_error(got[1][name], value) < rtol, name


def test_schedules_follow_the_dropout_contract_and_equal_gpipe():
    want = contract.plain(Piped, piped_loss(True), replicas=4)
    same_masks = contract.plain(Piped, piped_loss(False), replicas=4)
    sizes, got = dict(data=4, stage=2), {}
    for schedule, strategy in (("gpipe", "gspmd"), ("1f1b", "shard_map"), ("interleaved", "gspmd")):
        run = contract.jaxdist_run(
            Piped, sizes, microbatches=M, pipeline_schedule=schedule, strategy=strategy
        )
        contract.assert_follows(run, want, same_masks)
        got[schedule] = run
    assert_same(got["1f1b"], got["gpipe"])
    assert_same(got["interleaved"], got["gpipe"])


G, STEPS = 32, 3


def gpt(remat):
    return GPT(VOCAB, SEQ, 32, 4, 4, attention="xla", scan_layers=True, remat=remat,
               rngs=nnx.Rngs(0))  # fmt: skip


def gpt_batches():
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, VOCAB, (G, SEQ + 1), dtype=np.int32)} for _ in range(STEPS)]


@pytest.fixture(scope="module")
def plain_gpt():
    """One device, flax and optax only (``test_layouts.plain_loop``), no remat: remat
    changes what is kept, not the numbers."""
    return layouts.plain_loop(model=lambda: gpt("none"), data=gpt_batches)


@pytest.mark.parametrize(
    "schedule, sizes, strategy, remat",
    [
        ("1f1b", dict(data=2, stage=2, model=2), "gspmd", "full"),
        ("interleaved", dict(data=2, stage=2, fsdp=2), "gspmd", "block"),
    ],
    ids=["1f1b-model-remat-full", "interleaved-fsdp-remat-block"],
)
def test_gpt_schedules_equal_a_plain_loop(schedule, sizes, strategy, remat, plain_gpt):
    losses, params, dp, _ = layouts.train_on(
        sizes, strategy, model=lambda: gpt(remat), data=gpt_batches, pipeline_schedule=schedule
    )
    assert dp.pipeline.schedule == schedule and dp.pipeline.microbatches == 8
    assert_same((losses, params), plain_gpt)


def temp_bytes(schedule: str) -> tuple[int, str]:
    """The compiled step's temporaries per device and the pipeline's description, built
    from the command's flags (``python -m jaxdist.train ... --dry-run`` compiles this)."""
    flags = ["--model", "gpt", "--d-model", "64", "--n-layers", "4", "--n-heads", "4"]
    flags += ["--seq-len", "32", "--global-batch-size", "64", "--mesh", "data=4,stage=2"]
    flags += ["--pipeline-schedule", schedule]
    dp, program, _ = compile_only.build(parse_args(flags), jax.devices())
    return program.compile().memory_analysis().temp_size_in_bytes, dp.pipeline.describe()


def test_1f1b_keeps_fewer_activations_than_gpipe():
    """M = 4 S = 8 (the command's default): GPipe keeps every tick's activations (M + S - 1
    microbatches per stage), 1f1b each stage's input per microbatch and one microbatch's
    activations. Measured here: 14.6 MiB and 3.4 MiB."""
    gpipe, gpipe_text = temp_bytes("gpipe")
    one_f_one_b, text = temp_bytes("1f1b")
    assert "2 stages x 8 microbatches (GPipe)" in gpipe_text
    assert "(1F1B:" in text and "bubble (S-1)/(M+S-1) = 1/9 = 11.1%" in text
    assert one_f_one_b < 0.5 * gpipe, (one_f_one_b, gpipe)


def test_bubble_formulas_and_the_interleaved_chunk_order():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    text = Pipeline(4, 8, schedule="interleaved", virtual=2).describe()
    assert "bubble (S-1)/(V*M+S-1) = 3/19 = 15.8%" in text and "2 chunks" in text
    # Device s's contiguous block of the relaid stack holds chunks s, s + S, ...: S = 4,
    # V = 2, one layer a chunk; chunks 1, 2, 5, 6 stay on their device (c // V == c % S).
    order = relay(jnp.arange(8), 4, 2)
    np.testing.assert_array_equal(order, [0, 4, 1, 5, 2, 6, 3, 7])
    assert moved_chunks(4, 2) == 6 and moved_chunks(2, 1) == 0


def pipelined(mesh_sizes, **options):
    return jaxdist.DataParallel(
        lambda: gpt("none"), optax.sgd(0.1), layouts.loss_fn,
        mesh=jaxdist.make_mesh(**mesh_sizes), **options,
    )  # fmt: skip


class OwnScan(nnx.Module):
    """Stacked layers (a leading "layers" axis) that the model runs itself, no Stack."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((4, 8, 8)), out_sharding=("layers", None, None))

    def __call__(self, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, self.w.get_value())[0]


def test_bad_schedules_are_refused():
    with pytest.raises(ConfigError, match=r"1f1b: the model runs its stacked layers with its own"):
        jaxdist.DataParallel(
            OwnScan, optax.sgd(0.1), lambda model, batch: model(batch).mean(),
            mesh=jaxdist.make_mesh(data=4, stage=2), pipeline_schedule="1f1b",
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"3 microbatches are fewer than the 4 stages"):
        pipelined(dict(data=2, stage=4), microbatches=3, pipeline_schedule="interleaved")
    with pytest.raises(ConfigError, match="'zb' is not one of gpipe, 1f1b, interleaved"):
        pipelined(dict(data=4, stage=2), pipeline_schedule="zb")
    dp = pipelined(dict(data=4, stage=2), pipeline_schedule="interleaved", virtual_stages=3)
    tokens = jax.ShapeDtypeStruct((G, SEQ + 1), np.int32)
    with pytest.raises(ConfigError, match=r"4 layers do not split into 2 stages x 3 virtual"):
        dp.program({"tokens": tokens})
