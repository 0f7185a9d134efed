"""The teaching toy: 10..80 over 4 workers, doubled, combined."""

import jax

from helpers import load_experiment


def test_pmap_and_shard_map_double_every_part():
    toy = load_experiment("split_data")
    devices = jax.devices()[:4]
    expected = [2 * v for v in range(10, 81, 10)]
    assert toy.with_pmap(devices) == (expected, sum(expected))
    assert toy.with_shard_map(devices) == (expected, sum(expected))
