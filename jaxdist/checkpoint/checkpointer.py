"""Checkpoints of the training state with orbax: asynchronous, sharded, verified.

A checkpoint is ``DIR/<step>/`` with two orbax items: ``state``, the state's arrays by
name (``params/blocks/0/attn/kernel``), each process writing only the shards it holds;
and ``meta``, JSON: the names, shapes and dtypes (``tree``), a fingerprint of every
array (``fingerprints``), and what the caller adds (the trainer: the data position and
the resolved config). Nothing is pickled.

Every array gets a fingerprint at save time (``verify.py``), computed on the devices
where it lives, and again after restore: a mismatch names the checkpoint step, the array
and both values, and the previous checkpoint is used instead. The fingerprint is the
same for any layout, so a checkpoint restored onto another mesh is verified too.

orbax writes a step into a temporary directory and renames it when every process has
finished: a save killed half way leaves no ``<step>`` directory, only the temporary one,
which the next ``Checkpointer`` removes (process 0, synchronously). With several
processes, a save's outcome is one for all (``outcome``): a write that fails on
one process fails the save on every process, with the same error, within the deadline.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist.checkpoint import io_errors, orbax_items
from jaxdist.checkpoint.outcome import SaveBarrier
from jaxdist.checkpoint.verify import check_compatible, describe, fingerprints, unreadable
from jaxdist.errors import JaxdistError

_TMP_MARK = ".orbax-checkpoint-tmp"


class CorruptCheckpointError(JaxdistError):
    """Every checkpoint in the directory failed its fingerprint check or could not be read."""


class Checkpointer:
    """Checkpoints in ``directory``, the newest ``keep`` kept. ``save`` returns once the
    arrays are copied off the devices (the state may then change); the files are
    written in the background, and the next ``save`` waits for the previous one."""

    def __init__(self, directory: Path | str, *, keep: int = 3, deadline_s: float = 1800.0):
        self.skipped: list[tuple[int, str]] = []  # the last restore's damaged checkpoints
        import orbax.checkpoint as ocp

        io_errors.quiet_orbax_storage_errors()
        self.directory = Path(directory).absolute()
        if jax.process_index() == 0:
            remove_partial(self.directory)
        multihost_utils.sync_global_devices(f"jaxdist-checkpointer:{self.directory}")
        self._ocp, self._keep = ocp, keep
        # orbax's barriers wait at most this long: a minute past jaxdist's checkpoint
        # deadline, so that the watchdog, when on, names a stalled write first
        self._timeout_s = int(deadline_s) + 60
        self._barrier = (
            SaveBarrier(self.directory, jax.process_index(), jax.process_count())
            if jax.process_count() > 1
            else None
        )
        # the save being written in the background: (step, time.monotonic() at its start)
        self.writing: tuple[int, float] | None = None
        self._orbax = None
        self._open()  # the directory is created, or its failure named, here

    @property
    def _manager(self):
        """orbax's manager of the directory; a new one after a save was abandoned (made
        by the next use, which every process reaches: making one meets the others)."""
        return self._orbax or self._open()

    def _open(self):
        with io_errors.writing("create the checkpoint directory", self.directory):
            self._orbax = self._new_manager()
        return self._orbax

    def _new_manager(self):
        ocp = self._ocp
        return ocp.CheckpointManager(
            self.directory,
            item_handlers=orbax_items.handlers(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self._keep,
                enable_async_checkpointing=True,
                create=True,
                async_options=ocp.AsyncOptions(
                    timeout_secs=self._timeout_s, barrier_sync_fn=self._barrier
                ),
            ),
        )

    def steps(self) -> list[int]:
        """Complete checkpoints, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def save(self, step: int, arrays: dict[str, jax.Array], extra: dict | None = None) -> float:
        """Starts saving ``arrays`` as checkpoint ``step``; returns the seconds it blocked."""
        if step in self._manager.all_steps():  # saved already (e.g. the last step)
            return 0.0
        started = time.perf_counter()
        meta = {
            "step": step,
            "tree": describe(arrays),
            "fingerprints": fingerprints(arrays),
            **(extra or {}),
        }
        self.wait()  # orbax would wait too: a failure of the previous save is named as its
        if self._barrier is not None:
            self._barrier.start(step)
        self.writing = (step, time.monotonic())
        with self._failing(step):
            self._manager.save(step, args=orbax_items.save(arrays, meta))
        return time.perf_counter() - started

    def wait(self) -> None:
        """Blocks until the last save is complete on disk; ``StorageError`` if it failed."""
        if self.writing is None:
            return
        step = self.writing[0]
        with self._failing(step):
            if self._barrier is None:
                self._manager.wait_until_finished()
            else:  # cut short by a failure of another process
                self._barrier.wait_for(self._manager, step)
        self.writing = None

    def in_flight(self) -> tuple[int, float, Path] | None:
        """(step, seconds, directory) of a save still being written, or None. Read by the
        watchdog's thread: a stalled file system shows as a save that never ends."""
        writing, manager = self.writing, self._orbax
        if writing is None or manager is None or not manager.is_saving_in_progress():
            return None
        return writing[0], time.monotonic() - writing[1], self.directory / str(writing[0])

    @contextlib.contextmanager
    def _failing(self, step: int):
        """A storage failure of checkpoint ``step`` as one ``StorageError``. The save is
        abandoned: its temporary directory removed (the space it took given back, the
        newest complete checkpoint untouched) and a fresh orbax manager made, so that a
        later save can be tried (``--checkpoint-failures continue``)."""
        try:
            yield
        except Exception as err:
            failed = self._outcome(err, step)
            if failed is None:
                raise
            self.writing = None
            self._abandon()
            raise failed from None

    def _outcome(self, err: Exception, step: int) -> io_errors.StorageError | None:
        """``err`` as the ``StorageError`` of checkpoint ``step``: with several processes,
        the one the group agreed on (the first published: this one, if it is first)."""
        where = self.directory / str(step)
        named = io_errors.storage_error(err, f"write checkpoint {step} to", where, step)
        return named if self._barrier is None else self._barrier.agreed(err, named, step)

    def _abandon(self) -> None:
        """Drops orbax's manager unclosed (closing waits for its threads, which may wait
        for another process); the next use makes a new one."""
        self._orbax = None
        if jax.process_index() == 0:
            remove_partial(self.directory)

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def read_meta(self, step: int) -> dict:
        return self._manager.restore(step, args=orbax_items.restore_meta())["meta"]

    def restore(self, target: dict | list[dict], step: int | None = None):
        """The newest (or the given) checkpoint whose arrays pass their fingerprints, as
        ``(step, arrays, meta)``, each array in ``target``'s sharding (any mesh: orbax
        reads the parts each device needs). ``target``: the arrays wanted by name, or a
        list of such forms of one state (the first the checkpoint holds is read). None
        if there is no checkpoint. A damaged checkpoint is reported and skipped; a
        checkpoint of another model is an error, naming the first form's difference."""
        targets = target if isinstance(target, list) else [target]
        steps = [step] if step is not None else self.steps()
        self.skipped = []  # (step, what is wrong) of each damaged checkpoint passed over
        for candidate in steps:
            meta = self.read_meta(candidate)
            held = next((t for t in targets if describe(t) == meta["tree"]), None)
            if held is None:
                check_compatible(meta, targets[0], candidate, self.directory)
                held = targets[0]
            arrays, problem = self._read_verified(candidate, held, meta)
            if problem is None:
                return candidate, arrays, meta
            self.skipped.append((candidate, problem))
            if jax.process_index() == 0:
                print(f"jaxdist: warning: {problem}; trying an older checkpoint", flush=True)
        if steps:
            raise CorruptCheckpointError(
                f"{self.directory}: no usable checkpoint (tried steps "
                f"{', '.join(map(str, steps))}); see the warnings above"
            )
        return None

    def _read_verified(self, step: int, target: dict, meta: dict):
        """(arrays, None) or (None, what is wrong), the same on every process."""
        try:
            restored = self._manager.restore(step, args=orbax_items.restore_state(target))["state"]
            problem = None
        except Exception as err:  # a truncated or unreadable file
            restored, problem = None, unreadable(step, self.directory, err, meta["tree"])
        # Agreed before the next collective: every process takes the same branch.
        if not _all_processes_ok(problem is None):
            return None, problem or f"checkpoint {step}: another process could not read it"
        found = fingerprints(restored)
        for name, expected in meta["fingerprints"].items():
            if found[name] != expected:
                return None, (
                    f"checkpoint {step} in {self.directory} is corrupt: {name} has fingerprint "
                    f"{found[name]:#010x}, saved as {expected:#010x}"
                )
        return restored, None


def _all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def remove_partial(directory: Path) -> list[Path]:
    """Removes the temporary directories of saves that never finished (a process killed
    mid-save); returns them."""
    if not directory.is_dir():
        return []
    partial = [p for p in directory.iterdir() if _TMP_MARK in p.name]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial
