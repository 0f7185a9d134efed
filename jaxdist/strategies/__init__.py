"""Each strategy wires the one pure ``train_step`` to devices, and does nothing else.

``wire(make_step, mesh) -> Wired``: ``make_step(mean_over_replicas)`` builds the step with
the strategy's way of averaging across replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jax.sharding import Mesh

from jaxdist.config import ConfigError


@dataclass(frozen=True)
class Wired:
    step: Callable  # jitted/pmapped (state, device_batch) -> (state, metrics)
    put_state: Callable  # host state -> device state in this strategy's layout
    put_batch: Callable  # host-local numpy batch -> device batch
    get_state: Callable  # device state -> one copy (for comparison, checkpoints)
    get_metrics: Callable  # device metrics -> dict of floats


NAMES = ("pmap", "shard_map", "gspmd")


def wire(name: str, make_step: Callable, mesh: Mesh) -> Wired:
    if name == "pmap":
        from jaxdist.strategies import pmap as module
    elif name == "shard_map":
        from jaxdist.strategies import shard_map as module
    elif name == "gspmd":
        from jaxdist.strategies import gspmd as module
    else:
        raise ConfigError(f"train.strategy: {name!r} is not one of {', '.join(NAMES)}")
    return module.wire(make_step, mesh)


def scalars(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}
