"""jaxdist: PyTorch's DDP and torchrun for Flax models, on every device JAX can see.

The public API, by subsystem (PyTorch names in brackets)::

    # cluster/: the process group
    info = jaxdist.initialize()                       # [init_process_group]
    jaxdist.barrier("name"); jaxdist.is_main_process(); jaxdist.print_main(...)
    # parallel/: the mesh, the layout, the step
    mesh = jaxdist.make_mesh(data=-1)                 # all devices on axis "data"
    dp = jaxdist.DataParallel(model, tx, loss_fn, mesh=mesh, strategy="gspmd")  # [DDP(model)]
    batch = jaxdist.shard_batch(host_numpy_batch, mesh)
    state, metrics = dp.step(state, batch)
    dp.check(metrics, step)                           # NaN / bad rows: raises (or skipped)
    jaxdist.mean_over_replicas(tree)                  # [all_reduce / world_size], in a step
    jaxdist.sum_over_replicas(tree)                   # [all_reduce], in a step
    jaxdist.attention(q, k, v, causal=True)           # split over a seq mesh axis if any
    # data/: which rows each process reads
    sampler = jaxdist.DistributedSampler(n, global_batch_size=256)  # [DistributedSampler]
    eval_sampler = jaxdist.EvalSampler(n, 256)        # every example once, padding masked
    # launch/: processes on one machine
    jaxdist.spawn(fn, args=(...), nprocs=2)           # [mp.spawn]
    # sinks/ and flops: what a run shows
    sinks = jaxdist.sinks.Sinks([jaxdist.sinks.TensorBoard("runs/mine/tb")])
    jaxdist.flops.xla_step_flops(dp.program(batch), mesh.size)  # FLOPs per step, for MFU

The command line (``python -m jaxdist.train``) is ``jaxdist.train``; importing ``jaxdist``
does not import it, nor the trainer's distributed health (``jaxdist.health``).
"""

from jaxdist import flops, sinks
from jaxdist.cluster import (
    ProcessInfo,
    barrier,
    cpu_backend,
    initialize,
    is_main_process,
    print_main,
)
from jaxdist.data import DistributedSampler, EvalSampler
from jaxdist.errors import ConfigError, JaxdistError, ModelError
from jaxdist.launch import SpawnError, spawn
from jaxdist.models import as_nnx, attention, fp8_dot_general
from jaxdist.parallel import (
    BadBatchError,
    DataParallel,
    NonFiniteError,
    PackedState,
    Parallel,
    TrainState,
    make_mesh,
    mean_over_replicas,
    replica_index,
    shard_batch,
    step_key,
    sum_over_replicas,
)

__version__ = "0.1.0"

# Importing jaxdist starts no backend; JAX creates its CPU one later, with this many threads.
cpu_backend.size_thread_pool()

__all__ = [
    "BadBatchError",
    "ConfigError",
    "DataParallel",
    "DistributedSampler",
    "EvalSampler",
    "JaxdistError",
    "ModelError",
    "NonFiniteError",
    "Parallel",
    "ProcessInfo",
    "SpawnError",
    "PackedState",
    "TrainState",
    "as_nnx",
    "attention",
    "barrier",
    "flops",
    "fp8_dot_general",
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


def __getattr__(name: str):
    """``jaxdist.plan(...)``: the planner, loaded on first use (a command built on the
    trainer, jaxdist.plan; ``import jaxdist`` loads neither)."""
    if name == "plan":
        import importlib

        return importlib.import_module("jaxdist.plan")
    raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
