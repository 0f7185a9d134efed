"""Float8 matmuls for a model's linear layers (``--fp8``): ``dot_general``, a drop-in for
``nnx.Linear(dot_general=...)``, and ``convert(model)``, which puts it in every
``nnx.Linear`` of a model whose sizes a float8 GEMM takes.

The recipe (what torchtitan's float8 calls "tensorwise" dynamic scaling):

- forward ``y = x @ w``: x and w each quantized to **e4m3** (3 mantissa bits, max 448),
- backward: the output's gradient g quantized to **e5m2** (2 mantissa bits, max 57344: the
  range gradients need), then ``dx = g @ w.T`` (e5m2 x e4m3) and ``dw = x.T @ g``
  (e4m3 x e5m2), reusing the forward's quantized x and w (saved in 1 byte an element),
- one **scale per tensor, from that tensor now** ("current scaling"): amax(|x|) maps to
  the format's largest value, the scale rounded up to a power of two,
- the matmul's inputs are float8 arrays, its output in the compute dtype multiplied by the
  two scales: on Hopper XLA runs it as a float8 GEMM (cuBLASLt or its Triton emitter;
  ``tests/test_fp8.py`` compiles it for an H100 without one). Elsewhere XLA widens the
  float8 inputs and the numbers are the same.

Master weights, the optimizer state and everything that is not an ``nnx.Linear`` (the
embedding and tied head, attention, norms, the loss) are as without ``--fp8``.

Why current scaling, not delayed scaling (an amax history from earlier steps): it holds no
state, so a checkpoint, a resume, a change of layout or of data-parallel width never has
float8 statistics to carry or to disagree on, and a step's scale never lags a spike in
its own tensor (delayed scaling overflows on exactly the steps whose values jump). Its
cost is one max-reduction over each input before its matmul, which XLA fuses into the
pass that writes the input (the norm or the activation before it). torchao made it its
default and later removed delayed scaling for this reason. Why powers of two: dividing
by the scale and multiplying the product by it are then exact in bf16, so the only
rounding is float8's own, and the scale costs at most one bit of headroom.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxdist.errors import ConfigError

FORWARD = jnp.float8_e4m3fn  # x and w
GRADIENT = jnp.float8_e5m2  # the output's gradient
ALIGN = 16  # a float8 GEMM's sizes (cuBLASLt on Hopper): multiples of 16


def scale_of(x: jax.Array, fmt) -> jax.Array:
    """() float32, a power of two: ``|x| / scale <= fmt``'s largest value, as near as a
    power of two lets it. 1 for an all-zero x; non-finite where x is (the step's NaN
    check then reports it)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    largest = float(jnp.finfo(fmt).max)
    # amax / largest = m 2^e, m in [0.5, 1): the smallest power of two >= it is 2^e, or
    # 2^(e-1) when m is 0.5. frexp and ldexp are exact where exp2(ceil(log2)) is not.
    m, e = jnp.frexp(amax / largest)
    scale = jnp.ldexp(jnp.float32(1), jnp.where(m == 0.5, e - 1, e))
    return jnp.where(amax > 0, scale, jnp.float32(1))


def quantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
    """``x / scale`` in ``fmt`` (rounded to nearest even; exact division: a power of two)."""
    largest = float(jnp.finfo(fmt).max)
    return jnp.clip(x / scale.astype(x.dtype), -largest, largest).astype(fmt)


def _scaled_dot(a, b, dims, scale, out_dtype, precision=None, out_sharding=None):
    """``dot(a, b) * scale`` of float8 a, b: the product in ``out_dtype``."""
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype, **kw)
    return out * scale.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_matmul(x, w, n_contract: int, dtypes: tuple, out_dtype, out_sharding):
    return _forward(x, w, n_contract, dtypes, out_dtype, out_sharding)[0]


def _forward(x, w, n_contract, dtypes, out_dtype, out_sharding):
    sx, sw = scale_of(x, FORWARD), scale_of(w, FORWARD)
    xq, wq = quantize(x, sx, FORWARD), quantize(w, sw, FORWARD)
    x_axes = tuple(range(x.ndim - n_contract, x.ndim))  # x (..., K...) . w (K..., N...)
    dims = ((x_axes, tuple(range(n_contract))), ((), ()))
    y = _scaled_dot(xq, wq, dims, sx * sw, out_dtype, out_sharding=out_sharding)
    return y, (xq, sx, wq, sw)


