"""``python -m jaxdist.data prepare --tokenizer``: a Hugging Face tokenizer's ids in a
token file, its end of document between files, its fingerprint and vocabulary in the
sidecar, in the dtype that holds its vocabulary; ``jaxdist.data.tokenizer`` turning ids
back into text. The tokenizers are trained here (a byte-level BPE of 400 ids,
tokenizer_corpus.py) or built (a word-level one of 70,002, for uint32). Training on the
ids: test_tokenizer_train.py; bad input: test_tokenizer_bad_input.py."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.data.__main__ import main as data_main
from jaxdist.data.tokens import read_sidecar
from jaxdist.errors import JaxdistError
from tokenizer_corpus import DOCS, EOS, VOCAB, bpe, corpus, prepared, reference  # noqa: F401


def test_prepare_writes_the_tokenizers_ids_with_its_eos_between_files(prepared, corpus, bpe):  # noqa: F811
    files = {}
    for split in ("train", "eval"):
        meta = read_sidecar(prepared / f"{split}.bin")
        files[split] = meta["files"]
        ids = np.fromfile(prepared / f"{split}.bin", dtype=np.uint16)
        assert meta["dtype"] == "uint16" and meta["num_tokens"] == len(ids)
        np.testing.assert_array_equal(ids, reference(bpe, corpus, meta["files"], eos=1))
        assert meta["vocab_size"] == VOCAB and meta["documents"] == len(meta["files"])
        assert meta["max_token"] == ids.max() < VOCAB
        assert meta["tokenizer"] == {
            "path": str(bpe.resolve()),
            "fingerprint": "sha256:" + hashlib.sha256(bpe.read_bytes()).hexdigest(),
            "vocab_size": VOCAB,
            "eos_id": 1,
            "eos_token": EOS,
        }
    assert sorted(files["train"] + files["eval"]) == sorted(DOCS)  # each file once
    assert files["eval"] and files["train"]


def test_one_file_is_split_at_its_tail_in_tokens(tmp_path, corpus, bpe):  # noqa: F811
    out = tmp_path / "out"
    args = ["prepare", str(corpus / "g.txt"), "--out", str(out), "--tokenizer", str(bpe)]
    assert data_main([*args, "--eos-token", EOS, "--eval-fraction", "0.1"]) == 0
    train, held_out = (np.fromfile(out / f"{s}.bin", np.uint16) for s in ("train", "eval"))
    whole = reference(bpe, corpus, ["g.txt"], eos=1)
    assert train[-1] == held_out[-1] == 1  # each ends its document
    np.testing.assert_array_equal(np.concatenate([train[:-1], held_out]), whole)
    assert len(held_out) - 1 == len(whole) - 1 - round((len(whole) - 1) * 0.9)


def test_a_model_folder_names_its_eos_in_its_configs(tmp_path, corpus, bpe):  # noqa: F811
    """tokenizer_config.json's eos_token (as transformers saves it: an AddedToken), else
    config.json's eos_token_id; --eos-token over both."""
    configs = {
        "hf": {"tokenizer_config.json": {"eos_token": {"content": EOS, "special": True}}},
        "ids": {"config.json": {"eos_token_id": [1, 0]}},
        "pad": {"tokenizer_config.json": {"eos_token": "<pad>"}},
    }
    for name, files in configs.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes(bpe.read_bytes())
        for config, content in files.items():
            (folder / config).write_text(json.dumps(content))
    small = ["prepare", str(corpus / "notes"), "--eval-fraction", "0"]
    for name, eos, flag in [("hf", 1, []), ("ids", 1, []), ("pad", 0, []), ("pad", 1, [EOS])]:
        out = tmp_path / f"out-{name}-{len(flag)}"
        eos_flag = ["--eos-token", *flag] if flag else []
        assert (
            data_main([*small, "--out", str(out), "--tokenizer", str(tmp_path / name), *eos_flag])
            == 0
        )
        meta = read_sidecar(out / "train.bin")
        assert meta["tokenizer"]["eos_id"] == eos, name
        assert meta["tokenizer"]["path"] == str((tmp_path / name / "tokenizer.json").resolve())
        ids = np.fromfile(out / "train.bin", np.uint16)
        np.testing.assert_array_equal(ids, reference(bpe, corpus / "notes", meta["files"], eos))


def test_a_vocabulary_over_65536_ids_is_written_as_uint32(tmp_path, corpus):  # noqa: F811
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "words"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("w0 w65535 w65536 w69999 unknown w12")
    (tmp_path / "text" / "b.txt").write_text("w3 w70000")
    out = tmp_path / "out"
    args = ["prepare", str(tmp_path / "text"), "--out", str(out), "--tokenizer", str(folder)]
    assert data_main([*args, "--eval-fraction", "0"]) == 0
    meta = read_sidecar(out / "train.bin")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    ids = np.fromfile(out / "train.bin", np.uint32)
    want = [0, 65535, 65536, 69999, 70000, 12, 70001, 3, 70000, 70001]
    np.testing.assert_array_equal(ids, want)


def test_decode_turns_ids_back_into_the_text(prepared, bpe, tmp_path):  # noqa: F811
    tok = tokenizer_lib.load(bpe, EOS)
    assert (tok.vocab_size, tok.eos_id, tok.eos_token) == (VOCAB, 1, EOS)
    assert tok.fingerprint == "sha256:" + hashlib.sha256(bpe.read_bytes()).hexdigest()
    for text in [*DOCS.values(), "", "unseen words: zebra quixotic ÆØÅ 🐍\n", f"a{EOS}b"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(np.array(ids, np.uint16)) == text  # numpy ids too
    assert tok.encode(f"a{EOS}b")[1] == 1  # the special token is one id
    # the tokenizer a token file records, to decode its ids
    again = tokenizer_lib.for_token_file(prepared / "train.bin")
    ids = np.fromfile(prepared / "train.bin", np.uint16)
    first = read_sidecar(prepared / "train.bin")["files"][0]
    end = int(np.argmax(ids == again.eos_id))
    assert again.decode(ids[:end]) == DOCS[first]
    # a tokenizer.json changed since: refused, naming both fingerprints
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(bpe.read_bytes())
    meta = read_sidecar(prepared / "train.bin")
    sidecar = tmp_path / "t.bin.json"
    (tmp_path / "t.bin").write_bytes((prepared / "train.bin").read_bytes())
    sidecar.write_text(json.dumps(meta | {"tokenizer": meta["tokenizer"] | {"path": str(copy)}}))
    assert tokenizer_lib.for_token_file(tmp_path / "t.bin").fingerprint == tok.fingerprint
    copy.write_text(copy.read_text().replace('"<pad>"', '"<PAD>"'))
    with pytest.raises(JaxdistError, match="is not the tokenizer .* prepared with"):
        tokenizer_lib.for_token_file(tmp_path / "t.bin")
    copy.unlink()  # gone: the sidecar's path named
    with pytest.raises(JaxdistError, match=f"{copy}, is not there"):
        tokenizer_lib.for_token_file(tmp_path / "t.bin")
