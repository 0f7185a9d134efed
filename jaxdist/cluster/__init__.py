"""The process group: where it comes from (a scheduler, flags, the environment), joining
it (``initialize``), its key-value store, dead peers, preemption, and how a process of it
ends (one fixed exit code per cause, ``failures.py``).

Open ``environment.py`` to see how SLURM, Open MPI, Kubernetes, flags, ``JAXDIST_*`` or
torchrun-style variables become a process group (``sources.py`` reads the schedulers'),
``process_group.py`` for ``initialize``, ``peers.py`` for how a dead peer is detected
and named, ``preemption.py`` for SIGUSR1/SIGTERM, ``failures.py`` for the
exit codes and ``failures.jsonl``, ``shutdown.py`` for the exit paths themselves.
"""

import importlib

from jaxdist.cluster.environment import ClusterSpec, resolve

# Imported on first use: preemption and process_group import JAX, which the launcher's
# modules of this package (failures, service, leaving, environment) do not need.
_FROM = {"Preempted": "preemption", "StopFlag": "preemption"}
_FROM |= dict.fromkeys(
    ["ProcessInfo", "barrier", "initialize", "is_main_process", "print_main"], "process_group"
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


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module 'jaxdist.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jaxdist.cluster.{_FROM[name]}"), name)
    globals()[name] = value
    return value
