"""Parallelism, declared: the mesh (axes ``data``, ``stage``, ``fsdp``, ``model``), the
layout of every array on it, the one pure training step, and the strategies that wire
that step to devices.

Open ``device_mesh.py`` for the mesh and the host-to-device seam (``shard_batch``),
``layout.py`` for where each array lives (the one function ``state_shardings``: an axis
is added there), ``step.py`` for ``train_step(state, batch) -> (state, metrics)``,
``strategies/`` for gspmd, shard_map, pmap and the pipeline, ``wrapper.py`` for
``Parallel`` (``DataParallel``), which holds them together, and ``hlo.py`` for what a
compiled step communicates and computes (collective bytes and replica groups, matmul
FLOPs, read from XLA's text; the dry run and the planner use it). Models know nothing of
this.
"""

from jaxdist.parallel.collectives import (
    mean_over_replicas,
    min_over_replicas,
    replica_index,
    step_key,
    sum_over_replicas,
)
from jaxdist.parallel.device_mesh import AXES, DeviceCountError, make_mesh, shard_batch
from jaxdist.parallel.host import host_value, local_value, scalars
from jaxdist.parallel.layout import Layout, LayoutError, path_name, state_shardings
from jaxdist.parallel.packed import PackedState
from jaxdist.parallel.program import StepProgram
from jaxdist.parallel.step import TrainState
from jaxdist.parallel.step_checks import BadBatchError, NonFiniteError
from jaxdist.parallel.wrapper import DataParallel, Parallel

__all__ = [
    "AXES",
    "BadBatchError",
    "DataParallel",
    "DeviceCountError",
    "Layout",
    "LayoutError",
    "NonFiniteError",
    "PackedState",
    "Parallel",
    "StepProgram",
    "TrainState",
    "host_value",
    "local_value",
    "make_mesh",
    "mean_over_replicas",
    "min_over_replicas",
    "path_name",
    "replica_index",
    "scalars",
    "shard_batch",
    "state_shardings",
    "step_key",
    "sum_over_replicas",
]
