"""The mesh (named axes data, stage, fsdp, model, seq, expert), the data-parallel rank,
and the one seam between host numpy and global device arrays."""

from __future__ import annotations

import collections
import functools
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.errors import JaxdistError

DATA = "data"  # the mesh axis that batches are split over (with fsdp)
SEQ = "seq"  # the mesh axis that splits a batch's sequence (dim 1) and the activations'
EXPERT = "expert"  # splits a MoE's experts (jaxdist.models.expert_parallel), and rows
AXES = ("data", "stage", "fsdp", "model", "seq", "expert")  # the mesh's axis order
# Outermost to innermost on the devices: model claims a process's devices first (it
# all-reduces activations in every block), then seq (its attention sends keys and values
# in every block), then expert (two all-to-alls of every routed token's rows in each MoE
# block, forward and backward: NVLink's bandwidth, not the network's), then stage (each
# tick of the schedule waits for its send), then fsdp (its gathers can overlap compute);
# data spans processes.
PLACEMENT = ("data", "fsdp", "stage", "expert", "seq", "model")
# Batch rows are split over all three, expert innermost (a process holding a whole expert
# group holds contiguous rows); replicated over the others. For everything outside the
# experts, expert is one more data axis: what is not split over it is replicated on it.
BATCH_AXES = ("data", "fsdp", "expert")
BATCH_SPEC = P(BATCH_AXES)


class DeviceCountError(JaxdistError):
    pass


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=2,model=2"`` -> {"data": 2, "fsdp": 2, "model": 2}; "" -> {}."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES or not value.strip().lstrip("-").isdigit():
            raise JaxdistError(
                f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}"
            )
        sizes[name] = int(value)
    return sizes


def mesh_devices(sizes: dict[str, int], devices) -> np.ndarray:
    """``devices`` as an array of shape (data, stage, fsdp, model, seq, expert), placed so
    that a ``model`` group, then ``seq``, ``expert``, ``stage`` and ``fsdp`` stay inside one
    process whenever it fits in what the axes inside it leave, and ``data`` spans
    processes. On several processes of equal size this is JAX's
    ``create_hybrid_device_mesh`` with one process per granule; otherwise (one process, or
    sizes that do not nest in processes) the devices are taken in ``PLACEMENT`` order by
    hand. ``sizes`` may hold one -1; the product must be the number of devices."""
    devices = sorted(devices, key=lambda d: d.process_index)  # stable: keeps jax's order
    shape = _resolve(sizes, len(devices), devices[0].platform)
    split = split_over_processes(shape, devices)
    if split is not None:  # in PLACEMENT order, as the hand placement below
        inside, across = split
        placed = mesh_utils.create_hybrid_device_mesh(
            inside, across, devices, process_is_granule=True
        )
    else:
        placed = np.array(devices, dtype=object).reshape([shape[AXES.index(a)] for a in PLACEMENT])
    return placed.transpose([PLACEMENT.index(a) for a in AXES])


