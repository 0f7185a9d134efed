"""Where the process group comes from: a scheduler, explicit flags, the environment, or nothing.

A pure function of the flags and the environment, so it is testable without processes.
The first that applies wins:

1. SLURM: a job step with more than one task (JAX's own SLURM detection);
2. Open MPI: a rank of ``mpirun``/``mpiexec -np N``, N > 1 (``OMPI_COMM_WORLD_SIZE``,
   ``OMPI_COMM_WORLD_RANK``), the coordinator derived as JAX derives it;
3. Kubernetes: a pod of an Indexed Job or a JobSet (``JOB_COMPLETION_INDEX``), the
   group's size and coordinator from the manifest (``JAXDIST_NUM_PROCESSES``,
   ``JAXDIST_COORDINATOR``; k8s/);
4. explicit arguments (``--coordinator HOST:PORT --num-processes N --process-id I``);
5. ``JAXDIST_COORDINATOR``, ``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID`` (what
   ``python -m jaxdist.launch`` sets);
6. PyTorch's ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` (and
   ``LOCAL_RANK``: one process per GPU);
7. a single process, no coordinator.

``process_group="single"`` (``--process-group single``) skips them all: one process.
A scheduler already says who is who, so ``--num-processes``/``--process-id`` beside one
are an error, and so is ``--coordinator`` under SLURM (under Open MPI and Kubernetes it
replaces the coordinator, as ``JAXDIST_COORDINATOR`` does). Variables that say "several
processes" but cannot form the group are an error naming them, never a silent single
process. Open MPI and Kubernetes step aside for a launcher run inside them that gave its
processes their own ids (``JAXDIST_PROCESS_ID`` or ``RANK`` set). Each scheduler's
variables are read in ``sources.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxdist.cluster import sources
from jaxdist.cluster.sources import ClusterSpec, env_int, in_range, parse_device_ids
from jaxdist.errors import JaxdistError

__all__ = ["ClusterSpec", "parse_device_ids", "resolve"]

SCHEDULERS = {
    "slurm": "a SLURM job step of {} tasks",
    "openmpi": "an Open MPI job of {} processes",
    "kubernetes": "a Kubernetes job of {} pods",
    "single": "a Kubernetes job of {} pod",  # sources.kubernetes: JAXDIST_NUM_PROCESSES=1
}


def resolve(
    env: Mapping[str, str],
    coordinator: str = "",
    num_processes: int = 0,
    process_id: int = -1,
    local_device_ids: str = "",
    process_group: str = "auto",
) -> ClusterSpec:
    device_ids = parse_device_ids(local_device_ids, "--local-device-ids")
    got = (
        f"(got coordinator={coordinator!r}, num-processes={num_processes}, process-id={process_id})"
    )
    flags_given = bool(coordinator or num_processes or process_id >= 0)
    if process_group == "single":
        if flags_given:
            raise JaxdistError(
                "--process-group single is one process: drop --coordinator/--num-processes/"
                f"--process-id {got}"
            )
        return ClusterSpec("single", local_device_ids=device_ids)
    if process_group != "auto":
        raise JaxdistError(f"process group {process_group!r}: expected auto or single")
    spec = (
        _slurm(env, device_ids)
        or sources.openmpi(env, coordinator, device_ids)
        or sources.kubernetes(env, coordinator, device_ids)
    )
    if spec is not None:
        return _scheduler_checked(spec, coordinator, num_processes, process_id, got)
    if flags_given:
        if not (coordinator and num_processes and process_id >= 0):
            raise JaxdistError(
                f"--coordinator, --num-processes and --process-id go together; {got}"
            )
        return _checked(ClusterSpec("flags", coordinator, num_processes, process_id, device_ids))
    spec = _launcher_env(env, device_ids) or _torch_env(env, device_ids)
    return _checked(spec) if spec else ClusterSpec("single", local_device_ids=device_ids)


def _slurm(env: Mapping[str, str], device_ids) -> ClusterSpec | None:
    tasks = sources.slurm_tasks(env)
    if tasks < 2:
        return None
    return ClusterSpec(
        "slurm",
        num_processes=tasks,
        process_id=env_int(env, "SLURM_PROCID"),
        local_device_ids=device_ids or sources.slurm_node_devices(env),
    )


def _scheduler_checked(spec: ClusterSpec, coordinator, num_processes, process_id, got: str):
    """The flags beside a scheduler: none under SLURM (JAX picks the coordinator), only
    ``--coordinator`` under Open MPI and Kubernetes."""
    what = "this is " + SCHEDULERS[spec.source].format(spec.num_processes)
    if spec.source == "slurm" and (coordinator or num_processes or process_id >= 0):
        raise JaxdistError(
            f"{what}, which sets up the process group itself; drop "
            f"--coordinator/--num-processes/--process-id {got}"
        )
    if num_processes or process_id >= 0:
        raise JaxdistError(
            f"{what}, which says who is who; drop --num-processes/--process-id {got} "
            "(--coordinator HOST:PORT alone may replace its coordinator)"
        )
    return _checked(spec) if spec.coordinator else spec


def _launcher_env(env: Mapping[str, str], device_ids) -> ClusterSpec | None:
    if "JAXDIST_COORDINATOR" not in env:
        count = env_int(env, "JAXDIST_NUM_PROCESSES") if "JAXDIST_NUM_PROCESSES" in env else 1
        if count > 1:
            raise JaxdistError(
                f"JAXDIST_NUM_PROCESSES={count} without JAXDIST_COORDINATOR: set it to process "
                "0's HOST:PORT, with JAXDIST_PROCESS_ID"
            )
        return None
    where = f"JAXDIST_COORDINATOR={env['JAXDIST_COORDINATOR']}"
    count = env_int(env, "JAXDIST_NUM_PROCESSES", where)
    process_id = env_int(env, "JAXDIST_PROCESS_ID", where)
    in_range(process_id, count, f"JAXDIST_PROCESS_ID={process_id}, JAXDIST_NUM_PROCESSES={count}")
    ids = device_ids or parse_device_ids(
        env.get("JAXDIST_LOCAL_DEVICE_IDS", ""), "JAXDIST_LOCAL_DEVICE_IDS"
    )
    return ClusterSpec("env", env["JAXDIST_COORDINATOR"], count, process_id, ids)


def _torch_env(env: Mapping[str, str], device_ids) -> ClusterSpec | None:
    if "WORLD_SIZE" not in env:
        return None
    size = env_int(env, "WORLD_SIZE")
    if "MASTER_ADDR" not in env:
        if size > 1:
            raise JaxdistError(
                f"PyTorch's WORLD_SIZE={size} without MASTER_ADDR: set MASTER_ADDR (and "
                "MASTER_PORT, default 29500) to process 0's host, and RANK"
            )
        return None
    rank = env_int(env, "RANK", f"PyTorch's WORLD_SIZE={size}")
    in_range(rank, size, f"PyTorch's RANK={rank}, WORLD_SIZE={size}")
    ids = device_ids
    if ids is None and "LOCAL_RANK" in env:
        ids = (env_int(env, "LOCAL_RANK"),)  # torchrun: one process per GPU
    coordinator = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
    return ClusterSpec("torch-env", coordinator, size, rank, ids)


def _checked(spec: ClusterSpec) -> ClusterSpec:
    in_range(spec.process_id, spec.num_processes, f"from {spec.source}")
    if ":" not in spec.coordinator:
        raise JaxdistError(
            f"coordinator {spec.coordinator!r} (from {spec.source}) is not HOST:PORT"
        )
    return spec
