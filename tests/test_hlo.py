"""The gradient all-reduce is really in the compiled program.

Counts the elements of every all-reduce result in the HLO text: the gradient reduction
must cover at least as many numbers as the model has parameters."""

from __future__ import annotations

import math
import re

import jax
import pytest

from helpers import small_config
from jaxdist.train.trainer import setup

SHAPE = re.compile(r"f32\[([\d,]*)\]")


def lowered_step(strategy: str, num_devices: int):
    run = setup(small_config(strategy=strategy, num_devices=num_devices))
    batch, _ = next(run.batches)  # already on the devices
    run.batches.close()
    run.health.close(finished=True)  # no loop follows: nothing for its watchdog to watch
    params = run.dp.unreplicate(run.state).params
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return run.dp.lower(run.state, batch), n_params


def all_reduced_elements(text: str, marker: str) -> int:
    total = 0
    for line in text.splitlines():
        if marker in line:
            result_type = line.split(marker)[0] if marker == " all-reduce(" else line
            for dims in SHAPE.findall(result_type):
                total += math.prod(int(d) for d in dims.split(",") if d)
    return total


@pytest.mark.parametrize("strategy", ["gspmd", "shard_map"])
def test_compiled_step_all_reduces_the_gradient(strategy):
    lowered, n_params = lowered_step(strategy, 8)
    hlo = lowered.compile().as_text()
    assert all_reduced_elements(hlo, " all-reduce(") >= n_params


def test_pmap_lowered_step_contains_pmean():
    lowered, n_params = lowered_step("pmap", 8)
    text = lowered.as_text()  # StableHLO: pmean = all_reduce(sum) then divide by 8
    assert "stablehlo.all_reduce" in text
    assert "[[0, 1, 2, 3, 4, 5, 6, 7]]" in text  # one group over all 8 devices
    assert all_reduced_elements(lowered.compile().as_text(), " all-reduce(") >= n_params


def test_single_device_has_no_all_reduce():
    """The check above can fail: one device needs no reduction, and XLA emits none."""
    lowered, _ = lowered_step("gspmd", 1)
    assert all_reduced_elements(lowered.compile().as_text(), " all-reduce(") == 0
