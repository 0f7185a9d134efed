"""``python -m jaxdist.data prepare --tokenizer``: a Hugging Face tokenizer's ids in a
token file, its end of document between files, its fingerprint and vocabulary in the
sidecar; a GPT trained on them; a model vocabulary smaller than the tokenizer's refused;
bad input as one line that writes nothing; ``jaxdist.data.tokenizer`` turning ids back
into text. The tokenizers are trained here (a byte-level BPE of 400 ids) or built (a
word-level one of 70,002, for uint32)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import metrics_of, run_cli
from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.data.__main__ import main as data_main
from jaxdist.data.text import collect_files
from jaxdist.data.tokens import read_sidecar
from jaxdist.errors import JaxdistError
from jaxdist.train.trainer import main as train_main
from test_bad_input import error_line

tokenizers = pytest.importorskip("tokenizers", reason="the text extra: pip install 'jaxdist[text]'")

EOS = "<|endoftext|>"
VOCAB = 400
GPT = ["--model", "gpt", "--steps", "3", "--log-every", "1", "--seq-len", "16"]
GPT += ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--global-batch-size", "8"]

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


def test_prepare_writes_the_tokenizers_ids_with_its_eos_between_files(prepared, corpus, bpe):
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


def test_one_file_is_split_at_its_tail_in_tokens(tmp_path, corpus, bpe):
    out = tmp_path / "out"
    args = ["prepare", str(corpus / "g.txt"), "--out", str(out), "--tokenizer", str(bpe)]
    assert data_main([*args, "--eos-token", EOS, "--eval-fraction", "0.1"]) == 0
    train, held_out = (np.fromfile(out / f"{s}.bin", np.uint16) for s in ("train", "eval"))
    whole = reference(bpe, corpus, ["g.txt"], eos=1)
    assert train[-1] == held_out[-1] == 1  # each ends its document
    np.testing.assert_array_equal(np.concatenate([train[:-1], held_out]), whole)
    assert len(held_out) - 1 == len(whole) - 1 - round((len(whole) - 1) * 0.9)


def test_a_model_folder_names_its_eos_in_its_configs(tmp_path, corpus, bpe):
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


def test_a_vocabulary_over_65536_ids_is_written_as_uint32(tmp_path, corpus):
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


def test_a_gpt_trains_on_the_tokens_and_a_smaller_vocabulary_is_refused(prepared, tmp_path, capsys):
    data = ["--data", str(prepared / "train.bin"), "--eval-data", str(prepared / "eval.bin")]
    run = tmp_path / "run"
    args = [*GPT, *data, "--eval-every", "3", "--run-dir", str(run)]
    proc = run_cli(*args, "--save-params", str(tmp_path / "params.npz"))
    assert proc.returncode == 0, proc.stderr
    last = metrics_of(run)[-1]
    assert last["step"] == 3 and np.isfinite(last["loss"]) and last["eval_count"] > 0
    assert "eval_bpb" not in last  # a tokenizer's ids are not bytes
    shapes = [v.shape for v in np.load(tmp_path / "params.npz").values()]
    assert (512, 16) in shapes  # the tokenizer's 400 ids, padded to 128s
    # --vocab-size below the tokenizer's: refused before anything compiles
    small = tmp_path / "small"
    code = train_main([*GPT, *data, "--vocab-size", "300", "--run-dir", str(small)])
    message = error_line(code, capsys.readouterr().err, ["train.bin", "400", "300"])
    assert "--vocab-size" in message and "tokenizer" in message
    assert not small.exists()
    # and by --dry-run, which reads no data
    code = train_main([*GPT, *data, "--vocab-size", "300", "--dry-run"])
    error_line(code, capsys.readouterr().err, ["train.bin", "400", "300"])


def test_a_held_out_file_of_another_tokenizer_is_refused(prepared, tmp_path, capsys, corpus, bpe):
    other = tmp_path / "other" / "tokenizer.json"  # the same vocabulary, another file
    other.parent.mkdir()
    other.write_text(bpe.read_text().replace('"<pad>"', '"<PAD>"'))
    out = tmp_path / "out"
    args = ["prepare", str(corpus), "--out", str(out), "--tokenizer", str(other)]
    assert data_main([*args, "--eos-token", EOS, "--eval-fraction", "0"]) == 0
    capsys.readouterr()
    data = ["--data", str(prepared / "train.bin"), "--eval-data", str(out / "train.bin")]
    code = train_main([*GPT, *data, "--eval-every", "3", "--run-dir", str(tmp_path / "run")])
    fingerprints = [
        read_sidecar(p / "train.bin")["tokenizer"]["fingerprint"] for p in (out, prepared)
    ]
    expected = ["another tokenizer", str(other.resolve()), *fingerprints]
    error_line(code, capsys.readouterr().err, expected)
    assert not (tmp_path / "run").exists()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, corpus, bpe, capsys):
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "vocab.json").write_text("{}")
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"model": 1}')
    (tmp_path / "badconfig").mkdir()
    (tmp_path / "badconfig" / "tokenizer.json").write_bytes(bpe.read_bytes())
    (tmp_path / "badconfig" / "tokenizer_config.json").write_text("eos?")
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_text("fine")
    (tmp_path / "latin1" / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    d = str(tmp_path)
    cases = [
        ([str(corpus), "--tokenizer", f"{d}/missing.json"], ["missing.json", "no such file"]),
        ([str(corpus), "--tokenizer", f"{d}/empty_folder"], ["a folder without tokenizer.json"]),
        ([str(corpus), "--tokenizer", f"{d}/slow"], ["without tokenizer.json", "vocab.json"]),
        ([str(corpus), "--tokenizer", f"{d}/garbage.json"], ["garbage.json", "not JSON"]),
        ([str(corpus), "--tokenizer", f"{d}/other.json"], ["other.json", "tokenizers package"]),
        (
            [str(corpus), "--tokenizer", f"{d}/badconfig"],
            ["tokenizer_config.json", "not readable JSON"],
        ),
        (
            [str(corpus), "--tokenizer", str(bpe)],
            ["no end-of-document token", "tokenizer_config.json", "config.json", EOS],
        ),
        (
            [str(corpus), "--tokenizer", str(bpe), "--eos-token", "<nope>"],
            ["--eos-token '<nope>' is not a token", EOS],
        ),
        ([str(corpus), "--eos-token", EOS], ["--eos-token", "is for --tokenizer"]),
        (
            [f"{d}/latin1", "--tokenizer", str(bpe), "--eos-token", EOS],
            ["b.txt", "not UTF-8", "0xe9", "offset 3"],
        ),
    ]
    for i, (args, expected) in enumerate(cases):
        out = tmp_path / f"out{i}"
        code = data_main(["prepare", *args, "--out", str(out)])
        captured = capsys.readouterr()
        error_line(code, captured.err, expected)
        assert not out.exists(), (args, list(out.iterdir()))


def test_a_missing_tokenizers_package_names_the_extra(tmp_path, corpus, bpe, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    out = tmp_path / "out"
    code = data_main(["prepare", str(corpus), "--out", str(out), "--tokenizer", str(bpe)])
    error_line(code, capsys.readouterr().err, ["tokenizers package", "pip install 'jaxdist[text]'"])
    assert not out.exists()


def test_byte_level_prepare_does_not_import_tokenizers(tmp_path, corpus):
    script = (
        "import sys; from jaxdist.data.__main__ import main; "
        f"code = main(['prepare', {str(corpus)!r}, '--out', {str(tmp_path / 'out')!r}]); "
        "assert code == 0; assert 'tokenizers' not in sys.modules, 'imported'; print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr
    assert read_sidecar(tmp_path / "out" / "train.bin")["vocab_size"] == 257


def test_decode_turns_ids_back_into_the_text(prepared, bpe, tmp_path):
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
