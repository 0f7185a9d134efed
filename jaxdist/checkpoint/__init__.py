"""Checkpoints and the run directory: orbax saves (asynchronous, sharded, verified by a
fingerprint per array: ``verify.py``) in ``checkpointer.py``, one outcome for all the
processes of a group (``outcome.py``: a save fails everywhere or nowhere), and the
run directory that holds them
(``run_directory.py``: named once for the whole group, never silently replaced; and
``lock.py``: one run in it at a time); a failed write to it, named once, in
``io_errors.py`` (``StorageError``: exit 74).
``Parallel.save`` / ``Parallel.restore`` use the checkpointer; the trainer's resume
decision is ``jaxdist.train.resume``.
"""

from jaxdist.checkpoint.checkpointer import Checkpointer, CorruptCheckpointError
from jaxdist.checkpoint.io_errors import StorageError
from jaxdist.checkpoint.verify import fingerprint, fingerprints

__all__ = ["Checkpointer", "CorruptCheckpointError", "StorageError", "fingerprint", "fingerprints"]
