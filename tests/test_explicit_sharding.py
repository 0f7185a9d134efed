"""Models as people write them now: JAX's explicit sharding and their own axis names.

``tests/explicit_model.py`` is a transformer in the explicit style (weights with
``out_sharding`` metadata on its own axis names ``fsdp`` and ``tp``, activations with
``out_sharding=``, weights gathered with ``jax.reshard``; grouped-query attention,
RMSNorm, RoPE), and its author's plain loop: an Explicit mesh of those names, the model
built under ``jax.set_mesh``, optax SGD. jaxdist trains it with ``axis_names={"tp":
"model"}`` on data=8, fsdp=8, fsdp=4,model=2 and data=2,fsdp=2,model=2 as the author's
loop trains it on a mesh of the same shape, and as on one device (10 steps, float32,
1e-5); each weight lies split as annotated; 2 processes x 4 devices through the command
line give the same numbers. Without the map the name ``tp`` is an error naming it and
its parameters. A model in the older style still runs without the explicit view."""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx

import explicit_model as em
import jaxdist
from helpers import launch, relative_error, run_cli, run_module
from jaxdist.data import write_token_file
from jaxdist.parallel.axis_names import UnmappedNames

TESTS = Path(__file__).resolve().parent
LAYOUTS = {
    "data=8": dict(data=8),
    "fsdp=8": dict(fsdp=8),
    "fsdp=4,model=2": dict(fsdp=4, model=2),
    "data=2,fsdp=2,model=2": dict(data=2, fsdp=2, model=2),
}
# the author's mesh of the same shape, in the model's own names
AUTHOR = {
    "data=8": {"data": 8, "fsdp": 1, "tp": 1},
    "fsdp=8": {"data": 1, "fsdp": 8, "tp": 1},
    "fsdp=4,model=2": {"data": 1, "fsdp": 4, "tp": 2},
    "data=2,fsdp=2,model=2": {"data": 2, "fsdp": 2, "tp": 2},
}
ONE_DEVICE = {"data": 1, "fsdp": 1, "tp": 1}


@functools.cache
def plain(shape: tuple) -> tuple[list[float], dict]:
    return em.plain_loop(dict(shape), em.token_batches())


def trained(layout: str, axis_names=None):
    """jaxdist's 10 SGD steps: (losses, host params, the final state's params, dp)."""
    mesh = jaxdist.make_mesh(**LAYOUTS[layout])
    names = {"tp": "model"} if axis_names is None else axis_names
    dp = jaxdist.Parallel(
        lambda: em.ExplicitLM(nnx.Rngs(0)), optax.sgd(em.LR), em.loss, mesh=mesh, axis_names=names
    )
    state, losses = dp.init_state(), []
    for batch in em.token_batches():
        state, metrics = dp.step(state, jaxdist.shard_batch(batch, mesh))
        losses.append(dp.metrics(metrics)["loss"])
    return losses, dp.host_params(state), state.params, dp


