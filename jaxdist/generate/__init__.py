"""Text generation with the built-in GPT and Llama family over a KV cache: prompts of
token ids in, each prompt's new tokens out, greedy or sampled (temperature, top-k,
top-p, a seed), on one device or a mesh laid out as training lays it.

``generate(model, prompt_ids, max_new_tokens=N)`` is the library call
(``generator``: prefill, one compiled decode step for every position, EOS);
``next_token`` chooses each token from its logits. The models' own decode path is
``jaxdist.models.kv_cache``. ``python -m jaxdist.generate SOURCE --prompt TEXT`` is the
command (``__main__``, with ``rebuild``: the model from a run directory's newest good
checkpoint or from a Hugging Face folder, and its tokenizer); the library never imports
it.
"""

from jaxdist.generate.generator import Generated, generate
from jaxdist.generate.next_token import Sampling, choose

__all__ = ["Generated", "Sampling", "choose", "generate"]