def _backward(n_contract, dtypes, out_dtype, out_sharding, saved, g):
    xq, sx, wq, sw = saved
    x_dtype, w_dtype = dtypes
    sg = scale_of(g, GRADIENT)
    gq = quantize(g, sg, GRADIENT)
    n_lead = xq.ndim - n_contract  # x's rows (batch, positions, ...)
    n_out = wq.ndim - n_contract  # w's output axes
    # dx (..., K...) = g (..., N...) . w (K..., N...) over N; dw (K..., N...) = x . g over
    # the rows. HIGHEST: full-precision accumulation in the GEMM (no "fast accumulation").
    out_axes_g = tuple(range(n_lead, n_lead + n_out))
    out_axes_w = tuple(range(n_contract, wq.ndim))
    highest = lax.Precision.HIGHEST
    dx = _scaled_dot(gq, wq, ((out_axes_g, out_axes_w), ((), ())), sg * sw, x_dtype, highest)
    rows = tuple(range(n_lead))
    dw = _scaled_dot(xq, gq, ((rows, rows), ((), ())), sx * sg, w_dtype, highest)
    return dx, dw


_fp8_matmul.defvjp(_forward, _backward)


def dot_general(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
):
    """``lax.dot_general`` in float8 (see the module) for the form ``nnx.Linear`` and
    ``nnx.LinearGeneral`` over trailing axes use: lhs's last n axes against rhs's first
    n, no batch axes. ``precision`` is the recipe's own and is not read."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    n = len(lhs_c)
    trailing = tuple(lhs_c) == tuple(range(lhs.ndim - n, lhs.ndim))
    if lhs_b or rhs_b or not trailing or tuple(rhs_c) != tuple(range(n)):
        raise ValueError(
            f"jaxdist fp8 dot_general: contracting axes {tuple(lhs_c)} of a {lhs.ndim}-D "
            f"input with {tuple(rhs_c)} of the kernel, batch axes {tuple(lhs_b)}: only a "
            "linear layer's form (the input's last axes with the kernel's first) is float8"
        )
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
    return _fp8_matmul(lhs, rhs, n, dtypes, jnp.dtype(out_dtype), out_sharding)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What ``convert`` did: the float8 layers' paths, and the others' with why."""

    converted: tuple[str, ...]
    left: tuple[tuple[str, str], ...]  # (path, why)

    def describe(self) -> str:
        """One start-up line."""
        total = len(self.converted) + len(self.left)
        line = (
            f"jaxdist: --fp8: {len(self.converted)} of {total} linear layers in float8 "
            "(e4m3 forward, e5m2 gradients, per-tensor current scaling); embeddings, "
            "attention and any other matmul stay in the compute dtype"
        )
        if self.left:
            shown = "; ".join(f"{path} ({why})" for path, why in self.left[:4])
            more = f"; and {len(self.left) - 4} more" if len(self.left) > 4 else ""
            line += f"; not converted: {shown}{more}"
        return line


def convert(model: nnx.Module) -> Conversion:
    """Every ``nnx.Linear`` of ``model`` whose input and output sizes are multiples of 16
    computes in float8 from now on (its ``dot_general``; its parameters are unchanged).
    ``ConfigError`` if none can: ``--fp8`` would change nothing."""
    converted, left = [], []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Linear):
            continue
        name = "/".join(map(str, path)) or "(the model)"
        sizes = (node.in_features, node.out_features)
        if any(s % ALIGN for s in sizes):
            left.append((name, f"{sizes[0]} -> {sizes[1]}: not multiples of {ALIGN}"))
            continue
        node.dot_general = dot_general
        converted.append(name)
    if not converted:
        why = f"; its linear layers: {'; '.join(f'{p} {w}' for p, w in left)}" if left else ""
        raise ConfigError(
            "--fp8: the model has no nnx.Linear layer a float8 GEMM can take (input and "
            f"output sizes multiples of {ALIGN}){why}. A model of its own matmuls can pass "
            "dot_general=jaxdist.fp8_dot_general to its layers instead"
        )
    return Conversion(tuple(converted), tuple(left))
