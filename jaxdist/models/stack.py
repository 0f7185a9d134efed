"""A stack of identical blocks held as one set of stacked parameters (a leading axis
named ``"layers"`` of size L) and run with ``jax.lax.scan``: XLA compiles one block, not
L, and a pipeline can split the stack over the ``stage`` mesh axis ("layers" -> "stage").

How a stack runs can be swapped while a step is traced: ``with runner(fn):`` makes every
``Stack`` call ``fn(apply, stacked_state, x)`` instead of the scan (the pipeline
strategy's GPipe schedule does this). Models only build and call stacks.

Activation checkpointing (``remat``) of each block: ``"none"`` keeps every activation;
``"block"`` keeps each block's matmul outputs and recomputes the rest in the backward
pass (norms, GELU, softmax: cheap); ``"full"`` keeps only each block's input and
recomputes the whole block. The results are the same; the memory is not. Within
``with offloading_activations(True):`` (``--offload activations``) ``"none"`` and
``"block"`` both run as ``"block"`` with those matmul outputs moved to host memory after
the forward pass and back for the backward pass, instead of kept in device memory.

A stack is the same model as the list of its blocks: layer i starts from exactly the
values block i of ``nnx.List([make_block(rngs) for _ in range(n)])`` starts from, drawn
from the same keys, so ``--scan-layers`` and pipeline stages never change the model.

Blocks alike in their parameters may differ in one setting (Gemma's layers alternate a
sliding window with global attention): ``kinds``, one int per layer, calls layer i as
``block(x, kind=kinds[i])``. Under the scan the kinds travel as an (L,) int32 array
beside the stacked parameters, so every runner (pipeline stages, fsdp's layer gathers)
slices them with the layers; unscanned, block i gets ``kinds[i]`` as a Python int.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.errors import ConfigError

REMAT = ("none", "block", "full")
_POLICIES = {
    "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # "block" with the saved matmul outputs kept in host memory (--offload activations)
    "block_offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),
}
_RUNNER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("runner", default=None)
# Within offloading_activations(True): the remat of each block given the offloading policy.
_OFFLOADED: contextvars.ContextVar[list | None] = contextvars.ContextVar("offload", default=None)
# Variable metadata of a stack's arrays: how many path keys follow the stack's "layers"
# ("blocks/layers/qkv/kernel": 2), so a checkpoint can name layer i "blocks/i/qkv/kernel",
# as an unstacked list of blocks names it (jaxdist.parallel.saved_state).
DEPTH = "stack_depth"


class Stack(nnx.Module):
    """``n`` blocks from ``make_block(rngs)``, stacked: layer i holds what the i-th of
    ``n`` blocks made in turn from ``rngs`` would hold (``make_layers``).

    Example::

        self.blocks = Stack(lambda rngs: Block(d, rngs=rngs), n_layers, rngs=rngs)
        x = self.blocks(x)  # (B, T, D) -> (B, T, D), the blocks in order
    """

    def __init__(
        self, make_block: Callable, n: int, *, rngs: nnx.Rngs, remat: str = "none",
        kinds: tuple[int, ...] | None = None,
    ):  # fmt: skip
        check_remat(remat)
        self.kinds = _checked_kinds(kinds, n)
        self.layers = make_layers(make_block, n, rngs)
        for path, node in nnx.iter_graph(self.layers):
            if isinstance(node, nnx.Variable):
                node.set_metadata(DEPTH, len(path))
        self.remat = remat

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, stacked = nnx.split(self.layers)
        apply = block_apply(graphdef, self.remat, with_kind=self.kinds is not None)
        run = _RUNNER.get() or scan_layers
        if self.kinds is not None:  # (state, (L,) kinds): sliced with the layers
            stacked = (stacked, jnp.asarray(self.kinds, jnp.int32))
        return run(apply, stacked, x)


def _checked_kinds(kinds, n: int) -> tuple[int, ...] | None:
    if kinds is None:
        return None
    kinds = tuple(int(k) for k in kinds)
    if len(kinds) != n:
        raise ValueError(f"Stack: {len(kinds)} kinds for {n} layers")
    return kinds


def make_layers(make_block: Callable, n: int, rngs: nnx.Rngs) -> nnx.Module:
    """One block holding ``n`` blocks' arrays stacked on a leading axis (logical name
    ``"layers"``): layer i exactly what block i of ``[make_block(rngs) for _ in range(n)]``
    holds, with ``rngs`` left where that list leaves it. So the layout never changes the model.

    Built in sequence, block i draws keys ``fold_in(key, c + i*k + j)``, j < k, from each
    stream (count c, k draws per block). One ``vmap`` over the counts ``c + i*k`` draws the
    same keys at once, and under a stage axis each device makes only its own layers."""
    streams = dict(rngs.items())
    draws = _draws_per_block(make_block, list(streams))
    if draws is None or any(s.key.get_value().shape for s in streams.values()):
        return stacked([make_block(rngs) for _ in range(n)])  # the same values, made in turn
    first = jnp.arange(n, dtype=jnp.uint32)  # times k: each layer's first draw
    batched = nnx.Rngs(**{k: jnp.broadcast_to(s.key.get_value(), (n,)) for k, s in streams.items()})
    for name, stream in streams.items():
        batched[name].count.set_value(stream.count.get_value() + first * draws[name])

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return make_block(rngs)

    layers = make(batched)
    for name, stream in streams.items():
        stream.count.set_value(stream.count.get_value() + n * draws[name])
    return layers


def _draws_per_block(make_block: Callable, names: list[str]) -> dict[str, int] | None:
    """Keys one block draws from each stream, counted while building one abstractly
    (``jax.eval_shape``: no arrays are made); None where the count cannot be read."""
    draws: dict[str, int] = {}

    def probe(key):
        rngs = nnx.Rngs(**dict.fromkeys(names, key))
        for name in names:  # a numpy count stays concrete under the trace: it counts draws
            rngs[name].count.set_value(np.zeros((), np.uint32))
        make_block(rngs)
        for name in names:
            count = rngs[name].count.get_value()
            if isinstance(count, np.ndarray):
                draws[name] = int(count)

    try:
        jax.eval_shape(probe, jax.random.key(0))
    except Exception:  # noqa: BLE001 - building in turn then says what is wrong
        return None
    return draws if len(draws) == len(names) else None


def stacked(blocks: list[nnx.Module]) -> nnx.Module:
    """One block of ``blocks``' structure holding all their arrays stacked on a leading
    axis, its logical name ``"layers"`` (in each Variable's ``out_sharding``)."""
    graphdef, *_ = nnx.split(blocks[0])
    states = []
    for i, block in enumerate(blocks):
        block_graphdef, state = nnx.split(block)
        if block_graphdef != graphdef:
            raise ValueError(f"Stack: block {i} is not built like block 0")
        states.append(state)

    def stack(*variables):
        return variables[0].replace(jnp.stack([v.get_value() for v in variables]))

    state = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    state = nnx.spmd.add_axis(state, 0, {nnx.PARTITION_NAME: "layers"})
    return nnx.merge(graphdef, state)


def scan_layers(apply: Callable, stacked, x):
    """The layers of ``stacked`` (leading axis L) applied to ``x`` in order."""
    return jax.lax.scan(lambda h, layer: (apply(layer, h), None), x, stacked)[0]


class BlockApply:
    """``(block_state, x) -> block(x)``, checkpointed as ``remat`` says.

    A runner that needs a checkpoint of its own around each block (fsdp's layer gathers,
    never saved) calls ``plain`` under ``policy`` joined with its own: a checkpoint
    around this one would save what the outer policy allows, all of the block's
    activations included (with ``--remat full`` the 100B GPT's attention scores for all
    80 layers: 1.4 TiB per device instead of ~60 GiB)."""

    def __init__(self, graphdef: nnx.GraphDef, remat: str, with_kind: bool = False):
        self.graphdef, self.with_kind = graphdef, with_kind
        remat = _offloaded(remat)
        self.policy = _POLICIES.get(remat, jax.checkpoint_policies.everything_saveable)
        checkpointed = jax.checkpoint(self.plain, policy=self.policy)
        self._run = self.plain if remat == "none" else checkpointed

    def plain(self, state, x):
        if self.with_kind:  # (block state, its kind): Stack's kinds
            state, kind = state
            return nnx.merge(self.graphdef, state)(x, kind=kind)
        return nnx.merge(self.graphdef, state)(x)

    def __call__(self, state, x):
        return self._run(state, x)


def block_apply(graphdef: nnx.GraphDef, remat: str, with_kind: bool = False) -> BlockApply:
    """``(block_state, x) -> block(x)``, checkpointed as ``remat`` says; ``with_kind``:
    ``((block_state, kind), x) -> block(x, kind=kind)``."""
    return BlockApply(graphdef, remat, with_kind)


def call_block(block: nnx.Module, x: jax.Array, remat: str, kind: int | None = None) -> jax.Array:
    """``block(x)`` (``block(x, kind=kind)``) for one block outside a stack,
    checkpointed as ``remat`` says."""
    kw = {} if kind is None else {"kind": kind}
    if remat == "none" and _OFFLOADED.get() is None:
        return block(x, **kw)
    graphdef, state = nnx.split(block)
    if kind is None:
        return block_apply(graphdef, remat)(state, x)
    return block_apply(graphdef, remat, with_kind=True)((state, kind), x)


def blocks(make_block: Callable, n: int, *, rngs: nnx.Rngs, remat: str, scan: bool,
           kinds: tuple[int, ...] | None = None):  # fmt: skip
    """``n`` blocks from ``make_block(rngs)``: one ``Stack`` (parameters (L, ...) run by
    one scan, splittable into pipeline stages) or, unscanned, an ``nnx.List`` of L
    separately compiled blocks (named blocks/0/..., blocks/1/...); the same values.
    ``kinds``: each layer's kind, given to its call (``Stack``); ``run_blocks`` passes
    them to an unscanned list."""
    if scan:
        return Stack(make_block, n, rngs=rngs, remat=remat, kinds=kinds)
    _checked_kinds(kinds, n)
    return nnx.List([make_block(rngs) for _ in range(n)])


def run_blocks(layers, x: jax.Array, remat: str, kinds: tuple[int, ...] | None = None):
    """``x`` through ``blocks(...)``'s layers in order, (B, T, D) -> (B, T, D); an
    unscanned list's block i called with ``kind=kinds[i]`` (a Stack holds its own)."""
    if isinstance(layers, Stack):
        return layers(x)
    for i, block in enumerate(layers):
        x = call_block(block, x, remat, None if kinds is None else kinds[i])
    return x


@contextlib.contextmanager
def runner(fn: Callable | None):
    """Within this context every ``Stack`` runs as ``fn(apply, stacked, x)``."""
    token = _RUNNER.set(fn)
    try:
        yield
    finally:
        _RUNNER.reset(token)


@contextlib.contextmanager
def offloading_activations(on: bool):
    """Within this context (``on``) every block offloads its saved matmul outputs to host
    memory; ``ConfigError`` if no block of a ``Stack`` or ``call_block`` ran in it."""
    blocks: list | None = [] if on else None
    token = _OFFLOADED.set(blocks)
    try:
        yield
    finally:
        _OFFLOADED.reset(token)
    if blocks == []:
        raise ConfigError(
            "--offload activations: the model ran no jaxdist Stack or call_block, whose "
            "block checkpoints are what moves activations to host memory"
        )


def _offloaded(remat: str) -> str:
    """The remat a block takes: ``"block_offload"`` for "none" and "block" within
    ``offloading_activations(True)``; "full" keeps nothing in a block to offload."""
    blocks = _OFFLOADED.get()
    if blocks is None:
        return remat
    if remat == "full":
        raise ConfigError(
            "--offload activations with remat full: each block keeps only its input, "
            "nothing to offload; use remat block (its matmul outputs go to host memory)"
        )
    blocks.append(remat)
    return "block_offload"


def has_stack(model: nnx.Module) -> bool:
    return any(isinstance(node, Stack) for _, node in nnx.iter_graph(model))


def check_remat(remat: str) -> None:
    if remat not in REMAT:
        raise ValueError(f"remat: {remat!r} is not one of {', '.join(REMAT)}")
