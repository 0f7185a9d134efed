"""Ids and labels from any source are checked against the model at setup: one byte
vocabulary, a user source's own ``vocab_size``, and a sampled check naming the source,
the example and the value; the per-step check that ``DataParallel`` runs on every row."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from jaxdist.data import text
from jaxdist.train import build_data, build_model
from jaxdist.train.config import ConfigError, from_dict

SOURCES = """
import numpy as np


class Tokens:
    def __init__(self, n, bad=None, vocab_size=None):
        self.tokens = np.arange(n * 9).reshape(n, 9) % 256
        self.tokens[:, -1] = 256  # end of document: a byte-level id
        if bad is not None:
            example, value = bad
            self.tokens[example, 4] = value
        if vocab_size:
            self.vocab_size = vocab_size

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, indices):
        return {"tokens": self.tokens[indices].astype(np.int32)}


class Labels:
    def __init__(self, n, bad_example):
        self.x = np.zeros((n, 3), np.float32)
        self.y = np.arange(n) % 5
        self.y[bad_example] = 7

    def __len__(self):
        return len(self.y)

    def __getitem__(self, indices):
        return {"x": self.x[indices], "y": self.y[indices]}


def plain(split):
    return Tokens(100)


def own_vocab(split):
    return Tokens(100, vocab_size=300)


def bad_first(split):
    return Tokens(100, bad=(0, 300))


def bad_eval_last(split):
    return Tokens(100, bad=(99, -1) if split == "eval" else None)


def bad_label(split):
    return Labels(100, bad_example=99)
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    (folder / "check_sources.py").write_text(textwrap.dedent(SOURCES))
    sys.path.insert(0, str(folder))
    yield "check_sources"
    sys.path.remove(str(folder))
    sys.modules.pop("check_sources", None)


def build(sources, factory, task="lm", **model):
    config = from_dict({"model": model, "data": {"path": f"{sources}:{factory}"}})
    return build_data.build(config, task, progress=False)


def test_one_byte_vocabulary_and_a_source_may_say_its_own(sources):
    assert build_model.BYTE_VOCAB is text.BYTE_VOCAB == 257  # bytes + end of document
    assert build(sources, "plain").vocab_size == 257  # id 256 (end of document) fits
    assert build(sources, "own_vocab").vocab_size == 300
    assert build(sources, "plain", vocab_size=512).vocab_size == 512


@pytest.mark.parametrize(
    "factory, model, words",
    [
        ("bad_first", {}, ["--data check_sources:bad_first", "example 0", "token id 300", "257"]),
        (
            "bad_eval_last",
            {},
            ["check_sources:bad_eval_last (held-out split)", "example 99", "token id -1"],
        ),
        ("plain", {"vocab_size": 200}, ["example 0", "token id 256", "vocabulary of 200"]),
    ],
)
def test_sampled_ids_outside_the_vocabulary_name_source_example_and_id(
    sources, factory, model, words
):
    with pytest.raises(ConfigError) as err:
        build(sources, factory, **model)
    assert all(word in str(err.value) for word in words), err.value


def test_labels_are_checked_against_the_classes(sources):
    with pytest.raises(ConfigError) as err:
        build(sources, "bad_label", task="classify", num_classes=5)
    for word in ["check_sources:bad_label", "example 99", "label 7", "5 classes"]:
        assert word in str(err.value), err.value
    assert build(sources, "bad_label", task="classify", num_classes=8).train is not None


def test_the_step_check_flags_every_row_out_of_range(sources):
    check = build(sources, "plain").row_check  # DataParallel's batch_check
    tokens = np.zeros((4, 9), np.int32)
    tokens[1, 8], tokens[3, 0] = 257, -1
    np.testing.assert_array_equal(check({"tokens": tokens}), [True, False, True, False])
    classify = build(sources, "bad_label", task="classify", num_classes=8).row_check
    np.testing.assert_array_equal(classify({"y": np.array([0, 7, 8])}), [True, True, False])
