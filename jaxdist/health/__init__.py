"""Distributed health of a training run: nothing hangs silently, nothing diverges
unseen. The watchdog and the hang report (``watchdog.py``, ``hang_report.py``), the
agreement of every process on config, versions, layout and program before the first
step (``agreement.py``), the replicas' fingerprints (``replica_check.py``), and the fault
injection the tests use (``fault_injection.py``). Dead peers are ``jaxdist.cluster.peers``;
the trainer wires all of it in ``jaxdist.train.run_health``.
"""

from jaxdist.health.agreement import MismatchError
from jaxdist.health.deadlines import Deadlines
from jaxdist.health.fault_injection import Faults
from jaxdist.health.replica_check import ReplicaCheck, ReplicaDivergenceError
from jaxdist.health.watchdog import Watchdog

__all__ = [
    "Deadlines",
    "Faults",
    "MismatchError",
    "ReplicaCheck",
    "ReplicaDivergenceError",
    "Watchdog",
]
