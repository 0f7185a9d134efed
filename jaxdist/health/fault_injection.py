"""Fault injection, for the tests and ``experiments/faults.py``: the environment variable
``JAXDIST_FAULT="KIND@PROCESS:STEP"`` (several, comma-separated) makes process PROCESS
misbehave at step STEP of ``python -m jaxdist.train``. ``KIND@PROCESS:STEP:RESTART`` acts
only in the group started for the launcher's restart RESTART (``JAXDIST_RESTART_COUNT``,
0 on the first start), so that a test can fail one attempt and let the next run on.

==========  ==============================================================================
kill        SIGKILL itself before the step (a crashed process, a lost node)
freeze      SIGSTOP itself before the step (a frozen process: all its threads stop)
stall-data  the read of the step's batch never returns (a stuck network filesystem)
spin        the training loop's thread spins for ever before the step (an infinite loop)
deadlock    the loop's thread waits for a lock it holds (a deadlocked callback)
program     its training step differs: the loss is scaled by 1 + 2^-20 (STEP is ignored)
flip        one bit of a parameter flips on its first device before the step
abort       a native thread calls abort() as the step starts (XLA giving up on a collective)
nan         the step's loss is NaN on every process (``--nan-policy`` decides what follows;
            PROCESS is ignored). Every batch then carries a per-row field, 0 or NaN, that
            the loss adds: one program for all steps.
==========  ==============================================================================

Unset (the normal case) it costs one dictionary lookup per step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import jax
import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.parallel.packed import unpack

VARIABLE = "JAXDIST_FAULT"
RESTART_VARIABLE = "JAXDIST_RESTART_COUNT"  # set by jaxdist.launch for each group it starts
KINDS = ("kill", "freeze", "stall-data", "spin", "deadlock", "program", "flip", "abort", "nan")
NAN_FIELD = "jaxdist_fault_nan"  # the batch field of the ``nan`` fault, popped by the loss
PROGRAM_SCALE = 1.0 + 2.0**-20


@dataclass(frozen=True)
class Fault:
    kind: str
    process: int
    step: int
    restart: int | None = None  # None: every start of the group


def parse(text: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, where = part.partition("@")
        process, _, when = where.partition(":")
        step, _, restart = when.partition(":")
        if (
            kind not in KINDS
            or not process.isdigit()
            or not (step.isdigit() or (kind == "program" and not step))
            or not (restart.isdigit() or not restart)
        ):
            raise ConfigError(
                f"{VARIABLE}={text!r}: {part!r} is not KIND@PROCESS:STEP[:RESTART] with KIND "
                f"one of {', '.join(KINDS)}"
            )
        restart_index = int(restart) if restart else None
        faults.append(Fault(kind, int(process), int(step or 0), restart_index))
    return faults


class Faults:
    """This process's faults (none unless ``JAXDIST_FAULT`` names it)."""

    def __init__(self, faults: list[Fault], process_index: int, restart: int = 0):
        faults = [f for f in faults if f.restart in (None, restart)]
        mine = [f for f in faults if f.process == process_index]
        self.process_index = process_index
        own = ("stall-data", "program", "nan")  # not acted on before a step
        self.at_step = {f.step: f for f in mine if f.kind not in own}
        self.stall_steps = {f.step for f in mine if f.kind == "stall-data"}
        self.program = any(f.kind == "program" for f in mine)
        # every process's batches carry the field: the global batch is one array
        self.nan_steps = {f.step for f in faults if f.kind == "nan"}

    @classmethod
    def from_env(cls, process_index: int) -> Faults:
        restart = int(os.environ.get(RESTART_VARIABLE) or 0)
        return cls(parse(os.environ.get(VARIABLE, "")), process_index, restart)

    def wrap_loss(self, loss_fn):
        """The ``program`` fault: the same loss scaled, so another compiled step. The
        ``nan`` fault: the loss plus the sum of the batch's NaN field (0 but at its step).
        The wrapper keeps ``loss_fn``'s signature (``functools.wraps``): whether it takes
        ``rngs`` is read from it."""
        if not (self.program or self.nan_steps):
            return loss_fn
        scale = PROGRAM_SCALE if self.program else 1.0

        @functools.wraps(loss_fn)
        def faulty(model, batch, *args, **kwargs):
            poison = 0.0
            if NAN_FIELD in batch:  # not in the batch shapes agreed on before step 1
                batch = dict(batch)
                poison = batch.pop(NAN_FIELD).sum()
            out = loss_fn(model, batch, *args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] * scale + poison, *out[1:])
            return out * scale + poison

        return faulty

    def wrap_batches(self, batches, start_step: int):
        """Host batches of steps start_step + 1, ...; a ``stall-data`` step never comes;
        with a ``nan`` fault each carries its NaN field."""
        if self.nan_steps:
            batches = _poisoning(batches, start_step, self.nan_steps)
        if not self.stall_steps:
            return batches
        return _stalling(batches, start_step, self.stall_steps, self.process_index)

    def before_step(self, step: int, state):
        fault = self.at_step.get(step)
        if fault is None:
            return state
        announce(fault)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault.kind == "spin":
            while True:  # the point is never to return
                pass
        if fault.kind == "deadlock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns
        if fault.kind == "flip":
            return flip_a_bit(state)
        if fault.kind == "abort":  # from another thread, as XLA's runtime aborts
            threading.Timer(0.2, os.abort).start()
        return state


def announce(fault: Fault) -> None:
    """One line on stderr with the wall time, so a harness can time the detection."""
    print(
        f"jaxdist: fault injected: {fault.kind} at step {fault.step} on process "
        f"{fault.process}, time {time.time():.3f}",
        file=sys.stderr,
        flush=True,
    )


def _stalling(batches, start_step: int, stall_steps: set[int], process: int):
    for step, batch in enumerate(batches, start_step + 1):
        if step in stall_steps:
            announce(Fault("stall-data", process, step))
        while step in stall_steps:
            time.sleep(3600)
        yield batch


def _poisoning(batches, start_step: int, nan_steps: set[int]):
    for step, batch in enumerate(batches, start_step + 1):
        rows = len(next(iter(batch.values())))  # this process's rows of the global batch
        value = np.nan if step in nan_steps else 0.0
        yield {**batch, NAN_FIELD: np.full((rows,), value, np.float32)}


def flip_a_bit(state, leaf: int = 0):
    """``state`` with bit 20 of the first element of parameter ``leaf`` (in
    ``jax.tree.leaves`` order) flipped in this process's first device's block only: its
    replicas now differ by one bit."""
    state = unpack(state)  # a TrainState, for dataclasses.replace
    leaves, treedef = jax.tree.flatten(state.params)
    first = leaves[leaf]
    shards = [s.data for s in first.addressable_shards]
    host = np.array(shards[0])
    bits = host.view(np.uint32) if host.dtype.itemsize == 4 else host.view(np.uint16)
    bits.reshape(-1)[0] ^= 1 << (20 if host.dtype.itemsize == 4 else 10)
    shards[0] = jax.device_put(host, shards[0].devices().pop())
    leaves[leaf] = jax.make_array_from_single_device_arrays(first.shape, first.sharding, shards)
    return dataclasses.replace(state, params=jax.tree.unflatten(treedef, leaves))
