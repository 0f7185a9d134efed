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

import importlib

from jaxdist.cluster import cpu_backend

# The public names and the module each comes from, imported on first use (PEP 562): a
# command that needs no JAX, the launcher's (``python -m jaxdist.launch``, which imports
# jaxdist.launch and jaxdist.cluster's plain modules), starts without importing JAX and
# Flax: 2 s of CPU at each start of a process group on a 2-core machine.
_GROUPS = {
    "jaxdist.cluster": "ProcessInfo barrier initialize is_main_process print_main",
    "jaxdist.data": "DistributedSampler EvalSampler",
    "jaxdist.errors": "ConfigError JaxdistError ModelError",
    "jaxdist.launch": "SpawnError spawn",
    "jaxdist.models": "as_nnx attention fp8_dot_general",
    "jaxdist.parallel": "BadBatchError DataParallel NonFiniteError PackedState Parallel "
    "TrainState make_mesh mean_over_replicas replica_index shard_batch step_key "
    "sum_over_replicas",
}
_FROM = {name: module for module, names in _GROUPS.items() for name in names.split()}
# Subpackages and modules reached as attributes (``jaxdist.sinks.Sinks``, ``jaxdist.plan``:
# the planner, a command built on the trainer).
_MODULES = {"flops", "sinks", "plan", "checkpoint", "cluster", "data", "evaluate", "export"}
_MODULES |= {"generate", "health", "launch", "losses", "models", "parallel", "report", "train"}
_MODULES |= {"units", "weights", "errors"}

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
    """A public name (``jaxdist.DataParallel``) or a subpackage (``jaxdist.sinks``), loaded on
    first use and kept."""
    if name in _FROM:
        value = getattr(importlib.import_module(_FROM[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"jaxdist.{name}")
    else:
        raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
