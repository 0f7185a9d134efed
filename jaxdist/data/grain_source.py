"""grain's datasets as jaxdist sources, and ``--data-workers``: their per-example work in
grain's worker processes.

A grain ``MapDataset`` (its ``.map(...)`` transforms included) or random-access source
(``__len__`` and ``__getitem__(int)``: an ``ArrayRecordDataSource``, or a class of yours
that subclasses ``grain.sources.RandomAccessDataSource``) becomes a ``GrainSource``: rows
by index -> a batch of numpy arrays. jaxdist's sampler still picks the indices, so the
global batch of step s is the same for any process count and a resume needs only s (no
grain iterator state). With workers, grain runs ``source[sampler.indices(s)]`` (the same
call as without) for step s in worker s mod N and hands the batches back in step order:
bitwise the batches of ``--data-workers 0``.

grain is imported only when a grain object is met or workers start: importing
``jaxdist.data`` does not import it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

import numpy as np

from jaxdist.data.loader import Batch, read_step
from jaxdist.data.sampler import DistributedSampler
from jaxdist.errors import ConfigError, JaxdistError

ENDLESS = sys.maxsize  # the length grain gives an endless dataset (``.repeat()``)
TOKENS = "tokens"  # the name a bare-array element takes: a language model's (T + 1,) ids
_NUMERIC = "biuf"  # numpy dtype kinds a batch may hold: bool, ints, floats
INSTALL = "pip install 'jaxdist[grain]'"


def is_grain(obj) -> bool:
    """Whether ``obj`` is a grain dataset or data source. Its class imported grain, so
    with grain not yet imported the answer is no, and nothing is imported."""
    if "grain" not in sys.modules:
        return False
    import grain

    if isinstance(obj, (grain.MapDataset, grain.IterDataset)):
        return True
    cls = type(obj)  # grain's own sources, or a class declaring grain's protocol
    return cls.__module__.startswith("grain.") or (
        grain.sources.RandomAccessDataSource in cls.__mro__
    )


def as_source(obj, what: str = ""):
    """``obj`` as a jaxdist DataSource: a grain object wrapped in a GrainSource, anything
    else (already a DataSource) as it is."""
    if isinstance(obj, GrainSource) or not is_grain(obj):
        return obj
    return GrainSource(obj, what)


def user_source(obj, task: str, what: str):
    """A factory's source (``--data package.module:factory``): grain's adapted, a bare
    array element (a language model's tokens) refused for another task."""
    source = as_source(obj, what)
    grain_backed = isinstance(source, GrainSource) and len(source) > 0
    if grain_backed and task != "lm" and isinstance(source.dataset[0], np.ndarray):
        raise ConfigError(
            f"{what}: element 0 is one array, which jaxdist reads as a language model's "
            f"tokens; the model's task is {task}: give elements as dicts of arrays "
            "(e.g. {'x': inputs, 'y': label})"
        )
    return source


class GrainSource:
    """jaxdist's DataSource over a grain ``MapDataset`` or random-access source.

    ``source[indices]`` reads ``dataset[i]`` for each index, in order, and stacks the
    elements: each a dict ``{name: array}`` (every element the same names and shapes),
    or one array, named ``tokens`` (a language model's window of T + 1 ids). Any other
    element (a tuple, a string, None from a ``.filter()``) is a ConfigError naming it.
    """

    def __init__(self, dataset, what: str = ""):
        import grain

        self.what = what or f"grain {type(dataset).__name__}"
        if isinstance(dataset, grain.IterDataset):
            raise ConfigError(
                f"{self.what}: a grain IterDataset has no random access, and jaxdist's "
                "sampler picks the indices of every step; give the MapDataset (before "
                ".to_iter_dataset()), without .batch() (jaxdist batches)"
            )
        self.dataset = dataset
        self.num_examples = len(dataset)
        if self.num_examples >= ENDLESS:
            raise ConfigError(
                f"{self.what}: the grain dataset is endless (a .repeat()); jaxdist's "
                "sampler makes the epochs: give one pass over the examples"
            )
        # an lm's vocabulary, when the dataset states it (else --vocab-size)
        self.vocab_size = getattr(dataset, "vocab_size", None)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, indices) -> Batch:
        rows = [int(i) for i in np.asarray(indices).reshape(-1)]
        return self._stack(rows, [self.example(i) for i in rows])

    def example(self, index: int) -> Batch:
        """Element ``index`` as ``{name: numpy array}`` (one example, no batch axis)."""
        element = self.dataset[index]
        if isinstance(element, np.ndarray):
            element = {TOKENS: element}
        if not isinstance(element, Mapping):
            raise ConfigError(
                f"{self.what}: element {index} is a {type(element).__name__}; jaxdist reads "
                "a dict of numpy arrays (e.g. {'x': (F,) float32, 'y': int32}) or one numpy "
                f"array (a language model's T + 1 token ids){_why(element)}"
            )
        example = {}
        for name, value in element.items():
            array = np.asarray(value)
            if not isinstance(name, str) or array.dtype.kind not in _NUMERIC:
                raise ConfigError(
                    f"{self.what}: element {index}: {name!r} is a {type(value).__name__} "
                    f"({array.dtype}); a batch holds numbers under string names"
                )
            example[name] = array
        return example

    def _stack(self, rows: list[int], examples: list[Batch]) -> Batch:
        names = list(examples[0]) if examples else []
        for row, example in zip(rows, examples, strict=True):
            if list(example) != names:
                raise ConfigError(
                    f"{self.what}: element {row} has the names {list(example)}, element "
                    f"{rows[0]} {names}; every element must have the same"
                )
        batch = {}
        for name in names:
            shapes = {np.shape(example[name]) for example in examples}
            if len(shapes) > 1:
                raise ConfigError(
                    f"{self.what}: {name!r} has the shapes {sorted(shapes)} among elements "
                    f"{rows[:8]}...; every element's must be the same (pad or crop them)"
                )
            batch[name] = np.stack([example[name] for example in examples])
        return batch


