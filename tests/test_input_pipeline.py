"""The prefetcher after its producer has ended, and ``--last-batch wrap`` across epoch
ends: no example twice in a global batch, every example once per epoch."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdist
from helpers import next_within
from jaxdist.data import Prefetcher


def test_prefetcher_raises_the_producers_error_on_every_later_call():
    def broken():
        yield 1
        raise OSError("disk gone")

    fetch = Prefetcher(broken(), lambda b: b)
    assert next_within(fetch)[0][0] == 1
    for _ in range(3):
        _, error = next_within(fetch)
        assert isinstance(error, OSError) and "disk gone" in str(error)
    fetch.close()


def test_prefetcher_stays_exhausted():
    fetch = Prefetcher(iter([1, 2]), lambda b: b)
    assert [b for b, _ in fetch] == [1, 2]
    for _ in range(2):
        assert isinstance(next_within(fetch)[1], StopIteration)
    fetch.close()


@pytest.mark.parametrize("n, g", [(100, 32), (40, 32), (33, 32), (1000, 64), (97, 8)])
def test_wrap_never_repeats_an_example_within_a_global_batch(n, g):
    """Awkward sizes: 100 examples in batches of 32 cross an epoch end every 3.125 steps;
    40 and 33 are under two batches, where an epoch's end depends on its start."""

    def sampler():
        return jaxdist.DistributedSampler(
            n, g, seed=5, last_batch="wrap", process_index=0, process_count=1
        )

    steps = -(-12 * n // g)  # 12 epochs and a bit
    one = sampler()
    batches = [one.global_indices(k) for k in range(steps)]
    crossing = 0
    for k, batch in enumerate(batches):
        assert len(np.unique(batch)) == g, (k, np.sort(batch))
        crossing += (k * g) // n != ((k + 1) * g - 1) // n
    assert crossing >= 9  # the case in question did occur, often
    stream = np.concatenate(batches)
    for epoch in range(12):  # each epoch's n positions of the stream: every example once
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n)), epoch
    for k in (1, steps // 2, steps - 1):  # a restart at step k needs only k
        np.testing.assert_array_equal(sampler().global_indices(k), batches[k])
    shares = [
        jaxdist.DistributedSampler(
            n, g, seed=5, last_batch="wrap", process_index=p, process_count=4
        ).indices(steps - 1)
        for p in range(4)
    ]
    np.testing.assert_array_equal(np.concatenate(shares), batches[-1])  # any process count
