"""``python -m jaxdist.generate SOURCE``: end to end on a jaxdist run directory (a tiny GPT
trained a few steps on the built-in bytes, with dropout, which generation turns off) and
on a Hugging Face folder (a tiny Llama saved by transformers with a BPE tokenizer trained
here: the ``hf`` and ``text`` extras), each completion the library's for that prompt
alone; ``--mesh model=2`` (in this process's 8 devices, and in a process of its own with
``--cpu-devices 2``) gives one device's tokens; bad input exits 2 with one line.
"""

from __future__ import annotations

import json

import pytest

from helpers import run_module
from jaxdist.generate import generate
from jaxdist.generate.__main__ import main
from jaxdist.generate.rebuild import rebuild
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train

SEQ = 32
PROMPTS = ["the cat ", "a"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("generate") / "run"
    config = config_lib.parse_args([
        "--model", "gpt", "--data", "grammar", "--seq-len", str(SEQ), "--d-model", "32",
        "--n-layers", "2", "--n-heads", "4", "--global-batch-size", "8", "--steps", "6",
        "--log-every", "6", "--checkpoint-every", "6", "--num-devices", "2", "--dropout", "0.1",
        "--run-dir", str(run),
    ])  # fmt: skip
    train(config, quiet=True)
    return run


def generated(capsys, *args) -> tuple[list[dict], str]:
    assert main([*map(str, args), "--json"]) == 0
    out = capsys.readouterr()
    return [json.loads(line) for line in out.out.splitlines()], out.err


def flags(prompts):
    return [arg for p in prompts for arg in ("--prompt", p)]


def test_a_run_directory_continues_each_prompt_as_alone(run_dir, capsys):
    rows, err = generated(capsys, run_dir, *flags(PROMPTS), "--max-new-tokens", 10)
    assert err.strip() == (
        f"jaxdist generate: gpt (2 layers, d_model 32) from {run_dir}, step 6, on 1 cpu device"
    )
    model = rebuild(run_dir).model
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row["prompt"] == prompt and row["prompt_ids"] == list(prompt.encode())
        assert row["ids"] == generate(model, list(prompt.encode()), 10).ids[0]
        assert row["text"] == bytes(row["ids"]).decode("utf-8", errors="replace")
        assert row["stopped"] == "length" and len(row["ids"]) == 10
    assert main([str(run_dir), *flags(PROMPTS), "--max-new-tokens", "10"]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = [(f"==> prompt {i + 1} <==", row["prompt"] + row["text"]) for i, row in enumerate(rows)]
    assert printed == [line for pair in shown for line in pair]


def test_a_run_trained_with_document_masks_is_told_generation_has_none(tmp_path, capsys):
    """Nothing silent: generation reads each prompt as one sequence, which a model trained
    with --document-mask never met across an EOS; the command says so before it runs (and
    says nothing of it for a run without: the first test's one line)."""
    run = tmp_path / "run"
    config = config_lib.parse_args([
        "--model", "gpt", "--data", "grammar", "--seq-len", str(SEQ), "--d-model", "32",
        "--n-layers", "1", "--n-heads", "4", "--global-batch-size", "8", "--steps", "1",
        "--checkpoint-every", "1", "--num-devices", "1", "--document-mask", "--run-dir", str(run),
    ])  # fmt: skip
    train(config, quiet=True)
    capsys.readouterr()  # what training printed
    _, err = generated(capsys, run, "--prompt", "a", "--max-new-tokens", 2)
    said = [line for line in err.splitlines() if "--document-mask" in line]
    assert said and "generation does not mask documents" in said[0], err


def test_mesh_model_2_gives_one_devices_tokens(run_dir, capsys):
    one, _ = generated(capsys, run_dir, *flags(PROMPTS), "--max-new-tokens", 8)
    split, err = generated(capsys, run_dir, *flags(PROMPTS), "--max-new-tokens", 8,
                           "--mesh", "model=2")  # fmt: skip
    assert "on 8 cpu device(s), mesh data=4,model=2" in err  # the suite's 8 devices
    assert [r["ids"] for r in split] == [r["ids"] for r in one]


def test_mesh_model_2_on_cpu_devices_of_its_own_gives_one_devices_tokens(run_dir, capsys):
    one, _ = generated(capsys, run_dir, *flags(PROMPTS), "--max-new-tokens", 8)
    proc = run_module("jaxdist.generate", str(run_dir), *flags(PROMPTS), "--max-new-tokens",
                      "8", "--cpu-devices", "2", "--mesh", "model=2", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "on 2 cpu device(s), mesh model=2" in proc.stderr
    assert [json.loads(line)["ids"] for line in proc.stdout.splitlines()] == [r["ids"] for r in one]


def bpe_tokenizer(folder, vocab: int):
    """A byte-level BPE of ``vocab`` ids, ``<|end|>`` its end of document, saved in
    ``folder`` as a Hugging Face folder saves one."""
    why = "the text extra: pip install 'jaxdist[text]'"
    tokenizers = pytest.importorskip("tokenizers", reason=why)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(["the cat sat on the mat", "hello world"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return tok


def test_a_hugging_face_folder_with_its_tokenizer(tmp_path, capsys):
    from test_generate import VOCAB, hf_folder, hf_greedy

    theirs = hf_folder(tmp_path, "llama")
    code = main([str(tmp_path), "--prompt", "the cat"])  # no tokenizer.json yet: ids only
    assert code == 2 and "no tokenizer" in capsys.readouterr().err
    tok = bpe_tokenizer(tmp_path, VOCAB)
    eos = tok.token_to_id("<|end|>")
    texts = ["the cat sat", "hello"]
    rows, err = generated(capsys, tmp_path, *flags(texts), "--prompt-ids", "5,6,7",
                          "--max-new-tokens", 12)  # fmt: skip
    assert f"from {tmp_path} (llama), on 1 cpu device" in err
    for row, ids in zip(rows, [*(tok.encode(t).ids for t in texts), [5, 6, 7]], strict=True):
        assert row["prompt_ids"] == ids
        expected = hf_greedy(theirs, ids, 12)
        if eos in expected:  # transformers, told no EOS, goes on past it
            expected = expected[: expected.index(eos)]
        assert row["ids"] == expected
        assert row["text"] == tok.decode(row["ids"], skip_special_tokens=False)
    assert rows[2]["prompt"] == tok.decode([5, 6, 7], skip_special_tokens=False)


@pytest.mark.parametrize(
    "args, says",
    [
        (["{tmp}/nothing", "--prompt", "a"], "no such folder"),
        (["{tmp}", "--prompt", "a"], "neither a run directory"),
        (["{bert}", "--prompt-ids", "1"], "model_type 'bert'"),
        (["{run}"], "no prompt"),
        (["{run}", "--prompt", ""], "prompt 1 is empty"),
        (["{run}", "--prompt", "a", "--prompt-ids", " "], "prompt 2 is empty"),
        (["{run}", "--prompt", "x" * 40], "40 tokens leaves no room in the model's context of 32"),
        (["{run}", "--prompt", "x" * 30, "--max-new-tokens", "3"], "make 33, past the model's"),
        (["{run}", "--prompt-ids", "1,x"], "give ids such as 1,2,3"),
        (["{run}", "--prompt-ids", "1,300"], "id 300 is not in the model's vocabulary of 257"),
        (["{run}", "--prompt", "a", "--step", "3"], "no checkpoint of step 3"),
        (["{run}", "--prompt", "a", "--mesh", "stage=2"], "mesh stage=2: generation runs"),
        (["{run}", "--prompt", "a", "--mesh", "model=3"], "model=3"),
        (["{run}", "--prompt", "a", "--temperature", "-1"], "--temperature -1.0"),
        (["{run}", "--prompt", "a", "--tokenizer", "{tmp}/none.json"], "no such file"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_exits_2_with_one_line(run_dir, tmp_path, capsys, args, says):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    given = [a.format(tmp=tmp_path, run=run_dir, bert=bert) for a in args]
    assert main(given) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdist: error: "), out.err
    assert says in lines[0], lines[0]
    assert not out.out


def test_the_command_exits_2_in_a_process_of_its_own(tmp_path):
    proc = run_module("jaxdist.generate", str(tmp_path / "nothing"), "--prompt", "a")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jaxdist: error: {tmp_path / 'nothing'}: no such folder (give a run directory "
        "or a Hugging Face folder with a config.json)"
    ]
