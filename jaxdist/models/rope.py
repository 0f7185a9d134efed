"""Rotary position embeddings (RoPE), in Hugging Face's rotate-half convention.

Each head's vector of ``Dh`` features is read as two halves, ``x = [x1 | x2]`` (Dh/2
each), and pair i (``x1[i]``, ``x2[i]``) is rotated by the angle ``position * f[i]``:
``x * cos + [-x2 | x1] * sin``, with ``cos`` and ``sin`` of the angles repeated over both
halves. That is what transformers' Llama-family models compute (``rotate_half``), so
their q_proj and k_proj weights read in without a permutation of their rows (Meta's
original checkpoints interleave the pairs instead; transformers' conversion script
permutes them into halves).

The frequencies ``f[i] = theta ** (-2i / Dh)``, scaled by ``rope_type``:

- ``default``: as they are;
- ``linear``: all divided by ``factor`` (positions interpolated);
- ``llama3``: Llama 3.1's: wavelengths above ``original_max_positions / low_freq_factor``
  divided by ``factor``, those below ``original_max_positions / high_freq_factor`` kept,
  the band between blended linearly in ``original_max_positions / wavelength``.

Others (``yarn``, ``dynamic``, ``longrope``, ...) are refused by name. The frequencies
are numpy constants computed when the model is traced; the angles come from the
positions each call is given, so a caller that knows where its tokens sit (a KV cache's
offset) passes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """The rotation of one head size; frozen and hashable: a static part of the model."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 8192  # llama3: the context the model was trained at

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_type {self.rope_type!r}: jaxdist's RoPE computes {', '.join(ROPE_TYPES)} "
                "only"
            )
        if self.head_dim % 2:
            raise ConfigError(f"RoPE rotates pairs: head_dim {self.head_dim} must be even")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"llama3 RoPE: high_freq_factor {self.high_freq_factor} must exceed "
                f"low_freq_factor {self.low_freq_factor}"
            )

    def frequencies(self) -> np.ndarray:
        """(Dh/2,) float32 radians per position, scaled as ``rope_type`` says."""
        exponent = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        freq = (1.0 / np.float32(self.theta) ** exponent).astype(np.float64)
        if self.rope_type == "linear":
            freq = freq / self.factor
        elif self.rope_type == "llama3":
            freq = self._llama3(freq)
        return freq.astype(np.float32)

    def _llama3(self, freq: np.ndarray) -> np.ndarray:
        wavelength = 2 * math.pi / freq
        context = self.original_max_positions
        low, high = self.low_freq_factor, self.high_freq_factor
        long = wavelength > context / low  # low frequencies: interpolated by factor
        short = wavelength < context / high  # high frequencies: kept
        blend = (context / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short
        between = (1 - blend) * freq / self.factor + blend * freq
        return np.where(long, freq / self.factor, np.where(short, freq, between))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x`` (B, T, H, Dh) rotated for ``positions`` (B, T) or (1, T) int."""
        angles = positions.astype(jnp.float32)[..., None] * self.frequencies()  # (B, T, Dh/2)
        angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (B, T, 1, Dh)
        # cos and sin in float32, then in x's dtype for the products, as transformers does
        cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
        half = self.head_dim // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin
