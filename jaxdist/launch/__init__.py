"""Processes on one machine: ``python -m jaxdist.launch`` (torchrun), ``jaxdist.spawn``
(``mp.spawn``), and ``python -m jaxdist.launch.requeue`` (what a SLURM script does
after ``srun``).

``group.py`` starts, watches and ends a group of local processes (the one implementation
behind both), ``rank_output.py`` prefixes their lines, ``orphans.py`` keeps them from
outliving the launcher, ``launcher.py`` is the command.
"""

from jaxdist.launch.group import free_port
from jaxdist.launch.spawn import SpawnError, spawn

__all__ = ["SpawnError", "free_port", "spawn"]
