"""A planner worker: ``python -m jaxdist.plan.worker TARGET``. It reads one candidate per
line on stdin (JSON: the config tree, with the candidate's mesh, grad_accum and remat)
and writes one result per line on stdout: the measured costs, or why the layout was
discarded. One process compiles many candidates (importing JAX and Flax costs seconds);
the planner kills it past a candidate's time limit or its memory limit.

For a GPU target it compiles with XLA's GPU compiler for a topology that is not attached
(``jax.experimental.topologies``; ``JAX_PLATFORMS=cpu`` is set by the planner); for a
CPU target on the emulated CPU devices the planner gave it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import jax
from jax.experimental import topologies

from jaxdist.errors import JaxdistError
from jaxdist.plan import targets
from jaxdist.train import compile_only
from jaxdist.train import config as config_lib


def target_devices(target: targets.Target) -> tuple[list, callable]:
    """The target's devices and each one's node."""
    if target.is_gpu:
        topology = topologies.get_topology_desc(
            platform="cuda",
            topology=f"1x{target.nodes}x{target.devices_per_node}",
            target_config=targets.gpu_target_config(target.kind),
        )
        return list(topology.devices), lambda d: d.process_index
    devices = jax.devices()
    if len(devices) != target.num_devices:
        raise RuntimeError(f"{len(devices)} CPU devices, expected {target.num_devices}")
    return devices, lambda d: d.id // target.devices_per_node


def run_one(tree: dict, devices, node_of) -> dict:
    try:
        config = config_lib.from_dict(tree)
        measured = compile_only.measure(config, devices, node_of)
    except JaxdistError as err:  # the layout function's own: this layout cannot split it
        return {"status": "unsplittable", "why": str(err)}
    except Exception as err:  # a compiler failure: reported, the search goes on
        last = traceback.format_exception_only(err)[-1].strip()
        return {"status": "failed", "why": last[:500]}
    return {"status": "compiled", **dataclasses.asdict(measured)}


def main() -> None:
    out = os.fdopen(os.dup(1), "w")  # results only; the library's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    target = targets.parse_target(sys.argv[1])
    devices, node_of = target_devices(target)
    out.write(json.dumps({"status": "ready"}) + "\n")
    out.flush()
    for line in sys.stdin:
        result = run_one(json.loads(line), devices, node_of)
        out.write(json.dumps(result) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
