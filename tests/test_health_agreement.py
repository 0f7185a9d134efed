"""Every process runs the same thing, and replicas stay equal. With 2 processes under
``python -m jaxdist.launch``: a different ``--global-batch-size`` on one, or a different
compiled step (``JAXDIST_FAULT=program@1``), stops both before step 1 with exit 78,
naming the field and both values (for the program: both hashes, the first differing
line, both texts saved); a bit flipped in one replica's parameter stops the run at the
next replica check, before the checkpoint of that step, naming the parameter, the device
and its process (exit 79). In one process: the replica check compares exactly the
devices that hold the same block, for sharded and pmap layouts; a step on batch shapes
not seen before calls the agreement hook."""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from group_helpers import MLP
from helpers import failures_of
from jaxdist.health.fault_injection import flip_a_bit
from jaxdist.health.replica_check import ReplicaCheck, ReplicaDivergenceError


def launch_args(run_dir, *train_args: str, command=None) -> list[str]:
    train = [sys.executable, "-m", "jaxdist.train", *MLP, "--run-dir", str(run_dir)]
    train += ["--compile-cache", "off", *train_args]
    return ["--nproc", "2", "--cpu-devices-per-proc", "2", "--", *(command or train)]


def test_a_different_global_batch_on_one_process_stops_both_before_step_1(tmp_path, launcher):
    run_dir = tmp_path / "run"
    batch = "$((32 - 16 * JAXDIST_PROCESS_ID))"  # 32 on process 0, 16 on process 1
    shell = f"exec {sys.executable} -m jaxdist.train {' '.join(MLP)} --run-dir {run_dir} "
    shell += f"--steps 5 --global-batch-size {batch}"
    run = launcher(*launch_args(run_dir, command=["bash", "-c", shell]))
    assert run.proc.wait(timeout=120) == 78, run.text()[-3000:]
    expected = (
        "the processes differ in config train.global_batch_size: 32 on process 0, 16 on process 1"
    )
    said = [
        x
        for x in run.text().splitlines()
        if x.startswith(("[rank 0] jaxdist: error:", "[rank 1] jaxdist: error:"))
    ]
    assert len(said) == 2 and all(expected in x for x in said), run.text()[-3000:]  # each
    assert not (run_dir / "metrics.jsonl").exists()  # no step trained
    (failure,) = failures_of(run_dir)
    assert (failure["cause"], failure["process"], failure["exit_code"]) == ("mismatch", 1, 78)


def test_a_different_program_on_one_process_is_named_with_its_first_differing_line(
    tmp_path, launcher
):
    run_dir = tmp_path / "run"
    run = launcher(*launch_args(run_dir, "--steps", "5"), env={"JAXDIST_FAULT": "program@1"})
    assert run.proc.wait(timeout=120) == 78, run.text()[-3000:]
    line = next(x for x in run.text().splitlines() if x.startswith("[rank 0] jaxdist: error"))
    assert "compiled different training steps: hash " in line, line
    texts = [(run_dir / f"step-program.process{i}.txt").read_text() for i in (0, 1)]
    lines = [text.splitlines() for text in texts]
    differ = next(n for n, (a, b) in enumerate(zip(*lines, strict=False)) if a != b)
    assert f"first difference at line {differ + 1}:" in line, line
    assert "1.00000095" in texts[1].splitlines()[differ]  # the loss scaled by 1 + 2^-20
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_flipped_bit_in_one_replica_stops_the_run_before_its_checkpoint(tmp_path, launcher):
    run_dir = tmp_path / "run"
    args = ["--steps", "30", "--check-replicas-every", "5", "--checkpoint-every", "10"]
    run = launcher(*launch_args(run_dir, *args), env={"JAXDIST_FAULT": "flip@1:7"})
    assert run.proc.wait(timeout=120) == 79, run.text()[-3000:]
    # Flipped before step 7: the check after step 10 finds it, before saving step 10.
    message = "step 10: the data-parallel replicas of params/head/bias differ: device "
    assert message in run.text(), run.text()[-3000:]
    assert "(process 1) holds fingerprint" in run.text()
    assert not (run_dir / "checkpoints" / "10").exists()
    (failure,) = failures_of(run_dir)
    assert (failure["cause"], failure["process"], failure["exit_code"]) == (
        "replica_divergence",
        1,
        79,
    )


def model():
    return nnx.Linear(64, 32, rngs=nnx.Rngs(0))  # kernel: 2048 elements, fsdp splits it


def loss_fn(m, batch):
    return ((m(batch["x"]) - batch["y"]) ** 2).mean()


def batch(rows: int):
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(rows, 64)), "y": rng.normal(size=(rows, 32))}
    return {k: v.astype(np.float32) for k, v in data.items()}


@pytest.mark.parametrize(
    ("strategy", "mesh", "rules", "holders"),
    [
        ("pmap", {"data": 8}, None, 8),  # 8 copies of every parameter
        ("gspmd", {"data": 2, "fsdp": 4}, None, 2),  # the kernel in 4 blocks: 2 of each
        ("gspmd", {"data": 4, "model": 2}, [("kernel", (None, "model"))], 4),
    ],
)
def test_the_replica_check_names_the_one_device_that_differs(strategy, mesh, rules, holders):
    mesh = jaxdist.make_mesh(**mesh)
    dp = jaxdist.Parallel(model, optax.sgd(0.1), loss_fn, mesh=mesh, strategy=strategy, rules=rules)
    state = dp.init_state()
    state, _ = dp.step(state, jaxdist.shard_batch(batch(32), dp.mesh))
    check = ReplicaCheck(dp)
    check.check(state.params, step=1)  # equal replicas pass
    table = check.fingerprints(state.params)
    assert table.shape == (8, 2)  # (devices, [bias, kernel])
    kernel = check.paths.index("kernel")
    flipped = flip_a_bit(state, leaf=kernel)  # device 0's block of the kernel
    with pytest.raises(ReplicaDivergenceError) as found:
        check.check(flipped.params, step=2)
    message = str(found.value)
    assert "step 2: the data-parallel replicas of params/kernel differ: device " in message
    assert "(process 0) holds fingerprint 0x" in message
    assert f"the other {holders - 1} replica(s)" in message, message
    changed = check.fingerprints(flipped.params) != table
    assert changed.sum() == 1 and changed[:, kernel].sum() == 1  # only that block


def test_a_step_on_new_batch_shapes_calls_the_agreement_hook():
    dp = jaxdist.Parallel(model, optax.sgd(0.1), loss_fn, mesh=jaxdist.make_mesh())
    state = dp.init_state()
    calls = []
    first = jaxdist.shard_batch(batch(32), dp.mesh)
    dp.on_new_batch_shapes(
        lambda program, b: calls.append(jax.tree.leaves(b)[0].shape), known=first
    )
    state, _ = dp.step(state, first)
    state, _ = dp.step(state, first)
    assert calls == []  # known shapes: already agreed
    state, _ = dp.step(state, jaxdist.shard_batch(batch(64), dp.mesh))
    state, _ = dp.step(state, jaxdist.shard_batch(batch(64), dp.mesh))
    assert calls == [(64, 64)]  # once, before its first step