def _why(element) -> str:
    if element is None:
        return " (a .filter() leaves None where it drops: jaxdist reads every index)"
    return ""


def check_workers(source, workers: int, what: str) -> None:
    """``--data-workers`` run a grain source's per-example work; other sources are numpy
    reads of whole batches already, which the thread prefetcher keeps ahead of the step."""
    if workers and not isinstance(source, GrainSource):
        raise ConfigError(
            f"--data-workers {workers}: workers run a grain source's per-example work, and "
            f"{what} is a {type(source).__name__}; use --data-workers 0 (its batches are "
            f"built in a background thread), or return a grain MapDataset ({INSTALL}) from "
            "a package.module:factory"
        )


class WorkerBatches:
    """Host batches of steps ``start_step``, ``start_step + 1``, ... built by ``workers``
    grain processes (step s in worker (s - start_step) mod N), returned in step order;
    ``close()`` ends the processes. A process that dies is a JaxdistError naming the
    step; a source's error is raised here as it was raised there."""

    def __init__(self, source, sampler: DistributedSampler, start_step: int, workers: int):
        check_workers(source, workers, "the source")
        import grain

        _absl_flags_parsed()
        steps = grain.MapDataset.source(_StepBatches(source, sampler, start_step))
        # One batch at a time in each worker: grain's default reads 500 elements ahead
        # with 16 threads per process, and each element here is a whole batch.
        reads = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        pipeline = steps.to_iter_dataset(reads).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers),
            # this process's id, taken here: a worker may start after its death
            worker_init_fn=functools.partial(_worker_init, os.getpid()),
        )
        self._batches = iter(pipeline)
        self._step = start_step  # the step of the next batch

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        try:
            shared = next(self._batches)
        except RuntimeError as err:
            if "terminated unexpectedly" not in str(err):
                raise
            died = JaxdistError(
                f"step {self._step + 1}: a --data-workers process died before its batch "
                f"came ({err}); the source's per-example work crashed it (a segfault, "
                "os._exit, out of memory). Run with --data-workers 0 to see the error in "
                "this process"
            )
            died.step = self._step + 1
            raise died from err
        self._step += 1
        # Copied out of grain's shared memory, which it frees when the copy is made:
        # none is left mapped while a device array or an interpreter's exit holds it.
        return {name: np.array(array) for name, array in shared.items()}

    def close(self) -> None:
        # Let go of grain's iterators now: freed at an interpreter's exit instead, their
        # own close fails on modules already torn down (a page of ignored exceptions).
        batches, self._batches = self._batches, iter(())
        if hasattr(batches, "close"):
            batches.close()


class _StepBatches:
    """grain's random-access view of the training steps: position k -> the host batch of
    step ``start_step + k``, read as ``host_batches`` reads it without workers."""

    def __init__(self, source, sampler: DistributedSampler, start_step: int):
        self.source, self.sampler, self.start_step = source, sampler, start_step

    def __len__(self) -> int:
        return ENDLESS  # as many steps as the run takes

    def __getitem__(self, position: int) -> Batch:
        step = self.start_step + position
        try:
            return read_step(self.source, self.sampler, step)
        except (SystemExit, KeyboardInterrupt) as err:
            # grain passes on Exceptions alone; a worker that exits 0 is never missed
            raise RuntimeError(
                f"step {step + 1}: the source raised {type(err).__name__}({err}) in a "
                "--data-workers process"
            ) from None


def _absl_flags_parsed() -> None:
    """grain 0.2.18 reads an absl flag when it starts workers, which raises unless the
    program parsed absl's flags (google/grain#1355); unparsed, they take their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _worker_init(trainer_pid: int, worker_index: int, worker_count: int) -> None:
    """In each worker: Ctrl-C and SIGTERM (a terminal's or a launcher's, sent to the whole
    process group) are the trainer's to act on (stop, checkpoint, close the workers), so
    the workers ignore them; and they exit once the trainer is gone (killed: nothing
    closed them), rather than live on blocked on a queue nobody reads."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == trainer_pid:  # an orphan's parent is another process
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="jaxdist-parent-watch", daemon=True).start()
