"""The mixture-of-experts block (``jaxdist.models.moe``) against a reference written here.

The reference routes one token at a time: the router's probabilities (softmax or
sigmoid written out), the token's top-k experts picked by numpy, and each chosen
expert's SwiGLU applied in turn, summed with the routing weights (and the shared
experts); in capacity mode it drops what the module documents: per sequence, in position
order, an expert's pairs past its C-th. The block's output, aux losses and gradients
(input and every parameter) must match it within 1e-5 in float32, and a reference with
the renormalisation skipped, or with the drop order reversed, must not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.moe import MoE, capacity
from jaxdist.models.router_aux import MoEAux
from jaxdist.models.stack import make_layers
from moe_reference import LB, B, D, E, F, K, T, Z, choices, reference, reference_run

CF = 0.75  # C = ceil(0.75 * 8 * 2 / 4) = 3 of the 4 pairs an expert gets on average
TOL = 1e-5
ROUTERS = {
    "softmax_norm": dict(router="softmax", norm_topk=True),
    "softmax": dict(router="softmax", norm_topk=False),
    "sigmoid_norm_scaled": dict(router="sigmoid", norm_topk=True, route_scale=2.5),
}


def build(**settings) -> MoE:
    with nnx.use_eager_sharding(False):
        return MoE(D, F, E, K, rngs=nnx.Rngs(0), **settings)


def flat(state) -> dict[str, jax.Array]:
    """A State (of values or of gradients) -> {"router": ..., "shared/gate/kernel": ...}."""
    return {
        "/".join(map(str, path)): v.get_value() if isinstance(v, nnx.Variable) else v
        for path, v in nnx.to_flat_state(state)
    }


def inputs(b=B, seed=1):
    kx, kp = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (b, T, D)), jax.random.normal(kp, (b, T, D))


# --- the reference: one token at a time


def block_run(model, x, probe):
    """The block's (y, aux), its gradients {name: array} and d/dx of the same objective."""
    graphdef, state = nnx.split(model)

    def objective(state, x):
        y, aux = nnx.merge(graphdef, state)(x)
        objective = LB * jnp.mean(aux.load_balance_loss) + Z * jnp.mean(aux.z_loss)
        return jnp.sum(y * probe) + objective, (y, aux)

    grad = jax.jit(jax.grad(objective, argnums=(0, 1), has_aux=True))
    (g_state, g_x), (y, aux) = grad(state, x)
    return y, aux, flat(g_state), g_x


def close(a, b) -> bool:
    return np.allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL)


def assert_close(a, b, what):
    err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert close(a, b), f"{what}: max |difference| {err:.2e}"


# --- the tests


# each router dropless and with a capacity, each with and without shared experts, and
# each mode with and without them: every pair of the three settings, in 6 cases of 12
CASES = [
    ("softmax_norm", 0, "dropless"),
    ("softmax_norm", 2, "capacity"),
    ("softmax", 2, "dropless"),
    ("softmax", 0, "capacity"),
    ("sigmoid_norm_scaled", 0, "dropless"),
    ("sigmoid_norm_scaled", 2, "capacity"),
]


@pytest.mark.parametrize("router, n_shared, mode", CASES)
def test_values_grads_and_aux_equal_the_per_token_reference(router, n_shared, mode):
    settings = ROUTERS[router]
    cf = CF if mode == "capacity" else 0.0
    model = build(n_shared=n_shared, capacity_factor=cf, **settings)
    x, probe = inputs()
    y, aux, grads, g_x = block_run(model, x, probe)
    params = flat(nnx.state(model))
    experts, keep = choices(params, x, settings["router"], cf)
    (ref_y, ref_lb, ref_z), ref_grads, ref_g_x = reference_run(
        params, x, probe, experts, keep, settings
    )
    assert_close(y, ref_y, "y")
    assert_close(aux.load_balance_loss, ref_lb, "load-balancing loss")
    assert_close(aux.z_loss, ref_z, "z-loss")
    rows = experts.reshape(B, -1)
    share = np.stack([np.bincount(row, minlength=E) for row in rows]) / rows.shape[1]
    assert_close(aux.expert_share, share, "expert share per row")
    np.testing.assert_array_equal(aux.dropped, np.sum(~keep.reshape(B, -1), axis=-1))
    if cf:  # some pairs dropped, and not all: the capacity decides something here
        assert 0 < float(aux.dropped.sum()) < keep.size // 2, aux.dropped
    assert set(grads) == set(params) == set(ref_grads)
    assert len(params) == 4 + 3 * bool(n_shared)
    for name in params:
        assert_close(grads[name], ref_grads[name], f"d/d {name}")
    assert_close(g_x, ref_g_x, "d/dx")


def test_a_wrong_routing_or_drop_order_is_outside_the_tolerance():
    """The comparison can fail: skipping the renormalisation, or dropping the latest
    pairs instead of the earliest, moves the output far past 1e-5."""
    x, _ = inputs()
    model = build(capacity_factor=CF, **ROUTERS["softmax_norm"])
    y, _ = model(x)
    params = flat(nnx.state(model))
    experts, keep = choices(params, x, "softmax", CF)
    right, _, _ = reference(params, x, experts, keep, "softmax", norm_topk=True)
    unnormalised, _, _ = reference(params, x, experts, keep, "softmax", norm_topk=False)
    _, reversed_keep = choices(params, x, "softmax", CF, latest_first=True)
    assert (reversed_keep != keep).any()
    reversed_drops, _, _ = reference(params, x, experts, reversed_keep, "softmax")
    assert close(y, right)
    for wrong in (unnormalised, reversed_drops):
        assert not close(y, wrong)
        assert float(jnp.max(jnp.abs(y - wrong))) > 100 * TOL


