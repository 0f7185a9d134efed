"""Checkpoints and the run directory: orbax saves (asynchronous, sharded, verified by a
fingerprint per array) in ``checkpointer.py``, and the run directory that holds them
(``run_directory.py``: named once for the whole group, never silently replaced).
``Parallel.save`` / ``Parallel.restore`` use the checkpointer; the trainer's resume
decision is ``jaxdist.train.resume``.
"""

from jaxdist.checkpoint.checkpointer import (
    Checkpointer,
    CorruptCheckpointError,
    fingerprint,
    fingerprints,
)

__all__ = ["Checkpointer", "CorruptCheckpointError", "fingerprint", "fingerprints"]
