"""Where the process group comes from: flags, SLURM, environment, PyTorch names, none."""

import pytest

from jaxdist.cluster.environment import resolve
from jaxdist.errors import JaxdistError

SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_NODELIST": "node[1-8]",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "0",
}


def test_single_process_by_default():
    spec = resolve({})
    assert (spec.source, spec.num_processes, spec.process_id) == ("single", 1, 0)
    assert not spec.multi_process


def test_slurm_step_wins_and_refuses_explicit_flags():
    spec = resolve(SLURM | {"JAXDIST_COORDINATOR": "h:1", "MASTER_ADDR": "x", "WORLD_SIZE": "2"})
    assert (spec.source, spec.num_processes, spec.process_id) == ("slurm", 8, 3)
    with pytest.raises(JaxdistError, match="SLURM job step of 8 tasks.*process-id=2"):
        resolve(SLURM, coordinator="10.0.0.1:1234", num_processes=4, process_id=2)


def test_explicit_flags_win_over_environment():
    spec = resolve(
        {"JAXDIST_COORDINATOR": "h:1", "MASTER_ADDR": "x", "WORLD_SIZE": "2", "RANK": "1"},
        coordinator="10.0.0.1:1234",
        num_processes=4,
        process_id=2,
    )
    assert (spec.source, spec.coordinator, spec.num_processes, spec.process_id) == (
        "flags",
        "10.0.0.1:1234",
        4,
        2,
    )


def test_slurm_step_with_several_tasks():
    spec = resolve(SLURM)
    assert (spec.source, spec.coordinator, spec.num_processes, spec.process_id) == (
        "slurm",
        None,
        8,
        3,
    )


def test_slurm_one_task_per_node_drives_every_gpu_of_its_node():
    assert resolve(SLURM).local_device_ids is None  # JAX's default: GPU SLURM_LOCALID
    one_per_node = SLURM | {"SLURM_STEP_TASKS_PER_NODE": "1(x8)", "SLURM_GPUS_ON_NODE": "8"}
    assert resolve(one_per_node).local_device_ids == tuple(range(8))
    eight_per_node = one_per_node | {"SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_NTASKS": "8"}
    assert resolve(eight_per_node).local_device_ids is None
    assert resolve(one_per_node, local_device_ids="0,1").local_device_ids == (0, 1)


def test_slurm_step_with_one_task_is_not_a_group():
    assert resolve(SLURM | {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}).source == "single"


def test_launcher_environment():
    env = {
        "JAXDIST_COORDINATOR": "127.0.0.1:5000",
        "JAXDIST_NUM_PROCESSES": "2",
        "JAXDIST_PROCESS_ID": "1",
        "JAXDIST_LOCAL_DEVICE_IDS": "2,3",
    }
    spec = resolve(env)
    assert (spec.source, spec.coordinator, spec.process_id) == ("env", "127.0.0.1:5000", 1)
    assert spec.local_device_ids == (2, 3)


def test_pytorch_names():
    env = {
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29400",
        "WORLD_SIZE": "16",
        "RANK": "9",
        "LOCAL_RANK": "1",
    }
    spec = resolve(env)
    assert (spec.source, spec.coordinator, spec.num_processes, spec.process_id) == (
        "torch-env",
        "head:29400",
        16,
        9,
    )
    assert spec.local_device_ids == (1,)  # one process per GPU, as torchrun


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"coordinator": "h:1"}, {}, "go together"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, r"2 is not in \[0, 2\)"),
        ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, {}, "not HOST:PORT"),
        ({}, {"MASTER_ADDR": "h", "WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two'"),
        ({"local_device_ids": "0,x"}, {}, "comma-separated"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, env, match):
    with pytest.raises(JaxdistError, match=match):
        resolve(env, **kwargs)
