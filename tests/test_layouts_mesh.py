"""Where the mesh puts its axes: on fake multi-process device lists, a ``model`` group,
then a ``stage`` group, then an ``fsdp`` group lies inside one process whenever it fits,
``data`` spans the processes, and processes holding one model replica share a
data-parallel rank."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist.parallel.device_mesh import AXES, DeviceCountError, data_parallel_rank, mesh_devices


def fake_devices(processes, per_process):
    return [
        SimpleNamespace(id=i, process_index=i // per_process, platform="cpu", device_kind="cpu")
        for i in range(processes * per_process)
    ]


def fake_mesh(array):
    return SimpleNamespace(
        devices=array, axis_names=AXES, shape=dict(zip(AXES, array.shape, strict=True))
    )


def groups(array, axis):
    """Every group of devices along ``axis`` (the other coordinates fixed)."""
    moved = np.moveaxis(array, AXES.index(axis), -1)
    return moved.reshape(-1, moved.shape[-1])


def processes_of(group):
    return {d.process_index for d in group}


def power_of_two_layouts(total):
    """Every (stage, fsdp, model) of powers of two whose product divides ``total``."""
    powers = [2**k for k in range(total.bit_length()) if 2**k <= total]
    for stage, fsdp, model in itertools.product(powers, repeat=3):
        if total % (stage * fsdp * model) == 0:
            yield dict(data=-1, stage=stage, fsdp=fsdp, model=model)


@pytest.mark.parametrize("processes, per_process", [(2, 4), (4, 2), (4, 4), (8, 8)])
def test_inner_axes_stay_inside_a_process_and_data_spans_processes(processes, per_process):
    every = fake_devices(processes, per_process)
    for sizes in power_of_two_layouts(processes * per_process):
        array = mesh_devices(sizes, every)
        assert sorted(d.id for d in array.flat) == list(range(len(every))), sizes
        inside = 1
        for axis in ("model", "stage", "fsdp"):  # each fits if it nests in what is left
            stride, inside = inside, inside * sizes[axis]
            if per_process % inside == 0:
                for group in groups(array, axis):
                    assert len(processes_of(group)) == 1, (sizes, axis, processes_of(group))
                    # model innermost, then stage, then fsdp: an axis's neighbours are
                    # the product of the sizes inside it apart (model=2, stage=2: 2 apart)
                    steps = set(np.diff([d.id for d in group]).tolist())
                    assert steps <= {stride}, (sizes, axis, steps)
        # Raises if a process's batch rows are not one contiguous block.
        ranks = [data_parallel_rank(fake_mesh(array), p) for p in range(processes)]
        if per_process % inside == 0:  # a whole model replica per process: data across
            for group in groups(array, "data"):
                assert processes_of(group) == set(range(processes)), sizes
            assert ranks == [(p, processes) for p in range(processes)], (sizes, ranks)


def test_stage_stays_inside_and_fsdp_spans_when_both_do_not_fit():
    """2 processes x 4 devices, stage=2, fsdp=4: the stage pairs fit inside a process,
    so fsdp (which then cannot) spans the two."""
    array = mesh_devices(dict(data=1, stage=2, fsdp=4), fake_devices(2, 4))
    assert all(len(processes_of(g)) == 1 for g in groups(array, "stage"))
    assert all(processes_of(g) == {0, 1} for g in groups(array, "fsdp"))


def test_data_parallel_rank_is_shared_by_a_model_group():
    # 2 processes x 4 devices, model=4: each process is one replica, its own rows.
    mesh = fake_mesh(mesh_devices({"data": 2, "model": 4}, fake_devices(2, 4)))
    assert [data_parallel_rank(mesh, p) for p in (0, 1)] == [(0, 2), (1, 2)]
    # model=8 spans both processes: one replica, both load the same rows.
    mesh = fake_mesh(mesh_devices({"data": 1, "model": 8}, fake_devices(2, 4)))
    assert [data_parallel_rank(mesh, p) for p in (0, 1)] == [(0, 1), (0, 1)]
    a = jaxdist.DistributedSampler(64, 16, mesh=mesh, seed=1)
    assert (a.process_index, a.process_count) == (0, 1) and len(a.indices(0)) == 16
    # 4 processes x 2 devices, data=2, model=4: processes 0, 1 share rank 0.
    mesh = fake_mesh(mesh_devices({"data": 2, "model": 4}, fake_devices(4, 2)))
    assert [data_parallel_rank(mesh, p)[0] for p in range(4)] == [0, 0, 1, 1]


def test_mesh_sizes():
    mesh = jaxdist.make_mesh(data=2, fsdp=2, model=2)
    assert mesh.axis_names == ("data", "stage", "fsdp", "model", "seq", "expert")
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "model": 2, "seq": 1, "expert": 1}
    assert jaxdist.make_mesh(model=2).shape["data"] == 4
    assert jaxdist.make_mesh(data=4).size == 4  # data alone: the first 4 devices
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(DeviceCountError, match="6 devices but 8"):
        jaxdist.make_mesh(data=3, model=2)
