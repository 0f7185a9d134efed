"""How jaxdist calls a user's loss function, and what it takes from the result.

``loss_fn(model, batch)``, ``loss_fn(model, batch, rngs)`` or ``loss_fn(model, batch, *,
rngs=...)`` returns a scalar ``loss`` or ``(loss, aux)``. Only a dict ``aux`` of scalars
becomes metrics (averaged over replicas every step); any other ``aux`` (flax's examples
return the logits) is ignored, never averaged.
"""

from __future__ import annotations

import functools
import inspect
import os
import sysconfig
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.errors import JaxdistError, ModelError
from jaxdist.parallel.bound_axes import unbound_name

# Metric names the step itself reports; health/* are read by DataParallel.check.
RESERVED = ("loss", "grad_norm", "lr")


def rngs_argument(loss_fn: Callable) -> str:
    """How to pass the step's ``nnx.Rngs``: "keyword" (a parameter named ``rngs``),
    "positional" (a third positional parameter without a default) or "none"."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # no signature to read: the documented two arguments
        return "none"
    rngs = params.get("rngs")
    if rngs is not None and rngs.kind in (rngs.POSITIONAL_OR_KEYWORD, rngs.KEYWORD_ONLY):
        return "keyword"
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) >= 3 and positional[2].default is inspect.Parameter.empty:
        return "positional"
    return "none"


def describe_batch(batch) -> str:
    """``image (4, 8, 8, 1) float32, label (4,) int32``: what a step's loss was given."""
    if not isinstance(batch, dict):
        return f"{type(batch).__name__} {jax.tree.map(jnp.shape, batch)}"
    return ", ".join(
        f"{k} {tuple(np.shape(v))} {getattr(v, 'dtype', type(v).__name__)}"
        for k, v in batch.items()
    )


def normalize_loss_fn(loss_fn: Callable) -> Callable:
    """``loss_fn`` as ``(model, batch, rngs) -> (loss, metrics)``: the loss checked to be
    a scalar, metrics the scalar entries of a dict ``aux``. An exception raised by the
    user's loss or model becomes one ModelError naming the function and the batch."""
    mode = rngs_argument(loss_fn)
    name = getattr(loss_fn, "__qualname__", None) or repr(loss_fn)

    def call(model, batch, rngs):
        try:
            if mode == "keyword":
                out = loss_fn(model, batch, rngs=rngs)
            elif mode == "positional":
                out = loss_fn(model, batch, rngs)
            else:
                out = loss_fn(model, batch)
        except JaxdistError:
            raise
        except NameError as err:
            if unbound_name(err) is not None:  # a model axis name: bound by jaxdist
                raise
            raise _user_error(name, batch, err) from err
        except Exception as err:
            raise _user_error(name, batch, err) from err
        loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        if jnp.shape(loss) != ():
            raise ModelError(
                f"loss function {name} must return a scalar loss (or (loss, aux)), "
                f"got an array of shape {jnp.shape(loss)}; take the mean over the batch"
            )
        return loss, scalar_metrics(aux, name)

    return call


def scalar_metrics(aux, name: str) -> dict:
    if not isinstance(aux, dict):
        return {}
    clashes = [k for k in aux if k in RESERVED or str(k).startswith("health/")]
    if clashes:
        raise ModelError(
            f"loss function {name} returns metrics named {', '.join(clashes)}, which jaxdist "
            f"reports itself ({', '.join(RESERVED)}); rename them"
        )
    return {k: v for k, v in aux.items() if jnp.ndim(v) == 0}


def _user_error(name: str, batch, err: Exception) -> ModelError:
    where = user_frame(err)
    at = f" (at {where})" if where else ""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ModelError(
        f"the loss function {name} (or the model it calls) raised {type(err).__name__}{at}: "
        f"{first}; it was given a batch of {describe_batch(batch)}"
    )


def user_frame(err: BaseException) -> str | None:
    """``my_model.py:42 in attention``: the innermost frame of ``err``'s traceback outside
    JAX, Flax, optax, numpy, jaxdist and Python's own library (the user's line), else None."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or any(path.startswith(r) for r in _library_roots()):
            continue
        shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
        return f"{shown}:{frame.lineno} in {frame.name}"
    return None


@functools.cache
def _library_roots() -> tuple[str, ...]:
    import flax
    import jaxlib
    import optax

    import jaxdist

    packages = (jax, jaxlib, flax, optax, np, jaxdist)
    roots = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in packages]
    roots.append(os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)
    return tuple(roots)
