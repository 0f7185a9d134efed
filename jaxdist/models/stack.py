"""A stack of identical blocks held as one set of stacked parameters (a leading axis
named ``"layers"`` of size L) and run with ``jax.lax.scan``: XLA compiles one block, not
L, and a pipeline can split the stack over the ``stage`` mesh axis ("layers" -> "stage").

How a stack runs can be swapped while a step is traced: ``with runner(fn):`` makes every
``Stack`` call ``fn(apply, stacked_state, x)`` instead of the scan (the pipeline
strategy's GPipe schedule does this). Models only build and call stacks.

Activation checkpointing (``remat``) of each block: ``"none"`` keeps every activation;
``"block"`` keeps each block's matmul outputs and recomputes the rest in the backward
pass (norms, GELU, softmax: cheap); ``"full"`` keeps only each block's input and
recomputes the whole block. The results are the same; the memory is not.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
from flax import nnx

REMAT = ("none", "block", "full")
_POLICIES = {
    "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
_RUNNER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("runner", default=None)


class Stack(nnx.Module):
    """``n`` blocks from ``make_block(rngs)``, each with its own initial values, stacked.

    Example::

        self.blocks = Stack(lambda rngs: Block(d, rngs=rngs), n_layers, rngs=rngs)
        x = self.blocks(x)  # (B, T, D) -> (B, T, D), the blocks in order
    """

    def __init__(self, make_block: Callable, n: int, *, rngs: nnx.Rngs, remat: str = "none"):
        check_remat(remat)

        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return make_block(rngs)

        self.layers = make(rngs)
        self.remat = remat

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, stacked = nnx.split(self.layers)
        apply = block_apply(graphdef, self.remat)
        run = _RUNNER.get() or scan_layers
        return run(apply, stacked, x)


def scan_layers(apply: Callable, stacked, x):
    """The layers of ``stacked`` (leading axis L) applied to ``x`` in order."""
    return jax.lax.scan(lambda h, layer: (apply(layer, h), None), x, stacked)[0]


def block_apply(graphdef: nnx.GraphDef, remat: str) -> Callable:
    """``(block_state, x) -> block(x)``, checkpointed as ``remat`` says."""

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    return apply if remat == "none" else jax.checkpoint(apply, policy=_POLICIES[remat])


def call_block(block: nnx.Module, x: jax.Array, remat: str) -> jax.Array:
    """``block(x)`` for one block outside a stack, checkpointed as ``remat`` says."""
    if remat == "none":
        return block(x)
    graphdef, state = nnx.split(block)
    return block_apply(graphdef, remat)(state, x)


@contextlib.contextmanager
def runner(fn: Callable | None):
    """Within this context every ``Stack`` runs as ``fn(apply, stacked, x)``."""
    token = _RUNNER.set(fn)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def has_stack(model: nnx.Module) -> bool:
    return any(isinstance(node, Stack) for _, node in nnx.iter_graph(model))


def check_remat(remat: str) -> None:
    if remat not in REMAT:
        raise ValueError(f"remat: {remat!r} is not one of {', '.join(REMAT)}")
