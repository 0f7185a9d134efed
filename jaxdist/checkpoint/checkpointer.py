"""Checkpoints of the training state with orbax: asynchronous, sharded, verified.

A checkpoint is ``DIR/<step>/`` with two orbax items: ``state``, the state's arrays by
name (``params/blocks/0/attn/kernel``), each process writing only the shards it holds;
and ``meta``, JSON: the names, shapes and dtypes (``tree``), a fingerprint of every
array (``fingerprints``), and what the caller adds (the trainer: the data position and
the resolved config). Nothing is pickled.

orbax checks no checksum of array contents (a flipped byte inside a chunk file restores
silently as a wrong value: shared/jax-notes fact 4). So every array gets a fingerprint
at save time, computed on the devices where it lives, and again after restore: a
mismatch names the checkpoint step, the array and both values, and the previous
checkpoint is used instead. The fingerprint is the same for any layout (it sums over
global element positions), so a checkpoint restored onto another mesh is verified too.

orbax writes a step into a temporary directory and renames it when every process has
finished: a save killed half way leaves no ``<step>`` directory, only the temporary one,
which the next ``Checkpointer`` removes (process 0, synchronously).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxdist.checkpoint import io_errors, orbax_items
from jaxdist.errors import ConfigError, JaxdistError

_TMP_MARK = ".orbax-checkpoint-tmp"


class CorruptCheckpointError(JaxdistError):
    """Every checkpoint in the directory failed its fingerprint check or could not be read."""


def fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 summary of ``x``'s bits: sum over elements of bits x an odd weight of the
    element's global position, mod 2^32. One flipped bit changes it (2^k times an odd
    number is never 0 mod 2^32 for k < 32); it needs no reshape, so a sharded array is
    summed where it lives and the result does not depend on the layout."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        x = jax.device_put(x, jax.memory.Space.Device)  # offloaded state: read it on the device
    if x.dtype.itemsize == 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 1:
        bits = x.astype(jnp.uint8).astype(jnp.uint32)
    else:  # 8-byte values: both halves
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    position = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):  # row-major position, mod 2^32
        stride = int(np.prod(bits.shape[dim + 1 :], dtype=np.uint64) % 2**32)
        position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * stride
    weight = position * jnp.uint32(0x9E3779B1) | jnp.uint32(1)
    return jnp.sum(bits * weight, dtype=jnp.uint32)


@jax.jit
def _fingerprints(arrays: dict) -> dict:
    return {name: fingerprint(x) for name, x in arrays.items()}


def fingerprints(arrays: dict[str, jax.Array]) -> dict[str, int]:
    """``fingerprint`` of every array, as Python ints (the same on every process)."""
    values = _fingerprints(arrays)
    return {name: int(np.asarray(v.addressable_data(0))) for name, v in values.items()}


def describe(arrays: dict) -> dict[str, list]:
    """name -> [shape, dtype]: what a checkpoint must match to be restored."""
    return {name: [list(x.shape), str(x.dtype)] for name, x in arrays.items()}


class Checkpointer:
    """Checkpoints in ``directory``, the newest ``keep`` kept. ``save`` returns once the
    arrays are copied off the devices (the state may then change); the files are
    written in the background, and the next ``save`` waits for the previous one."""

    def __init__(self, directory: Path | str, *, keep: int = 3):
        self.skipped: list[tuple[int, str]] = []  # the last restore's damaged checkpoints
        import orbax.checkpoint as ocp

        io_errors.quiet_orbax_storage_errors()
        self.directory = Path(directory).absolute()
        if jax.process_index() == 0:
            remove_partial(self.directory)
        multihost_utils.sync_global_devices(f"jaxdist-checkpointer:{self.directory}")
        self._ocp, self._keep = ocp, keep
        # the save being written in the background: (step, time.monotonic() at its start)
        self.writing: tuple[int, float] | None = None
        with io_errors.writing("create the checkpoint directory", self.directory):
            self._manager = self._new_manager()

    def _new_manager(self):
        ocp = self._ocp
        return ocp.CheckpointManager(
            self.directory,
            item_handlers=orbax_items.handlers(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self._keep, enable_async_checkpointing=True, create=True
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
        self.writing = (step, time.monotonic())
        with self._failing(step):
            self._manager.save(step, args=orbax_items.save(arrays, meta))
        return time.perf_counter() - started

    def wait(self) -> None:
        """Blocks until the last save is complete on disk; ``StorageError`` if it failed."""
        if self.writing is None:
            return
        with self._failing(self.writing[0]):
            self._manager.wait_until_finished()
        self.writing = None

    def in_flight(self) -> tuple[int, float, Path] | None:
        """(step, seconds, directory) of a save still being written, or None. Read by the
        watchdog's thread: a stalled file system shows as a save that never ends."""
        writing = self.writing
        if writing is None or not self._manager.is_saving_in_progress():
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
            where = self.directory / str(step)
            failed = io_errors.storage_error(err, f"write checkpoint {step} to", where, step)
            if failed is None:
                raise
            self.writing = None
            self._abandon()
            raise failed from None

    def _abandon(self) -> None:
        with contextlib.suppress(Exception):
            self._manager.close()
        if jax.process_index() == 0:
            remove_partial(self.directory)
        with contextlib.suppress(Exception):
            self._manager = self._new_manager()

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
            restored, problem = None, _unreadable(step, self.directory, err, meta["tree"])
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


def _unreadable(step: int, directory: Path, err: Exception, tree: dict) -> str:
    """What could not be read: orbax names the array's storage path in its error
    (``'path': 'params/fc/kernel/'``) among a page of TensorStore details."""
    text = str(err)
    name = next((n for n in tree if f"'{n}/'" in text), None)
    reason = text.split(" See full TensorStore details")[0].splitlines()[0]
    if name is None:
        return f"checkpoint {step} in {directory} cannot be read: {reason}"
    shape, dtype = tree[name]
    return (
        f"checkpoint {step} in {directory} cannot be read: {name} (saved as {tuple(shape)} "
        f"{dtype}) does not decode from its stored bytes: {reason}"
    )


def check_compatible(meta: dict, target: dict, step: int, directory: Path) -> None:
    """ConfigError naming the first array whose name, shape or dtype differs."""
    saved, wanted = meta["tree"], describe(target)
    for name in list(wanted) + [n for n in saved if n not in wanted]:
        if saved.get(name) != wanted.get(name):

            def show(entry):
                return "absent" if entry is None else f"{tuple(entry[0])} {entry[1]}"

            raise ConfigError(
                f"checkpoint {step} in {directory} holds a different model: {name} is "
                f"{show(saved.get(name))} there and {show(wanted.get(name))} in this one "
                "(start afresh with --overwrite, or in another --run-dir)"
            )


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
