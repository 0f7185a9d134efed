"""``--model jaxdist``: a run directory scored by EleutherAI's lm-evaluation-harness.

``lm_eval.simple_evaluate(model="jaxdist", model_args={"pretrained": RUN}, ...)`` once
this module is imported, or ``python -m jaxdist.evaluate --model jaxdist --model_args
pretrained=RUN[,step=N][,tokenizer=PATH][,max_length=T] ...`` (lm-eval's own command,
with this model registered). ``pretrained`` is the run directory, under lm-eval's name
for what to load: its results are filed under it (``OUTPUT/runs__NAME/``).
Log-likelihood tasks (multiple choice, perplexity) only: ``generate_until`` is refused,
the model having no KV cache yet. Requests are tokenized as lm-eval's ``hf`` model
tokenizes them (a context's trailing spaces move to the continuation; the
continuation's ids are those of context + continuation past the context's; an empty
context is the end-of-document id), so the two give the same numbers for the same
model. Needs the ``eval`` extra.
"""

from __future__ import annotations

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxdist.evaluate.scoring import load_run

__all__ = ["JaxdistLM"]


@register_model("jaxdist")
class JaxdistLM(LM):
    def __init__(self, pretrained: str, step=None, tokenizer=None, max_length=None,
                 batch_size=8, max_batch_size=None, device=None, **_ignored):  # fmt: skip
        super().__init__()
        self.run = load_run(pretrained, int(step) if step else None, tokenizer,
                            int(max_length) if max_length else None)  # fmt: skip
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        encode = self.run.tokenizer.encode
        if not context:
            return [self.run.tokenizer.eos_id], encode(continuation)
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = encode(context + continuation), encode(context)
        return head, whole[len(head) :]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*request.args) for request in requests]
        return self.run.loglikelihood(pairs, self.batch_size)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each text's log-likelihood, in disjoint windows of ``max_length`` tokens."""
        out = []
        for request in requests:
            windows = get_rolling_token_windows(
                token_list=self.run.tokenizer.encode(request.args[0]),
                prefix_token=self.run.tokenizer.eos_id,
                max_seq_len=self.run.max_length,
                context_len=1,
            )
            pairs = [make_disjoint_window(window) for window in windows]
            out.append(sum(ll for ll, _ in self.run.loglikelihood(pairs, self.batch_size)))
        return out

    def generate_until(self, requests) -> list[str]:
        raise NotImplementedError(
            "--model jaxdist scores log-likelihoods only (no KV cache yet): export the run "
            "(python -m jaxdist.export) and generate with --model hf"
        )
