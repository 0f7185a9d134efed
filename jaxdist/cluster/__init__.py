"""The process group: where it comes from (a scheduler, flags, the environment), joining
it (``initialize``), its key-value store, dead peers, preemption, and how a process of it
ends (one fixed exit code per cause, ``failures.py``).

Open ``environment.py`` to see how SLURM, Open MPI, Kubernetes, flags, ``JAXDIST_*`` or
torchrun-style variables become a process group (``sources.py`` reads the schedulers'),
``process_group.py`` for ``initialize``, ``peers.py`` for how a dead peer is detected
and named, ``preemption.py`` for SIGUSR1/SIGTERM, ``failures.py`` for the
exit codes and ``failures.jsonl``, ``shutdown.py`` for the exit paths themselves.
"""

from jaxdist.cluster.environment import ClusterSpec, resolve
from jaxdist.cluster.preemption import Preempted, StopFlag
from jaxdist.cluster.process_group import (
    ProcessInfo,
    barrier,
    initialize,
    is_main_process,
    print_main,
)

__all__ = [
    "ClusterSpec",
    "Preempted",
    "ProcessInfo",
    "StopFlag",
    "barrier",
    "initialize",
    "is_main_process",
    "print_main",
    "resolve",
]
