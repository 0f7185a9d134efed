"""Where the process group comes from: explicit flags, SLURM, the environment, or nothing.

A pure function of the flags and the environment, so it is testable without processes.
The first that applies wins:

1. a SLURM job step with more than one task: JAX's own SLURM detection (explicit flags
   as well are an error: SLURM already says who is who);
2. explicit arguments (``--coordinator HOST:PORT --num-processes N --process-id I``);
3. environment: ``JAXDIST_COORDINATOR``, ``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID``
   (what ``python -m jaxdist.launch`` sets), or PyTorch's ``MASTER_ADDR``, ``MASTER_PORT``,
   ``WORLD_SIZE``, ``RANK`` (and ``LOCAL_RANK``: one process per GPU);
4. a single process, no coordinator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from jaxdist.errors import JaxdistError


@dataclass(frozen=True)
class ClusterSpec:
    source: str  # "flags", "slurm", "env", "torch-env" or "single"
    coordinator: str | None = None  # HOST:PORT; None for slurm (JAX finds it) and single
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None  # None: every local device

    @property
    def multi_process(self) -> bool:
        return self.source != "single"


def parse_device_ids(text: str, what: str) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise JaxdistError(f"{what}: {text!r} is not a comma-separated list of integers") from None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise JaxdistError(f"environment {name}={env[name]!r} is not an integer") from None


def _checked(spec: ClusterSpec) -> ClusterSpec:
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise JaxdistError(
            f"process id {spec.process_id} is not in [0, {spec.num_processes}) (from {spec.source})"
        )
    if spec.coordinator is not None and ":" not in spec.coordinator:
        raise JaxdistError(
            f"coordinator {spec.coordinator!r} (from {spec.source}) is not HOST:PORT"
        )
    return spec


def _slurm_tasks(env: Mapping[str, str]) -> int:
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if not all(name in env for name in needed):
        return 0
    return _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")


def _slurm_node_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Every GPU of the node when the step runs one task per node. JAX's own default under
    SLURM is GPU number SLURM_LOCALID, i.e. one GPU per task: right for 8 tasks per node,
    but one task per node would then use 1 GPU of 8."""
    per_node = re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if per_node and set(per_node) == {"1"} and gpus.isdigit() and int(gpus) > 1:
        return tuple(range(int(gpus)))  # e.g. "1(x8)" with 8 GPUs -> (0, ..., 7)
    return None


def resolve(
    env: Mapping[str, str],
    coordinator: str = "",
    num_processes: int = 0,
    process_id: int = -1,
    local_device_ids: str = "",
) -> ClusterSpec:
    device_ids = parse_device_ids(local_device_ids, "--local-device-ids")
    flags_given = bool(coordinator or num_processes or process_id >= 0)
    slurm_tasks = _slurm_tasks(env)
    if slurm_tasks > 1:
        if flags_given:
            raise JaxdistError(
                f"this is a SLURM job step of {slurm_tasks} tasks, which sets up the process "
                "group itself; drop --coordinator/--num-processes/--process-id (got "
                f"coordinator={coordinator!r}, num-processes={num_processes}, "
                f"process-id={process_id})"
            )
        return ClusterSpec(
            "slurm",
            num_processes=slurm_tasks,
            process_id=_int(env, "SLURM_PROCID"),
            local_device_ids=device_ids or _slurm_node_devices(env),
        )
    if flags_given:
        if not (coordinator and num_processes and process_id >= 0):
            raise JaxdistError(
                "--coordinator, --num-processes and --process-id go together; got "
                f"coordinator={coordinator!r}, num-processes={num_processes}, "
                f"process-id={process_id}"
            )
        return _checked(ClusterSpec("flags", coordinator, num_processes, process_id, device_ids))
    if "JAXDIST_COORDINATOR" in env:
        ids = device_ids or parse_device_ids(
            env.get("JAXDIST_LOCAL_DEVICE_IDS", ""), "JAXDIST_LOCAL_DEVICE_IDS"
        )
        return _checked(
            ClusterSpec(
                "env",
                env["JAXDIST_COORDINATOR"],
                _int(env, "JAXDIST_NUM_PROCESSES"),
                _int(env, "JAXDIST_PROCESS_ID"),
                ids,
            )
        )
    if "MASTER_ADDR" in env and "WORLD_SIZE" in env:
        ids = device_ids
        if ids is None and "LOCAL_RANK" in env:
            ids = (_int(env, "LOCAL_RANK"),)  # torchrun: one process per GPU
        return _checked(
            ClusterSpec(
                "torch-env",
                f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}",
                _int(env, "WORLD_SIZE"),
                _int(env, "RANK"),
                ids,
            )
        )
    return ClusterSpec("single", local_device_ids=device_ids)
