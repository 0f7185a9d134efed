"""One outcome for a checkpoint on every process: written everywhere, or failed everywhere.

orbax ends an asynchronous save with barriers between the processes (every write done;
the temporary directory renamed; the save over), each waited for up to its own timeout
(1,200 s by default). A process whose write fails skips the barriers after it, so the
others used to wait that whole timeout and then end on an error naming nothing.

``SaveBarrier`` is the barrier orbax is given instead (``AsyncOptions.barrier_sync_fn``):
kept on the coordination service's store, and aware of failures. A process whose save
failed reaches its next barrier while that failure propagates (orbax's finalizing thread
meets a barrier in a ``finally``); it publishes the failure under the checkpoint's step
first. Every process waiting at a barrier of that save, and every one arriving later,
raises the published failure: one ``StorageError`` naming the process, the path and the
cause. So the save ends everywhere with the same error, found by each process at the
same point of its loop (the next save, or the end), and the processes agree whether to
stop (exit 74) or, with ``--checkpoint-failures continue``, go on. No barrier waits
past the checkpoint deadline (``timeout_ms``, set from ``--slow-phase-timeout``).

The cost is a few store round trips per barrier and four barriers per save; measured by
``experiments/save_outcome_cost.py`` (see docs/health.md).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

from jaxdist.checkpoint import io_errors
from jaxdist.cluster import store

PREFIX = "jaxdist/save/"
POLL_S = 0.1  # a failure published while a barrier waits is seen within this


class SaveBarrier:
    """orbax's ``BarrierSyncFn`` for the saves into ``directory`` (the same path on every
    process), on a group of ``process_count``. ``start(step)`` before each save."""

    def __init__(self, directory: Path, process_index: int, process_count: int):
        self.directory = Path(directory)
        self.index, self.count = process_index, process_count
        tag = hashlib.sha1(str(self.directory).encode()).hexdigest()[:10]
        self._prefix = f"{PREFIX}{tag}/"  # two checkpoint folders never share a barrier
        self.step: int | None = None
        self._calls: dict[str, int] = {}  # barrier key -> times met in this save
        self._mine: dict[int | None, list[str]] = {}  # step -> keys this process set
        self._lock = threading.Lock()

    def start(self, step: int) -> None:
        """The barriers from now on are checkpoint ``step``'s. Removes this process's keys
        of the saves before the previous one: every process arrived at the previous
        save's barriers, so each has left the ones before it."""
        with self._lock:
            stale = [s for s in self._mine if s != self.step]
            keys = [k for s in stale for k in self._mine.pop(s)]
            self.step, self._calls = step, {}
        for key in keys:
            store.delete(key)

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        pending = sys.exc_info()[1]  # called in a `finally` while this save's error rises
        if pending is not None:
            self.publish(pending)
        with self._lock:
            n = self._calls[key] = self._calls.get(key, -1) + 1
            step = self.step
            where = f"{self._prefix}{step}/{key}/{n}/"
            self._mine.setdefault(step, []).extend([f"{where}in/{self.index}", f"{where}done"])
        store.put(f"{where}in/{self.index}", "")
        # The process that finds everyone arrived says so; the others wait on that key
        # (answered the moment it is set), looking for a failure between two waits.
        if len(store.get_dir(f"{where}in/")) >= self.count:
            store.put(f"{where}done", "")
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            failed = self.failure(step)
            if failed is not None:
                raise failed
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise self._timed_out(step, store.get_dir(f"{where}in/"), timeout_ms / 1000)
            try:
                store.wait_get(f"{where}done", min(POLL_S, left_s))
                return
            except TimeoutError:
                continue

    def publish(self, err: BaseException, step: int | None = None) -> None:
        """Makes ``err`` the outcome of checkpoint ``step`` (default: the current save)
        unless another process's failure was published first."""
        step = self.step if step is None else step
        if isinstance(err, io_errors.StorageError) and err.process is not None:
            return  # the agreed failure itself, passing through
        path = self.directory / str(step)
        named = io_errors.storage_error(err, f"write checkpoint {step} to", path, step)
        record = {
            "process": self.index,
            "operation": f"write checkpoint {step} to",
            "path": str(named.path if named else path),
            "cause": named.cause if named else f"{type(err).__name__}: {err}"[:500],
        }
        store.set_first(self._failed_key(step), json.dumps(record))

    def agreed(self, err: Exception, named, step: int) -> io_errors.StorageError | None:
        """The error checkpoint ``step`` ends with here, ``err`` having been raised (as a
        storage failure: ``named``): the group's (the first published: this one's, if it
        was first); None for this process's own unexpected error (raised as it is)."""
        try:
            self.publish(err, step)  # the others' barriers and waits end on it
            agreed = self.failure(step)
        except Exception:  # the store is gone (process 0 died): this process's own view
            return named
        if named is None and agreed is not None and agreed.process == self.index:
            return None
        return agreed or named

    def wait_for(self, manager, step: int) -> None:
        """orbax's ``wait_until_finished`` of checkpoint ``step``, cut short when another
        process published a failure of it: orbax's threads are then left to end by
        themselves (one waiting for a signal the failed process never sends would wait
        its 300 s)."""
        outcome = concurrent.futures.Future()

        def wait() -> None:
            try:
                outcome.set_result(manager.wait_until_finished())
            except BaseException as err:
                outcome.set_exception(err)

        threading.Thread(target=wait, name="jaxdist-save-wait", daemon=True).start()
        while True:
            try:
                return outcome.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                failed = self.failure(step)
                if failed is not None:
                    raise failed from None

    def failure(self, step: int | None = None) -> io_errors.StorageError | None:
        """The failure published for checkpoint ``step`` (default: the current save)."""
        step = self.step if step is None else step
        found = store.try_get(self._failed_key(step))
        if found is None:
            return None
        record = json.loads(found)
        return io_errors.StorageError(
            record["operation"], record["path"], record["cause"], step, process=record["process"]
        )

    def _failed_key(self, step) -> str:
        return f"{self._prefix}{step}/failed"

    def _timed_out(self, step, arrived: dict, waited_s: float) -> io_errors.StorageError:
        here = {int(k.rsplit("/", 1)[1]) for k in arrived}
        missing = ", ".join(str(i) for i in range(self.count) if i not in here)
        return io_errors.StorageError(
            f"write checkpoint {step} to",
            self.directory / str(step),
            f"process {missing} did not finish writing it within {waited_s:.0f}s "
            "(a stalled or very slow file system?)",
            step,
        )
