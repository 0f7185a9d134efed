"""The refinement of one mesh that fits: the fewest microbatches that still fit (a binary
search over its grad_accum counts), then lighter remat, then each memory option off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxdist.plan import candidates as cands

if TYPE_CHECKING:
    from jaxdist.plan.planner import Candidate


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
        if (c.layout.zero, c.layout.schedule) != (self.layout.zero, self.layout.schedule):
            return  # an option off: a row of its own, the search's layout unchanged
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
