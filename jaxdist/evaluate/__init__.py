"""Evaluation of a run's language model in place, from its checkpoint, without exporting.

``scoring.load_run(RUN_DIR)`` builds the run's model (``--model gpt``, ``llama`` or a
factory of your own, from the config its checkpoint records), fills it with the
checkpoint's parameters and scores continuations: the log-likelihood of each, and
whether greedy decoding gives it. ``harness`` is EleutherAI's lm-evaluation-harness
model ``jaxdist`` built on it (the ``eval`` extra; imported only there), and ``python -m
jaxdist.evaluate`` lm-eval's command with that model registered (docs/evaluate.md).
"""

from jaxdist.evaluate.scoring import RunModel, load_run

__all__ = ["RunModel", "load_run"]
