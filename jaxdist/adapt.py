"""Any Flax model as an NNX module: NNX as it is, Linen through flax's own bridge."""

from __future__ import annotations

import jax
from flax import linen, nnx
from flax.nnx import bridge

from jaxdist.errors import ModelError

# Variable kinds jaxdist knows how to keep right across replicas.
KNOWN = "nnx.Param (trained), nnx.BatchStat (averaged over replicas), RNG state (reseeded)"


class LinenModel(bridge.ToNNX):
    """A Linen module behind NNX's interface. Calls let Linen update ``batch_stats``
    (as ``nnx.BatchNorm`` updates its ``BatchStat``), so one training step serves both."""

    def __call__(self, *args, **kwargs):
        if "mutable" not in kwargs and nnx.state(self, nnx.BatchStat):
            kwargs["mutable"] = ["batch_stats"]
        return super().__call__(*args, **kwargs)


def as_nnx(model, example_input=None, *, seed: int = 0) -> nnx.Module:
    """Returns ``model`` as an ``nnx.Module``.

    - an ``nnx.Module`` is returned unchanged;
    - a ``linen.Module`` is wrapped with ``flax.nnx.bridge`` and initialised by calling it
      on ``example_input`` (e.g. one row of a batch, (1, ...)); its ``params`` become
      ``nnx.Param``, ``batch_stats`` become ``nnx.BatchStat``, and ``dropout`` draws from an
      RNG stream that jaxdist reseeds every step.

    Example::

        model = jaxdist.as_nnx(flax_resnet, example_input=np.zeros((1, 32, 32, 3)))
    """
    if isinstance(model, nnx.Module):
        return model
    if isinstance(model, linen.Module):
        if example_input is None:
            raise ModelError(f"Linen module {type(model).__name__} needs an example_input")
        wrapped = LinenModel(model, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
        try:
            return wrapped.lazy_init(example_input)
        except Exception as err:  # the user's module: say what we tried, keep the cause
            raise ModelError(
                f"initialising Linen {type(model).__name__} as module(x) with x of shape "
                f"{jax.numpy.shape(example_input)} failed: {type(err).__name__}: {err}"
            ) from err
    raise ModelError(
        f"expected a flax.nnx.Module or a flax.linen.Module, got {type(model).__name__}"
    )


def split_model(model: nnx.Module):
    """(graphdef, params, batch_stats, rng_state); anything else is an error, since
    jaxdist could not keep it consistent across replicas."""
    graphdef, params, stats, rngs, other = nnx.split(
        model, nnx.Param, nnx.BatchStat, nnx.RngState, ...
    )
    leftovers = [
        f"{'.'.join(map(str, path))} ({type(var).__name__})"
        for path, var in nnx.to_flat_state(other)
    ]
    if leftovers:
        raise ModelError(
            "cannot find the batch statistics or other state of this model: variables "
            f"{', '.join(leftovers[:5])} are of no kind jaxdist keeps in sync; expected "
            f"{KNOWN}. Use nnx.BatchStat for running statistics (Linen: the 'batch_stats' "
            "collection)."
        )
    return graphdef, params, stats, rngs
