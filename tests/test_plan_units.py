"""The planner's pieces that need no compiler: targets, the layouts it enumerates and
screens, the step-time arithmetic, the command it prints."""

from __future__ import annotations

import itertools

import pytest

from jaxdist.errors import ConfigError
from jaxdist.plan import candidates as cands
from jaxdist.plan import estimate, targets
from jaxdist.plan.table import train_command
from jaxdist.units import size


def brute_force_meshes(nodes: int, per_node: int) -> set[tuple[int, int, int, int]]:
    """Every (data, fsdp, model, stage) of nodes x per_node devices with model dividing
    a node's devices, by trying all sizes up to the device count."""
    total = nodes * per_node
    found = set()
    for data, fsdp, model, stage in itertools.product(range(1, total + 1), repeat=4):
        if data * fsdp * model * stage == total and per_node % model == 0:
            found.add((data, fsdp, model, stage))
    return found


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 4), (4, 2), (3, 4), (1, 1)])
def test_meshes_are_every_split_with_model_inside_a_node(nodes, per_node):
    target = targets.Target(nodes, per_node, targets.cpu_kind(per_node))
    got = [(m.data, m.fsdp, m.model, m.stage) for m in cands.meshes(target)]
    assert len(got) == len(set(got))
    assert set(got) == brute_force_meshes(nodes, per_node)


def test_a_given_mesh_keeps_only_the_layouts_it_names():
    target = targets.parse_target("2x4:cpu")
    got = cands.meshes(target, {"model": 2})
    assert got and all(m.model == 2 for m in got)
    assert {m.mesh for m in got} >= {"data=4,model=2", "fsdp=4,model=2", "stage=2,fsdp=2,model=2"}
    # named by the user, model may span nodes
    assert [m.mesh for m in cands.meshes(target, {"model": 8})] == ["model=8"]
    assert cands.meshes(target, {"model": 3}) == []  # 3 divides no count of 8 devices


def test_which_axes_cross_nodes_and_the_state_bytes_they_must_send():
    """A node's 8 devices go to model, then stage, then fsdp, then data."""
    fsdp64 = cands.Layout(data=1, fsdp=64, model=1, stage=1)
    pipeline = cands.Layout(data=1, fsdp=1, model=8, stage=8)
    hybrid = cands.Layout(data=8, fsdp=8, model=1, stage=1)
    assert cands.crossing_axes(fsdp64, 8) == {"fsdp"}
    assert cands.crossing_axes(pipeline, 8) == {"stage"}
    assert cands.crossing_axes(hybrid, 8) == {"data"}  # fsdp fills the node
    assert cands.crossing_axes(cands.Layout(2, 2, 2, 2), 8) == {"data"}  # 2 x 2 x 2 fill a node
    params = 6400.0
    assert cands.cross_node_floor_bytes(fsdp64, 8, params) == 6400 * 63 / 64
    assert cands.cross_node_floor_bytes(pipeline, 8, params) == 0.0
    assert cands.cross_node_floor_bytes(hybrid, 8, params) == 2 * 6400 / 8 * 7 / 8
    order = sorted([fsdp64, hybrid, pipeline],
                   key=lambda m: cands.search_order(m, 8, params, False))  # fmt: skip
    assert order == [pipeline, hybrid, fsdp64]


def test_microbatch_counts_divide_each_shards_rows():
    layout = cands.Layout(data=2, fsdp=4, model=1, stage=1)
    assert cands.accum_options(layout, 64) == [1, 2, 4, 8]  # 64 rows / 8 shards = 8 each
    assert cands.accum_options(layout, 12) == []  # 12 rows do not split 8 ways


def test_the_state_floor_splits_state_and_one_gradient_over_the_shards():
    layout = cands.Layout(data=2, fsdp=4, model=2, stage=1)
    assert layout.shards == 8 and layout.mesh == "data=2,fsdp=4,model=2"
    assert cands.state_floor_bytes(layout, 1200.0, 400.0) == 200.0  # (1200 + 400) / 8
    # ZeRO-1: the optimizer's 800 split over data too: (2 x 400 + 800 / 2) / 8
    assert cands.state_floor_bytes(layout.with_(zero=True), 1200.0, 400.0) == 150.0
    assert layout.with_(zero=True).option_flags == ["--shard-optimizer"]
    staged = cands.Layout(1, 1, 1, 2, schedule="1f1b")
    assert staged.option_flags == ["--pipeline-schedule", "1f1b"] and staged.option_names == "1f1b"
    assert cands.Layout(1, 1, 1, 1).mesh == "data=1"


