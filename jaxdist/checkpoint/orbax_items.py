"""The two orbax items of a checkpoint: ``state`` (the arrays by name) and ``meta`` (JSON).

``state`` is a PyTree item whose ``jax.Array`` handler writes each shard from one of its
replicas. orbax's default on CPU and TPU is replica-parallel: every replica of a
replicated array slices off a part of it to write, which compiles one slice program per
device and shape on the first save of a process (64 programs and about 1.8 s for the
8-device GPT, whose 8 distinct shapes sit on 8 devices). orbax's default on GPU is
already one replica per shard, and the bytes written are the same either way.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp


def _registry():
    default = ocp.type_handlers.get_type_handler(jax.Array)
    arrays = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,
        # orbax's default handler keeps a per-process record of each array (a PRNG key's
        # implementation among it): the same store, where this orbax has one
        array_metadata_store=getattr(default, "_array_metadata_store", None),
    )
    scalars = ocp.type_handlers.ScalarHandler()
    return ocp.type_handlers.create_type_handler_registry(
        (jax.Array, arrays),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        *((kind, scalars) for kind in (int, float, np.number)),
    )


def handlers() -> dict:
    """``item_handlers`` for ``ocp.CheckpointManager``."""
    state = ocp.PyTreeCheckpointHandler(type_handler_registry=_registry())
    return {"state": state, "meta": ocp.JsonCheckpointHandler()}


def save(arrays: dict[str, jax.Array], meta: dict):
    return ocp.args.Composite(state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta))


def restore_state(target: dict):
    """Every array of ``target`` (arrays or ShapeDtypeStructs) read into its sharding."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    return ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args))


def restore_meta():
    return ocp.args.Composite(meta=ocp.args.JsonRestore())
