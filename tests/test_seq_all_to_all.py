"""``--seq-attention all-to-all`` (Ulysses): attention over a ``seq`` axis by turning the
sequence split into a heads split and back. Against ``jax.nn.dot_product_attention`` on
the whole sequence (no jaxdist): values and gradients within 1e-5 in float32, causal and
not, grouped heads, windows; the compiled program holds exactly its four all-to-alls and
none of the ring's or gather's collectives; a key/value head count seq does not divide
is refused, naming both."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist
from jaxdist.models.attention import attention

T = 16


def under(mesh, fn):
    """``fn`` jitted with ``mesh`` ambient, as jaxdist's step runs it."""

    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return jax.jit(traced)


def qkv(heads: int, kv_heads: int):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, T, heads, 8)).astype(np.float32)  # (B, T, H, Dh)
    k, v = (rng.normal(size=(2, T, kv_heads, 8)).astype(np.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    "seq, heads, kv_heads, causal, window",
    [(4, 4, 4, True, 0), (4, 8, 4, True, 0), (2, 4, 2, False, 0), (4, 8, 4, True, 5),
     (2, 6, 2, True, 3)],
)  # fmt: skip
def test_values_and_gradients_equal_whole_sequence_attention(seq, heads, kv_heads, causal, window):
    q, k, v = qkv(heads, kv_heads)
    mesh = jaxdist.make_mesh(seq=seq, devices=jax.devices()[:seq])
    on_mesh = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]

    def split(q, k, v):
        return attention(q, k, v, causal=causal, seq_attention="all-to-all", window=window)

    def whole(q, k, v):  # jax's own, the key/value heads repeated to every query head
        k, v = (jax.numpy.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
        local = (window - 1, 0) if window else None
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=local)

    np.testing.assert_allclose(under(mesh, split)(*on_mesh), whole(q, k, v), atol=1e-5)
    loss_split = under(mesh, jax.grad(lambda *a: (split(*a) ** 2).sum(), argnums=(0, 1, 2)))
    loss_whole = jax.grad(lambda *a: (whole(*a) ** 2).sum(), argnums=(0, 1, 2))
    for got, want in zip(loss_split(*on_mesh), loss_whole(q, k, v), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_program_holds_four_all_to_alls_and_no_ring_or_gather():
    q, k, v = qkv(8, 4)
    mesh = jaxdist.make_mesh(seq=4, devices=jax.devices()[:4])
    on_mesh = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    fn = under(mesh, lambda q, k, v: attention(q, k, v, seq_attention="all-to-all"))
    text = fn.lower(*on_mesh).compile().as_text()
    # q, k, v to heads and the output back: four ops, each moving S = 4 chunks
    ops = [line for line in text.splitlines() if " all-to-all(" in line]
    assert len(ops) == 4, ops
    assert "collective-permute" not in text and "all-gather" not in text


def test_key_value_heads_that_seq_does_not_divide_are_refused():
    q, k, v = qkv(4, 2)
    mesh = jaxdist.make_mesh(seq=4, devices=jax.devices()[:4])
    fn = under(mesh, lambda q, k, v: attention(q, k, v, seq_attention="all-to-all"))
    with pytest.raises(jaxdist.ConfigError, match="the 2 key/value heads do not split into 4"):
        fn.lower(q, k, v)


def test_the_planner_tries_all_to_all_where_seq_divides_the_key_value_heads():
    from jaxdist.plan.candidates import Layout
    from jaxdist.plan.refine import Fixed, floor_options, option_changes

    seq4 = Layout(2, 1, 1, 1, seq=4)
    chosen = Fixed(zero=None, schedule=None, seq_way=None, kv_heads=8)
    assert floor_options(seq4, chosen)["seq_way"] == "ring"  # the floor: the ring
    assert {"seq_way": "all-to-all"} in option_changes(seq4, chosen)  # then Ulysses
    for fixed in (Fixed(None, None, None, kv_heads=2), Fixed(None, None, "ring", kv_heads=8)):
        assert {"seq_way": "all-to-all"} not in option_changes(seq4, fixed)
    assert {"seq_way": "all-to-all"} not in option_changes(Layout(8, 1, 1, 1), chosen)
    ulysses = seq4.with_(seq_way="all-to-all")
    assert ulysses.option_flags == ["--seq-attention", "all-to-all"]
    assert ulysses.option_names == "all-to-all"
