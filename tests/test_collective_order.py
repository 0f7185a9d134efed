"""Programs with collectives that devices start in different orders.

XLA:CPU runs a program's operations on one thread pool shared by every emulated device,
and a collective holds its thread until all its participants arrive. With one thread per
device (XLA's default here) a pipelined GPT with a checkpoint, a replica check or
``--save-params`` aborted after 40 s in XLA's rendezvous, every time
(``jaxdist/cluster/cpu_backend.py``). jaxdist sizes the pool; what XLA still aborts
ends as a named failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import failures_of, metrics_of, run_module

REPRODUCER = (
    "--model",
    "gpt",
    "--vocab-size",
    "264",
    "--global-batch-size",
    "16",
    "--microbatches",
    "4",
    "--mesh",
    "stage=2,data=4",
    "--cpu-devices",
    "8",
)  # fmt: skip  (the default --log-every: steps overlap on the devices, as in real runs)
# (global batch, vocabulary, microbatches, mesh): the shape, and shapes around it
# (stage=2,fsdp=2,model=2 with a checkpoint, replica check and --save-params: test_matrix.py)
SHAPES = [
    (16, 264, 4, "stage=2,data=4"),
    (16, 512, 2, "stage=2,data=4"),
]


# What a user's shell does not have: jaxdist sizes the pool itself.
POOL_VARIABLES = ("PJRT_NPROC", "JAXDIST_SET_PJRT_NPROC")


def test_the_pipeline_checkpoints_checks_replicas_and_saves_params(tmp_path):
    run_dir, params = tmp_path / "run", tmp_path / "params.npz"
    proc = run_module(
        "jaxdist.train", *REPRODUCER, "--steps", "8", "--checkpoint-every", "4",
        "--check-replicas-every", "2", "--save-params", str(params), "--run-dir", str(run_dir),
        timeout=240, env_drop=POOL_VARIABLES,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics_of(run_dir)][-1] == 8
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4", "8"]
    with np.load(params) as saved:
        assert len(saved.files) > 10 and all(np.isfinite(saved[k]).all() for k in saved.files)
    assert not (run_dir / "failures.jsonl").exists()


@pytest.mark.parametrize("batch,vocab,microbatches,mesh", SHAPES[1:])
def test_shapes_around_it_finish_too(tmp_path, batch, vocab, microbatches, mesh):
    run_dir = tmp_path / "run"
    args = [*REPRODUCER, "--global-batch-size", str(batch), "--vocab-size", str(vocab)]
    args += ["--microbatches", str(microbatches), "--mesh", mesh, "--steps", "4"]
    args += ["--check-replicas-every", "2", "--checkpoint-every", "2"]
    args += ["--save-params", str(tmp_path / "p.npz"), "--run-dir", str(run_dir)]
    proc = run_module("jaxdist.train", *args, timeout=240, env_drop=POOL_VARIABLES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics_of(run_dir)][-1] == 4


def pool_of(cpu_devices: int, **env_extra) -> tuple[str, int]:
    """``PJRT_NPROC`` and XLA's CPU pool threads in a fresh process that ran
    ``jaxdist.initialize(cpu_devices=...)``, from a shell without jaxdist's variables."""
    code = (
        "import os, jax, jaxdist\n"
        f"jaxdist.initialize(cpu_devices={cpu_devices}); jax.devices()\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "names = [open(f'/proc/self/task/{t}/comm').read() for t in tasks]\n"
        "print(os.environ.get('PJRT_NPROC'), sum('XLAEigen' in n for n in names))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*POOL_VARIABLES, "JAX_NUM_CPU_DEVICES")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**env, **env_extra}
    )
    assert proc.returncode == 0, proc.stderr
    variable, threads = proc.stdout.split()[-2:]
    return variable, int(threads)


def test_the_cpu_pool_has_threads_for_every_devices_collectives():
    assert pool_of(8)[1] >= 8 * 8  # THREADS_PER_DEVICE x devices
    assert pool_of(8, PJRT_NPROC="9")[1] == 9  # a user's own PJRT_NPROC stands


def test_one_device_in_one_process_keeps_xlas_own_pool():
    """No collective can wait in it: extra threads would only compete with the step's
    (the tiny GPT's step on 2 cores: 5.3 ms with 2 threads, 6.5-8.4 ms with 8)."""
    variable, threads = pool_of(1)
    assert variable == "None" and threads <= (os.cpu_count() or 1)


def test_an_xla_abort_ends_as_a_named_failure(tmp_path):
    """A native abort (as XLA's rendezvous timeout ends a process) is one line naming the
    phase and step, a failures.jsonl record and exit 128 + SIGABRT, not a bare dump."""
    run_dir = tmp_path / "run"
    proc = run_module(
        "jaxdist.train", "--cpu-devices", "8", "--steps", "200", "--log-every", "1",
        "--run-dir", str(run_dir), timeout=120, env_extra={"JAXDIST_FAULT": "abort@0:3"},
    )  # fmt: skip
    assert proc.returncode == 134, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxdist: error: native code (XLA) aborted this process in the ")
    assert " phase of step " in last
    (record,) = failures_of(run_dir)
    assert record["cause"] == "aborted" and record["exit_code"] == 134
    assert record["step"] >= 3 and f"of step {record['step']}" in record["message"]
    json.dumps(record)  # strict JSON


def test_on_cpu_the_compilation_cache_is_used_only_when_given(tmp_path):
    """Programs loaded from XLA's persistent cache started their collectives in another
    order on each CPU device (``jaxdist.train.resume.use_compile_cache``): by default
    none is written on CPU; a directory given is used."""
    env = {
        "JAXDIST_CACHE": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    args = ["--cpu-devices", "8", "--steps", "2", "--global-batch-size", "16"]
    drop = ("JAX_COMPILATION_CACHE_DIR",)
    for run, extra in (("default", []), ("given", ["--compile-cache", str(tmp_path / "given")])):
        proc = run_module(
            "jaxdist.train", *args, *extra, "--run-dir", str(tmp_path / run), timeout=120,
            env_extra=env, env_drop=drop,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "cache" / "xla").exists()
    assert list((tmp_path / "given").glob("*train_step*"))


def test_off_turns_off_the_directory_jax_read_from_its_environment():
    """JAX reads JAX_COMPILATION_CACHE_DIR when it is imported (slurm/*.sh export it):
    ``--compile-cache off`` must undo that, not only skip jaxdist's own default."""
    import jax

    from jaxdist.train.resume import use_compile_cache

    session = jax.config.jax_compilation_cache_dir  # tests/conftest.py set one, as JAX would
    assert session
    try:
        for platform in ("cpu", "gpu"):
            jax.config.update("jax_compilation_cache_dir", session)
            assert use_compile_cache("off", platform) is None
            assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", session)
