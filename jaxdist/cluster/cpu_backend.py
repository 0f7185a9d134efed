"""The CPU backend's thread pool, sized so that collectives cannot starve it.

XLA:CPU runs a program's operations as a graph on one pool of threads shared by every
local device (``PJRT_NPROC`` threads, default: the cores, at least one per device). A
collective blocks its thread until every participant has reached it, and XLA may start
a device's independent collectives in any order (an all-reduce of some gradients while
the pipeline's ppermutes still run). On 8 emulated devices the pool had 8 threads: 5
blocked in an all-reduce, 3 in a collective-permute, none left for the participants
they waited for, and XLA aborted the process 40 s later ("Termination timeout for all
reduce ... collective permute"). ``--mesh stage=2,data=4 --global-batch-size 16
--microbatches 4 --vocab-size 264 --save-params p.npz`` did so every time. With
``THREADS_PER_DEVICE`` threads per device the same runs pass; the threads are idle
unless a collective waits in them.
"""

from __future__ import annotations

import os

THREADS_PER_DEVICE = 8  # collectives one device may have started at once, with margin
VARIABLE = "PJRT_NPROC"  # read once, when JAX creates its CPU client


def size_thread_pool(num_devices: int | None = None, num_processes: int = 1) -> None:
    """Sizes the pool for ``num_devices`` CPU devices per process (default:
    ``JAX_NUM_CPU_DEVICES``, else 1) in a group of ``num_processes``, unless the user set
    ``PJRT_NPROC``. One device in one process runs no collective: XLA's own default (one
    thread per core) stands, since extra threads only compete with the step's (the tiny
    GPT's step on 2 cores: 5.3 ms with 2 threads, 6.5-8.4 with 8). Only has an effect
    before JAX creates its CPU backend; later calls change nothing (and harm nothing)."""
    if num_devices is None:
        num_devices = int(os.environ.get("JAX_NUM_CPU_DEVICES") or 1)
    if num_devices * num_processes == 1:
        return
    wanted = max(os.cpu_count() or 1, THREADS_PER_DEVICE * num_devices)
    set_by_us = os.environ.get("JAXDIST_SET_PJRT_NPROC") == "1"
    if VARIABLE in os.environ and not set_by_us:
        return  # the user's own choice stands
    if int(os.environ.get(VARIABLE, 0)) < wanted:
        os.environ[VARIABLE] = str(wanted)
        os.environ["JAXDIST_SET_PJRT_NPROC"] = "1"  # ours: a later, larger count may raise it


def host_memory_bytes() -> float:
    """This host's physical memory, which its CPU devices share (16 GiB where the system
    does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16.0 * 2**30
