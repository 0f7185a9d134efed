"""jaxdist.parallel.replica_groups: the devices each collective spans, from the three forms
compiled text prints them in (explicit, iota, GSPMD's mesh axes), checked against
groups worked out here with numpy, by hand and from real compiled programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.parallel import hlo
from test_plan_hlo import F32, compiled, mesh_1d


def rows(a: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in row) for row in a)


def as_sets(groups) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


def test_explicit_groups_and_the_empty_form():
    text = "{{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add"
    assert hlo.parse_replica_groups(text, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo.parse_replica_groups("{}, dimensions={0}", 4) == ((0, 1, 2, 3),)


def test_iota_groups():
    assert hlo.parse_replica_groups("[2,4]<=[8]", 8) == rows(np.arange(8).reshape(2, 4))
    # Transposed: 8 groups of stride 8, {0,8,...,56}, {1,9,...,57}, ...
    got = hlo.parse_replica_groups("[8,8]<=[8,8]T(1,0), use_global_device_ids=true", 64)
    assert got == rows(np.arange(64).reshape(8, 8).T)
    assert got[1] == (1, 9, 17, 25, 33, 41, 49, 57)
    expected = np.arange(8).reshape(2, 2, 2).transpose(0, 2, 1).reshape(4, 2)
    assert hlo.parse_replica_groups("[4,2]<=[2,2,2]T(0,2,1)", 8) == rows(expected)


def test_mesh_axes_groups():
    grid = np.arange(8).reshape(2, 4)  # mesh a=2 (rows) x b=4 (columns)
    assert hlo.parse_replica_groups("mesh['a'=2,'b'=4] {'b'}", 8) == rows(grid)
    assert hlo.parse_replica_groups("mesh['a'=2,'b'=4] {'a'}, x=1", 8) == rows(grid.T)
    # A permuted mesh: device ids iota [2,4] transposed, i.e. [[0,4],[1,5],[2,6],[3,7]].
    text = "mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, dimensions={0}"
    assert hlo.parse_replica_groups(text, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # A sub-axis: 'a':(2)2 is the minor half of a's 4 (a = 2 * major + minor).
    devices = np.arange(8).reshape(2, 2, 2).transpose(0, 2, 1).reshape(4, 2)
    by_part = devices.reshape(2, 2, 2)  # [a major, a minor, b]
    expected = rows(by_part.transpose(0, 2, 1).reshape(4, 2))  # vary a minor only
    text = "mesh['a'=4,'b'=2], device_ids=([2,2,2]T(0,2,1)) {'a':(2)2}"
    assert hlo.parse_replica_groups(text, 8) == expected


def test_mesh_axes_groups_of_a_real_reduction():
    """Rows of x sharded 8 ways; summing over axis 0 of x.reshape(2, 4, 2, 16) adds the
    row blocks of devices j and j + 4 (row 8i + 2j + k lives on device 4i + j)."""
    sharding = NamedSharding(mesh_1d(), P("d"))
    x = jax.device_put(jnp.ones((16, 16)), sharding)
    f = jax.jit(
        lambda x: x.reshape(2, 4, 2, 16).sum(0), out_shardings=NamedSharding(mesh_1d(), P())
    )
    counts = hlo.read_program(compiled(f, x), 8)
    reduce = [c for c in counts.collectives if c.kind == "all-reduce"]
    assert len(reduce) == 1
    assert as_sets(reduce[0].groups) == as_sets(np.arange(8).reshape(2, 4).T)


def test_explicit_groups_of_a_shard_map_psum():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))
    spec = P(("a", "b", "c"))
    f = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, ("a", "c")), mesh=mesh, in_specs=spec, out_specs=spec
        )
    )
    (reduce,) = hlo.read_program(compiled(f, jnp.ones(8 * 4)), 8).collectives
    # Devices sharing a "b" coordinate sum together; each holds 4 float32.
    expected = np.arange(8).reshape(2, 2, 2).transpose(1, 0, 2).reshape(2, 4)
    assert as_sets(reduce.groups) == as_sets(expected)
    assert (reduce.kind, reduce.bytes, reduce.count) == ("all-reduce", 4 * F32, 1)
