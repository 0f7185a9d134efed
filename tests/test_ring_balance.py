"""The causal ring's balance over ``seq=8``: in the zig-zag order every device computes
the same attention; in the contiguous order device 7 would compute 8 times device 0's.

Each device's work is measured two ways: the score entries its executed branches
computed (``work=True``, counted inside the traced program, per device), and XLA's cost
analysis of each branch it takes (its FLOPs). The values equal
``jax.nn.dot_product_attention`` on the whole sequence (the layouts' tests train with it:
``tests/test_sequence_parallel.py``, ``tests/test_llama.py``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist
from jaxdist.models import ring

S, T, H, K, DH = 8, 64, 4, 2, 8  # chunks of C = T / 2S = 4 positions


def per_device(fn):
    mesh = jaxdist.make_mesh(seq=S)
    spec = P(None, "seq")
    run = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P("seq")))
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, T, H, DH)).astype(np.float32)
    k, v = (rng.normal(size=(2, T, K, DH)).astype(np.float32) for _ in range(2))
    put = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    out, work = jax.jit(run)(*put)
    want = jax.nn.dot_product_attention(q, np.repeat(k, H // K, 2), np.repeat(v, H // K, 2),
                                        is_causal=True)  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-5)
    return np.asarray(work)  # (S,): each device's score entries


def counted(way):
    def run(q, k, v):
        out, entries = way(q, k, v, work=True)
        return out, entries[None]  # (1,) on each device: (S,) over seq

    return run


def test_zigzag_gives_every_device_the_same_work_and_contiguous_does_not():
    balanced = per_device(counted(ring.balanced_ring))
    contiguous = per_device(counted(functools.partial(ring.contiguous_ring, causal=True)))
    assert balanced.max() / balanced.min() <= 1.10, balanced
    assert contiguous.max() / contiguous.min() == S, contiguous  # device r: r + 1 blocks
    assert balanced.sum() == contiguous.sum()  # the same work in all, spread evenly


def test_each_branch_costs_the_same_flops_in_xlas_cost_analysis():
    """The two branches a hop takes (every query against the earlier chunk, or the later
    queries against both): the same FLOPs, by XLA's count of each compiled alone."""
    c = T // (2 * S)
    q = jax.ShapeDtypeStruct((2, 2 * c, H, DH), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 2 * c, K, DH), jnp.float32)
    state = (jax.ShapeDtypeStruct((2, H, 2 * c), jnp.float32),) * 2 + (q,)

    def flops(branch):
        fn = jax.jit(functools.partial(branch, c=c))
        return fn.lower(state, q, kv, kv).compile().cost_analysis()["flops"]

    early = flops(ring._all_queries_first_keys)
    late = flops(ring._late_queries_all_keys)
    assert abs(early - late) / max(early, late) < 0.10, (early, late)


def test_a_sequence_that_does_not_cut_into_2s_chunks_is_refused_for_the_causal_ring():
    from jaxdist.models.attention import attention

    mesh = jaxdist.make_mesh(seq=4, devices=jax.devices()[:4])
    q = jax.ShapeDtypeStruct((2, 12, 2, 8), jnp.float32)  # 3 positions a device: odd

    def traced(q, causal=True):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return attention(q, q, q, causal=causal)

    with pytest.raises(jaxdist.ConfigError, match="cuts the sequence into 2 x 4 chunks"):
        jax.jit(traced).lower(q)
    jax.jit(functools.partial(traced, causal=False)).lower(q)  # not causal: contiguous, runs
