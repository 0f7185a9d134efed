"""Models, which know nothing of devices or strategies: the MLP, the GPT, the Llama and
Gemma 2 (logical axis names on their parameters), ``MoE`` (a mixture-of-experts
feed-forward block, returning its auxiliary losses), ``Stack`` (identical blocks held
stacked and scanned, with remat and per-layer kinds), ``attention``
(``jax.nn.dot_product_attention``, split over a ``seq`` mesh axis when the ambient mesh
has one; the function, which shadows its module's name here), and ``as_nnx``: any Flax
model (NNX, or Linen through flax's bridge) as an NNX module, and ``fp8_dot_general``:
float8 matmuls for a linear layer (``jaxdist.models.fp8``); ``kv_cache``: the decode
path for generation (a fixed-size key/value cache per layer). The command line's
``--model`` registry is ``jaxdist.train.build_model``.
"""

from jaxdist.models.adapt import as_nnx
from jaxdist.models.attention import attention
from jaxdist.models.fp8 import dot_general as fp8_dot_general
from jaxdist.models.gemma import Gemma
from jaxdist.models.gpt import GPT
from jaxdist.models.llama import Llama
from jaxdist.models.mlp import MLP
from jaxdist.models.moe import MoE, MoESettings
from jaxdist.models.stack import Stack

__all__ = ["GPT", "MLP", "Gemma", "Llama", "MoE", "MoESettings", "Stack", "as_nnx",
           "attention", "fp8_dot_general"]  # fmt: skip
