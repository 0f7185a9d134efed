"""jaxdist: data-parallel training of Flax models with pmap, shard_map or GSPMD.

The public API (PyTorch names in brackets)::

    info = jaxdist.initialize()                       # [init_process_group]
    mesh = jaxdist.make_mesh(data=-1)                 # all devices on axis "data"
    dp = jaxdist.DataParallel(model, tx, loss_fn, mesh=mesh, strategy="gspmd")  # [DDP(model)]
    sampler = jaxdist.DistributedSampler(n, global_batch_size=256)  # [DistributedSampler]
    eval_sampler = jaxdist.EvalSampler(n, 256)        # every example once, padding masked
    batch = jaxdist.shard_batch(host_numpy_batch, mesh)
    state, metrics = dp.step(state, batch)
    dp.check(metrics, step)                           # NaN / bad rows: raises (or skipped)
    jaxdist.mean_over_replicas(tree)                  # [all_reduce / world_size], in a step
    jaxdist.sum_over_replicas(tree)                   # [all_reduce], in a step
    jaxdist.barrier("name"); jaxdist.is_main_process(); jaxdist.print_main(...)
    sinks = jaxdist.sinks.Sinks([jaxdist.sinks.TensorBoard("runs/mine/tb")])  # what a run shows
    jaxdist.flops.xla_step_flops(dp.program(batch), mesh.size)  # FLOPs per step, for MFU
"""

from jaxdist import flops, sinks
from jaxdist.adapt import as_nnx
from jaxdist.errors import JaxdistError, ModelError
from jaxdist.health import BadBatchError, NonFiniteError
from jaxdist.parallel import DataParallel, Parallel
from jaxdist.process import ProcessInfo, barrier, initialize, is_main_process, print_main
from jaxdist.replicas import mean_over_replicas, replica_index, step_key, sum_over_replicas
from jaxdist.sampler import DistributedSampler, EvalSampler
from jaxdist.sharding import make_mesh, shard_batch
from jaxdist.spawn import SpawnError, spawn
from jaxdist.step import TrainState

__version__ = "0.1.0"

__all__ = [
    "BadBatchError",
    "DataParallel",
    "DistributedSampler",
    "EvalSampler",
    "JaxdistError",
    "ModelError",
    "NonFiniteError",
    "Parallel",
    "ProcessInfo",
    "SpawnError",
    "TrainState",
    "as_nnx",
    "barrier",
    "flops",
    "initialize",
    "is_main_process",
    "make_mesh",
    "mean_over_replicas",
    "print_main",
    "replica_index",
    "shard_batch",
    "sinks",
    "spawn",
    "step_key",
    "sum_over_replicas",
]
