"""The worked example trains: a custom loop on the public API only."""

import pytest

from helpers import load_experiment


@pytest.mark.parametrize("strategy", ["gspmd", "pmap"])
def test_custom_loop_example_learns(strategy):
    accuracy = load_experiment("custom_loop").main(strategy, steps=100)
    assert accuracy > 0.9  # held-out; chance is 0.25
