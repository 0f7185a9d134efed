"""Processes on one machine or several: ``python -m jaxdist.launch`` (torchrun, with its
multi-node flags), ``jaxdist.spawn`` (``mp.spawn``), and ``python -m jaxdist.launch.requeue``
(what a SLURM script does after ``srun``).

``group.py`` starts, watches and ends this machine's processes (the one implementation
behind both), ``placement.py`` gives them their global ranks and coordinator,
``rank_output.py`` prefixes their lines, ``orphans.py`` keeps them from outliving the
launcher, ``launcher.py`` is the command; across machines the launchers meet at node 0's
``rendezvous.py`` (``nodes.py`` is each node's side of it).
"""

from jaxdist.launch.group import free_port
from jaxdist.launch.spawn import SpawnError, spawn

__all__ = ["SpawnError", "free_port", "spawn"]
