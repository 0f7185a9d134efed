"""The layouts a plan considers: every mesh data x fsdp x model x stage (x seq, for the
GPT and the Llama; x expert, for a model with MoE experts) of the target with ``model``,
``seq`` and ``expert`` inside a node, each with the microbatch
counts (grad_accum) its batch rows allow and the remat modes; and the screen that
discards a mesh without compiling when the state alone cannot fit."""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.plan.targets import Target

REMAT_LIGHTEST_FIRST = ("none", "block", "full")
REMAT_MODELS = ("gpt", "llama", "gemma")  # the built-in models whose --remat a plan sets
SEQ_MODELS = ("gpt", "llama")  # ... and whose sequence it may split (Gemma's: refused)


@dataclass(frozen=True, order=True)
class Layout:
    data: int
    fsdp: int
    model: int
    stage: int
    grad_accum: int = 1
    remat: str = "none"
    seq: int = 1  # the sequence split over seq: activations split, the state not
    zero: bool = False  # --shard-optimizer: the optimizer state split over data too
    schedule: str = "gpipe"  # --pipeline-schedule, with stages
    seq_way: str = "ring"  # --seq-attention, with seq: ring or all-to-all
    expert: int = 1  # a MoE's experts split over expert (and rows, as data splits them)

    @property
    def mesh(self) -> str:
        """The ``--mesh`` flag: ``fsdp=64``, ``data=8,model=8``; ``data=1`` on one device."""
        sizes = {"data": self.data, "stage": self.stage, "fsdp": self.fsdp, "model": self.model}
        sizes["seq"], sizes["expert"] = self.seq, self.expert
        return ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "data=1"

    @property
    def shards(self) -> int:
        """How many ways the state can be split (data replicates it; expert splits only
        the experts' kernels, counted as splitting all: a floor stays a floor)."""
        return self.fsdp * self.model * self.stage * self.expert

    @property
    def option_flags(self) -> list[str]:
        """The options' flags: ``--shard-optimizer``, ``--pipeline-schedule 1f1b``,
        ``--seq-attention all-to-all``."""
        flags = ["--shard-optimizer"] if self.zero else []
        flags += ["--seq-attention", self.seq_way] if self.seq > 1 else []
        return flags + (["--pipeline-schedule", self.schedule] if self.stage > 1 else [])

    @property
    def option_names(self) -> str:
        """The options as the table's column shows them: "zero1 1f1b", "ring", "-"."""
        names = ["zero1"] if self.zero else []
        names += [self.seq_way] if self.seq > 1 else []
        names += [self.schedule] if self.stage > 1 else []
        return " ".join(names) or "-"

    def with_(self, **changes) -> Layout:
        return Layout(**{**self.__dict__, **changes})


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(
    target: Target, fixed: dict[str, int] | None = None, seq_len: int = 0, n_experts: int = 0
) -> list[Layout]:
    """Every data x fsdp x model x stage x seq = the target's devices with ``model`` x
    ``seq`` dividing a node's devices (tensor parallelism's all-reduces and sequence
    parallelism's key/value sends run in every layer: NVLink, not the network); ``stage``
    may span nodes (a pipeline sends one activation per microbatch and stage). ``seq``
    only with ``seq_len`` (the GPT's T, which it must divide), with stages only without
    ``model`` (as ``expert``), and no ``fixed`` mesh or one naming seq. ``fixed`` (the
    user's ``--mesh``) keeps only the layouts it names, and a ``model`` or ``seq`` it
    names may span nodes.
    ``expert`` only with ``n_experts`` (the model's E, which it must divide), with stages
    only without ``model`` (the command's check, ``strategies.check_stage_nesting``), inside
    what ``model`` x ``seq`` leave of a node: its two all-to-alls per MoE block (and two
    more backwards) carry every routed token's rows."""
    total, per_node = target.num_devices, target.devices_per_node
    model_limit = total if fixed and "model" in fixed else per_node
    found = []
    for model in divisors(model_limit):
        for seq in _seq_sizes(total if fixed else per_node, model, fixed, seq_len):
            # seq with stages as the step allows it: per replica, so without model
            for stage in divisors(total // (model * seq)) if seq == 1 or model == 1 else [1]:
                rest = total // (model * seq * stage)
                experts = _expert_sizes(per_node // (model * seq), rest, fixed, n_experts)
                for expert in experts if stage == 1 or model == 1 else [1]:  # as the step
                    for fsdp in divisors(rest // expert):
                        data = rest // (expert * fsdp)
                        layout = Layout(data, fsdp, model, stage, seq=seq, expert=expert)
                        if not fixed or all(getattr(layout, k) == v for k, v in fixed.items()):
                            found.append(layout)
    return found


def _expert_sizes(room: int, rest: int, fixed, n_experts: int) -> list[int]:
    """The expert sizes: divisors of E that fit in ``room`` (a node's devices left) and
    divide ``rest``; a ``fixed`` mesh's own (1 if it names none); [1] without experts."""
    if fixed:  # the user's mesh: its own expert size, or none
        return [fixed.get("expert", 1)]
    if not n_experts:
        return [1]
    return [e for e in divisors(max(room, 1)) if n_experts % e == 0 and rest % e == 0]


def _seq_sizes(room: int, model: int, fixed, seq_len: int) -> list[int]:
    """The seq sizes next to ``model``: divisors of what ``model`` leaves of ``room``
    that divide ``seq_len``; [1] without a sequence or with a ``fixed`` mesh not naming seq."""
    if not seq_len or (fixed and "seq" not in fixed) or room % model:
        return [1]
    return [s for s in divisors(room // model) if seq_len % s == 0]


def accum_options(layout: Layout, global_batch_size: int) -> list[int]:
    """grad_accum counts that divide the rows each data shard holds, fewest first; []
    if the batch does not divide over data x fsdp."""
    shards = layout.data * layout.fsdp * layout.expert
    if global_batch_size % shards:
        return []
    return divisors(global_batch_size // shards)


def state_floor_bytes(layout: Layout, state_bytes: float, param_bytes: float) -> float:
    """The least memory a device of ``layout`` can need: the training state (params,
    optimizer state) and one gradient, split as many ways as the layout can split them,
    the optimizer state ``data`` times more with ``zero`` (ZeRO-1)."""
    optimizer = state_bytes - param_bytes  # AdamW: 8 of the 12 bytes a parameter keeps
    split = layout.data if layout.zero else 1
    return (2 * param_bytes + optimizer / split) / layout.shards


def crossing_axes(layout: Layout, per_node: int) -> set[str]:
    """The axes whose groups span nodes: a node's devices go to ``model`` first, then
    ``seq``, ``expert``, ``stage``, ``fsdp``, ``data`` (``device_mesh.PLACEMENT``)."""
    crossing, inner = set(), 1
    for axis in ("model", "seq", "expert", "stage", "fsdp", "data"):
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
    return (crossing, data, layout.model * layout.stage, layout.stage, layout.fsdp, layout.seq)
