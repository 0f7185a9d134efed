"""The refinement of one mesh that fits: the fewest microbatches that still fit (a binary
search over its grad_accum counts), then lighter remat, then each memory option off (and,
with seq, the other attention split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxdist.plan import candidates as cands

if TYPE_CHECKING:
    from jaxdist.plan.planner import Candidate


@dataclass(frozen=True)
class Fixed:
    """The options the user's flags set (None: the plan's to choose)."""

    zero: bool | None  # --shard-optimizer
    schedule: str | None  # --pipeline-schedule
    seq_way: str | None  # --seq-attention
    kv_heads: int  # the model's key/value heads: what all-to-all attention splits over seq


def floor_options(mesh: cands.Layout, fixed: Fixed) -> dict:
    """The options of a mesh's floor: the user's, else those that save memory (ZeRO-1,
    1F1B) and the ring."""
    zero = fixed.zero if fixed.zero is not None else mesh.data > 1
    schedule = fixed.schedule or ("1f1b" if mesh.stage > 1 else "gpipe")
    return {"zero": bool(zero) and mesh.data > 1, "schedule": schedule,
            "seq_way": fixed.seq_way or "ring"}  # fmt: skip


def option_changes(layout: cands.Layout, fixed: Fixed) -> list[dict]:
    """Changes to try once a mesh fits, each a row of its own, unless the user set it:
    each memory option off (GPipe rather than 1F1B, the optimizer state whole), and
    all-to-all attention (Ulysses) where seq divides the key/value heads."""
    changes = []
    if layout.stage > 1 and fixed.schedule is None and layout.schedule != "gpipe":
        changes.append({"schedule": "gpipe"})
    if layout.zero and fixed.zero is None:
        changes.append({"zero": False})
    if layout.seq > 1 and fixed.seq_way is None and fixed.kv_heads % layout.seq == 0:
        changes.append({"seq_way": "all-to-all"})
    return changes


class Refine:
    """One fitting mesh: the fewest microbatches that fit (memory falls as they grow),
    then lighter remat at that count while it fits, then each memory option off there
    (kept as a row of its own: the fastest that fits wins)."""

    def __init__(self, floor: Candidate, lighter_remats: list[str], lighter_options: list[dict]):
        self.options = floor.options
        self.layout = floor.layout
        self.lo, self.hi = -1, len(self.options) - 1  # options[hi] fits; [lo] does not
        self.remats = list(lighter_remats)
        self.lighter = list(lighter_options)
        self.busy = False
        self.step_s = floor.time.step_s  # its best fitting estimate so far

    def next_probe(self) -> cands.Layout | None:
        if self.busy:
            return None
        if self.hi - self.lo > 1:
            mid = (self.lo + self.hi) // 2
            self.busy = True
            return self.layout.with_(grad_accum=self.options[mid])
        if self.remats:
            self.busy = True
            return self.layout.with_(grad_accum=self.options[self.hi], remat=self.remats[0])
        if self.lighter:
            self.busy = True
            return self.layout.with_(grad_accum=self.options[self.hi], **self.lighter.pop(0))
        return None

    def learn(self, c: Candidate) -> None:
        self.busy = False
        if c.fits:
            self.step_s = min(self.step_s, c.time.step_s)
        options = (c.layout.zero, c.layout.schedule, c.layout.seq_way)
        if options != (self.layout.zero, self.layout.schedule, self.layout.seq_way):
            return  # an option changed: a row of its own, the search's layout unchanged
        if c.layout.remat != self.layout.remat:  # a lighter remat
            self.remats.pop(0)
            if c.fits:
                self.layout = c.layout
            else:
                self.remats = []
            return
        index = self.options.index(c.layout.grad_accum)
        if c.fits:
            self.hi = index
        else:
            self.lo = index
