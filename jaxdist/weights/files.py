"""safetensors files: a reader over one file or a folder of shards, and a writer.

A folder is read through its index (``*.safetensors.index.json``, whose ``weight_map``
names each tensor's file, as Hugging Face writes it) or, without one, every
``*.safetensors`` in it. Tensors are read by region (``safe_open(...).get_slice``): only
the bytes of the rows asked for are read, so each process reads what its devices hold.

The writer puts tensors in one ``model.safetensors`` or, above ``max_shard_bytes``, in
``model-00001-of-0000N.safetensors`` files with ``model.safetensors.index.json``, the
metadata ``{"format": "pt"}`` that transformers' loader asks for included.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from jaxdist.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Reader:
    """The tensors of ``path``: ``shapes`` (name -> shape, dtype) and ``read(name, index)``."""

    def __init__(self, path: str | Path, what: str = "--init-from"):
        from safetensors import safe_open

        self.path = Path(path)
        self._handles, self._file_of = {}, {}
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        for file, names in self._files(what):
            try:
                handle = self._handles.get(file) or safe_open(str(file), framework="numpy")
            except Exception as err:  # not a safetensors file, truncated, unreadable
                raise ConfigError(
                    f"{what} {file}: not a readable safetensors file ({err})"
                ) from None
            self._handles[file] = handle
            held = set(handle.keys())
            for tensor in held if names is None else names:
                if tensor not in held:
                    raise ConfigError(
                        f"{what} {self.path}: the index puts {tensor} in {file}, which does "
                        "not hold it"
                    )
                part = handle.get_slice(tensor)
                self.shapes[tensor] = (tuple(part.get_shape()), str(part.get_dtype()))
                self._file_of[tensor] = file

    def _files(self, what: str) -> list[tuple[Path, list[str] | None]]:
        """Each file with the tensors to take from it (None: all it holds)."""
        if self.path.is_file():
            return [(self.path, None)]
        if not self.path.is_dir():
            raise ConfigError(f"{what} {self.path}: no such file or folder")
        indexes = sorted(self.path.glob("*.safetensors.index.json"))
        if indexes:
            try:
                weight_map = json.loads(indexes[0].read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise ConfigError(
                    f"{what} {indexes[0]}: not an index of safetensors ({err})"
                ) from None
            by_file: dict[Path, list[str]] = {}
            for name, file in weight_map.items():
                by_file.setdefault(self.path / file, []).append(name)
            return list(by_file.items())
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{what} {self.path}: no .safetensors file in this folder")
        return [(file, None) for file in files]

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """``tensor[index]`` (a tuple of slices), only that region read."""
        part = self._handles[self._file_of[name]].get_slice(name)
        return np.asarray(part[index] if index else part[:])


def write(
    tensors: dict[str, np.ndarray], out: Path, max_shard_bytes: int, extra: dict | None = None
) -> list[Path]:
    """Writes ``tensors`` (and ``extra``: file name -> text) into the new folder ``out``,
    made whole, then renamed into place: a failure leaves no partial folder. Returns
    the files written."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(array)
        size += array.nbytes
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        names = _write_shards(shards, partial, save_file)
        for name, text in (extra or {}).items():
            (partial / name).write_text(text)
            names.append(name)
        mask = os.umask(0)
        os.umask(mask)
        for name in names:  # safetensors writes its files owner-only; these are to share
            os.chmod(partial / name, 0o666 & ~mask)
        os.chmod(partial, 0o777 & ~mask)
        if out.exists():
            out.rmdir()  # checked empty by the caller
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [out / name for name in names]


def _write_shards(shards, folder: Path, save_file) -> list[str]:
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE), metadata=meta)
        return [SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(a.nbytes for shard in shards for a in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]
