"""Any Flax model as an NNX module: NNX as it is, Linen through flax's own bridge with its
training flag driven by NNX's train/eval mode."""

from __future__ import annotations

import inspect
import warnings

import jax
from flax import errors as flax_errors
from flax import linen, nnx
from flax.nnx import bridge

from jaxdist.errors import ModelError

# Variable kinds jaxdist knows how to keep right across replicas.
KNOWN = "nnx.Param (trained), nnx.BatchStat (averaged over replicas), RNG state (reseeded)"
# Not training state: sown intermediates and decoding caches are dropped, with a note.
DROPPED = (nnx.Intermediate, nnx.Cache)

# The usual names of a Linen ``__call__`` argument that switches training mode, and
# whether the argument is True while training (``train=True``) or while evaluating
# (``deterministic=True``).
TRAIN_ARGS = {
    "train": True,
    "training": True,
    "is_training": True,
    "deterministic": False,
    "use_running_average": False,
}


def set_training(model: nnx.Module, training: bool) -> None:
    """NNX's ``model.train()`` / ``model.eval()``, through the attributes they set (Dropout's
    ``deterministic``, BatchNorm's ``use_running_average``, and ``LinenModel``'s)."""
    model.set_attributes(
        deterministic=not training, use_running_average=not training, raise_if_not_found=False
    )


class LinenModel(nnx.Module):
    """A Linen module behind NNX's interface, in training or eval mode like NNX modules.

    flax's ``ToNNX`` bridge ignores ``.eval()``; here ``deterministic`` (set by NNX's
    ``train()``/``eval()``) becomes the module's own flag (``train=``, ``deterministic=``,
    ...), and only training calls may update ``batch_stats``, so inference never changes
    the running statistics."""

    def __init__(self, module: linen.Module, rngs: nnx.Rngs, train_arg: tuple[str, bool] | None):
        self.linen = bridge.ToNNX(module, rngs=rngs)
        self.train_arg = train_arg  # (name, value while training) or None
        self.deterministic = False  # NNX's eval() sets these two to True
        self.use_running_average = False

    def __call__(self, *args, **kwargs):
        training = not self.deterministic
        if self.train_arg is not None:
            name, value_in_training = self.train_arg
            kwargs.setdefault(name, value_in_training if training else not value_in_training)
        if training and "mutable" not in kwargs and nnx.state(self, nnx.BatchStat):
            kwargs["mutable"] = ["batch_stats"]
        # The bridge writes the new batch_stats back as new Variables: made, like those of
        # as_nnx, with eager sharding off, so they carry the same pytree metadata (else
        # grad-accum's scan, which carries them, sees two structures).
        with nnx.use_eager_sharding(False):
            return self.linen(*args, **kwargs)


def find_train_arg(module: linen.Module, name: str | None) -> tuple[str, bool] | None:
    """(argument name, its value while training), from ``name`` ("!name": True in eval) or
    from the usual names in the signature of ``module.__call__``; None if there is none."""
    if name:
        return (name[1:], False) if name.startswith("!") else (name, True)
    params = inspect.signature(type(module).__call__).parameters
    found = [arg for arg in TRAIN_ARGS if arg in params]
    if len(found) > 1:
        raise ModelError(
            f"Linen {type(module).__name__}.__call__ takes {' and '.join(found)}: say which "
            "switches training mode with linen_train_arg= (--linen-train-arg)"
        )
    return (found[0], TRAIN_ARGS[found[0]]) if found else None


def as_nnx(
    model, example_input=None, *, seed: int = 0, linen_train_arg: str | None = None
) -> nnx.Module:
    """Returns ``model`` as an ``nnx.Module``.

    - an ``nnx.Module`` is returned unchanged;
    - a ``linen.Module`` is wrapped with ``flax.nnx.bridge`` and initialised by calling it
      on ``example_input`` (e.g. one row of a batch, (1, ...)); its ``params`` become
      ``nnx.Param``, ``batch_stats`` become ``nnx.BatchStat``, and ``dropout`` draws from an
      RNG stream that jaxdist reseeds every step. Its training flag (``train``,
      ``training``, ``is_training``, ``deterministic`` or ``use_running_average`` in
      ``__call__``, or the one named by ``linen_train_arg``; "!name" for a flag that is True
      in eval) follows ``model.train()`` / ``model.eval()``.

    Example::

        model = jaxdist.as_nnx(flax_resnet, example_input=np.zeros((1, 32, 32, 3)))
    """
    if isinstance(model, nnx.Module):
        return model
    if isinstance(model, linen.Module):
        if example_input is None:
            raise ModelError(f"Linen module {type(model).__name__} needs an example_input")
        train_arg = find_train_arg(model, linen_train_arg)
        if train_arg is None:
            _check_needs_no_mode(model, example_input)
        wrapped = LinenModel(model, nnx.Rngs(params=seed, dropout=seed + 1), train_arg)
        try:  # logical names (nn.with_logical_partitioning) are no mesh's axes: a layout
            with nnx.use_eager_sharding(False):  # places them later, as for NNX models
                bridge.lazy_init(wrapped, example_input)
        except Exception as err:  # the user's module: say what we tried, keep the cause
            raise ModelError(
                f"initialising Linen {type(model).__name__} as module(x) with x of shape "
                f"{jax.numpy.shape(example_input)} failed: {type(err).__name__}: {err}"
            ) from err
        return wrapped
    raise ModelError(
        f"expected a flax.nnx.Module or a flax.linen.Module, got {type(model).__name__}"
    )


def _check_needs_no_mode(module: linen.Module, example_input) -> None:
    """A Linen model without a training flag must not need one: no batch statistics and
    no randomness at call time."""
    hint = (
        f"Linen {type(module).__name__}.__call__ has no train/training/deterministic/"
        "use_running_average argument, so jaxdist cannot switch it to eval mode; name its "
        "flag with linen_train_arg= (--linen-train-arg; '!name' for a flag True in eval)"
    )
    try:
        shapes = jax.eval_shape(
            lambda x: module.init({"params": jax.random.key(0)}, x), example_input
        )
    except Exception:  # noqa: BLE001 - the real initialisation reports it with context
        return
    if "batch_stats" in shapes:
        raise ModelError(f"{hint}: it has batch statistics (BatchNorm)")
    try:  # called without RNGs: dropout asks for one
        jax.eval_shape(module.apply, shapes, example_input)
    except flax_errors.InvalidRngError as err:
        raise ModelError(f"{hint}: it draws random numbers (dropout): {err}") from None


def model_copy(model: nnx.Module, training: bool, warn: bool = False) -> nnx.Module:
    """A structural copy of ``model`` (its arrays shared, never modified) in training or
    eval mode, without the variables that are not training state."""
    copy = nnx.merge(*nnx.split(model))
    dropped = nnx.pop(copy, DROPPED)
    paths = [".".join(map(str, path)) for path, _ in nnx.to_flat_state(dropped)]
    if paths and warn:
        warnings.warn(
            f"jaxdist: variables {', '.join(paths[:5])} (nnx.Intermediate / nnx.Cache) are "
            "not training state; they are left out of the training state",
            stacklevel=3,
        )
    set_training(copy, training)
    return copy


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