def split_over_processes(shape, devices) -> tuple[list[int], list[int]] | None:
    """Each axis's size as (inside a process) x (across processes), in ``PLACEMENT``
    order: innermost first, an axis takes all of itself if it fits in the devices a
    process has left, else all that is left if that divides it. None with one process,
    processes of unequal size, or sizes that do not nest so."""
    counts = collections.Counter(d.process_index for d in devices)
    if len(counts) == 1 or len(set(counts.values())) > 1:
        return None
    room, inside = next(iter(counts.values())), {}
    for axis in reversed(PLACEMENT):
        size = shape[AXES.index(axis)]
        if room % size == 0:
            inside[axis] = size
        elif size % room == 0:
            inside[axis] = room
        else:
            return None
        room //= inside[axis]
    inner = [inside[a] for a in PLACEMENT]
    return inner, [shape[AXES.index(a)] // inside[a] for a in PLACEMENT]


def _resolve(sizes: dict[str, int], count: int, platform: str) -> list[int]:
    """The sizes in ``AXES`` order with the -1 filled in, checked against ``count``."""
    shape = [sizes.get(axis, 1) for axis in AXES]
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise DeviceCountError(f"mesh {_show(sizes)}: sizes must be >= 1, at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if count % known:
            raise DeviceCountError(
                f"mesh {_show(sizes)}: {count} devices do not split into groups of {known}"
            )
        shape[shape.index(-1)] = count // known
    if math.prod(shape) != count:
        raise DeviceCountError(
            f"mesh {_show(sizes)} has {math.prod(shape)} devices but {count} are used "
            f"({platform}); the product of the axis sizes must be the device count"
        )
    return shape


def make_mesh(
    data: int = -1, *, fsdp: int = 1, model: int = 1, stage: int = 1, seq: int = 1,
    expert: int = 1, devices=None,
) -> Mesh:  # fmt: skip
    """A mesh with axes ("data", "stage", "fsdp", "model", "seq", "expert"); size-1 axes
    cost nothing.

    Example::

        mesh = jaxdist.make_mesh()                   # every device on "data"
        mesh = jaxdist.make_mesh(data=4)             # the first 4 devices, data only
        mesh = jaxdist.make_mesh(data=2, fsdp=2, model=2)  # 8 devices
        mesh = jaxdist.make_mesh(fsdp=-1, model=2)   # all devices, fsdp = N / 2
        mesh = jaxdist.make_mesh(data=2, seq=4)      # 8 devices, sequences split in 4
        mesh = jaxdist.make_mesh(data=2, expert=4)   # 8 devices, a MoE's experts in 4

    With only ``data`` given, it may use the first ``data`` devices; otherwise the product
    of the sizes (one may be -1) must equal the number of devices. Built from ``Mesh``
    with Auto axes: ``jax.make_mesh`` silently drops devices that do not fit its shape,
    and its default Explicit axes reject the grad-accum reshape of a sharded batch."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "stage": stage, "fsdp": fsdp, "model": model, "seq": seq}
    sizes[EXPERT] = expert
    if data != -1 and fsdp == model == stage == seq == expert == 1:  # the first N, as before
        if not 1 <= data <= len(devices):
            raise DeviceCountError(
                f"{data} devices requested but only {len(devices)} exist "
                f"({devices[0].platform}); use --cpu-devices {data} to emulate CPU devices"
            )
        devices = devices[:data]
    array = mesh_devices(sizes, devices)
    return Mesh(array, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _show(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "data=1"


def batch_shards(mesh: Mesh) -> int:
    """How many blocks the global batch is split into: data x fsdp x expert."""
    return axis_size(mesh, BATCH_AXES)


def axis_size(mesh: Mesh, axes) -> int:
    """The number of shards along ``axes`` (a name, a tuple of names or None)."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape.get(a, 1) for a in names)


def batch_spec(mesh: Mesh, shape=None) -> P:
    """Batch rows over ("data", "fsdp", "expert") together (a 1-D ``data`` mesh: over
    ``data``).
    With ``shape`` (one array's) and a ``seq`` axis > 1 that divides its dimension 1
    (tokens (B, T)): that dimension over ``seq`` too. A dimension seq does not divide
    (the trainer's (B, T + 1) tokens: inputs and shifted targets) stays whole over seq;
    the model splits its activations itself (``jaxdist.models.attention``)."""
    # expert only where it splits: a size-1 expert left out keeps the (data, fsdp) rows an
    # explicit-sharding model names (their types must match, size 1 or not)
    rows = tuple(
        a for a in BATCH_AXES if a in mesh.axis_names and (a != EXPERT or mesh.shape[a] > 1)
    )
    seq = mesh.shape.get(SEQ, 1)
    if seq > 1 and shape is not None and len(shape) >= 2 and shape[1] % seq == 0:
        return P(rows, SEQ)
    return P(rows)


def batch_shardings(mesh: Mesh, batch):
    """The ``NamedSharding`` of each array of ``batch`` (``batch_spec`` by its shape)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(mesh, np.shape(x))), batch)


def data_parallel_rank(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
    """(rank, count): which contiguous block of the global batch this process loads, and
    how many such blocks there are. Processes whose devices hold the same rows (one model
    group spread over processes) share a rank and load the same rows. With a data-only
    mesh this is (process index, process count)."""
    process_index = jax.process_index() if process_index is None else process_index
    rows = batch_blocks_by_process(mesh)
    groups = sorted(set(rows.values()))
    first = groups[0]
    for block in groups:
        if len(block) != len(first) or block != tuple(range(block[0], block[0] + len(block))):
            raise JaxdistError(
                f"the mesh {dict(mesh.shape)} gives processes uneven or scattered batch rows "
                f"({[list(b) for b in groups]}); order the devices process by process"
            )
    return groups.index(rows[process_index]), len(groups)


def batch_blocks_by_process(mesh: Mesh) -> dict[int, tuple[int, ...]]:
    """process index -> the sorted batch blocks (positions along data x fsdp x expert,
    expert fastest) its devices hold."""
    names = mesh.axis_names
    blocks: dict[int, set[int]] = {}
    for index, device in np.ndenumerate(mesh.devices):
        at = dict(zip(names, index, strict=True))
        block = 0
        for axis in BATCH_AXES:
            if axis in at:
                block = block * mesh.shape[axis] + at[axis]
        blocks.setdefault(device.process_index, set()).add(block)
    return {p: tuple(sorted(b)) for p, b in blocks.items()}


def shard_batch(host_batch, mesh: Mesh | None = None, spec: P | None = None):
    """Host-local numpy (this data-parallel rank's rows) -> global ``jax.Array``, rows
    split over ("data", "fsdp", "expert") and replicated over ``model`` and ``stage``; a sequence
    dimension (1) that a ``seq`` axis divides split over seq (``batch_spec``).

    With R data-parallel ranks (processes, or groups of processes sharing a model
    replica; see ``data_parallel_rank``) each holding G/R rows, the result has G rows.
    ``mesh`` defaults to all devices (``make_mesh()``). Works the same for every strategy.

    Example::

        batch = jaxdist.shard_batch({"x": x_np, "y": y_np}, mesh)  # x_np: (64, 32) numpy
    """
    mesh = make_mesh() if mesh is None else mesh
    local_blocks = len(batch_blocks_by_process(mesh)[jax.process_index()])
    _, ranks = data_parallel_rank(mesh)
    for x in jax.tree.leaves(host_batch):
        if np.shape(x)[0] % local_blocks:
            raise JaxdistError(
                f"a host batch of {np.shape(x)[0]} rows does not split over this process's "
                f"{local_blocks} batch shards"
            )

    def put(x):
        global_shape = (np.shape(x)[0] * ranks, *np.shape(x)[1:])
        sharding = NamedSharding(mesh, batch_spec(mesh, global_shape) if spec is None else spec)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, host_batch)


def traced_in(mesh: Mesh, fn):
    """``fn`` traced with ``mesh`` as the ambient mesh (``jax.sharding.get_abstract_mesh``),
    where code inside a step that splits work over an axis by hand looks for it
    (``jaxdist.models.attention``: the ``seq`` axis)."""

    @functools.wraps(fn)
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return traced


def replicate(tree, mesh: Mesh):
    """A full copy of ``tree`` on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