def close(got: tuple, want: tuple, what: str) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=what)
    assert got[1].keys() == want[1].keys(), (sorted(got[1]), sorted(want[1]))
    for name, value in want[1].items():
        assert relative_error(got[1][name], value) < 1e-5, (what, name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trains_as_its_authors_explicit_loop_and_as_one_device(layout, capsys):
    losses, params, state_params, dp = trained(layout)
    said = capsys.readouterr().out
    assert "the model annotates its own activations (JAX's explicit sharding)" in said
    assert dp.explicit_view is not None
    close((losses, params), plain(tuple(AUTHOR[layout].items())), f"{layout}: the author's")
    close((losses, params), plain(tuple(ONE_DEVICE.items())), f"{layout}: one device")
    assert losses[-1] < losses[0] - 0.2  # it learns: every comparison above means something
    # each weight lies split as annotated: its shard on a device is the annotated fraction
    sizes = {"fsdp": LAYOUTS[layout].get("fsdp", 1), "tp": LAYOUTS[layout].get("model", 1)}
    with nnx.use_eager_sharding(False):  # for its annotations only
        model = em.ExplicitLM(nnx.Rngs(0))
    arrays = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state_params)}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, path))
        array = arrays[name]
        names = variable.get_metadata()["out_sharding"]
        want = tuple(d // sizes.get(n, 1) for d, n in zip(array.shape, names, strict=True))
        shard = array.addressable_shards[0].data.shape
        assert shard == want, (layout, name, shard, want)


def test_the_models_own_axis_name_unmapped_is_an_error_naming_it_and_its_parameters():
    with pytest.raises(UnmappedNames) as raised:
        trained("fsdp=4,model=2", axis_names={})
    text = str(raised.value)
    assert "'tp' (blocks/0/w_down, blocks/0/w_gate, blocks/0/w_up, and 12 more)" in text, text
    assert "--axis-names tp=model" in text


def test_a_name_only_in_the_forward_pass_is_named_with_the_map_it_needs():
    """Activations named "mp" that no weight names: the forward pass's name is found."""

    class Renamed(em.ExplicitLM):
        def __call__(self, tokens):
            from jax.sharding import PartitionSpec as P

            x = super().__call__(tokens)
            return jaxdist_free_reshard(x, P(self.rows, None, "mp"))

    mesh = jaxdist.make_mesh(data=4, model=2)
    dp = jaxdist.Parallel(
        lambda: Renamed(nnx.Rngs(0)),
        optax.sgd(em.LR),
        em.loss,
        mesh=mesh,
        axis_names={"tp": "model"},
    )
    batch = jaxdist.shard_batch(em.token_batches(1)[0], mesh)
    with pytest.raises(UnmappedNames, match=r"names mesh axis 'mp' .* --axis-names mp=model"):
        dp.step(dp.init_state(), batch)


def jaxdist_free_reshard(x, spec):
    import jax

    return jax.reshard(x, spec)


def test_other_strategies_and_stages_are_refused_naming_gspmd(capsys):
    mesh = jaxdist.make_mesh(data=8)
    for strategy in ("shard_map", "pmap"):
        dp = jaxdist.Parallel(
            lambda: em.ExplicitLM(nnx.Rngs(0)), optax.sgd(em.LR), em.loss, mesh=mesh,
            strategy=strategy, axis_names={"tp": "model"},
        )  # fmt: skip
        batch = jaxdist.shard_batch(em.token_batches(1)[0], mesh)
        with pytest.raises(jaxdist.ConfigError, match=f"--strategy {strategy}: .*--strategy gspmd"):
            dp.step(dp.init_state(), batch)


# --- the command line: 2 processes x 4 devices, resume onto another layout, --init-from

G = em.ROWS  # the token file holds exactly one global batch of windows: every step
# trains on all of them, in some order, which the mean loss does not see


def token_file(tmp_path) -> Path:
    ids = np.random.default_rng(5).integers(0, em.VOCAB, G * em.SEQ + 1).astype(np.uint16)
    return write_token_file(tmp_path / "tokens.bin", ids, vocab_size=em.VOCAB, documents=1,
                            sources="random")  # fmt: skip


def whole_batch(path: Path) -> dict:
    ids = np.fromfile(path, dtype=np.uint16).astype(np.int32)
    windows = [ids[i * em.SEQ : i * em.SEQ + em.SEQ + 1] for i in range(G)]
    return {"tokens": np.stack(windows)}


def flags(path: Path, steps: int) -> list[str]:
    return [
        *("--model", "explicit_model:build", "--loss", "explicit_model:loss", "--task", "lm"),
        *("--data", str(path), "--seq-len", str(em.SEQ), "--vocab-size", str(em.VOCAB)),
        *("--global-batch-size", str(G), "--steps", str(steps), "--log-every", "1"),
        *("--optimizer", "sgd", "--lr", str(em.LR), "--momentum", "0", "--weight-decay", "0"),
        *("--clip-norm", "0", "--warmup-steps", "0", "--min-lr-ratio", "1"),
        "--no-tensorboard",
    ]


def logged(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_through_the_command_line_train_as_the_plain_loop(tmp_path):
    path = token_file(tmp_path)
    proc, _ = launch(
        *("--nproc", "2", "--cpu-devices-per-proc", "4", "--"),
        *(sys.executable, "-m", "jaxdist.train", *flags(path, 4)),
        *("--mesh", "fsdp=4,model=2", "--axis-names", "tp=model"),
        *("--run-dir", str(tmp_path / "two"), "--save-params", str(tmp_path / "two.npz")),
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "explicit view of the mesh, fsdp=4, tp=2 (jaxdist's model)" in proc.stdout
    want = em.plain_loop(AUTHOR["fsdp=4,model=2"], [whole_batch(path)] * 4)
    saved = dict(np.load(tmp_path / "two.npz"))
    close((logged(tmp_path / "two"), saved), want, "2 processes x 4 devices")


def test_unmapped_on_the_command_line_is_exit_2_with_one_line(tmp_path):
    path = token_file(tmp_path)
    run = run_cli(*flags(path, 2), "--cpu-devices", "8", "--mesh", "fsdp=4,model=2",
                  "--run-dir", str(tmp_path / "r"), cwd=TESTS)  # fmt: skip
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert "'tp' (blocks/0/w_down" in lines[0] and "--axis-names tp=model" in lines[0]
    assert not (tmp_path / "r").exists()


def test_resumed_onto_another_layout_and_loaded_by_init_from(tmp_path):
    """Stopped after its step-3 checkpoint on fsdp=4,model=2, continued on
    data=2,fsdp=2,model=2: the losses of an uninterrupted run. Exported, and read by
    --init-from on data=8 (--lr 0: the values are the file's, untouched)."""
    path = token_file(tmp_path)
    common = ["--axis-names", "tp=model", "--checkpoint-every", "3", "--cpu-devices", "8"]

    def train(steps: int, mesh: str, run_dir: str, *extra: str):
        done = run_cli(*flags(path, steps), *common, "--mesh", mesh,
                       "--run-dir", str(tmp_path / run_dir), *extra, cwd=TESTS)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    train(6, "fsdp=4,model=2", "full")
    train(3, "fsdp=4,model=2", "part")
    more = train(6, "data=2,fsdp=2,model=2", "part")
    assert "resumed from the checkpoint of step 3" in more.stdout
    np.testing.assert_allclose(logged(tmp_path / "part"), logged(tmp_path / "full"), rtol=1e-5)

    out = tmp_path / "w"
    exported = run_module("jaxdist.export", str(tmp_path / "full"), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    saved = str(tmp_path / "loaded.npz")
    train(1, "data=8", "loaded", "--lr", "0", "--init-from", str(out), "--save-params", saved)
    from safetensors.numpy import load_file

    files = load_file(str(out / "model.safetensors"))
    got = dict(np.load(saved))
    assert got.keys() == files.keys()
    for name, value in files.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


# --- flax's own mappings, the older style, the start-up lines, the user's line


def test_flax_sharding_rules_metadata_and_logical_axis_rules_are_honoured():
    import jax
    from flax import linen as nn

    class Ruled(nnx.Module):
        def __init__(self, rngs):
            rules = (("embed", "fsdp"), ("hidden", "tp"))
            self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 64)),
                               out_sharding=("embed", "hidden"), sharding_rules=rules)  # fmt: skip
            self.v = nnx.Param(
                jax.random.normal(rngs.params(), (64, 32)), out_sharding=("mlp2", "embed2")
            )

        def __call__(self, x):
            return jax.nn.relu(x @ self.w[...]) @ self.v[...]

    def loss(model, batch):
        return ((model(batch["x"]) - batch["x"]) ** 2).mean()

    mesh = jaxdist.make_mesh(fsdp=4, model=2)
    with nn.logical_axis_rules([("mlp2", "model"), ("embed2", "fsdp")]):
        dp = jaxdist.Parallel(lambda: Ruled(nnx.Rngs(0)), optax.sgd(0.1), loss, mesh=mesh,
                              axis_names={"tp": "model"})  # fmt: skip
    specs = {"/".join(map(str, p)): s.spec for p, s in nnx.to_flat_state(dp.state_sharding.params)}
    assert tuple(specs["w"]) == ("fsdp", "model") and tuple(specs["v"]) == ("model", "fsdp")
    state = dp.init_state()
    assert state.params["w"].get_value().addressable_shards[0].data.shape == (8, 32)


def test_a_model_in_the_older_style_runs_without_the_explicit_view(capsys):
    from jaxdist.losses import next_token_loss
    from jaxdist.models import GPT

    mesh = jaxdist.make_mesh(data=4, model=2)
    model = GPT(64, 8, 32, 1, 4, rngs=nnx.Rngs(0))
    dp = jaxdist.Parallel(model, optax.sgd(0.1), next_token_loss, mesh=mesh)
    batch = jaxdist.shard_batch(em.token_batches(1)[0], mesh)
    dp.step(dp.init_state(), batch)
    assert dp.explicit_view is None
    assert "explicit" not in capsys.readouterr().out


def test_a_model_axis_that_splits_nothing_is_said_with_its_cost(capsys):
    from jaxdist.losses import classification_loss
    from jaxdist.models import MLP

    mesh = jaxdist.make_mesh(data=4, model=2)
    model = MLP(12, 32, 2, 5, rngs=nnx.Rngs(0))  # 1,637 float32 parameters: 6,548 bytes
    dp = jaxdist.Parallel(model, optax.sgd(0.1), classification_loss, mesh=mesh)
    out = capsys.readouterr().out
    line = re.search(r"jaxdist: warning: --mesh model=2 splits no parameter.*", out)
    assert line and "2 copies of 6.4 KiB of parameters" in line.group(0), out
    assert dp.notices
    jaxdist.Parallel(model, optax.sgd(0.1), classification_loss, mesh=jaxdist.make_mesh(fsdp=8),
                     shard_optimizer=True)  # fmt: skip
    assert "--shard-optimizer with data=1: there is no data axis" in capsys.readouterr().out
