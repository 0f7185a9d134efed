"""The run's training step compiled for a set of devices without data, and what it costs
per device: memory (arguments, temporaries, peak), matmul FLOPs and collective bytes by
link. ``python -m jaxdist.train --dry-run`` and the planner's workers share it.

Nothing here reads a dataset or writes a file: the batch is known by its shapes
(``example_row``), and the model and optimizer state are abstract until compiled.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxdist.cluster import cpu_backend
from jaxdist.data import sidecar
from jaxdist.data.text import BYTE_VOCAB
from jaxdist.errors import ConfigError
from jaxdist.parallel import hlo, strategies
from jaxdist.parallel.axis_names import Names
from jaxdist.parallel.axis_names import parse as parse_axis_names
from jaxdist.parallel.device_mesh import EXPERT, batch_shards
from jaxdist.train import build_data, trainer
from jaxdist.train.build_model import model_task
from jaxdist.train.config import Config
from jaxdist.train.factories import import_object, parse_model_args


class ShapeSource:
    """A data source of ``size`` rows of zeros shaped like ``row``: the step needs only
    the batch's shapes and dtypes."""

    def __init__(self, row: dict[str, np.ndarray], size: int = 2**31 - 1):
        self.row, self.size = row, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, indices):
        n = len(np.atleast_1d(indices))
        return {k: np.zeros((n, *v.shape), v.dtype) for k, v in self.row.items()}


def example_row(config: Config, task: str) -> tuple[dict[str, np.ndarray], int]:
    """One example's arrays (zeros) and the vocabulary (lm), as ``--data`` would give
    them, read without preparing the data: token ids (T + 1,) for lm; for an .npz its
    arrays' headers; a data factory (``pkg.mod:fn``) is called and one row read."""
    d, m = config.data, config.model
    path = d.path or ("stdlib" if task == "lm" else "synthetic")
    if task == "lm":
        vocab = _token_vocab(config, path)
        return {"tokens": np.zeros(m.seq_len + 1, np.int32)}, vocab
    if path == "synthetic":
        return {"x": np.zeros(m.in_features, np.float32), "y": np.zeros((), np.int32)}, 0
    if path.endswith(".npz"):
        return _npz_row(Path(path), d.npz_inputs), 0
    if ":" in path:
        source = import_object(path, "--data")(split="train")
        return {k: np.asarray(v)[0] for k, v in source[np.arange(1)].items()}, 0
    raise ConfigError(f"--data {path}: not classification data (the model's task is {task})")


def _token_vocab(config: Config, path: str) -> int:
    declared = parse_model_args(config.model.model_args).get("vocab_size")
    token_file = path.endswith((".bin", ".npy"))
    if declared or config.model.vocab_size:
        vocab = int(declared or config.model.vocab_size)
        if token_file:  # the file's tokenizer needs this many rows at least, as in a run
            given_by = "--model-args vocab_size" if declared else "--vocab-size"
            sidecar.check_vocabulary(Path(path), vocab, given_by)
        return vocab
    if token_file:  # its sidecar says; a missing one is an error
        return build_data.file_vocab(Path(path))
    return BYTE_VOCAB  # stdlib, grammar, text files: bytes


def _npz_row(path: Path, inputs: str) -> dict[str, np.ndarray]:
    """The .npz's arrays with as many rows as ``inputs``, from their headers only."""
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file")
    shapes = {}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            with zf.open(name) as f:
                version = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)  # fmt: skip
                shape, _, dtype = read(f)
            shapes[name.removesuffix(".npy")] = (shape, dtype)
    if inputs not in shapes:
        raise ConfigError(f"--data {path}: no array {inputs!r} (--npz-inputs)")
    rows = shapes[inputs][0][0]
    row = {}
    for name, (shape, dtype) in shapes.items():
        if shape and shape[0] == rows and (dtype.kind in "fiub"):
            kind = np.float32 if dtype.kind == "f" or name == inputs else np.int32
            row[name] = np.zeros(shape[1:], kind)
    return row


def shape_only_data(config: Config, task: str) -> build_data.Data:
    row, vocab = example_row(config, task)
    return build_data.Data(ShapeSource(row), None, vocab_size=vocab, description="shapes only")


