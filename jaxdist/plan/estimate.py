"""A step's time from its compiled program's counts: matmul FLOPs at the device's peak
times an efficiency, and collective bytes at the links' bandwidths. Stated, not
measured: the efficiency (default 0.5) and whether communication overlaps compute
(default: it does not, the sum; ``overlap``: the larger of the two)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.plan.targets import DeviceKind

EFFICIENCY = 0.5  # of the datasheet peak, on a large model's matmuls: 40-60% is typical MFU


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    intra_node_s: float
    inter_node_s: float
    step_s: float


def step_time(
    matmul_flops: float,
    wire_bytes: dict,
    kind: DeviceKind,
    dtype: str,
    efficiency: float = EFFICIENCY,
    overlap: bool = False,
) -> StepTime:
    """``wire_bytes``: {"intra": ..., "inter": ...} through one device's links per step."""
    compute = matmul_flops / (kind.peak_flops[dtype] * efficiency)
    intra = wire_bytes.get("intra", 0.0) / kind.intra_node_bytes_per_s
    inter = wire_bytes.get("inter", 0.0) / kind.inter_node_bytes_per_s
    comm = intra + inter
    return StepTime(compute, intra, inter, max(compute, comm) if overlap else compute + comm)
