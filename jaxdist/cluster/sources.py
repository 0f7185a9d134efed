"""What each scheduler says about the process group: SLURM, Open MPI and Kubernetes, each
read from its own variables into a ``ClusterSpec``, the form every source yields.

A reader returns None where its scheduler is absent or runs one process, and raises
``JaxdistError`` naming the variable where the scheduler says "several processes" but the
group cannot be formed from what it gives: never a silent process of its own. Pure
functions of the environment; ``environment.resolve`` puts them in order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from jaxdist.errors import JaxdistError

# JAX's rule for an Open MPI job's coordinator port: one of the top 4096 ports
# (61440-65535), picked by the job id, so that two jobs on a node rarely collide.
PORT_RANGE = 4096
FIRST_PORT = 65536 - PORT_RANGE
ORTE_URI = "OMPI_MCA_orte_hnp_uri"  # Open MPI 4: mpirun's own address and job id
PMIX_URIS = ("PMIX_SERVER_URI41", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3", "PMIX_SERVER_URI21")
PMIX_URIS += ("PMIX_SERVER_URI2",)  # Open MPI 5: the node's PMIx server, newest first


@dataclass(frozen=True)
class ClusterSpec:
    # "slurm", "openmpi", "kubernetes", "flags", "env", "torch-env" or "single"
    source: str
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


def env_int(env: Mapping[str, str], name: str, needed_by: str = "") -> int:
    if name not in env:
        raise JaxdistError(f"{needed_by or 'the environment'}: {name} is not set")
    try:
        return int(env[name])
    except ValueError:
        raise JaxdistError(f"environment {name}={env[name]!r} is not an integer") from None


def in_range(process_id: int, count: int, what: str) -> None:
    if count < 1 or not 0 <= process_id < count:
        raise JaxdistError(f"{what}: process id {process_id} is not in [0, {count})")


def launched_inside(env: Mapping[str, str]) -> bool:
    """A launcher inside the scheduler's process (``jaxdist.launch``, torchrun) gave this
    process its own id: its group, not the scheduler's, is this process's."""
    return "JAXDIST_PROCESS_ID" in env or "RANK" in env


def slurm_tasks(env: Mapping[str, str]) -> int:
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if not all(name in env for name in needed):
        return 0
    return env_int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")


def slurm_node_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Every GPU of the node when the step runs one task per node. JAX's own default under
    SLURM is GPU number SLURM_LOCALID, i.e. one GPU per task: right for 8 tasks per node,
    but one task per node would then use 1 GPU of 8."""
    per_node = re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if per_node and set(per_node) == {"1"} and gpus.isdigit() and int(gpus) > 1:
        return tuple(range(int(gpus)))  # e.g. "1(x8)" with 8 GPUs -> (0, ..., 7)
    return None