def test_targets_parse_and_refuse_with_the_choices():
    t = targets.parse_target("8x8:A100-80GB")
    assert (t.nodes, t.devices_per_node, t.num_devices, t.is_gpu) == (8, 8, 64, True)
    assert t.node_of(7) == 0 and t.node_of(8) == 1 and t.node_of(63) == 7
    assert targets.parse_target("H100").kind.name == "H100-80GB"  # one device, by alias
    cpu = targets.parse_target("cpu:8")
    assert (cpu.num_devices, cpu.is_gpu) == (8, False)
    for bad in ["8x8:Z100", "8by8:H100", "0x8:H100", "cpu:0"]:
        with pytest.raises(ConfigError, match="--target"):
            targets.parse_target(bad)


def test_a_device_kind_from_a_file(tmp_path):
    path = tmp_path / "mygpu.yaml"
    path.write_text(
        "name: H100-96GB\nlike: H100-80GB\nmemory_gib: 96\nbf16_tflops: 900\n"
        "intra_node_gb_s: 400\ninter_node_gb_s: 50\n"
    )
    kind = targets.parse_target(f"2x8:{path}").kind
    assert kind.memory_bytes == 96 * 2**30 and kind.peak_flops["bfloat16"] == 900e12
    assert kind.gpu["core_count"] == 132 and kind.gpu["device_memory_size"] == 96 * 2**30
    assert "device_memory_size: 103079215104" in targets.gpu_target_config(kind)
    (tmp_path / "short.yaml").write_text("name: X\nmemory_gib: 1\n")
    with pytest.raises(ConfigError, match="missing bf16_tflops"):
        targets.parse_target(f"{tmp_path / 'short.yaml'}")


def test_the_gpu_target_config_carries_the_kinds_numbers():
    text = targets.gpu_target_config(targets.KINDS["A100-80GB"])
    assert "core_count: 108" in text and "major: 8 minor: 0" in text
    assert f"device_memory_size: {81221 * 2**20}" in text
    assert 'platform_name: "CUDA"' in text


def test_step_time_is_compute_plus_communication_unless_overlapped():
    kind = targets.KINDS["H100-80GB"]  # 989 TFLOP/s bf16, 450 GB/s NVLink, 50 GB/s network
    wire = {"intra": 450e9, "inter": 100e9}  # 1 s and 2 s
    t = estimate.step_time(989e12, wire, kind, "bfloat16", efficiency=0.5)
    assert t.compute_s == pytest.approx(2.0) and t.intra_node_s == pytest.approx(1.0)
    assert t.inter_node_s == pytest.approx(2.0) and t.step_s == pytest.approx(5.0)
    hidden = estimate.step_time(989e12, wire, kind, "bfloat16", efficiency=0.5, overlap=True)
    assert hidden.step_s == pytest.approx(3.0)  # the larger of 2 s and 1 + 2 s


def test_the_command_keeps_the_users_flags_and_sets_the_layout():
    flags = ["--model", "gpt", "--mesh", "data=64", "--grad-accum=2", "--seq-len", "2048"]
    layout = cands.Layout(1, 64, 1, 1, grad_accum=4, remat="full")
    gpu = targets.parse_target("8x8:A100-80GB")
    command = train_command(flags, layout, gpu, 0.9, gpt=True)
    assert command == (
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 python -m jaxdist.train --model gpt "
        "--seq-len 2048 --mesh fsdp=64 --grad-accum 4 --remat full"
    )
    cpu = train_command(["--cpu-devices", "4"], layout, targets.parse_target("cpu:64"), 0.9, False)
    assert cpu == "python -m jaxdist.train --mesh fsdp=64 --grad-accum 4 --cpu-devices 64"


def test_sizes_are_shown_in_the_unit_that_reads():
    assert [size(n) for n in (0, 2048, 3 * 2**20, 67.1 * 2**30, 2**41)] == [
        "0 B", "2.0 KiB", "3.0 MiB", "67.1 GiB", "2.0 TiB"
    ]  # fmt: skip
