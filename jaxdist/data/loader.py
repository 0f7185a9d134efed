"""From a source to device batches: host batches by sampler, and a background producer.

Loaders yield *host-local numpy*, this process's rows of a global batch; ``shard_batch``
(the one seam) turns them into a global device array. The ``Prefetcher`` runs both in a
thread, ``depth`` batches ahead, so the step does not wait for input; with
``--data-workers`` a grain source's batches come from grain's worker processes.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from jaxdist.data.sampler import DistributedSampler, EvalSampler
from jaxdist.errors import JaxdistError

Batch = dict[str, np.ndarray]


class DataSource(Protocol):
    """What jaxdist reads: ``len(source)`` examples, and ``source[indices]`` -> a batch,
    ``{name: (len(indices), ...) numpy array}``, e.g. ``{"tokens": (B, T + 1) int32}``
    or ``{"x": (B, F) float32, "y": (B,) int32}``. Indexing must be deterministic."""

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> Batch: ...


def host_batches(
    source: DataSource, sampler: DistributedSampler, start_step: int = 0, workers: int = 0
) -> Iterator[Batch]:
    """This process's rows of each global batch, from ``start_step`` on. ``source`` may be
    a grain MapDataset or random-access source (``jaxdist.data.grain_source``); with
    ``workers`` > 0 its per-example work runs in that many grain processes, with the same
    batches in the same order (close the iterator to end them)."""
    from jaxdist.data import grain_source  # it reads steps through read_step, below

    source = grain_source.as_source(source)
    if workers:
        return grain_source.WorkerBatches(source, sampler, start_step, workers)
    return _read_steps(source, sampler, start_step)


def _read_steps(source: DataSource, sampler: DistributedSampler, step: int):
    while True:
        yield read_step(source, sampler, step)
        step += 1


def read_step(source: DataSource, sampler: DistributedSampler, step: int) -> Batch:
    """This process's rows of step ``step`` (from 0). A source's JaxdistError (a bad id,
    a file that changed) names the optimizer step, counted from 1."""
    try:
        return source[sampler.indices(step)]
    except JaxdistError as err:
        named = JaxdistError(f"step {step + 1}: {err}")
        named.step = step + 1  # what its failure record (failures.jsonl) holds
        raise named from None


def eval_batches(source: DataSource, sampler: EvalSampler) -> Iterator[Batch]:
    """This process's rows of every eval batch, with ``mask`` (B/P,): 0 on padding."""
    from jaxdist.data import grain_source

    source = grain_source.as_source(source)
    for step in range(sampler.steps):
        indices, mask = sampler.indices(step)
        yield {**source[indices], "mask": mask}


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Iterates ``put(batch)`` for each host batch, computed by a background thread that
    keeps up to ``depth`` finished batches ready (plus one in the making).

    ``next(prefetcher)`` returns ``(device_batch, wait_s)``: ``wait_s`` is the time the
    caller blocked for it, 0 when the producer keeps ahead. An error in the producer is
    raised here, in the caller's thread, and again by every later call (the producer has
    ended: waiting for another item would block forever); the end of a finite source is
    ``StopIteration`` every time."""

    def __init__(self, batches: Iterator[Batch], put: Callable, depth: int = 2):
        self._batches, self._put = batches, put
        self._ready: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._ended: BaseException | None = None  # the producer's error, or StopIteration
        self._thread = threading.Thread(target=self._produce, name="jaxdist-prefetch")
        self._thread.daemon = True  # never keeps a finished or failed process alive
        self._thread.start()

    def _produce(self) -> None:
        try:
            for batch in self._batches:
                item = self._put(batch)
                while not self._stop.is_set():
                    try:
                        self._ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._ready.put(_Failed(StopIteration()))  # a finite source ends the iteration
        except BaseException as error:  # handed to the consumer, raised there
            self._ready.put(_Failed(error))

    def __iter__(self):
        return self

    def __next__(self):
        if self._ended is not None:
            raise self._ended
        start = time.perf_counter()
        item = self._ready.get()
        wait_s = time.perf_counter() - start
        if isinstance(item, _Failed):
            self._ended = item.error
            raise item.error
        return item, wait_s

    def close(self) -> None:
        self._stop.set()
        # Empty the queue so that a producer blocked putting a batch returns now rather
        # than at its next 0.1 s timeout (the end of every run waited for it).
        with contextlib.suppress(queue.Empty):
            while True:
                self._ready.get_nowait()
        self._thread.join(timeout=5)
        close = getattr(self._batches, "close", None)  # grain's workers (--data-workers)
        if close is not None and not self._thread.is_alive():  # not while it is reading
            close()
