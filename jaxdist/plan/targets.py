"""The cluster a plan is for: nodes x devices per node of one device kind.

``--target 8x8:A100-80GB`` (8 nodes of 8), ``--target H100-80GB`` (one device),
``--target cpu:8`` (8 CPU devices on one host) or ``--target 8x8:my_gpu.yaml`` (a kind
of your own, see ``load_kind``). A GPU kind carries what XLA's GPU compiler needs to
compile for it without one (``gpu_target_config``) and the numbers the step-time
estimate uses: peak matmul FLOP/s and the bandwidth of the links inside a node (NVLink)
and across nodes (the network, per GPU).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from jaxdist.cluster import cpu_backend
from jaxdist.errors import ConfigError

GiB = 2**30
T, G = 1e12, 1e9


@dataclass(frozen=True)
class DeviceKind:
    name: str
    memory_bytes: float  # the device's memory, as the driver reports its total
    peak_flops: dict  # dtype ("bfloat16", "float32") -> dense matmul FLOP/s (datasheet)
    intra_node_bytes_per_s: float  # one device's link to the others of its node, one way
    inter_node_bytes_per_s: float  # one device's share of its node's network, one way
    platform: str = "cuda"  # "cuda" or "cpu"
    # XLA's GPU compiler: compute capability, SMs, clock, memory bandwidth, caches
    gpu: dict = field(default_factory=dict)
    description: str = ""  # as jax.Device.device_kind says it


def _gpu(cc, sms, clock_ghz, mem_tb_s, l2_mib, smem_kib, memory_bytes, description):
    return {
        "cuda_compute_capability": cc,
        "core_count": sms,
        "clock_rate_ghz": clock_ghz,
        "memory_bandwidth": mem_tb_s * T,
        "l2_cache_size": l2_mib * 2**20,
        "shared_memory_per_core": smem_kib * 1024,
        "device_memory_size": memory_bytes,
        "description": description,
    }


# Datasheet numbers (NVIDIA's product briefs): dense bf16 / TF32 tensor-core peaks;
# NVLink one way (A100 600 GB/s both ways -> 300; H100/H200 900 -> 450; B200 1.8 TB/s
# -> 900); the network as one 200 Gb/s (A100 nodes, HDR) or 400 Gb/s (NDR) adapter per
# GPU: 25 or 50 GB/s. Memory: the driver's total (A100 80GB: 81,221 MiB).
KINDS = {
    "A100-80GB": DeviceKind(
        "A100-80GB", 81221 * 2**20, {"bfloat16": 312 * T, "float32": 156 * T},
        300 * G, 25 * G, gpu=_gpu((8, 0), 108, 1.41, 2.039, 40, 164, 81221 * 2**20,
                                  "NVIDIA A100-SXM4-80GB"),
        description="NVIDIA A100-SXM4-80GB",
    ),
    "A100-40GB": DeviceKind(
        "A100-40GB", 40536 * 2**20, {"bfloat16": 312 * T, "float32": 156 * T},
        300 * G, 25 * G, gpu=_gpu((8, 0), 108, 1.41, 1.555, 40, 164, 40536 * 2**20,
                                  "NVIDIA A100-SXM4-40GB"),
        description="NVIDIA A100-SXM4-40GB",
    ),
    "H100-80GB": DeviceKind(
        "H100-80GB", 81559 * 2**20, {"bfloat16": 989 * T, "float32": 495 * T},
        450 * G, 50 * G, gpu=_gpu((9, 0), 132, 1.98, 3.35, 50, 228, 81559 * 2**20,
                                  "NVIDIA H100 80GB HBM3"),
        description="NVIDIA H100 80GB HBM3",
    ),
    "H200": DeviceKind(
        "H200", 143771 * 2**20, {"bfloat16": 989 * T, "float32": 495 * T},
        450 * G, 50 * G, gpu=_gpu((9, 0), 132, 1.98, 4.8, 50, 228, 143771 * 2**20,
                                  "NVIDIA H200"),
        description="NVIDIA H200",
    ),
    "B200": DeviceKind(
        "B200", 183359 * 2**20, {"bfloat16": 2250 * T, "float32": 1100 * T},
        900 * G, 50 * G, gpu=_gpu((10, 0), 148, 1.965, 8.0, 126, 228, 183359 * 2**20,
                                  "NVIDIA B200"),
        description="NVIDIA B200",
    ),
}  # fmt: skip
ALIASES = {"A100": "A100-80GB", "H100": "H100-80GB", "H200-141GB": "H200", "B200-180GB": "B200"}


@dataclass(frozen=True)
class Target:
    nodes: int
    devices_per_node: int
    kind: DeviceKind

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def is_gpu(self) -> bool:
        return self.kind.platform == "cuda"

    def node_of(self, device_index: int) -> int:
        """The node of the mesh's device ``device_index`` (JAX numbers a node's devices
        together: process i holds ids i*D ... i*D + D - 1)."""
        return device_index // self.devices_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.devices_per_node}:{self.kind.name}"


def cpu_kind(devices_per_node: int) -> DeviceKind:
    """This host's CPU as a device kind: its memory shared by the emulated devices. No
    datasheet peak: 0.1 TFLOP/s per device, a nominal figure (the plan says so)."""
    memory = cpu_backend.host_memory_bytes() / max(devices_per_node, 1)
    return DeviceKind("cpu", memory, {"bfloat16": 0.1 * T, "float32": 0.1 * T}, 10 * G,
                      1 * G, platform="cpu", description="cpu")  # fmt: skip


def parse_target(text: str) -> Target:
    """``NODESxPER_NODE:KIND``, ``KIND`` (one device), ``cpu:N`` or ``NxM:cpu``; KIND is
    a name of ``KINDS`` or a YAML file (``load_kind``)."""
    text = text.strip()
    shape, _, kind_name = text.rpartition(":")
    if kind_name.isdigit() and shape.lower() == "cpu":  # cpu:8
        n = int(kind_name)
        return Target(1, n, cpu_kind(n)) if n > 0 else _bad(text)
    nodes, per_node = 1, 1
    if shape:
        m = re.fullmatch(r"(\d+)x(\d+)", shape)
        if not m or int(m[1]) < 1 or int(m[2]) < 1:
            _bad(text)
        nodes, per_node = int(m[1]), int(m[2])
    if kind_name.lower() == "cpu":
        return Target(nodes, per_node, cpu_kind(per_node))
    return Target(nodes, per_node, find_kind(kind_name))


def find_kind(name: str) -> DeviceKind:
    if name.endswith((".yaml", ".yml")):
        return load_kind(Path(name))
    key = next((k for k in KINDS if k.lower() == name.lower()), None)
    key = key or next((v for k, v in ALIASES.items() if k.lower() == name.lower()), None)
    if key is None:
        raise ConfigError(
            f"--target: unknown device kind {name!r}; known: {', '.join(KINDS)}, cpu, or a "
            "YAML file describing one (docs/plan.md)"
        )
    return KINDS[key]


def load_kind(path: Path) -> DeviceKind:
    """A device kind from YAML: ``name``, ``memory_gib``, ``bf16_tflops``,
    ``fp32_tflops``, ``intra_node_gb_s``, ``inter_node_gb_s``, and for the compiler either
    ``like: H100-80GB`` (its spec) or ``compute_capability: [9, 0]``, ``sm_count``,
    ``clock_ghz``, ``memory_bandwidth_tb_s``, ``l2_cache_mib``, ``shared_memory_per_sm_kib``."""
    if not path.is_file():
        raise ConfigError(f"--target: no such file {path}")
    spec = yaml.safe_load(path.read_text()) or {}
    need = ["name", "memory_gib", "bf16_tflops", "intra_node_gb_s", "inter_node_gb_s"]
    missing = [k for k in need if k not in spec]
    if missing:
        raise ConfigError(f"--target {path}: missing {', '.join(missing)}")
    memory = float(spec["memory_gib"]) * GiB
    if "like" in spec:
        gpu = {**find_kind(str(spec["like"])).gpu, "device_memory_size": memory}
    else:
        try:
            gpu = _gpu(tuple(spec["compute_capability"]), int(spec["sm_count"]),
                       float(spec["clock_ghz"]), float(spec["memory_bandwidth_tb_s"]),
                       float(spec["l2_cache_mib"]), float(spec["shared_memory_per_sm_kib"]),
                       memory, str(spec["name"]))  # fmt: skip
        except KeyError as err:
            raise ConfigError(f"--target {path}: missing {err.args[0]} (or give like:)") from None
    peaks = {"bfloat16": float(spec["bf16_tflops"]) * T}
    peaks["float32"] = float(spec.get("fp32_tflops", spec["bf16_tflops"] / 2)) * T
    return DeviceKind(
        str(spec["name"]), memory, peaks, float(spec["intra_node_gb_s"]) * G,
        float(spec["inter_node_gb_s"]) * G, gpu=gpu, description=str(spec["name"]),
    )  # fmt: skip


def gpu_target_config(kind: DeviceKind) -> str:
    """XLA's ``GpuTargetConfigProto`` as text, for ``get_topology_desc(target_config=)``:
    what the compiler reads of a GPU it cannot query. The limits every NVIDIA GPU since
    Volta shares (1024 threads a block, 2048 an SM, 64K registers) are fixed here."""
    g = kind.gpu
    major, minor = g["cuda_compute_capability"]
    smem_sm = int(g["shared_memory_per_core"])
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152", f"  shared_memory_per_core: {smem_sm}",
        f"  shared_memory_per_block_optin: {smem_sm - 1024}",
        "  threads_per_core_limit: 2048", f"  core_count: {int(g['core_count'])}",
        "  fpus_per_core: 128",
        "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(g['memory_bandwidth'])}",
        f"  l2_cache_size: {int(g['l2_cache_size'])}",
        f"  clock_rate_ghz: {g['clock_rate_ghz']}",
        f"  device_memory_size: {int(g['device_memory_size'])}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info { major: 9 minor: 8 }",
        f'device_description_str: "{g["description"]}"',
    ])  # fmt: skip


def with_memory(target: Target, memory_bytes: float) -> Target:
    return dataclasses.replace(
        target, kind=dataclasses.replace(target.kind, memory_bytes=memory_bytes)
    )


def _bad(text: str):
    raise ConfigError(
        f"--target {text!r}: expected NODESxDEVICES:KIND (8x8:A100-80GB), KIND, cpu:N or "
        f"NxM:cpu; kinds: {', '.join(KINDS)}"
    )