def openmpi(env: Mapping[str, str], coordinator: str, device_ids) -> ClusterSpec | None:
    """A rank of ``mpirun -np N`` (N > 1). The coordinator is JAX's: the launcher's host
    and a port from the job id, unless ``--coordinator`` or ``JAXDIST_COORDINATOR`` says.
    Several ranks on a node: one GPU each (the local rank), as JAX does; one rank per
    node: every GPU of the node."""
    if "OMPI_COMM_WORLD_SIZE" not in env or launched_inside(env):
        return None
    size = env_int(env, "OMPI_COMM_WORLD_SIZE")
    if size < 2:
        return None
    where = f"Open MPI job of {size} processes (OMPI_COMM_WORLD_SIZE)"
    rank = env_int(env, "OMPI_COMM_WORLD_RANK", where)
    in_range(rank, size, f"{where}, OMPI_COMM_WORLD_RANK={rank}")
    address = coordinator or env.get("JAXDIST_COORDINATOR") or _ompi_coordinator(env, where)
    if device_ids is None and env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1") != "1":
        device_ids = (env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", where),)
    return ClusterSpec("openmpi", address, size, rank, device_ids)


def _ompi_coordinator(env: Mapping[str, str], where: str) -> str:
    port = env.get("JAX_COORDINATOR_PORT", "")  # JAX's own override of the derived port
    if ORTE_URI in env:  # "1531576320.0;tcp://10.0.0.1,10.1.0.1:34911"
        uri = env[ORTE_URI]
        host, job = _uri_host(uri), uri.split(".", 1)[0]
        if host is None or not job.isdigit():
            raise JaxdistError(f"{where}: no address and job id in {ORTE_URI}={uri!r}")
        return f"{host}:{port or _port(int(job) // PORT_RANGE)}"  # job ids step by 4096
    uri_name = next((name for name in PMIX_URIS if name in env), "")
    namespace = env.get("PMIX_NAMESPACE", "")  # "prterun-node1-4711@1": launcher, its pid
    job = re.search(r"-(\d+)@", namespace)
    if not uri_name or job is None:
        seen = f" (PMIX_NAMESPACE={namespace!r})" if namespace else ""
        raise JaxdistError(
            f"{where}: its coordinator comes from {ORTE_URI} (Open MPI 4) or PMIX_SERVER_URI* "
            f"with a PMIX_NAMESPACE like prterun-HOST-PID@1 (Open MPI 5): none here{seen}; "
            "give rank 0's host: JAXDIST_COORDINATOR=HOST:PORT"
        )
    host = _uri_host(env[uri_name])
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE") != env.get("OMPI_COMM_WORLD_SIZE"):
        # several nodes: each node's PMIx server differs; the launcher's host is common
        launcher = re.fullmatch(r"prte(?:run)?-(.+)-\d+@\d+", namespace)
        host = launcher[1] if launcher else None
    if host is None:
        raise JaxdistError(
            f"{where}: no coordinator host in {uri_name}={env[uri_name]!r} or "
            f"PMIX_NAMESPACE={namespace!r}; give rank 0's host: JAXDIST_COORDINATOR=HOST:PORT"
        )
    return f"{host}:{port or _port(int(job[1]))}"


def _uri_host(uri: str) -> str | None:
    """The first address of an Open MPI contact URI (IPv6 in brackets)."""
    found = re.search(r"tcp[46]?://(?:\[([^,\]]+)|([^,:;\]]+))", uri)
    if found is None:
        return None
    return f"[{found[1]}]" if found[1] else found[2]


def _port(job: int) -> int:
    return FIRST_PORT + job % PORT_RANGE


def kubernetes(env: Mapping[str, str], coordinator: str, device_ids) -> ClusterSpec | None:
    """A pod of an Indexed Job (``JOB_COMPLETION_INDEX``), or of a JobSet's jobs
    (``JAXDIST_JOB_INDEX`` x ``JAXDIST_PODS_PER_JOB`` + the completion index). The group's
    size and coordinator come from the manifest (``JAXDIST_NUM_PROCESSES``,
    ``JAXDIST_COORDINATOR``; k8s/): no Kubernetes API is asked."""
    if "JOB_COMPLETION_INDEX" not in env or launched_inside(env):
        return None
    index = env_int(env, "JOB_COMPLETION_INDEX")
    where = f"Kubernetes pod JOB_COMPLETION_INDEX={index}"
    if "JAXDIST_NUM_PROCESSES" not in env:
        raise JaxdistError(
            f"{where}: JAXDIST_NUM_PROCESSES is not set (the pods of the group: the Job's "
            "parallelism, times the replicas of a JobSet); set it, 1 for one pod, or pass "
            "--process-group single"
        )
    count = env_int(env, "JAXDIST_NUM_PROCESSES")
    process_id = index
    if "JAXDIST_JOB_INDEX" in env:  # a JobSet: job j's pod i is process j x pods + i
        pods = env_int(env, "JAXDIST_PODS_PER_JOB", f"{where} of a JobSet (JAXDIST_JOB_INDEX)")
        in_range(index, pods, f"{where}, JAXDIST_PODS_PER_JOB={pods}")
        process_id = env_int(env, "JAXDIST_JOB_INDEX") * pods + index
        where += f", JAXDIST_JOB_INDEX={env['JAXDIST_JOB_INDEX']}"
    in_range(process_id, count, f"{where}, JAXDIST_NUM_PROCESSES={count}")
    if count == 1:
        return ClusterSpec("single", local_device_ids=device_ids)
    address = coordinator or env.get("JAXDIST_COORDINATOR")
    if not address:
        raise JaxdistError(
            f"{where}, JAXDIST_NUM_PROCESSES={count}: no coordinator; set "
            "JAXDIST_COORDINATOR=<job>-0.<headless service>:PORT, pod 0's name (k8s/)"
        )
    return ClusterSpec("kubernetes", address, count, process_id, device_ids)
