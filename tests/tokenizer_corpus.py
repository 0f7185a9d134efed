"""The tokenizer tests' corpus and tokenizer (test_tokenizer.py, test_tokenizer_train.py,
test_tokenizer_bad_input.py): eight small documents, a byte-level BPE of 400 ids trained
on them here, the corpus prepared with it, and the token file numpy makes of
``encode``. Importing this module skips a test file without the text extra."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxdist.data.__main__ import main as data_main
from jaxdist.data.text import collect_files

tokenizers = pytest.importorskip("tokenizers", reason="the text extra: pip install 'jaxdist[text]'")

EOS = "<|endoftext|>"
VOCAB = 400
DOCS = {
    "notes/a.txt": "The quick brown fox jumps over the lazy dog. " * 30,
    "notes/b.md": "# Heading\n\nSome *markdown* text, with `code` and a list:\n- one\n- two\n" * 12,
    "c.py": "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n" * 20,
    "d.txt": "Unicode too: café, naïve, Straße, 東京, emoji 🙂, tabs\tand\r\nnewlines.\n" * 15,
    "e.txt": "Numbers 0123456789 and punctuation !?;:,.()[]{}<>@#$%^&*~ repeat. " * 25,
    "f.txt": "",  # an empty document: its end of document alone
    "g.txt": "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40,
    "h.txt": "To be, or not to be, that is the question. " * 30,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8", newline="")
    return root


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, corpus) -> Path:
    """A byte-level BPE of 400 ids trained on the corpus, alone in its folder (no config
    naming its end of document): ``<pad>`` is id 0, ``<|endoftext|>`` id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in collect_files([str(corpus)])], trainer)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(EOS) == 1
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus, bpe) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "out"
    args = ["prepare", str(corpus), "--out", str(out), "--tokenizer", str(bpe)]
    assert data_main([*args, "--eos-token", EOS, "--eval-fraction", "0.25"]) == 0
    return out


def reference(tokenizer_path: Path, folder: Path, names: list[str], eos: int) -> np.ndarray:
    """Each document's ``tokenizer.encode`` ids, then ``eos``: the token file, by numpy."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    parts = [np.array(tok.encode((folder / n).read_bytes().decode()).ids) for n in names]
    return np.concatenate([np.append(p, eos) for p in parts]).astype(np.int64)
