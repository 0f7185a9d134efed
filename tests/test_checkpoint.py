"""Checkpoints in the trainer: a run resumed from the checkpoint of step 12 ends with the
params of an uninterrupted run of 20 steps, bit for bit (every strategy, grad-accum,
BatchNorm and dropout); onto fewer devices and another layout it continues the same
losses; damaged and foreign checkpoints are named; ``--keep`` and ``--lr-scaling`` hold
across a resume. The reference is the uninterrupted run's own files (params,
metrics.jsonl; tests/finished_runs.py). The run directory's guards:
tests/test_checkpoint_rundir.py.

Interrupting by deleting the checkpoints after step 12 gives the resumed run exactly
what a run killed after saving step 12 leaves; real signals and kills are in
tests/test_preemption.py and tests/test_checkpoint_cluster.py. Each uninterrupted run is
trained once for the session (``finished``) and every test works on a copy of it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from finished_runs import (
    EVERY,
    STEPS,
    STOP,
    config,
    final_params,
    interrupt_after,
)
from helpers import failures_of, flat, metrics_of, relative_error
from jaxdist.train.config import ConfigError
from jaxdist.train.trainer import train

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
    tmp_path, finished, strategy, grad_accum, model
):
    flags = {"strategy": strategy, "grad_accum": grad_accum}
    full, run_dir = finished(tmp_path, model, **flags)
    interrupt_after(run_dir, STOP)
    resumed = train(config(run_dir, model, **flags), quiet=True)
    assert resumed.begin.step == STOP
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [4, 8, 12, 16, 20]
    got = final_params(resumed)
    assert got.keys() == full.params.keys()
    for name in full.params:
        np.testing.assert_array_equal(got[name], full.params[name], err_msg=name)
    # metrics.jsonl: one record per step, the resumed steps replacing the dropped ones
    records = metrics_of(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, STEPS + 1)), steps
    assert [r["loss"] for r in records] == [r["loss"] for r in full.metrics]


def test_bn_statistics_and_optimizer_state_come_back_exactly(tmp_path, finished):
    full, run_dir = finished(tmp_path, BN_DROPOUT)
    again = train(config(run_dir, BN_DROPOUT), quiet=True)  # already trained: restores 20
    assert again.begin.step == STEPS and not again.history
    for part in ("batch_stats", "opt_state"):
        want, got = flat(getattr(full.run.state, part)), flat(getattr(again.state, part))
        assert got.keys() == want.keys() and want, part
        for name in want:  # float32 -> float64 is exact: still bit for bit
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{part}/{name}")


GPT = {"name": "gpt", "vocab_size": 258, "seq_len": 16, "d_model": 32, "n_heads": 2}


@pytest.mark.parametrize(
    ("after", "model", "data"),
    [
        ({"num_devices": 4}, None, None),  # 8 devices -> 4
        ({"mesh": "data=4,model=2"}, GPT, {"path": "grammar"}),
    ],
    ids=["8-to-4-devices", "gpt-data8-to-data4-model2"],
)
def test_elastic_resume_continues_the_uninterrupted_losses(tmp_path, finished, after, model, data):
    full, run_dir = finished(tmp_path, model, data=data)
    reference = {r["step"]: r["loss"] for r in full.metrics}
    interrupt_after(run_dir, STOP)
    resumed = train(config(run_dir, model, data=data, **after), quiet=True)
    assert resumed.begin.step == STOP
    assert [r["step"] for r in metrics_of(run_dir)] == list(range(1, STEPS + 1))
    for record in metrics_of(run_dir):
        if record["step"] > STOP:
            assert record["loss"] == pytest.approx(reference[record["step"]], rel=1e-5)
    assert (
        relative_error(
            np.concatenate([v.ravel() for v in final_params(resumed).values()]),
            np.concatenate([v.ravel() for v in full.params.values()]),
        )
        < 1e-5
    )


def newest_array_file(run_dir: Path, step: int) -> Path:
    files = [p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(
    tmp_path, finished, capsys, damage
):
    wide = {"hidden": 256}  # array chunks, not metadata, are the largest files
    full, run_dir = finished(tmp_path, wide)
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
    (record,) = failures_of(run_dir)
    assert (record["cause"], record["step"], record["recovered"]) == (
        "corrupt_checkpoint",
        STOP,
        True,
    )
    got = final_params(resumed)
    for name in full.params:
        np.testing.assert_array_equal(got[name], full.params[name], err_msg=name)


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path, finished):
    _, run_dir = finished(tmp_path, {"hidden": 24})
    with pytest.raises(ConfigError) as err:
        train(config(run_dir, {"hidden": 32}), quiet=True)
    text = str(err.value)
    assert f"checkpoint {STEPS} in" in text and "holds a different model" in text, text
    assert "params/head/kernel is (24, 5) float32 there and (32, 5) float32 in this one" in text


def test_keep_leaves_only_the_newest_checkpoints(tmp_path, finished):
    _, run_dir = finished(tmp_path)
    interrupt_after(run_dir, 8)  # 4 and 8 saved by the earlier attempt
    train(config(run_dir, keep=2), quiet=True)  # saves 12, 16 and 20
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["16", "20"]


@pytest.mark.parametrize(("scaling", "factor"), [("none", 1.0), ("linear", 2.0)])
def test_a_changed_global_batch_is_said_and_the_lr_follows_lr_scaling(
    tmp_path, finished, capsys, scaling, factor
):
    full, run_dir = finished(tmp_path)  # global batch 16, lr 0.05
    interrupt_after(run_dir, STOP)
    capsys.readouterr()
    scaled = {"lr_scaling": scaling, "base_batch_size": 16}
    resumed = train(config(run_dir, global_batch_size=32, optim=scaled), quiet=True)
    out = capsys.readouterr().out
    assert resumed.begin.step == STOP
    assert (
        f"note: resuming at step {STOP}: the global batch is 32, the checkpoint's was 16: "
        f"batches from step {STOP + 1} differ from the earlier run's, and the learning rate "
        f"follows --lr-scaling {scaling}: peak {0.05 * factor:.3g}, the checkpoint's 0.05"
    ) in out, out
    # The logged lr: the uninterrupted run's schedule, scaled by 32 / base batch 16 or not
    want = {r["step"]: r["lr"] * factor for r in full.metrics if r["step"] > STOP}
    got = {r["step"]: r["lr"] for r in metrics_of(run_dir) if r["step"] > STOP}
    assert got == pytest.approx(want, rel=1e-6)
