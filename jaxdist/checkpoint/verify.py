"""What a checkpoint is checked against when it is read: a fingerprint of every array
(orbax checks no checksum of array contents: a flipped byte inside a chunk file restores
silently as a wrong value, shared/jax-notes fact 4), and the names, shapes and dtypes
the model expects; and what to say when an array cannot be read at all.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.errors import ConfigError


def fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 summary of ``x``'s bits: sum over elements of bits x an odd weight of the
    element's global position, mod 2^32. One flipped bit changes it (2^k times an odd
    number is never 0 mod 2^32 for k < 32); it needs no reshape, so a sharded array is
    summed where it lives and the result does not depend on the layout."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        x = jax.device_put(x, jax.memory.Space.Device)  # offloaded state: read it on the device
    if x.dtype.itemsize == 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 1:
        bits = x.astype(jnp.uint8).astype(jnp.uint32)
    else:  # 8-byte values: both halves
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    position = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):  # row-major position, mod 2^32
        stride = int(np.prod(bits.shape[dim + 1 :], dtype=np.uint64) % 2**32)
        position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * stride
    weight = position * jnp.uint32(0x9E3779B1) | jnp.uint32(1)
    return jnp.sum(bits * weight, dtype=jnp.uint32)


@jax.jit
def _fingerprints(arrays: dict) -> dict:
    return {name: fingerprint(x) for name, x in arrays.items()}


def fingerprints(arrays: dict[str, jax.Array]) -> dict[str, int]:
    """``fingerprint`` of every array, as Python ints (the same on every process)."""
    values = _fingerprints(arrays)
    return {name: int(np.asarray(v.addressable_data(0))) for name, v in values.items()}


def describe(arrays: dict) -> dict[str, list]:
    """name -> [shape, dtype]: what a checkpoint must match to be restored."""
    return {name: [list(x.shape), str(x.dtype)] for name, x in arrays.items()}


def unreadable(step: int, directory: Path, err: Exception, tree: dict) -> str:
    """What could not be read: orbax names the array's storage path in its error
    (``'path': 'params/fc/kernel/'``) among a page of TensorStore details."""
    text = str(err)
    name = next((n for n in tree if f"'{n}/'" in text), None)
    reason = text.split(" See full TensorStore details")[0].splitlines()[0]
    if name is None:
        return f"checkpoint {step} in {directory} cannot be read: {reason}"
    shape, dtype = tree[name]
    return (
        f"checkpoint {step} in {directory} cannot be read: {name} (saved as {tuple(shape)} "
        f"{dtype}) does not decode from its stored bytes: {reason}"
    )


def check_compatible(meta: dict, target: dict, step: int, directory: Path) -> None:
    """ConfigError naming the first array whose name, shape or dtype differs."""
    saved, wanted = meta["tree"], describe(target)
    for name in list(wanted) + [n for n in saved if n not in wanted]:
        if saved.get(name) != wanted.get(name):

            def show(entry):
                return "absent" if entry is None else f"{tuple(entry[0])} {entry[1]}"

            raise ConfigError(
                f"checkpoint {step} in {directory} holds a different model: {name} is "
                f"{show(saved.get(name))} there and {show(wanted.get(name))} in this one "
                "(start afresh with --overwrite, or in another --run-dir)"
            )
