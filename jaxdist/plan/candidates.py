"""The layouts a plan considers: every mesh data x fsdp x model x stage of the target
with ``model`` and ``stage`` inside a node, each with the microbatch counts (grad_accum)
its batch rows allow and the remat modes; and the screen that discards a mesh without
compiling when the state alone cannot fit."""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.plan.targets import Target

REMAT_LIGHTEST_FIRST = ("none", "block", "full")


@dataclass(frozen=True, order=True)
class Layout:
    data: int
    fsdp: int
    model: int
    stage: int
    grad_accum: int = 1
    remat: str = "none"

    @property
    def mesh(self) -> str:
        """The ``--mesh`` flag: ``fsdp=64``, ``data=8,model=8``; ``data=1`` on one device."""
        sizes = {"data": self.data, "stage": self.stage, "fsdp": self.fsdp, "model": self.model}
        return ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "data=1"

    @property
    def shards(self) -> int:
        """How many ways the state can be split (data replicates it)."""
        return self.fsdp * self.model * self.stage

    def with_(self, **changes) -> Layout:
        return Layout(**{**self.__dict__, **changes})


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(target: Target, fixed: dict[str, int] | None = None) -> list[Layout]:
    """Every data x fsdp x model x stage = the target's devices with ``model`` dividing a
    node's devices (tensor parallelism's all-reduces run in every layer: NVLink, not the
    network); ``stage`` may span nodes (a pipeline sends one activation per microbatch
    and stage). ``fixed`` (the user's ``--mesh``) keeps only the layouts it names, and a
    ``model`` it names may span nodes too."""
    total, per_node = target.num_devices, target.devices_per_node
    model_limit = total if fixed and "model" in fixed else per_node
    found = []
    for model in divisors(model_limit):
        for stage in divisors(total // model):
            rest = total // (model * stage)
            for fsdp in divisors(rest):
                layout = Layout(rest // fsdp, fsdp, model, stage)
                if not fixed or all(getattr(layout, k) == v for k, v in fixed.items()):
                    found.append(layout)
    return found


def accum_options(layout: Layout, global_batch_size: int) -> list[int]:
    """grad_accum counts that divide the rows each data shard holds, fewest first; []
    if the batch does not divide over data x fsdp."""
    shards = layout.data * layout.fsdp
    if global_batch_size % shards:
        return []
    return divisors(global_batch_size // shards)


def state_floor_bytes(layout: Layout, state_bytes: float, param_bytes: float) -> float:
    """The least memory a device of ``layout`` can need: the training state (params,
    optimizer state) and one gradient, split as many ways as the layout can split them."""
    return (state_bytes + param_bytes) / layout.shards


def crossing_axes(layout: Layout, per_node: int) -> set[str]:
    """The axes whose groups span nodes: a node's devices go to ``model`` first, then
    ``stage``, ``fsdp``, ``data`` (``jaxdist.parallel.device_mesh.PLACEMENT``)."""
    crossing, inner = set(), 1
    for axis in ("model", "stage", "fsdp", "data"):
        size = getattr(layout, axis)
        inner *= size
        if size > 1 and inner > per_node:
            crossing.add(axis)
    return crossing


def cross_node_floor_bytes(layout: Layout, per_node: int, param_bytes: float) -> float:
    """The least a device must send across nodes per step for its state, whatever the
    microbatches: fsdp spanning nodes gathers its parameter shard's layers at least once
    ((fsdp-1)/fsdp of them), data spanning nodes all-reduces its gradient shard (a ring:
    2 (data-1)/data of it). A pipeline's activations and the rest are not counted."""
    crossing = crossing_axes(layout, per_node)
    total = 0.0
    if "fsdp" in crossing:
        total += param_bytes / (layout.model * layout.stage) * (layout.fsdp - 1) / layout.fsdp
    if "data" in crossing:
        total += 2 * param_bytes / layout.shards * (layout.data - 1) / layout.data
    return total


def search_order(layout: Layout, per_node: int, param_bytes: float, data_first: bool) -> tuple:
    """The order floors are compiled in (what the time budget reaches first): the least
    state sent across nodes first, then the fewest data replicas (the state split most
    ways; ``data_first``, for a state that fits whole: the most), then the plainest."""
    data = -layout.data if data_first else layout.data
    crossing = cross_node_floor_bytes(layout, per_node, param_bytes)
    return (crossing, data, layout.model * layout.stage, layout.stage, layout.fsdp)
