"""``plan(train_flags, target)``: which layout of a training run fits a cluster and runs
fastest, from the step compiled for each candidate layout on that cluster's devices,
which need not be present.

The search, in a time budget (default 50 s; 0: no limit): no compile starts that would
end past it, judged by the longest of the last four.
1. every mesh of the target (``candidates.meshes``), screened without compiling: a batch
   that data x fsdp cannot split, or a state (params, optimizer state, one gradient)
   that cannot fit even split ``fsdp x model x stage`` ways, is discarded;
2. each mesh's floor: compiled with the most microbatches its rows allow (and, unless
   ``--remat`` is given, ``--remat full``): the least memory that mesh can reach;
3. for the meshes that fit, fastest first: the fewest microbatches that still fit
   (a binary search), then lighter remat at that count, then each memory option off and,
   with seq, all-to-all attention in place of the ring (``refine.option_changes``).
A layout the model's dimensions cannot split is discarded by the layout function's own
error in its worker.

A GPT whose unrolled blocks compiled nothing in the budget (each of its L blocks is
compiled apart, minutes for a large L on a few cores) is planned again as one scanned
block (``--scan-layers``) unless the flags chose either form; the plan says so, and its
command carries the flag. A plan that still compiled nothing says that it measured
nothing (``Plan.compiled == 0``), rather than that nothing fits.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass, field

from jaxdist.parallel.device_mesh import parse_mesh
from jaxdist.plan import candidates as cands
from jaxdist.plan import gpu_compiler
from jaxdist.plan.estimate import EFFICIENCY, StepTime, step_time
from jaxdist.plan.pool import Pool, environment
from jaxdist.plan.refine import Fixed, Refine, floor_options, option_changes
from jaxdist.plan.table import train_command
from jaxdist.plan.targets import Target, parse_target
from jaxdist.train import compile_only
from jaxdist.train import config as config_lib


@dataclass
class Options:
    budget_s: float = 50.0  # no compile starts that would end after this; 0: no limit
    workers: int = 2  # compiling processes (one per core is right)
    efficiency: float = EFFICIENCY  # of the peak FLOP/s the step reaches
    overlap: bool = False  # communication hidden under compute (else added to it)
    memory_fraction: float = 0.9  # of the device's memory the run may use
    candidate_timeout_s: float = 180.0
    worker_memory_gib: float = 6.0


@dataclass
class Candidate:
    layout: cands.Layout
    phase: str  # "screen", "floor" (the mesh's least memory) or "refine"
    # compiled, too big (screened), unsplittable, failed, timed out, worker memory, budget
    status: str = "pending"
    why: str = ""
    measured: dict | None = None
    time: StepTime | None = None
    fits: bool = False
    tree: dict = field(default_factory=dict, repr=False)  # the config the worker builds
    options: list = field(default_factory=list, repr=False)  # floor: its grad_accum counts
    refine: object = field(default=None, repr=False)  # refine: the search it belongs to
    started: float = field(default=0.0, repr=False)  # time.perf_counter() when sent

    @property
    def peak_bytes(self) -> float:
        return self.measured["peak_bytes"] if self.measured else float("nan")


@dataclass
class Plan:
    target: Target
    capacity_bytes: float
    options: Options
    candidates: list[Candidate]
    best: Candidate | None
    command: str
    state_bytes: float
    elapsed_s: float
    dtype: str
    notes: list[str] = field(default_factory=list)  # what the plan changed, said above it

    @property
    def compiled(self) -> int:
        return sum(c.status == "compiled" for c in self.candidates)


def plan(train_flags: list[str], target: str | Target, options: Options | None = None,
         progress=None) -> Plan:  # fmt: skip
    """``train_flags``: ``python -m jaxdist.train``'s flags (``--model gpt ...``); what
    they set (``--mesh``, ``--grad-accum``, ``--remat``) is kept, the rest searched.
    ``progress(done, total, text)`` is called as candidates finish."""
    t0 = time.perf_counter()
    options = options or Options()
    target = parse_target(target) if isinstance(target, str) else target
    result = _plan(train_flags, target, options, progress, t0)
    tree = config_lib.parse_tree(train_flags)
    tried = any(c.phase != "screen" for c in result.candidates)  # not all screened out
    if result.compiled == 0 and tried and _unrolled_gpt(tree):
        scanned = [*train_flags, "--scan-layers"]
        layers = config_lib.from_dict(tree).model.n_layers
        again = _plan(scanned, target, options, progress, time.perf_counter())
        again.notes.append(
            f"Planned with --scan-layers: unrolled, the {layers} blocks compiled apart and no "
            f"layout compiled within the {options.budget_s:.0f} s budget "
            f"({len(result.candidates)} layouts); scanned, one block is compiled for all "
            "(--no-scan-layers plans them unrolled, with --budget-s 0 for no limit)"
        )
        again.elapsed_s = time.perf_counter() - t0
        return again
    return result


def _unrolled_gpt(tree: dict) -> bool:
    """The built-in GPT, its form not chosen by the flags (neither --scan-layers nor
    --no-scan-layers), and not made a stack by a stage axis (always scanned)."""
    model = tree.get("model", {})
    mesh = parse_mesh(tree.get("train", {}).get("mesh", ""))
    return model.get("name") == "gpt" and "scan_layers" not in model and mesh.get("stage", 1) == 1


def _plan(train_flags: list[str], target: Target, options: Options, progress, t0) -> Plan:
    tree = config_lib.parse_tree(train_flags)
    base = config_lib.from_dict(tree)
    capacity = target.kind.memory_bytes * options.memory_fraction
    env = environment(target, gpu_compiler.python_path() if target.is_gpu else None)
    with Pool(str(target), options.workers, env, options.candidate_timeout_s,
              options.worker_memory_gib) as pool:  # fmt: skip
        state_bytes, param_bytes, n_experts = compile_only.state_facts(base)
        search = _Search(tree, base, target, capacity, state_bytes, param_bytes, options,
                         n_experts)  # fmt: skip
        if search.queue:  # something to compile (none when every layout was screened out)
            pool.start()
        for task, result in pool.run(lambda: search.next_task(t0)):
            search.record(task, result)
            if progress:
                progress(
                    search.done, search.total, f"{task.layout.mesh} accum {task.layout.grad_accum}"
                )
    search.finish()
    best = search.best()
    builtin = base.model.name in cands.REMAT_MODELS
    fraction = options.memory_fraction
    command = train_command(train_flags, best.layout, target, fraction, builtin) if best else ""
    return Plan(target, capacity, options, search.all, best, command, state_bytes,
                time.perf_counter() - t0, base.model.dtype)  # fmt: skip


class _Search:
    """The candidates, the queue of the ones to compile next, and each fitting mesh's
    binary search for its fewest microbatches."""

    def __init__(
        self, tree, base, target, capacity, state_bytes, param_bytes, options, n_experts=0
    ):
        self.tree, self.base, self.target, self.options = tree, base, target, options
        self.capacity, self.all, self.queue = capacity, [], []
        train, model = tree.get("train", {}), tree.get("model", {})
        self.fixed_accum = train.get("grad_accum")
        # the memory options the user set are kept; else a floor takes them (ZeRO-1 where
        # data > 1, 1F1B where stages), and refining tries the run without them
        heads = base.model.n_kv_heads or base.model.n_heads
        self.fixed = Fixed(train.get("shard_optimizer"), train.get("pipeline_schedule"),
                           model.get("seq_attention"), heads)  # fmt: skip
        # the built-in transformers' --remat is the plan's to choose where not given
        self.builtin = base.model.name in cands.REMAT_MODELS
        self.fixed_remat = model.get("remat") if self.builtin else base.model.remat
        fixed = {k: v for k, v in parse_mesh(base.train.mesh).items() if v != -1}
        if base.train.strategy != "gspmd":  # pmap and shard_map take data only
            fixed = {**fixed, "fsdp": 1, "model": 1, "stage": 1, "seq": 1, "expert": 1}
        # A state that fits whole on every device with room to spare: data parallel
        # first (the least communication); else the layouts that split it most.
        replicated = (state_bytes + param_bytes) < capacity / 2
        order = functools.partial(
            cands.search_order, per_node=target.devices_per_node, param_bytes=param_bytes,
            data_first=replicated,
        )  # fmt: skip
        seq_len = base.model.seq_len if base.model.name in cands.SEQ_MODELS else 0
        for mesh in sorted(cands.meshes(target, fixed, seq_len, n_experts), key=order):
            self._screen(mesh, state_bytes, param_bytes)
        self.refining: list[Refine] = []  # fitting meshes, best estimate first
        self.done = 0
        self.durations: list[float] = []  # seconds from a compile's start to its result

    @property
    def total(self) -> int:
        return len([c for c in self.all if c.phase != "screen"])

    def _screen(self, mesh: cands.Layout, state_bytes: float, param_bytes: float) -> None:
        options = cands.accum_options(mesh, self.base.train.global_batch_size)
        if self.fixed_accum:
            options = [a for a in options if a == self.fixed_accum]
        layout = mesh.with_(grad_accum=options[-1] if options else 1,
                            remat=self.fixed_remat or "full")  # fmt: skip
        layout = layout.with_(**floor_options(mesh, self.fixed))
        floor = cands.state_floor_bytes(layout, state_bytes, param_bytes)
        if not options:
            batch, shards = self.base.train.global_batch_size, mesh.data * mesh.fsdp * mesh.expert
            why = f"the batch does not divide: {batch} rows over data x fsdp x expert = {shards}"
            self._add(layout, "screen", "unsplittable", why)
        elif floor > self.capacity:
            why = (
                f"the state and one gradient alone are {floor / 2**30:.1f} GiB per device "
                f"({state_bytes / 2**30:.0f} + {param_bytes / 2**30:.0f} GiB / {mesh.shards})"
            )
            self._add(layout, "screen", "too big", why)  # fmt: skip
        else:
            self.queue.append(self._add(layout, "floor", "pending", "", options))

    def _add(self, layout, phase, status, why, options=None) -> Candidate:
        c = Candidate(layout, phase, status, why, tree=self._tree(layout), options=options or [])
        self.all.append(c)
        return c

    def _tree(self, layout: cands.Layout) -> dict:
        tree = copy.deepcopy(self.tree)
        train = tree.setdefault("train", {})
        train.update(mesh=layout.mesh, grad_accum=layout.grad_accum, num_devices=0)
        train.update(shard_optimizer=layout.zero, pipeline_schedule=layout.schedule)
        train.pop("cpu_devices", None)
        if self.builtin:
            tree.setdefault("model", {})["remat"] = layout.remat
        if layout.seq > 1:
            tree.setdefault("model", {})["seq_attention"] = layout.seq_way
        return tree

    def next_task(self, t0: float) -> Candidate | None:
        """A probe of the fitting mesh with the best estimate first (refining the likely
        winner matters more than the floors of unlikely ones), then the next floor."""
        # no compile starts that would end past the budget (as long as the longest seen)
        longest = max(self.durations[-4:], default=0.0)
        if self.options.budget_s and time.perf_counter() - t0 + longest > self.options.budget_s:
            return None
        task = self._next_task()
        if task is not None:
            task.started = time.perf_counter()
        return task

    def _next_task(self) -> Candidate | None:
        if self.refining and (probe := self._probe(self.refining[:1])):
            return probe
        if self.queue:
            return self.queue.pop(0)
        return self._probe(self.refining[1:])

    def _probe(self, refining: list[Refine]) -> Candidate | None:
        for refine in refining:
            layout = refine.next_probe()
            if layout is not None:
                c = self._add(layout, "refine", "pending", "")
                c.refine = refine
                return c
        return None

    def record(self, c: Candidate, result: dict) -> None:
        self.done += 1
        self.durations.append(time.perf_counter() - c.started)
        c.status = result.pop("status")
        c.why = result.pop("why", "")
        if c.status == "compiled":
            c.measured = result
            c.fits = result["peak_bytes"] <= self.capacity
            c.time = step_time(result["matmul_flops"], result["wire_bytes"], self.target.kind,
                               self.base.model.dtype, self.options.efficiency,
                               self.options.overlap)  # fmt: skip
        if c.refine is not None:
            c.refine.learn(c)
        elif c.fits:  # a floor that fits: search it for fewer microbatches, lighter remat
            remats = [] if self.fixed_remat else ["block", "none"]
            self.refining.append(Refine(c, remats, option_changes(c.layout, self.fixed)))
            self.refining.sort(key=lambda r: r.step_s)

    def finish(self) -> None:
        for c in self.all:
            if c.status == "pending":
                c.status, c.why = (
                    "budget",
                    f"not compiled: the {self.options.budget_s:.0f} s budget ran out",
                )

    def best(self) -> Candidate | None:
        fitting = [c for c in self.all if c.fits and c.time]
        return min(fitting, key=lambda c: (c.time.step_s, c.peak_bytes), default=None)
