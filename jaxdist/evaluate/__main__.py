"""``python -m jaxdist.evaluate ARGS``: lm-eval's command (``lm_eval ARGS``) with
``--model jaxdist`` registered (``jaxdist.evaluate.harness``). Exit 2 without lm-eval."""

import sys

try:
    from lm_eval.__main__ import cli_evaluate
except ImportError as err:
    print(f"jaxdist evaluate: error: {err}; pip install 'jaxdist[eval]'", file=sys.stderr)
    sys.exit(2)

import jaxdist.evaluate.harness  # noqa: E402, F401  registers --model jaxdist

cli_evaluate()
