"""Which layout fits a cluster and runs fastest, from the step compiled for it.

``python -m jaxdist.plan --target 8x8:A100-80GB --model gpt ...`` and, in Python,
``jaxdist.plan(["--model", "gpt", ...], "8x8:A100-80GB")`` (the module is callable: it
is ``plan.planner.plan``). The step of each candidate layout is compiled by XLA for the
target's devices, which need not exist (``worker``), and read: memory from the compiled
program's own analysis, FLOPs and collective bytes from its text
(``jaxdist.parallel.hlo``), a step time estimated from them (``estimate``). It is a
command built on the trainer's flags and step (``jaxdist.train.compile_only``, which
``python -m jaxdist.train --dry-run`` uses too): neither the library nor the trainer
imports it.
"""

from __future__ import annotations

import importlib
import sys
import types

from jaxdist.plan.candidates import Layout
from jaxdist.plan.targets import KINDS, DeviceKind, Target, parse_target

# The planner builds the trainer's step (jaxdist.train), so it loads on first use:
# ``import jaxdist.plan`` alone (targets, layouts) does not load the trainer.
_PLANNER = ("Candidate", "Options", "Plan", "plan")


def __getattr__(name: str):
    if name in _PLANNER:
        return getattr(importlib.import_module("jaxdist.plan.planner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return importlib.import_module("jaxdist.plan.planner").plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["KINDS", "Candidate", "DeviceKind", "Layout", "Options", "Plan", "Target",
           "parse_target", "plan"]  # fmt: skip
