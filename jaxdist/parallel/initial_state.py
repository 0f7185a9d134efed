"""Where the model comes from, and the initial state made from it inside ``jax.jit``.

A model arrives built (an ``nnx.Module``: its arrays are the program's inputs, never
donated or changed), as a Linen description, or as a function that builds one (run inside
the program). Either way one compiled program makes the ``TrainState`` directly in the
strategy's layout: no device holds more than its share, nothing is all-gathered, and
pmap's N copies are made on their own devices, not first on device 0. The values are
the model's and the seed's alone, bit for bit the same under every mesh, strategy and
form (a ``Stack``'s layer i is made from the keys block i of the unstacked model draws).
"""

from __future__ import annotations

import jax
from flax import linen, nnx

from jaxdist.errors import ModelError
from jaxdist.models.adapt import as_nnx, model_copy, split_model
from jaxdist.models.stack import has_stack
from jaxdist.parallel import idle_axes
from jaxdist.parallel.layout import Layout, _map, path_name
from jaxdist.parallel.step import make_loss, new_state


class ModelSource:
    def __init__(self, model, tx, layout: Layout, example_input, *, seed, linen_train_arg):
        self._make, self._args = _maker(model, example_input, seed, linen_train_arg)
        with nnx.use_eager_sharding(False):  # annotated models: the layout decides placement
            abstract = nnx.eval_shape(self._make, *self._args)
        self.train_graphdef, *self._abstract_state = split_model(
            model_copy(abstract, training=True, warn=True)
        )
        self.eval_graphdef = split_model(model_copy(abstract, training=False))[0]
        params = self._abstract_state[0]
        self.has_stack = has_stack(abstract)  # a jaxdist Stack: pipelined under stage
        # Parameters stacked on a leading "layers" axis (a Stack, or Linen's nn.scan with
        # metadata_params={nn.PARTITION_NAME: "layers"}): what a stage axis can split.
        self.stacked = [path_name(p) for p, var in nnx.to_flat_state(params) if _stacked(var)]
        # Per parameter (the layout's tree): a Stack's stacked parameter, which fsdp can
        # gather one layer at a time.
        self.by_layer = _map(lambda _, var: self.has_stack and _stacked(var), params)
        # Names of the parameter leaves in jax.tree.leaves order ("blocks/0/attn/kernel").
        self.leaf_paths = [path_name(path) for path, _ in jax.tree.leaves_with_path(params)]

        def init(*args):
            with nnx.use_eager_sharding(False):
                made = self._make(*args)
            _, params, stats, rngs = split_model(model_copy(made, training=True))
            return layout.expand(new_state(params, stats, rngs, tx))

        # The state's layout (layout.state_shardings under gspmd): init makes each array
        # directly in its shards, so no device ever holds a whole copy of a sharded state.
        # One copy of the state, whatever the layout: what a checkpoint holds.
        self.one_copy_state = jax.eval_shape(
            lambda *parts: new_state(*parts, tx), *self._abstract_state
        )
        self.state_sharding = layout.shardings(self.one_copy_state)
        # what the layout asks for that does nothing for this model (one line each)
        params_sharding = getattr(self.state_sharding, "params", None)
        self.notices = (
            []
            if params_sharding is None
            else idle_axes.notices(layout.mesh, params_sharding, params, layout.shard_optimizer)
        )
        self.has_batch_stats = bool(jax.tree.leaves(self._abstract_state[1]))
        self._init = jax.jit(init, out_shardings=self.state_sharding)
        # The state as the step sees it (pmap: with its leading device axis), no arrays.
        self.abstract_state = jax.eval_shape(self._init, *self._args)

    def init_state(self):
        return self._init(*self._args)

    def lower_init(self) -> jax.stages.Lowered:
        return self._init.lower(*self._args)

    @property
    def abstract_params(self):
        """The parameters' Variables (shapes and metadata, no arrays)."""
        return self._abstract_state[0]

    def abstract_loss(self, loss_fn, explicit_view=None):
        """The training loss as a pure function, for tracing without data (on the
        explicit view ``explicit_view``, if given)."""
        return make_loss(self.train_graphdef, loss_fn, explicit_view=explicit_view)

    def abstract_args(self, rows):
        """Arguments of ``abstract_loss``: the state's shapes, ``rows``, a key."""
        return (*self._abstract_state, rows, jax.random.key(0))


def _maker(model, example_input, seed: int, linen_train_arg):
    """(make, args): ``make(*args)`` returns the model as an ``nnx.Module``."""
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        return (lambda state: nnx.merge(graphdef, state)), (state,)
    if isinstance(model, linen.Module) or callable(model):

        def make():
            built = model() if not isinstance(model, linen.Module) else model
            return as_nnx(built, example_input, seed=seed, linen_train_arg=linen_train_arg)

        return make, ()
    raise ModelError(
        f"expected a flax.nnx.Module, a flax.linen.Module or a function returning one, "
        f"got {type(model).__name__}"
    )


def _stacked(variable) -> bool:
    """Whether a parameter's first axis is a stack of layers (logical name "layers")."""
    return (variable.get_metadata().get("out_sharding") or (None,))[0] == "layers"
