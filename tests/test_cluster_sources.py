"""Every source of a process group from its variables (SLURM, Open MPI 4 and 5, a
Kubernetes Indexed Job and JobSet, flags, JAXDIST_*, PyTorch's names, none), their order,
each environment that says "several processes" but cannot form the group, and
``--process-group single``; last, one rank of an mpirun job whose peer never starts."""

import os
import re

import pytest

from helpers import run_module
from jaxdist.cluster.environment import resolve
from jaxdist.errors import ConfigError, JaxdistError
from jaxdist.train import config as config_lib

SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_NODELIST": "node[1-8]",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_PROCID": "3",
}
# mpirun -np 4, one rank per node (Open MPI 4): JAX's coordinator is the launcher's first
# address, port 61440 + (job id // 4096) % 4096 = 61440 + 373920 % 4096 = 62624
OMPI4 = {
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
}
# mpirun -np 2 on one node (Open MPI 5): the PMIx server's address, port 61440 + pid % 4096
URI5 = "prterun-gpu-node-7-4711@0.0;tcp4://127.0.0.1:43210"
OMPI5 = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "PRTE_LAUNCHED": "1",
    "PMIX_NAMESPACE": "prterun-gpu-node-7-4711@1",
    "PMIX_SERVER_URI41": URI5,
    "PMIX_SERVER_URI2": URI5,
}
INDEXED = {  # pod 2 of k8s/indexed-job.yaml's Job, 4 pods
    "JOB_COMPLETION_INDEX": "2",
    "JAXDIST_NUM_PROCESSES": "4",
    "JAXDIST_COORDINATOR": "train-0.train:55527",
}
JOBSET = {  # pod 1 of job 2 of a JobSet of 3 jobs x 2 pods
    "JOB_COMPLETION_INDEX": "1",
    "JAXDIST_JOB_INDEX": "2",
    "JAXDIST_PODS_PER_JOB": "2",
    "JAXDIST_NUM_PROCESSES": "6",
    "JAXDIST_COORDINATOR": "train-workers-0-0.train:55527",
}
LAUNCHER = {
    "JAXDIST_COORDINATOR": "127.0.0.1:5000",
    "JAXDIST_NUM_PROCESSES": "2",
    "JAXDIST_PROCESS_ID": "1",
}
TORCH = {"MASTER_ADDR": "head", "MASTER_PORT": "29400", "WORLD_SIZE": "16", "RANK": "9"}
FLAGS = {"coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}


def group(spec):
    return spec.source, spec.coordinator, spec.num_processes, spec.process_id


@pytest.mark.parametrize(
    "env, kwargs, expected",
    [
        (SLURM, {}, ("slurm", None, 8, 3)),
        (OMPI4, {}, ("openmpi", "10.96.0.1:62624", 4, 2)),
        (OMPI5, {}, ("openmpi", "127.0.0.1:62055", 2, 1)),
        (INDEXED, {}, ("kubernetes", "train-0.train:55527", 4, 2)),
        (JOBSET, {}, ("kubernetes", "train-workers-0-0.train:55527", 6, 5)),
        ({}, FLAGS, ("flags", "10.0.0.1:1234", 4, 2)),
        (LAUNCHER, {}, ("env", "127.0.0.1:5000", 2, 1)),
        (TORCH, {}, ("torch-env", "head:29400", 16, 9)),
        ({}, {}, ("single", None, 1, 0)),
    ],
)
def test_each_source_from_its_variables(env, kwargs, expected):
    assert group(resolve(env, **kwargs)) == expected


def test_open_mpi_4_over_ipv6_takes_the_first_address_in_brackets():
    uri = "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083:150e::3000:2]:43370"
    spec = resolve(OMPI4 | {"OMPI_MCA_orte_hnp_uri": uri})
    assert spec.coordinator == "[fe80::b9b:ac5d:9cf0:b858]:62880"  # 320928 % 4096 = 1440


def test_open_mpi_5_on_several_nodes_meets_at_the_launchers_host():
    # each node's PMIx server is its own (here loopback); the launcher's name is common
    spec = resolve(OMPI5 | {"OMPI_COMM_WORLD_SIZE": "4"})
    assert spec.coordinator == "gpu-node-7:62055"


def test_open_mpi_coordinator_can_be_given():
    assert resolve(OMPI4, coordinator="rank0:1234").coordinator == "rank0:1234"
    assert resolve(OMPI4 | {"JAXDIST_COORDINATOR": "r0:99"}).coordinator == "r0:99"
    assert resolve(OMPI4 | {"JAX_COORDINATOR_PORT": "4321"}).coordinator == "10.96.0.1:4321"


def test_open_mpi_devices_one_gpu_per_rank_only_when_ranks_share_a_node():
    assert resolve(OMPI4).local_device_ids is None  # one rank per node: every device
    assert resolve(OMPI5).local_device_ids == (1,)  # two on the node: its local rank's
    assert resolve(OMPI5, local_device_ids="0,1").local_device_ids == (0, 1)
    assert resolve(INDEXED).local_device_ids is None


@pytest.mark.parametrize(
    "env",
    [
        OMPI4 | {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
        {"JOB_COMPLETION_INDEX": "0", "JAXDIST_NUM_PROCESSES": "1"},
        {"WORLD_SIZE": "1"},
        {"JAXDIST_NUM_PROCESSES": "1"},
    ],
)
def test_one_process_is_not_a_group(env):
    assert resolve(env).source == "single"


@pytest.mark.parametrize(
    "env, source",
    [
        (SLURM | OMPI4 | INDEXED, "slurm"),
        (OMPI4 | INDEXED, "openmpi"),
        (INDEXED | {"MASTER_ADDR": "h", "WORLD_SIZE": "2"}, "kubernetes"),
        (OMPI4 | {"JAXDIST_NUM_PROCESSES": "8", "MASTER_ADDR": "h", "WORLD_SIZE": "8"}, "openmpi"),
        (LAUNCHER | TORCH, "env"),
        (TORCH, "torch-env"),
        # a launcher inside mpirun or a pod gave the process its own id: its group wins
        (OMPI4 | LAUNCHER, "env"),
        (INDEXED | LAUNCHER, "env"),
        ({"JOB_COMPLETION_INDEX": "2"} | TORCH, "torch-env"),  # torchrun in a pod
    ],
)
def test_the_first_source_that_applies_wins(env, source):
    assert resolve(env).source == source


def test_flags_win_over_the_environment_but_not_over_a_scheduler():
    assert resolve(LAUNCHER | TORCH, **FLAGS).source == "flags"
    with pytest.raises(JaxdistError, match="SLURM job step of 8 tasks.*drop --coordinator"):
        resolve(SLURM, coordinator="h:1")
    with pytest.raises(JaxdistError, match="Open MPI job of 4 processes.*num-processes=4"):
        resolve(OMPI4, **FLAGS)
    with pytest.raises(JaxdistError, match="Kubernetes job of 4 pods.*process-id=0"):
        resolve(INDEXED, process_id=0)


NO_OMPI_COORDINATOR = {k: v for k, v in OMPI4.items() if k != "OMPI_MCA_orte_hnp_uri"}


@pytest.mark.parametrize(
    "env, match",
    [
        (NO_OMPI_COORDINATOR, "OMPI_MCA_orte_hnp_uri .*PMIX_SERVER_URI.* JAXDIST_COORDINATOR"),
        (OMPI5 | {"PMIX_NAMESPACE": "job"}, "PMIX_NAMESPACE='job'"),
        (OMPI4 | {"OMPI_MCA_orte_hnp_uri": "x;ud://y"}, "no address and job id in OMPI_MCA"),
        (OMPI5 | {"OMPI_COMM_WORLD_SIZE": "4", "PMIX_NAMESPACE": "x-1@1"}, "no coordinator host"),
        (
            {"OMPI_COMM_WORLD_SIZE": "2"},
            r"\(OMPI_COMM_WORLD_SIZE\): OMPI_COMM_WORLD_RANK is not",
        ),
        (OMPI4 | {"OMPI_COMM_WORLD_RANK": "4"}, r"OMPI_COMM_WORLD_RANK=4: process id 4 is not in"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "WORLD_SIZE=2: RANK is not set"),
        (TORCH | {"RANK": "16"}, r"RANK=16, WORLD_SIZE=16: process id 16 is not in \[0, 16\)"),
        ({"JAXDIST_NUM_PROCESSES": "2"}, "JAXDIST_NUM_PROCESSES=2 without JAXDIST_COORDINATOR"),
        ({"JAXDIST_COORDINATOR": "h:1", "JAXDIST_NUM_PROCESSES": "2"}, "JAXDIST_PROCESS_ID is not"),
        ({"JOB_COMPLETION_INDEX": "0"}, "JOB_COMPLETION_INDEX=0: JAXDIST_NUM_PROCESSES is not set"),
        (INDEXED | {"JAXDIST_COORDINATOR": ""}, "JAXDIST_NUM_PROCESSES=4: no coordinator"),
        (INDEXED | {"JOB_COMPLETION_INDEX": "4"}, "JAXDIST_NUM_PROCESSES=4: process id 4 is not"),
        (INDEXED | {"JAXDIST_COORDINATOR": "train-0"}, "'train-0' .from kubernetes. is not HOST"),
        (JOBSET | {"JAXDIST_PODS_PER_JOB": "1"}, "JAXDIST_PODS_PER_JOB=1: process id 1 is not"),
        (JOBSET | {"JAXDIST_JOB_INDEX": "3"}, "JAXDIST_NUM_PROCESSES=6: process id 7 is not"),
        ({k: v for k, v in JOBSET.items() if k != "JAXDIST_PODS_PER_JOB"}, "PODS_PER_JOB is not"),
    ],
)
def test_several_processes_that_cannot_form_a_group_are_an_error(env, match):
    with pytest.raises(JaxdistError, match=match):
        resolve(env)


@pytest.mark.parametrize("env", [SLURM, OMPI4, OMPI5, INDEXED, TORCH, NO_OMPI_COORDINATOR])
def test_process_group_single_is_one_process_whatever_the_environment(env):
    spec = resolve(env, local_device_ids="0", process_group="single")
    assert group(spec) == ("single", None, 1, 0) and spec.local_device_ids == (0,)


def test_process_group_single_refuses_a_group_given_by_hand():
    with pytest.raises(JaxdistError, match="single is one process: drop"):
        resolve({}, process_id=1, process_group="single")
    with pytest.raises(ConfigError, match="single is one process: drop --num-processes 2"):
        config_lib.parse_args(["--process-group", "single", "--num-processes", "2"])
    with pytest.raises(ConfigError, match="--process-group.*invalid choice: 'many'"):
        config_lib.parse_args(["--process-group", "many"])
    assert config_lib.parse_args([]).dist.process_group == "auto"


# Rank 1 of `mpirun -np 2` (Open MPI 4, launched from this machine) whose rank 0 never
# starts: nothing listens on the derived coordinator 127.0.0.1:62624.
RANK_1_OF_2 = OMPI4 | {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911",
}
SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PRTE_", "JAXDIST_", "JOB_COMPLETION_INDEX")


def train_as_rank_1(tmp_path, *extra):
    others = [k for k in os.environ if k.startswith(SCHEDULER_PREFIXES)]
    others += ["MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "JAX_COORDINATOR_PORT"]
    args = ["--cpu-devices", "2", "--steps", "1", "--init-timeout", "5"]
    args += ["--run-dir", str(tmp_path / "run"), "--no-tensorboard", *extra]
    return run_module("jaxdist.train", *args, env_extra=RANK_1_OF_2, env_drop=others, timeout=120)


def test_an_mpirun_rank_waits_for_its_group_and_names_it(tmp_path):
    proc = train_as_rank_1(tmp_path)
    assert proc.returncode == 76, proc.stdout + proc.stderr  # the group did not form
    assert re.search(
        r"did not form within --init-timeout 5s: process 1 of 2 waited for the coordinator "
        r"127\.0\.0\.1:62624 \(openmpi",
        proc.stderr,
    ), proc.stderr
    assert "process 0/1" not in proc.stdout  # it never trained alone


def test_an_mpirun_rank_with_process_group_single_trains_alone(tmp_path):
    proc = train_as_rank_1(tmp_path, "--process-group", "single")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] process 0/1: 2 local of 2 cpu devices" in proc.stdout
