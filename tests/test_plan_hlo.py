"""jaxdist.parallel.hlo: collective bytes, replica groups, matmul FLOPs and loop trip counts
read from compiled programs, checked against numbers worked out here with numpy."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.parallel import hlo

F32 = 4  # bytes


def mesh_1d() -> Mesh:
    return Mesh(np.array(jax.devices()), ("d",))


def compiled(f, *args) -> str:
    return f.lower(*args).compile().as_text()


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# --- compiled CPU programs -----------------------------------------------------------

IN, HIDDEN, OUT, BATCH = 4, 8, 2, 16


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def mlp_params():
    return {"w1": jnp.ones((IN, HIDDEN)), "b1": jnp.ones((HIDDEN,)), "w2": jnp.ones((HIDDEN, OUT))}


def test_data_parallel_gradient_is_all_reduced_once():
    mesh = mesh_1d()
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = mlp_params()
    f = jax.jit(jax.grad(mlp_loss), in_shardings=(rep, batch, batch), out_shardings=rep)
    text = compiled(f, params, jnp.ones((BATCH, IN)), jnp.ones((BATCH, OUT)))
    counts = hlo.read_program(text, 8)
    assert counts.bytes_by_kind() == {"all-reduce": nbytes(params)}  # 224 bytes
    assert all(c.groups == (tuple(range(8)),) for c in counts.collectives)
    # Per device, batch 2: forward x@w1, h@w2; backward dh = dy@w2.T, dw2 = h.T@dy,
    # dw1 = x.T@dz (no dx: x is not differentiated).
    b = BATCH // 8
    fwd = 2 * b * IN * HIDDEN + 2 * b * HIDDEN * OUT
    bwd = 2 * b * OUT * HIDDEN + 2 * HIDDEN * OUT * b + 2 * IN * HIDDEN * b
    assert counts.matmul_flops == fwd + bwd == 448
    assert counts.unknown_trip_counts == 0


def test_dots_inside_fusions_are_counted():
    """XLA:CPU puts dots in fusions ("ynn" custom fusions) here: at least one of the
    448 FLOPs above comes from a dot outside ENTRY."""
    mesh = mesh_1d()
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    f = jax.jit(jax.grad(mlp_loss), in_shardings=(rep, batch, batch), out_shardings=rep)
    text = compiled(f, mlp_params(), jnp.ones((BATCH, IN)), jnp.ones((BATCH, OUT)))
    entry = text[text.index("\nENTRY") :]
    assert " dot(" in text[: text.index("\nENTRY")], "no fused dot to test with"
    entry_dots = re.findall(r"= f32\[([\d,]*)\]\S* dot\(", entry)
    assert len(entry_dots) < 5  # five dots in all (see the test above)
    assert hlo.read_program(text, 8).matmul_flops == 448


def test_fsdp_all_gathers_seven_eighths_of_the_parameters():
    mesh = mesh_1d()
    params = {"w1": jnp.ones((16, 8)), "w2": jnp.ones((8, 4))}
    sharded = jax.device_put(params, NamedSharding(mesh, P("d")))

    def forward(p, x):
        p = jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P()))
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    x = jax.device_put(jnp.ones((4, 16)), NamedSharding(mesh, P()))
    counts = hlo.read_program(compiled(jax.jit(forward), sharded, x), 8)
    assert counts.bytes_by_kind() == {"all-gather": nbytes(params) * 7 / 8}  # 560 bytes
    assert counts.matmul_flops == 2 * 4 * 8 * 16 + 2 * 4 * 4 * 8


M, N = 4, 16  # the loop body: carry [M, N] @ this device's own [N, N] weight


def psum_loop(trips: tuple[int, ...]):
    """shard_map whose innermost loop body does one [M,N]@[N,N] dot and one psum."""
    mesh = mesh_1d()

    def local(c, w):
        def step(_, c):
            return jnp.tanh(jax.lax.psum(c @ w[0], "d"))

        def nest(level: int, c):
            if level == len(trips) - 1:
                return jax.lax.fori_loop(0, trips[level], step, c)
            return jax.lax.fori_loop(0, trips[level], lambda _, c: nest(level + 1, c), c)

        return nest(0, c)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    w = jax.device_put(jnp.ones((8, N, N)) / N, NamedSharding(mesh, P("d")))
    return compiled(jax.jit(f), jnp.ones((M, N)), w)


def test_loop_trip_count_multiplies_collectives_and_flops():
    counts = hlo.read_program(psum_loop((5,)), 8)
    (reduce,) = counts.collectives
    assert (reduce.kind, reduce.count, reduce.bytes) == ("all-reduce", 5, M * N * F32)
    assert counts.matmul_flops == 5 * 2 * M * N * N
    assert counts.unknown_trip_counts == 0


def test_nested_loops_multiply():
    counts = hlo.read_program(psum_loop((3, 4)), 8)
    (reduce,) = counts.collectives
    assert reduce.count == 12
    assert counts.bytes_by_kind() == {"all-reduce": 12 * M * N * F32}
    assert counts.matmul_flops == 12 * 2 * M * N * N


# --- links ---------------------------------------------------------------------------


def test_link_from_node_of():
    halves = hlo.Collective("all-reduce", 100.0, ((0, 1, 2, 3), (4, 5, 6, 7)), 2, "ar")
    counts = hlo.ProgramCounts((halves,), 0.0, 0)
    assert counts.bytes_by_link(lambda d: d // 4) == {"intra": 200.0, "inter": 0.0}
    assert counts.bytes_by_link(lambda d: d // 2) == {"intra": 0.0, "inter": 200.0}


# --- handwritten GPU-style text ------------------------------------------------------

GPU_TEXT = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.0 = f32[] add(f32[] %x, f32[] %y)
}

%fused_dot (p0: bf16[32,64], p1: bf16[64,16]) -> bf16[32,16] {
  %p0 = bf16[32,64]{1,0} parameter(0)
  %p1 = bf16[64,16]{1,0} parameter(1)
  %dot.1 = bf16[32,16]{1,0} dot(bf16[32,64]{1,0} %p0, bf16[64,16]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %neg = bf16[32,16]{1,0} negate(bf16[32,16]{1,0} %dot.1)
}

%rs_wrapped (q0: f32[64]) -> f32[8] {
  %q0 = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8]{0} reduce-scatter(f32[64]{0} %q0), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (a: bf16[32,64], b: bf16[64,16], c: bf16[64,256], d: bf16[256,128], e: f32[1024], g: f32[64], h: f32[16]) -> f32[8] {
  %a = bf16[32,64]{1,0} parameter(0)
  %b = bf16[64,16]{1,0} parameter(1)
  %c = bf16[64,256]{1,0} parameter(2)
  %d = bf16[256,128]{1,0} parameter(3)
  %e = f32[1024]{0} parameter(4)
  %g = f32[64]{0} parameter(5)
  %h = f32[16]{0} parameter(6)
  %fusion.1 = bf16[32,16]{1,0} fusion(bf16[32,64]{1,0} %a, bf16[64,16]{1,0} %b), kind=kCustom, calls=%fused_dot
  %custom-call.1 = (bf16[64,128]{1,0}, s8[4194304]{0}) custom-call(bf16[64,256]{1,0} %c, bf16[256,128]{1,0} %d), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %all-gather-start = (f32[16]{0}, f32[128]{0}) all-gather-start(f32[16]{0} %h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[128]{0} all-gather-done((f32[16]{0}, f32[128]{0}) %all-gather-start)
  %all-reduce-start = (f32[1024]{0}, bf16[32,16]{1,0}) all-reduce-start(f32[1024]{0} %e, bf16[32,16]{1,0} %fusion.1), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %all-reduce-done = (f32[1024]{0}, bf16[32,16]{1,0}) all-reduce-done((f32[1024]{0}, bf16[32,16]{1,0}) %all-reduce-start)
  %rs-start = ((f32[64]{0}), f32[8]{0}) async-start(f32[64]{0} %g), calls=%rs_wrapped
  %rs-done = f32[8]{0} async-done(((f32[64]{0}), f32[8]{0}) %rs-start), calls=%rs_wrapped
  %collective-permute-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(f32[16]{0} %h), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[16]{0} collective-permute-done((f32[16]{0}, f32[16]{0}, u32[], u32[]) %collective-permute-start)
  ROOT %out = f32[8]{0} copy(f32[8]{0} %rs-done)
}
"""  # noqa: E501