def test_capacity_drops_the_same_pairs_however_the_batch_is_split():
    """Capacity is per sequence: two halves of a batch, split anywhere, drop what the
    whole batch drops (a capacity over the B * T tokens of a call would not)."""
    model = build(capacity_factor=CF)
    run = jax.jit(lambda x: model(x))
    x, _ = inputs(b=4, seed=2)
    y, aux = run(x)
    assert float(aux.dropped.sum()) > 0
    for cut in (1, 2, 3):
        (y1, aux1), (y2, aux2) = run(x[:cut]), run(x[cut:])
        np.testing.assert_allclose(jnp.concatenate([y1, y2]), y, rtol=1e-6, atol=1e-6)
        # per row: the halves' aux are the whole's rows
        joined = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), aux1, aux2)
        for got, want in zip(jax.tree.leaves(joined), jax.tree.leaves(aux), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_capacity_keeps_the_block_causal():
    """Drops go by position, so changing later tokens changes no earlier output."""
    model = build(capacity_factor=CF)
    x, other = inputs(seed=3)
    cut = T // 2
    changed = x.at[:, cut:].set(other[:, cut:])
    (y, _), (y2, _) = model(x), model(changed)
    np.testing.assert_array_equal(y[:, :cut], y2[:, :cut])
    assert not np.allclose(y[:, cut:], y2[:, cut:])


def test_dropless_drops_nothing_even_when_routing_is_lopsided():
    """A router sending every token to the same experts: each still gets its k choices."""
    model = build(n_shared=1)
    router = np.zeros((D, E), np.float32)
    router[:, 1], router[:, 3] = 5.0, 4.0  # positive inputs: experts 1 and 3 win
    model.router.set_value(jnp.asarray(router))
    x = jnp.abs(inputs()[0])
    y, aux = model(x)
    params = flat(nnx.state(model))
    experts, keep = choices(params, x, "softmax")
    assert (np.sort(experts, axis=-1) == [1, 3]).all()
    np.testing.assert_allclose(aux.expert_share, np.tile([0, 0.5, 0, 0.5], (B, 1)))
    assert float(aux.dropped.sum()) == 0
    assert_close(y, reference(params, x, experts, keep, "softmax")[0], "y")


def test_layers_of_a_stack_report_their_aux_per_layer():
    """Stacked as jaxdist's Stack holds its layers and run by a scan, each layer's
    MoEAux comes out with a leading layer axis, equal to the blocks run one by one."""
    with nnx.use_eager_sharding(False):
        layers = make_layers(lambda rngs: MoE(D, F, E, K, rngs=rngs), 2, nnx.Rngs(0))
        rngs = nnx.Rngs(0)
        blocks = [MoE(D, F, E, K, rngs=rngs) for _ in range(2)]
    graphdef, stacked = nnx.split(layers)

    def body(h, layer):
        y, aux = nnx.merge(graphdef, layer)(h)
        return h + y, aux

    x, _ = inputs()
    h, auxes = jax.jit(lambda x: jax.lax.scan(body, x, stacked))(x)
    assert isinstance(auxes, MoEAux)
    assert auxes.load_balance_loss.shape == (2, B) and auxes.expert_share.shape == (2, B, E)
    for i, block in enumerate(blocks):
        y, aux = block(x)
        for got, want in zip(jax.tree.leaves(auxes), jax.tree.leaves(aux), strict=True):
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
        x = x + y
    np.testing.assert_allclose(h, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cf", [0.0, CF])
def test_bfloat16_compute_keeps_float32_params_and_routing(cf):
    x, _ = inputs()
    y32, aux32 = build(capacity_factor=cf, n_shared=1)(x)
    model = build(capacity_factor=cf, n_shared=1, dtype=jnp.bfloat16)
    y, aux = model(x)
    assert y.dtype == jnp.bfloat16
    assert {a.dtype for a in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(aux.expert_share, aux32.expert_share)  # routed in float32
    np.testing.assert_array_equal(aux.dropped, aux32.dropped)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - y32)) / jnp.max(jnp.abs(y32)))
    assert err < 3e-2, err


def test_capacity_rounds_up_within_one_and_the_sequence_length():
    assert capacity(0.75, 8, 2, 4) == 3
    assert capacity(1.25, 8, 2, 4) == 5
    assert capacity(1.1, 20, 1, 2) == 11  # 1.1 * 20 / 2 is 11.000000000000002 in floats
    assert capacity(0.01, 8, 2, 4) == 1
    assert capacity(100.0, 8, 2, 4) == 8


def test_bad_settings_are_refused():
    for bad in (dict(router="relu"), dict(capacity_factor=-1.0)):
        with pytest.raises(ValueError):
            build(**bad)
    with pytest.raises(ValueError, match="top_k"), nnx.use_eager_sharding(False):
        MoE(D, F, E, E + 1, rngs=nnx.Rngs(0))
