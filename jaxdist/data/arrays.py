"""A classification set from a ``.npz`` of arrays, held in memory, batches keyed by the
arrays' own names."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from jaxdist.errors import JaxdistError


class NpzArrays:
    """Row i is ``{name: array[i]}`` for every numeric array of the file with as many rows
    as ``inputs`` (others, e.g. a list of class names, are left out). ``inputs`` and
    ``labels`` name the arrays the default loss and evaluation read: inputs become
    float32, labels must be 1-D non-negative integers (int32); other floating arrays
    become float32 and integer ones int32, as JAX would make them."""

    def __init__(self, path, *, inputs: str = "x", labels: str = "y"):
        self.path = Path(path)
        if not self.path.is_file():
            raise JaxdistError(f"{self.path}: no such file")
        self.inputs, self.labels = inputs, labels
        arrays = _load(self.path, inputs, labels)
        x, y = arrays[inputs], arrays[labels]
        if x.ndim < 1 or not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
            raise JaxdistError(
                f"{self.path}: inputs {inputs} must be numbers, got {x.dtype}{x.shape}"
            )
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise JaxdistError(
                f"{self.path}: labels {labels} must be 1-D integers, got {y.dtype}{y.shape}"
            )
        if len(x) != len(y):
            raise JaxdistError(
                f"{self.path}: {inputs} has {len(x)} rows but {labels} has {len(y)}: "
                "they must match"
            )
        if len(y) == 0:
            raise JaxdistError(f"{self.path}: no rows")
        if y.min() < 0:
            raise JaxdistError(f"{self.path}: label {y.min()} at row {y.argmin()} is negative")
        # converted once, not per batch
        self.arrays = {k: _device_dtype(v) for k, v in arrays.items() if _is_row_array(v, len(y))}
        self.arrays[inputs] = x.astype(np.float32)
        self.arrays[labels] = y.astype(np.int32)
        self.num_classes = int(y.max()) + 1
        self.in_features = x.shape[1:]

    def __len__(self) -> int:
        return len(self.arrays[self.labels])

    def __getitem__(self, indices) -> dict[str, np.ndarray]:
        return {name: array[indices] for name, array in self.arrays.items()}


def _is_row_array(array: np.ndarray, rows: int) -> bool:
    numeric = np.issubdtype(array.dtype, np.number) or array.dtype == bool
    return numeric and array.ndim >= 1 and len(array) == rows


def _device_dtype(array: np.ndarray) -> np.ndarray:
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.integer) and array.dtype.itemsize > 4:
        return array.astype(np.int32)
    return array


def _load(path: Path, inputs: str, labels: str) -> dict[str, np.ndarray]:
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
        out = {}
        for name in archive.files:
            try:
                out[name] = archive[name]
            except (OSError, ValueError, zipfile.BadZipFile) as err:
                if name in (inputs, labels):
                    raise JaxdistError(f"{path}: cannot read {name}: {err}") from err
                # e.g. an object array (pickles are refused): not batch data, left out
        return out
