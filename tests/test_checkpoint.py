"""Checkpoints in the trainer: a run resumed from the checkpoint of step 12 ends with the
params of an uninterrupted run of 20 steps, bit for bit (every strategy, grad-accum,
BatchNorm and dropout); onto fewer devices and another layout it continues the same
losses; damaged and foreign checkpoints are named; an earlier run is never replaced
silently. The reference is the uninterrupted run's own files (params, metrics.jsonl).

Interrupting by deleting the checkpoints after step 12 gives the resumed run exactly
what a run killed after saving step 12 leaves; real signals and kills are in
tests/test_preemption.py and tests/test_checkpoint_cluster.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import relative_error, small_config
from jaxdist.config import ConfigError, from_dict, to_dict
from jaxdist.train import train

STEPS, EVERY, STOP = 20, 4, 12


def config(run_dir: Path, model: dict | None = None, **train_flags):
    base = to_dict(small_config(steps=STEPS, checkpoint_every=EVERY, keep=10, **train_flags))
    base["train"].update(run_dir=str(run_dir), compile_cache="off")
    base["model"].update(model or {})
    return from_dict(base)


def final_params(run) -> dict[str, np.ndarray]:
    return run.dp.host_params(run.state)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def interrupt_after(run_dir: Path, step: int) -> None:
    """What a run stopped after saving ``step`` leaves: no later checkpoint."""
    for path in (run_dir / "checkpoints").iterdir():
        if path.name.isdigit() and int(path.name) > step:
            shutil.rmtree(path)


def uninterrupted_then_resumed(tmp_path, model=None, **train_flags):
    run_dir = tmp_path / "run"
    full = train(config(run_dir, model, **train_flags), quiet=True)
    reference, reference_metrics = final_params(full), metrics(run_dir)
    interrupt_after(run_dir, STOP)
    resumed = train(config(run_dir, model, **train_flags), quiet=True)
    return reference, reference_metrics, resumed, run_dir


BN_DROPOUT = {"name": "ckpt_models:BatchNormDropoutMLP"}


@pytest.mark.parametrize(
    ("strategy", "grad_accum", "model"),
    [
        ("gspmd", 1, None),
        ("shard_map", 1, None),
        ("pmap", 1, None),
        ("gspmd", 2, None),
        ("gspmd", 1, BN_DROPOUT),
        ("pmap", 2, BN_DROPOUT),
    ],
    ids=[
        "gspmd",
        "shard_map",
        "pmap",
        "gspmd-accum2",
        "gspmd-bn-dropout",
        "pmap-accum2-bn-dropout",
    ],
)
def test_resumed_run_ends_with_the_uninterrupted_params_bit_for_bit(
    tmp_path, strategy, grad_accum, model
):
    reference, reference_metrics, resumed, run_dir = uninterrupted_then_resumed(
        tmp_path, model, strategy=strategy, grad_accum=grad_accum
    )
    assert resumed.begin.step == STOP
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [4, 8, 12, 16, 20]
    got = final_params(resumed)
    assert got.keys() == reference.keys()
    for name in reference:
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)
    # metrics.jsonl: one record per step, the resumed steps replacing the dropped ones
    records = metrics(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, STEPS + 1)), steps
    assert [r["loss"] for r in records] == [r["loss"] for r in reference_metrics]


def test_bn_statistics_and_optimizer_state_come_back_exactly(tmp_path):
    run_dir = tmp_path / "run"
    full = train(config(run_dir, BN_DROPOUT), quiet=True)
    again = train(config(run_dir, BN_DROPOUT), quiet=True)  # already trained: restores 20
    assert again.begin.step == STEPS and not again.history
    for part in ("batch_stats", "opt_state"):
        for a, b in zip(
            jax_leaves(getattr(full.state, part)),
            jax_leaves(getattr(again.state, part)),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b, err_msg=part)


def jax_leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    ("after", "model"),
    [
        ({"num_devices": 4}, None),  # 8 devices -> 4
        (
            {"mesh": "data=4,model=2"},
            {"name": "gpt", "vocab_size": 258, "seq_len": 16, "d_model": 32, "n_heads": 2},
        ),
    ],
    ids=["8-to-4-devices", "gpt-data8-to-data4-model2"],
)
def test_elastic_resume_continues_the_uninterrupted_losses(tmp_path, after, model):
    run_dir = tmp_path / "run"
    lm = {"data": {"path": "grammar"}} if model else {}
    first = config(run_dir, model)
    full = train(_with(first, lm), quiet=True)
    reference = {r["step"]: r["loss"] for r in metrics(run_dir)}
    interrupt_after(run_dir, STOP)
    resumed = train(_with(config(run_dir, model, **after), lm), quiet=True)
    assert resumed.begin.step == STOP
    for record in metrics(run_dir):
        if record["step"] > STOP:
            assert record["loss"] == pytest.approx(reference[record["step"]], rel=1e-5)
    assert (
        relative_error(
            np.concatenate([v.ravel() for v in final_params(resumed).values()]),
            np.concatenate([v.ravel() for v in final_params(full).values()]),
        )
        < 1e-5
    )


def _with(cfg, sections: dict):
    tree = to_dict(cfg)
    for name, values in sections.items():
        tree[name].update(values)
    return from_dict(tree)


def newest_array_file(run_dir: Path, step: int) -> Path:
    files = [p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, capsys, damage):
    run_dir = tmp_path / "run"
    wide = {"hidden": 256}  # array chunks, not metadata, are the largest files
    reference = final_params(train(config(run_dir, wide), quiet=True))
    interrupt_after(run_dir, STOP)
    path = newest_array_file(run_dir, STOP)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x04
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = train(config(run_dir, wide), quiet=True)
    warning = capsys.readouterr().out
    assert f"checkpoint {STOP} in" in warning, warning
    if damage == "flip":  # the bytes decode to other values: the fingerprint tells
        assert re.search(r"corrupt: \S+ has fingerprint 0x\w{8}, saved as 0x\w{8}", warning)
    else:  # orbax fails to decode the array: named, with its saved shape
        assert re.search(r"cannot be read: \S+ \(saved as \(\d+, \d+\) float32\)", warning)
    assert resumed.begin.step == STOP - EVERY  # the previous checkpoint
    got = final_params(resumed)
    for name in reference:
        np.testing.assert_array_equal(got[name], reference[name], err_msg=name)


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    run_dir = tmp_path / "run"
    train(config(run_dir, {"hidden": 24}), quiet=True)
    with pytest.raises(ConfigError) as err:
        train(config(run_dir, {"hidden": 32}), quiet=True)
    text = str(err.value)
    assert f"checkpoint {STEPS} in" in text and "holds a different model" in text, text
    assert "params/head/kernel is (24, 5) float32 there and (32, 5) float32 in this one" in text


def test_an_earlier_run_is_never_replaced_silently(tmp_path):
    run_dir = tmp_path / "run"
    train(config(run_dir), quiet=True)
    with pytest.raises(
        ConfigError, match="has checkpoints .newest: step 20. and --resume is never"
    ):
        train(_with(config(run_dir), {"train": {"resume": "never"}}), quiet=True)
    shutil.rmtree(run_dir / "checkpoints")  # an earlier run with nothing to resume from
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds an earlier run .metrics.jsonl, config.yaml."):
        train(config(run_dir), quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == before  # untouched
    fresh = train(_with(config(run_dir), {"train": {"overwrite": True}}), quiet=True)
    assert fresh.begin.step == 0
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))


def test_a_changed_global_batch_is_said_not_silently_trained(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(config(run_dir), quiet=True)
    capsys.readouterr()
    longer = _with(config(run_dir), {"train": {"steps": 24, "global_batch_size": 32}})
    resumed = train(longer, quiet=True)
    out = capsys.readouterr().out
    assert resumed.begin.step == STEPS
    assert (
        f"note: resuming at step {STEPS}: the global batch is 32, the checkpoint's was 16: "
        f"batches from step {STEPS + 1} differ from the earlier run's, and the learning rate "
        "follows --lr-scaling none"
    ) in out, out
