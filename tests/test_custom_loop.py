"""The worked example trains: a custom loop on the public API only, and its three
TensorBoard lines write the steps it logs (read back with TensorBoard's own reader)."""

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import load_experiment

LOGGED = [0, 25, 50, 75, 99]  # every 25th step and the last


@pytest.mark.parametrize("strategy", ["gspmd", "pmap"])
def test_custom_loop_example_learns_and_shows_in_tensorboard(strategy, tmp_path, capsys):
    accuracy = load_experiment("custom_loop").main(strategy, steps=100, tb_dir=str(tmp_path))
    assert accuracy > 0.9  # held-out; chance is 0.25
    printed = re.findall(r"step +(\d+)  loss (\S+)", capsys.readouterr().out)
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("train/loss", "train/accuracy", "train/grad_norm"):  # no lr: no schedule
        assert [e.step for e in events.Scalars(tag)] == LOGGED, tag
    # the loss the example prints (3 decimals) is the one TensorBoard holds
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(int(s), pytest.approx(float(v), abs=5e-4 + 1e-6)) for s, v in printed]
