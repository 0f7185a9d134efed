"""The teaching toy: 10..80 over 4 workers, doubled, combined."""

import importlib.util
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]


def load_toy():
    spec = importlib.util.spec_from_file_location("split_data", ROOT / "experiments/split_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pmap_and_shard_map_double_every_part():
    toy = load_toy()
    devices = jax.devices()[:4]
    expected = [2 * v for v in range(10, 81, 10)]
    assert toy.with_pmap(devices) == (expected, sum(expected))
    assert toy.with_shard_map(devices) == (expected, sum(expected))
