"""The layout never changes the model: the default GPT's initial parameters are a function
of the model and the seed only, bit for bit under every mesh, strategy, ``--scan-layers``,
``--remat`` and stage count, and equal to the GPT that flax alone builds from
``nnx.Rngs(seed)``; the first step's loss is the same in every form; and a checkpoint of
one form (stacked, pipelined, unscanned) resumes in another, ending where an
uninterrupted run ends.

Checkpoints hold one form: a stack's (L, ...) arrays are saved as the unscanned model's
per-layer arrays ``blocks/0/...`` (params and optimizer state alike) and stacked again on
restore (jaxdist/parallel/saved_state.py)."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import jaxdist
from finished_runs import interrupt_after
from helpers import per_layer, relative_error
from jaxdist.checkpoint import Checkpointer
from jaxdist.models import stack
from jaxdist.models.gpt import GPT
from jaxdist.parallel import path_name
from jaxdist.train.build_model import model_factory
from jaxdist.train.config import from_dict
from jaxdist.train.optim import make_optimizer, make_schedule
from jaxdist.train.resume import use_compile_cache
from jaxdist.train.trainer import train

SEED, VOCAB, SEQ, D_MODEL, LAYERS, HEADS = 3, 260, 16, 32, 4, 2
STEPS, STOP = 6, 3


def config(run_dir=None, steps=STEPS, mesh="", scan=False, remat="none", **train_flags):
    model = {"name": "gpt", "vocab_size": VOCAB, "seq_len": SEQ, "d_model": D_MODEL}
    model.update(n_layers=LAYERS, n_heads=HEADS, attention="xla", scan_layers=scan, remat=remat)
    flags = {"steps": steps, "global_batch_size": 16, "log_every": 1, "seed": SEED}
    flags.update(mesh=mesh, checkpoint_every=STOP, keep=10, tensorboard=False)
    flags.update(run_dir=str(run_dir or ""), **train_flags)
    # SGD: Adam divides by the gradient's size, so two forms' rounding differences in a
    # near-zero gradient would become differences of a whole step in the parameter.
    optim = {"optimizer": "sgd", "lr": 0.5, "warmup_steps": 2}
    return from_dict({"model": model, "data": {"path": "grammar"}, "optim": optim, "train": flags})


def reference_params(jitted: bool) -> dict[str, np.ndarray]:
    """The GPT class built by flax alone from ``nnx.Rngs(seed)``: no jaxdist machinery."""

    def build():
        model = GPT(VOCAB, SEQ, D_MODEL, LAYERS, HEADS, attention="xla", rngs=nnx.Rngs(SEED))
        return nnx.state(model, nnx.Param)

    params = jax.jit(build)() if jitted else build()
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def losses(run) -> list[float]:
    return [record["loss"] for record in run.history]


def assert_params_close(got: dict, want: dict, tol: float) -> None:
    got, want = per_layer(got), per_layer(want)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert relative_error(got[name], value) <= tol, name


# The trainer's runs come first: the init programs of the same layouts below are then
# loaded from the compilation cache instead of compiled again.


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The unscanned data=8 run of STEPS steps, checkpoints every STOP: (run, run_dir)."""
    run_dir = tmp_path_factory.mktemp("unscanned") / "run"
    return train(config(run_dir), quiet=True), run_dir


def test_a_pipelined_checkpoint_resumes_unscanned(tmp_path, uninterrupted):
    """``--scan-layers --mesh stage=2,data=4`` for STOP steps (the uninterrupted run's
    losses), then the unscanned GPT on data=8 from its checkpoint: the uninterrupted
    run's losses and params."""
    full, _ = uninterrupted
    run_dir = tmp_path / "run"
    stacked = train(config(run_dir, steps=STOP, mesh="stage=2,data=4", scan=True), quiet=True)
    assert losses(stacked) == pytest.approx(losses(full)[:STOP], rel=1e-6, abs=0)
    saved = stacked.dp.host_params(stacked.state)
    assert "blocks/layers/fc/kernel" in saved
    resumed = train(config(run_dir), quiet=True)  # unscanned, data=8, to STEPS
    assert resumed.begin.step == STOP
    assert losses(resumed) == pytest.approx(losses(full)[STOP:], rel=1e-5)
    got = resumed.dp.host_params(resumed.state)
    assert "blocks/0/fc/kernel" in got
    assert_params_close(got, full.dp.host_params(full.state), 1e-5)
    # What it resumed from: the pipelined run's state, bit for bit, layer i in block i.
    restored, _ = resumed.dp.restore(run_dir / "checkpoints", step=STOP)
    for name, value in resumed.dp.host_params(restored).items():
        np.testing.assert_array_equal(value, per_layer(saved)[name], err_msg=name)


def test_an_unscanned_checkpoint_resumes_scanned(tmp_path, uninterrupted):
    full, full_dir = uninterrupted
    shutil.copytree(full_dir, tmp_path / "run")
    interrupt_after(tmp_path / "run", STOP)
    resumed = train(config(tmp_path / "run", scan=True), quiet=True)  # --scan-layers, data=8
    assert resumed.begin.step == STOP
    assert losses(resumed) == pytest.approx(losses(full)[STOP:], rel=1e-5)
    got = resumed.dp.host_params(resumed.state)
    assert "blocks/layers/fc/kernel" in got
    assert_params_close(got, full.dp.host_params(full.state), 1e-5)
    # Back to the unscanned form at the scanned run's last checkpoint: the same values.
    again = train(config(tmp_path / "run"), quiet=True)
    assert again.begin.step == STEPS and not again.history
    want = per_layer(got)
    for name, value in again.dp.host_params(again.state).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_the_first_loss_is_the_same_on_four_stages(uninterrupted):
    """Four pipeline stages, each block recomputed in the backward pass (two stages:
    above)."""
    run = train(config(steps=1, mesh="stage=4,data=2", remat="full"), write=False)
    assert losses(run)[0] == pytest.approx(losses(uninterrupted[0])[0], rel=1e-6, abs=0)


