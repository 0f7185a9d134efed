"""What a run reports, as events. The training loop (or your own loop) emits them to
``Sinks``; each sink (metrics.jsonl, the terminal, TensorBoard, goodput, the profiler)
picks the kinds it cares about. Adding a sink touches no loop code.

Every event carries ``time_s``, the ``time.perf_counter()`` reading when it was made,
so every sink that accounts for time (goodput, the summary) reads the same clock.

Order within a run: ``Started``; per step ``StepStarting``; after the first step
``Compiled``; at a logged step ``EvalMetrics`` (when it evaluates) then ``StepMetrics``;
``CheckpointSaved`` and ``Resumed`` as they happen (``Resumed``, and ``DataChanged`` if
a resume trains on changed data, before the first step);
``Stopped`` last. ``Note`` is a line for people, any time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"  # a sink's handler for it is ``on_<kind>``
    time_s: float = field(default_factory=time.perf_counter, kw_only=True)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step over all devices, and the devices' peak.

    ``xla``: XLA's cost analysis of the compiled step, per device x devices (it does not
    multiply a loop body, e.g. a ``scan`` over layers or microbatches, by its trip count).
    ``analytic``: a formula's (the GPT's 6N + 12 L d T per token, the Llama's
    6N + 12 L H Dh T), or None; ``formula`` names it.
    ``peak_flops_per_s``: all devices together; None where unknown (CPU): no MFU then."""

    xla: float | None = None
    analytic: float | None = None
    peak_flops_per_s: float | None = None
    device_kind: str = ""
    formula: str = "6N + 12LdT"  # how the log line names ``analytic``

    @property
    def per_step(self) -> float | None:
        """The count MFU uses: the formula's where there is one (model FLOPs), else XLA's."""
        return self.analytic or self.xla

    def mfu(self, step_time_s: float) -> float | None:
        """Model FLOPs utilisation of a step that took ``step_time_s``."""
        if not self.per_step or not self.peak_flops_per_s or step_time_s <= 0:
            return None
        return self.per_step / step_time_s / self.peak_flops_per_s


@dataclass(frozen=True)
class Started(Event):
    """The loop is about to run its first step: what came before is start-up."""

    kind: ClassVar[str] = "started"
    total_steps: int
    first_step: int = 1  # > 1 after a resume
    config: dict = field(default_factory=dict)  # the resolved config, nested
    samples_per_step: int = 0  # the global batch
    tokens_per_step: int = 0  # language models: global batch x sequence length


@dataclass(frozen=True)
class StepStarting(Event):
    """Step ``step`` is about to take its batch (every step: keep handlers cheap)."""

    kind: ClassVar[str] = "step_starting"
    step: int


@dataclass(frozen=True)
class Compiled(Event):
    """The first step finished: ``seconds`` from ``Started`` to its end, compilation,
    its data wait and its run included."""

    kind: ClassVar[str] = "compiled"
    step: int
    seconds: float
    flops: StepFlops | None = None


@dataclass(frozen=True)
class StepMetrics(Event):
    """A logged step: ``values`` is its metrics.jsonl record (loss, lr, step_time_s, ...,
    and eval_* when it evaluated). Timing of the steps since the last StepMetrics:
    ``steps`` of them took ``timed_s`` seconds, of which ``data_wait_s`` waiting for input;
    evaluations and checkpoint saves are not in ``timed_s``. ``compiling``: the first
    step, already counted by ``Compiled``."""

    kind: ClassVar[str] = "step_metrics"
    step: int
    values: dict
    steps: int = 1
    timed_s: float = 0.0
    data_wait_s: float = 0.0
    compiling: bool = False


@dataclass(frozen=True)
class EvalMetrics(Event):
    """Held-out metrics at ``step`` (``loss``, ``bpb`` or ``accuracy``, ``count``), which
    took ``eval_s`` seconds."""

    kind: ClassVar[str] = "eval_metrics"
    step: int
    values: dict
    eval_s: float = 0.0


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """A checkpoint of ``step`` started or finished; the loop was blocked ``blocked_s``."""

    kind: ClassVar[str] = "checkpoint_saved"
    step: int
    blocked_s: float


@dataclass(frozen=True)
class Resumed(Event):
    """This attempt restored the checkpoint of ``from_step``; an earlier attempt had
    reached ``earlier_last_step``, so steps (from_step, earlier_last_step] are computed a
    second time."""

    kind: ClassVar[str] = "resumed"
    from_step: int
    earlier_last_step: int


@dataclass(frozen=True)
class DataChanged(Event):
    """This attempt resumed at ``step`` on a data file (``role``: train or eval) whose
    fingerprint differs from the checkpoint's, as ``--data-changed ok`` allows:
    ``saved`` and ``found`` are ``{"path", "size", "blake2b"}`` (jaxdist.data.fingerprint).
    Emitted with ``Resumed``; metrics.jsonl records it before the resumed steps."""

    kind: ClassVar[str] = "data_changed"
    step: int
    role: str
    saved: dict
    found: dict

    def record(self) -> dict:
        """Its metrics.jsonl line: an ``event`` record, not a step's metrics."""
        return {
            "event": self.kind,
            "step": self.step,
            "role": self.role,
            "file": self.found.get("path"),
            "saved": self.saved,
            "found": self.found,
        }


@dataclass(frozen=True)
class Stopped(Event):
    """The loop ended after ``step``: the last step, or earlier on a stop signal."""

    kind: ClassVar[str] = "stopped"
    step: int
    early: bool = False


@dataclass(frozen=True)
class Note(Event):
    """A line for people (the terminal prints it)."""

    kind: ClassVar[str] = "note"
    text: str
