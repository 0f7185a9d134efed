"""A classification set from a ``.npz`` of inputs and integer labels, held in memory."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from jaxdist.errors import JaxdistError


class NpzArrays:
    """Row i is (``inputs``[i], ``labels``[i]): x float32 (B, ...), y int32 (B,)."""

    def __init__(self, path, *, inputs: str = "x", labels: str = "y"):
        self.path = Path(path)
        if not self.path.is_file():
            raise JaxdistError(f"{self.path}: no such file")
        x, y = _load(self.path, inputs, labels)
        if x.ndim < 1 or not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
            raise JaxdistError(
                f"{self.path}: inputs {inputs} must be numbers, got {x.dtype}{x.shape}"
            )
        if len(x) != len(y):
            raise JaxdistError(
                f"{self.path}: {inputs} has {len(x)} rows but {labels} has {len(y)}: "
                "they must match"
            )
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise JaxdistError(
                f"{self.path}: labels {labels} must be 1-D integers, got {y.dtype}{y.shape}"
            )
        if len(y) == 0:
            raise JaxdistError(f"{self.path}: no rows")
        if y.min() < 0:
            raise JaxdistError(f"{self.path}: label {y.min()} at row {y.argmin()} is negative")
        self.x = x.astype(np.float32)  # converted once, not per batch
        self.y = y.astype(np.int32)
        self.num_classes = int(y.max()) + 1
        self.in_features = x.shape[1:]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, indices) -> dict[str, np.ndarray]:
        return {"x": self.x[indices], "y": self.y[indices]}


def _load(path: Path, inputs: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise JaxdistError(f"{path}: not an .npz file ({err})") from err
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise JaxdistError(f"{path}: not an .npz file (a single array: use np.savez)")
    with archive:
        missing = [key for key in (inputs, labels) if key not in archive.files]
        if missing:
            raise JaxdistError(
                f"{path}: no array named {', '.join(missing)}; it has "
                f"{', '.join(archive.files)} (name them with --npz-inputs, --npz-labels)"
            )
        try:
            return archive[inputs], archive[labels]
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            raise JaxdistError(f"{path}: cannot read {inputs}/{labels}: {err}") from err