def build(config: Config, devices) -> tuple:
    """``(parallel, program, mesh)``: the run's step for ``devices`` in ``--mesh``'s
    layout; the layout's own errors (a dimension the mesh cannot split, a batch it
    cannot divide) raise as in training."""
    cfg = config.train
    mesh = trainer.make_mesh(cfg, devices)
    strategies.layout(cfg.strategy, mesh, shard_optimizer=cfg.shard_optimizer)
    trainer.check_batch(cfg.global_batch_size, batch_shards(mesh), cfg.grad_accum)
    task = model_task(config.model)
    data = shape_only_data(config, task)
    dp = trainer.make_step(config, task, data, mesh)
    program = dp.program(data.batch_shapes(cfg.global_batch_size))
    return dp, program, mesh


def state_bytes(config: Config) -> tuple[float, float]:
    """(training state, parameters) in bytes, from the abstract state of a 1-device run."""
    return state_facts(config)[:2]


def state_facts(config: Config) -> tuple[float, float, int]:
    """(training state bytes, parameter bytes, E): E the experts of the model's MoE
    blocks, the size of the dimension its annotations map onto the ``expert`` axis (0 when
    none does: the planner then offers no expert axis)."""
    one = copy.deepcopy(config)
    one.train.mesh, one.train.num_devices, one.train.grad_accum = "", 0, 1
    one.train.global_batch_size = 1
    one.train.offload, one.train.shard_optimizer = "", False  # options of a mesh: none here
    dp, program, _ = build(one, jax.devices()[:1])
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.state))
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.state.params))
    return float(total), float(params), expert_dim(dp._source.abstract_params, config)


def expert_dim(abstract_params, config: Config) -> int:
    """The largest dimension that a parameter's annotation maps onto ``expert``, or 0."""
    names = Names(parse_axis_names(config.train.axis_names))
    found = 0
    for path, var in nnx.to_flat_state(abstract_params):
        meta = var.get_metadata()
        shape = var.get_value().shape
        for dim, entry in enumerate(meta.get("out_sharding") or ()):
            if dim < len(shape) and EXPERT in names.axes(entry, str(path), meta):
                found = max(found, shape[dim])
    return found


@dataclasses.dataclass
class Measured:
    """Per device, per optimizer step."""

    argument_bytes: float
    output_bytes: float
    temp_bytes: float
    alias_bytes: float
    peak_bytes: float  # argument + output + temp - alias (jax-notes fact 8)
    matmul_flops: float
    collective_bytes: dict  # link ("intra", "inter") -> bytes (hlo's definition)
    wire_bytes: dict  # link -> bytes through the link (all-reduce: 2(n-1)/n of its buffer)
    by_kind: dict  # collective kind -> bytes
    unknown_loops: int  # while loops whose trip count was not found (counted once)
    microbatches: int  # the pipeline's, with a stage axis (0: none)
    lower_s: float
    compile_s: float
    notices: list = dataclasses.field(default_factory=list)  # what the layout does not do


def measure(config: Config, devices, node_of_device: Callable) -> Measured:
    """Compiles the step of ``config`` for ``devices`` and reads its costs."""
    t0 = time.perf_counter()
    dp, program, mesh = build(config, devices)
    lowered = program.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    memory = compiled.memory_analysis()
    counts = hlo.read_program(compiled.as_text(), mesh.size)
    nodes = [node_of_device(d) for d in mesh.devices.flat]  # replica groups index these
    node_of = nodes.__getitem__
    wire = {"intra": 0.0, "inter": 0.0}
    for c in counts.collectives:
        n = max((len(g) for g in c.groups), default=1)
        # a ring all-reduce moves 2(n-1)/n of its buffer through each device's link; the
        # others move what hlo counts (received or sent: already x (n-1)/n)
        factor = 2 * (n - 1) / n if c.kind == "all-reduce" else 1.0
        wire[c.link(node_of)] += c.bytes * c.count * factor
    arg, out = memory.argument_size_in_bytes, memory.output_size_in_bytes
    temp, alias = memory.temp_size_in_bytes, memory.alias_size_in_bytes
    pipeline = dp.pipeline.microbatches if dp.pipeline else 0
    links = counts.bytes_by_link(node_of)
    return Measured(
        arg, out, temp, alias, arg + out + temp - alias, counts.matmul_flops, links, wire,
        counts.bytes_by_kind(), counts.unknown_trip_counts, pipeline, t1 - t0, t2 - t1,
        list(dp.notices),
    )  # fmt: skip


def capacity_bytes(devices) -> float | None:
    """What the allocator of ``devices`` lets a program use (the smallest): a GPU's
    ``bytes_limit``; a CPU's share of the host's memory; None if unknown."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if all(limits):
        return float(min(limits))
    if devices[0].platform == "cpu":
        return cpu_backend.host_memory_bytes() / max(jax.local_device_count(), 1)
    return None
