"""Host offload (``--offload optimizer,params,activations``): parts of the training state,
or of what the backward pass keeps, held in host memory through JAX's memory kinds.

- ``optimizer``: the optimizer state's shardings carry ``memory_kind="pinned_host"``
  (the layout's, split or not): the state is made, kept between steps, checkpointed and
  restored there. The step moves it into device memory for the update
  (``jax.device_put`` with the same sharding of kind ``"device"``) and its new value
  leaves through the jit's host out-sharding. AdamW's moments are 8 of the 16 bytes per
  float32 parameter that a data-parallel replica holds with its gradient.
- ``params`` (fsdp only): the same for the parameters' float32 master copy, moved in at
  the start of the step, for the forward pass, the backward pass and the update.
- ``activations``: each block's remat policy moves the block's saved matmul outputs
  to host memory after the forward pass and back for the backward pass
  (``jaxdist.models.stack``, ``offload_dot_with_no_batch_dims``).

What the platform does (``MOVES_LOWERED``, checked here): JAX lowers a ``device_put``
inside ``jax.jit`` to a memory move only for GPU and TPU (jax 0.10.2). On CPU, where
host and device memory are the same RAM, the state's placement holds (the compiled
program's parameters are laid out in host memory, ``S(5)``) and the step reads it in
place, while the remat policy's moves lower to nothing: ``activations`` is refused there.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from jaxdist.errors import ConfigError

OPTIMIZER, PARAMS, ACTIVATIONS = "optimizer", "params", "activations"
NAMES = (OPTIMIZER, PARAMS, ACTIVATIONS)
HOST, DEVICE = "pinned_host", "device"
# Platforms whose jit lowers a move between memory kinds (jax/_src/dispatch.py registers
# the device_put lowering for these; every other platform's is the identity).
MOVES_LOWERED = ("gpu", "tpu")


def parse(names, strategy: str, mesh) -> tuple[str, ...]:
    """``names`` (a tuple, or "optimizer,params") checked against the strategy, the mesh
    and the platform, in ``NAMES`` order; ``ConfigError`` for what cannot be done."""
    if isinstance(names, str):
        names = names.split(",")
    wanted = {n.strip() for n in names if n.strip()}
    unknown = sorted(wanted - set(NAMES))
    if unknown:
        raise ConfigError(f"--offload: {', '.join(unknown)}: not one of {', '.join(NAMES)}")
    if wanted and strategy == "pmap":
        raise ConfigError(
            "--offload: pmap keeps one whole copy of the state per device, outside jit's "
            "memory kinds; use --strategy gspmd (or shard_map)"
        )
    fsdp = mesh.shape.get("fsdp", 1)
    if PARAMS in wanted and fsdp == 1:
        raise ConfigError(
            f"--offload params: the parameters' master copy is offloaded under fsdp only, "
            f"and the mesh has fsdp={fsdp} ({_mesh(mesh)}); add fsdp=N to --mesh, or "
            "offload the optimizer state alone"
        )
    _check_platform(wanted, mesh)
    return tuple(n for n in NAMES if n in wanted)


def _check_platform(wanted: set[str], mesh) -> None:
    mine = jax.process_index()  # another process's device lists no memories here
    device = next(d for d in mesh.devices.flat if d.process_index == mine)
    kinds = {m.kind for m in device.addressable_memories()}
    if wanted and HOST not in kinds:
        raise ConfigError(
            f"--offload {','.join(sorted(wanted))}: {device.platform} devices have no "
            f"{HOST} memory (they report {', '.join(sorted(kinds)) or 'none'}; jax "
            f"{jax.__version__}; the planner's devices described by a topology report none)"
        )
    if ACTIVATIONS in wanted and device.platform not in MOVES_LOWERED:
        raise ConfigError(
            f"--offload activations: on {device.platform} (jax {jax.__version__}) jit lowers "
            "the remat policy's moves to host memory to nothing, so the saved activations "
            f"would stay where they are; it needs a {' or '.join(map(str.upper, MOVES_LOWERED))}. "
            "optimizer and params offload work here"
        )


def _mesh(mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items())


def offloaded(layout, names, strategy: str):
    """``layout`` (a ``jaxdist.parallel.layout.Layout``) holding the checked ``names``."""
    names = parse(names, strategy, layout.mesh)
    return dataclasses.replace(layout, offload=names) if names else layout


def in_host_memory(shardings, names):
    """The state's shardings (a ``TrainState`` of them) with the optimizer state and/or
    the parameters in host memory, as ``names`` say."""
    changes = {}
    if OPTIMIZER in names:
        changes["opt_state"] = _with_kind(shardings.opt_state, HOST)
    if PARAMS in names:
        changes["params"] = _with_kind(shardings.params, HOST)
    return dataclasses.replace(shardings, **changes) if changes else shardings


def step_options(options, state_sharding, names):
    """``options`` (``StepOptions``) with the moves into device memory the step makes."""
    changes = {}
    if OPTIMIZER in names:
        changes["opt_state_in"] = _to_device(state_sharding.opt_state)
    if PARAMS in names:
        changes["params_in"] = _to_device(state_sharding.params)
    if ACTIVATIONS in names:
        changes["offload_activations"] = True
    return dataclasses.replace(options, **changes)


def _with_kind(tree, kind: str):
    return jax.tree.map(lambda s: s.with_memory_kind(kind), tree)


def _to_device(shardings):
    """``tree -> tree`` in device memory, each array keeping its sharding."""
    device = _with_kind(shardings, DEVICE)
    return lambda tree: jax.device_put(tree, device)


# One array in the compiled module's entry layout: f32[4,64]{1,0:S(5)} or s32[]{:S(5)}
# (S(5): host memory), s32[] (a scalar in device memory).
_ENTRY_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def argument_bytes(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program's arguments by memory kind, {"device": n,
    "pinned_host": m}, read from its entry layout (host memory is ``S(5)``). CPU's
    ``memory_analysis()`` counts host arguments as device ones (its host_* fields are 0)."""
    text = compiled.as_text()
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1)
    found = {DEVICE: 0, HOST: 0}
    for match in _ENTRY_ARRAY.finditer(layout):
        dtype, dims = match.group(1), match.group(2)
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        kind = HOST if "S(5)" in match.group(0) else DEVICE
        found[kind] += size * _ITEMSIZE.get(dtype, int(re.sub(r"\D", "", dtype) or 32) // 8)
    return found