FORMS = {  # id: (mesh, strategy, --scan-layers, --remat)
    "data8": ("data=8", "gspmd", False, "none"),
    "data4-model2-remat-full": ("data=4,model=2", "gspmd", False, "full"),
    "fsdp8-shard_map-remat-block": ("fsdp=8", "shard_map", False, "block"),
    "data2-fsdp2-model2": ("data=2,fsdp=2,model=2", "gspmd", False, "none"),
    "scan-data8": ("data=8", "gspmd", True, "none"),
    "scan-data8-pmap-remat-block": ("data=8", "pmap", True, "block"),
    "scan-data4-model2": ("data=4,model=2", "gspmd", True, "none"),
    "scan-fsdp8-remat-full": ("fsdp=8", "gspmd", True, "full"),
    "scan-data2-fsdp2-model2-shard_map": ("data=2,fsdp=2,model=2", "shard_map", True, "none"),
    "stage2-data4": ("stage=2,data=4", "gspmd", True, "none"),
    "stage4-data2-remat-full": ("stage=4,data=2", "gspmd", True, "full"),
}


def parallel(mesh: str, strategy: str, scan: bool, remat: str) -> jaxdist.Parallel:
    """The trainer's model and optimizer (``--model gpt`` and the flags above) on
    ``mesh``: the model factory runs inside the init program, as under ``train``."""
    cfg = config(mesh=mesh, scan=scan or "stage" in mesh, remat=remat, strategy=strategy)
    sizes = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    schedule = make_schedule(cfg.optim, cfg.train.global_batch_size, STEPS)
    return jaxdist.Parallel(
        model_factory(cfg.model, SEED),
        make_optimizer(cfg.optim, schedule),
        lambda model, batch: 0.0,  # never called: only the initial state is made
        mesh=jaxdist.make_mesh(**sizes),
        strategy=strategy,
    )


@pytest.fixture(scope="module")
def reference():
    use_compile_cache("")  # as train() does: a program compiled before is loaded
    return reference_params(jitted=True)


def test_flax_alone_builds_the_same_values_jitted_or_eagerly(reference):
    """The reference: jitted, bit for bit what the init program makes; eagerly (op by
    op), XLA rounds the embeddings' normal draws differently, by at most one ulp."""
    eager = reference_params(jitted=False)
    assert eager.keys() == reference.keys()
    for name, value in eager.items():
        np.testing.assert_array_max_ulp(value, reference[name], maxulp=1)


@pytest.mark.parametrize("form", FORMS)
def test_initial_params_are_the_models_whatever_the_layout(form, reference):
    dp = parallel(*FORMS[form])
    got = per_layer(dp.host_params(dp.init_state()))
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{form}: {name}")


def test_the_stacked_init_holds_no_more_than_its_shards_under_fsdp():
    """Per device, the scanned model's init program (arguments + outputs + temporaries)
    needs no more than the unscanned one's + 10%: each device makes its own shards."""

    def per_device(scan):
        compiled = parallel("fsdp=8", "gspmd", scan, "none").lower_init().compile()
        memory = compiled.memory_analysis()
        return (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )

    assert per_device(True) <= per_device(False) * 1.1, (per_device(True), per_device(False))


def test_a_checkpoint_saved_stacked_still_restores_stacked(tmp_path):
    """Checkpoints saved before the per-layer form name a stack's arrays stacked
    ("params/blocks/layers/fc/kernel"): the stacked forms still restore them."""
    dp = parallel("data=8", "gspmd", True, "none")
    state = dp.init_state()
    arrays = {path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    assert any(name.endswith("trace/blocks/layers/fc/kernel") for name in arrays)  # momentum
    old = Checkpointer(tmp_path / "checkpoints")
    old.save(1, arrays)
    old.wait()
    old.close()
    restored, _ = dp.restore(tmp_path / "checkpoints")
    for path, value in jax.tree_util.tree_leaves_with_path(restored):  # params, momentum
        name = path_name(path)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(arrays[name]), err_msg=name)


class DropoutBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # its own RNG stream, forked from rngs


@pytest.mark.parametrize("in_turn", [False, True], ids=["vmapped", "made-in-turn"])
def test_a_stack_holds_its_blocks_values_and_rng_state(in_turn, monkeypatch):
    """Layer i of a Stack (params and each dropout layer's RNG stream) is block i of the
    blocks made in turn, and the streams are left where those blocks leave them; also when
    the stack cannot count a block's draws and makes its blocks in turn."""
    if in_turn:
        monkeypatch.setattr(stack, "_draws_per_block", lambda *args: None)
    rngs, again = nnx.Rngs(0, dropout=1), nnx.Rngs(0, dropout=1)
    layers = stack.Stack(DropoutBlock, 3, rngs=rngs).layers
    blocks = [DropoutBlock(again) for _ in range(3)]

    def plain(value):
        prng = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(value) if prng else value)

    for path, var in nnx.to_flat_state(nnx.state(layers)):
        for i, block in enumerate(blocks):
            want = dict(nnx.to_flat_state(nnx.state(block)))[path].get_value()
            np.testing.assert_array_equal(plain(var.get_value()[i]), plain(want), str(path))
    for name in ("default", "dropout"):
        assert int(rngs[name].count.get_value()) == int(again[name].count.get_value()), name