def test_gpu_style_gemms_and_async_collectives():
    counts = hlo.read_program(GPU_TEXT, 8)
    fused_dot = 2 * (32 * 16) * 64
    cublas = 2 * (64 * 128) * 256
    assert counts.matmul_flops == fused_dot + cublas
    by_name = {c.name: c for c in counts.collectives}
    assert sorted(by_name) == [
        "all-gather-start",
        "all-reduce-start",
        "collective-permute-start",
        "reduce-scatter.1",
    ]
    assert all(c.count == 1 for c in counts.collectives)  # each pair counted once
    assert by_name["all-gather-start"].bytes == 128 * F32 * 7 / 8
    assert by_name["all-reduce-start"].bytes == 1024 * F32 + 32 * 16 * 2
    assert by_name["all-reduce-start"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert by_name["reduce-scatter.1"].bytes == 64 * F32 * 7 / 8
    assert by_name["reduce-scatter.1"].groups == (tuple(range(8)),)
    assert by_name["collective-permute-start"].bytes == 16 * F32
    assert by_name["collective-permute-start"].link(lambda d: d // 2) == "intra"


def loop_text(known: str, condition_root: str) -> str:
    return f"""HloModule loop
%cmp (a: s32[], b: s32[]) -> pred[] {{
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %lt = pred[] compare(s32[] %a, s32[] %b), direction=LT
}}
%body (s: (s32[], f32[4,8], f32[8,8])) -> (s32[], f32[4,8], f32[8,8]) {{
  %s = (s32[], f32[4,8]{{1,0}}, f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[4,8]{{1,0}} get-tuple-element(%s), index=1
  %w = f32[8,8]{{1,0}} get-tuple-element(%s), index=2
  %y = f32[4,8]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (s32[], f32[4,8]{{1,0}}, f32[8,8]{{1,0}}) tuple(%i, %y, %w)
}}
%cond (s: (s32[], f32[4,8], f32[8,8])) -> pred[] {{
  %s = (s32[], f32[4,8]{{1,0}}, f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(7)
  %m = s32[] get-tuple-element(%s), index=0
  {condition_root}
}}
ENTRY %main (p: (s32[], f32[4,8], f32[8,8])) -> (s32[], f32[4,8], f32[8,8]) {{
  %p = (s32[], f32[4,8]{{1,0}}, f32[8,8]{{1,0}}) parameter(0)
  ROOT %w = (s32[], f32[4,8]{{1,0}}, f32[8,8]{{1,0}}) while(%p), condition=%cond, body=%body{known}
}}
"""


def test_trip_count_from_the_condition_when_not_annotated():
    dot_flops = 2 * 4 * 8 * 8
    direct = "ROOT %c = pred[] compare(%i, %n), direction=LT"
    fused = "ROOT %f = pred[] fusion(%i, %n), kind=kLoop, calls=%cmp"
    unreadable = "ROOT %c = pred[] compare(%i, %m), direction=LT"
    annotated = ', backend_config={"known_trip_count":{"n":"3"}}'
    for known, root, trips, unknown in [
        ("", direct, 7, 0),
        ("", fused, 7, 0),
        ("", unreadable, 1, 1),
        (annotated, unreadable, 3, 0),
    ]:
        counts = hlo.read_program(loop_text(known, root), 1)
        assert (counts.matmul_flops, counts.unknown_trip_counts) == (trips * dot_flops, unknown)


def test_element_sizes():
    """A variadic all-reduce of mixed element types: the operands' bytes are summed."""
    text = """HloModule sizes
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
ENTRY %main (a: bf16[4,2], b: f8e4m3fn[8], c: s64[2], d: pred[3]) -> pred[3] {
  %a = bf16[4,2]{1,0} parameter(0)
  %b = f8e4m3fn[8]{0} parameter(1)
  %c = s64[2]{0} parameter(2)
  %d = pred[3]{0} parameter(3)
  %r = (bf16[4,2]{1,0}, f8e4m3fn[8]{0}, s64[2]{0}, /*index=3*/pred[3]{0}) all-reduce(%a, %b, %c, %d), replica_groups={}, to_apply=%add
  ROOT %o = pred[3]{0} get-tuple-element(%r), index=3
}
"""  # noqa: E501
    (reduce,) = hlo.read_program(text, 4).collectives
    assert reduce.bytes == 4 * 2 * 2 + 8 * 1 + 2 * 8 + 3 * 1
    assert reduce.groups == ((0, 1, 2, 3),)


def test_convolution_flops():
    """2 x output elements x (kernel height x width x input channels per group)."""
    x, kernel = jnp.ones((2, 3, 8, 8)), jnp.ones((6, 1, 3, 3))  # 3 groups of 1 channel
    conv = jax.jit(
        lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", feature_group_count=3)
    )
    counts = hlo.read_program(compiled(conv, x, kernel), 1)
    assert counts.matmul_flops == 2 * (2 * 6 * 6 * 6) * (3 * 3 * 1)


def test_permute_to_itself_moves_nothing():
    def program(pairs: str) -> str:
        return f"""HloModule permute
ENTRY %main (a: f32[16]) -> f32[16] {{
  %a = f32[16]{{0}} parameter(0)
  ROOT %p = f32[16]{{0}} collective-permute(%a), channel_id=1, source_target_pairs={pairs}
}}
"""

    for pairs, moved in [("{{0,0},{1,1}}", 0.0), ("{}", 0.0), ("{{0,0},{1,2}}", 16 * F32)]:
        (permute,) = hlo.read_program(program(pairs), 4).collectives
        assert (permute.kind, permute.bytes) == ("collective-permute", moved)
