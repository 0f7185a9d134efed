"""EleutherAI's lm-evaluation-harness on a jaxdist run: lm-eval's numbers are this model's.

A byte-level BPE of 512 ids is trained on the README (the ``tokenizers`` package) and
saved as a folder both ``python -m jaxdist.data prepare --tokenizer`` and transformers'
``AutoTokenizer`` read; the README's text is prepared into tokens with it; a small Llama
(2 layers, d_model 32) trains 5 steps on them under ``--mesh data=2,model=2`` and is
exported with ``python -m jaxdist.export --map llama``. lm-eval's Python API
(``lm_eval.simple_evaluate``, its ``hf`` model on the CPU) then evaluates the exported
folder, with ``tokenizer=`` the tokenizer folder, on the repository's two-example task
``experiments/lm_eval_tasks/`` (a YAML config and a local JSONL: nothing downloaded; the
test refuses every network connection while lm-eval runs) and writes its results and
samples as its CLI does.

Checked: the metrics (acc and acc_norm in [0, 1], 2 samples of 2 choices each, 4
log-likelihood requests), and, independently of lm-eval and of transformers, that the
log-likelihood lm-eval used for each choice is the one jaxdist's own trained model gives
(its forward pass, before export, on the tokens the ``tokenizers`` package makes of the
context and the continuation) within 1e-4, with the same greedy flags, and that lm-eval's
acc and acc_norm are what those log-likelihoods give. So the harness evaluated this model.

Then lm-eval's ``--model jaxdist`` (``jaxdist.evaluate.harness``) on the run directory in
place, no export, its tokenizer the one the run's data records: the same checks, its
rolling log-likelihood against the text's in one window, generation refused, and a
checkpoint that is not the model's refused naming both sides.

Needs the ``eval`` extra (lm-eval with its ``hf`` model: torch, transformers,
accelerate); skipped with the reason without it.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra: pip install 'jaxdist[eval]'")
pytest.importorskip("transformers", reason="the eval extra: pip install 'jaxdist[eval]'")
pytest.importorskip("accelerate", reason="the eval extra: pip install 'jaxdist[eval]'")

import jax  # noqa: E402

from jaxdist.data import tokenizer as tokenizer_lib  # noqa: E402
from jaxdist.data.__main__ import main as data_main  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.export import main as export_main  # noqa: E402
from jaxdist.train import config as config_lib  # noqa: E402
from jaxdist.train.trainer import train  # noqa: E402

# one worker for both tests: they share the trained, exported run (built once)
pytestmark = pytest.mark.xdist_group("lm_eval")
ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "experiments" / "lm_eval_tasks"
TASK = "jaxdist_two_choice"
EOS = "<|endoftext|>"


def save_tokenizer(folder: Path) -> None:
    """docs/evaluate.md's ``eval_tokenizer.py``, on the README alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(ROOT / "README.md")], trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config) + "\n")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the finished run, its run directory, the exported folder, the tokenizer folder)."""
    work = tmp_path_factory.mktemp("lm-eval")
    tokenizer = work / "bpe-512"
    save_tokenizer(tokenizer)
    data = work / "data"
    args = ["prepare", str(ROOT / "README.md"), "--tokenizer", str(tokenizer), "--out", str(data)]
    assert data_main(args) == 0
    run_dir, out = work / "run", work / "export"
    config = config_lib.parse_args([
        "--model", "llama", "--data", str(data / "train.bin"), "--d-model", "32",
        "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--global-batch-size", "8",
        "--lr", "1e-2", "--steps", "5", "--log-every", "5", "--num-devices", "4", "--mesh",
        "data=2,model=2", "--run-dir", str(run_dir),
    ])  # fmt: skip
    run = train(config, quiet=True)
    assert export_main([str(run_dir), "--out", str(out), "--map", "llama"]) == 0
    return run, run_dir, out, tokenizer


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt is recorded and refused."""
    tried = []

    def refuse(self, address, *args, **kwargs):
        tried.append(address)
        raise OSError(f"the test refuses network connections ({address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return tried


def evaluate(model: str, model_args: dict, out: Path, monkeypatch, batch_size=2):
    """lm-eval's ``model`` on the task as its CLI runs it: (the results it writes under
    ``out``, the folder they are in); its datasets cache in ``out`` too. From the
    repository's root, as the task's data_files are relative to it."""
    import datasets
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", out / "datasets-cache")
    tracker = EvaluationTracker(output_path=str(out / "results"))
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),  # ours alone
        device="cpu",
        batch_size=batch_size,
        log_samples=True,
        evaluation_tracker=tracker,
    )
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    tracker.save_results_samples(task_name=TASK, samples=samples[TASK])
    (written,) = (out / "results").rglob("results_*.json")
    return json.loads(written.read_text()), written.parent


def jaxdist_loglikelihood(model, tokenizer, context: str, continuation: str):
    """(log p(continuation | context), whether it is the greedy continuation) from the
    trained model's own forward pass, on the ``tokenizers`` package's ids."""
    ctx, cont = tokenizer.encode(context), tokenizer.encode(continuation)
    logits = np.asarray(model(jax.numpy.asarray([ctx + cont]))[0], np.float64)
    scored = logits[len(ctx) - 1 : len(ctx) + len(cont) - 1]  # the rows predicting cont
    total = float(log_softmax(scored)[np.arange(len(cont)), cont].sum())
    return total, bool((scored.argmax(-1) == np.asarray(cont)).all())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def check_against_jaxdist(results: dict, folder: Path, run, tokenizer_folder: Path) -> float:
    """The written metrics and samples: 2 questions of 2 choices, each choice's
    log-likelihood the trained model's own within 1e-4, acc and acc_norm what those
    give. Returns the largest difference."""
    metrics = results["results"][TASK]
    assert metrics["sample_len"] == 2 and results["n-samples"][TASK]["effective"] == 2
    assert 0 <= metrics["acc,none"] <= 1 and 0 <= metrics["acc_norm,none"] <= 1
    (samples_file,) = folder.glob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert [s["doc_id"] for s in samples] == [0, 1]

    model = run.dp.merge(run.state)
    tokenizer = tokenizer_lib.load(tokenizer_folder)
    right, right_norm, gaps = [], [], []
    for sample in samples:
        requests = list(sample["arguments"].values())
        assert len(requests) == len(sample["doc"]["choices"]) == 2
        assert [r["arg_1"] for r in requests] == [" " + c for c in sample["doc"]["choices"]]
        theirs = [(float(ll), greedy == "True") for ((ll, greedy),) in sample["resps"]]
        ours = [jaxdist_loglikelihood(model, tokenizer, r["arg_0"], r["arg_1"]) for r in requests]
        gaps += [abs(a[0] - b[0]) for a, b in zip(theirs, ours, strict=True)]
        assert max(gaps) < 1e-4, (theirs, ours)
        assert [t[1] for t in theirs] == [o[1] for o in ours]
        assert all(ll < 0 for ll, _ in ours)
        lls, gold = np.array([ll for ll, _ in ours]), sample["doc"]["gold"]
        right.append(int(np.argmax(lls)) == gold)
        lengths = np.array([len(c) for c in sample["doc"]["choices"]], float)  # characters
        right_norm.append(int(np.argmax(lls / lengths)) == gold)
        assert (sample["acc"], sample["acc_norm"]) == (float(right[-1]), float(right_norm[-1]))
    assert metrics["acc,none"] == pytest.approx(np.mean(right))
    assert metrics["acc_norm,none"] == pytest.approx(np.mean(right_norm))
    return max(gaps)


def test_lm_eval_scores_the_exported_model_with_jaxdists_log_likelihoods(
    exported, tmp_path, monkeypatch, no_network
):
    run, _, export, tokenizer = exported
    args = {"pretrained": str(export), "tokenizer": str(tokenizer), "dtype": "float32"}
    results, folder = evaluate("hf", args, tmp_path, monkeypatch)
    assert not no_network, f"lm-eval tried to connect: {no_network}"
    assert results["config"]["model"] == "hf"
    gap = check_against_jaxdist(results, folder, run, tokenizer)
    print(f"largest log-likelihood difference from jaxdist's model: {gap:.2g}")


def test_the_jaxdist_model_scores_the_run_directory_in_place(
    exported, tmp_path, monkeypatch, no_network
):
    """``--model jaxdist``: the checkpoint read in place (no export), the tokenizer the
    one the run's data records, batches of 3 rows (4 requests: one batch padded)."""
    from jaxdist.evaluate.harness import JaxdistLM
    from jaxdist.evaluate.scoring import fill

    run, run_dir, _, tokenizer = exported
    results, folder = evaluate("jaxdist", {"pretrained": str(run_dir)}, tmp_path, monkeypatch, 3)
    assert not no_network, f"lm-eval tried to connect: {no_network}"
    assert results["config"]["model"] == "jaxdist"
    assert folder.name == str(run_dir).replace("/", "__")  # filed under the run
    gap = check_against_jaxdist(results, folder, run, tokenizer)
    print(f"largest log-likelihood difference from jaxdist's model: {gap:.2g}")

    class Request:  # what lm-eval hands a model: .args
        def __init__(self, *args):
            self.args = args

    lm = JaxdistLM(pretrained=str(run_dir), tokenizer=str(tokenizer), batch_size="auto")
    assert lm.run.step == 5 and lm.run.max_length == 32  # the run's --seq-len
    text = "The run directory holds the checkpoints and the metrics of every step."
    ids = lm.run.tokenizer.encode(text)
    assert 16 < len(ids) < 32
    model = run.dp.merge(run.state)
    logits = np.asarray(model(jax.numpy.asarray([[lm.run.tokenizer.eos_id, *ids]]))[0, :-1])
    logp = log_softmax(logits.astype(np.float64))[np.arange(len(ids)), ids]
    # one window: each token after all before it (the end of document first)
    ((whole, _),) = lm.run.loglikelihood([([lm.run.tokenizer.eos_id], ids)])
    assert abs(whole - logp.sum()) < 1e-4
    assert abs(lm.loglikelihood_rolling([Request(text)])[0] - logp.sum()) < 1e-4
    # windows of 16: the later tokens see less than the whole text
    short = JaxdistLM(pretrained=str(run_dir), tokenizer=str(tokenizer), max_length=16)
    assert abs(short.loglikelihood_rolling([Request(text)])[0] - logp.sum()) > 1e-3
    with pytest.raises(NotImplementedError, match="no KV cache"):
        lm.generate_until([Request("The run", {"until": ["."]})])
    # a checkpoint that is not the model's: refused, listing both sides
    with pytest.raises(ConfigError, match="not in the checkpoint: params/blocks/0/") as err:
        fill(run.dp.merge(run.state), {"params/blocks/9/q/kernel": np.zeros(1)}, run_dir)
    assert "not in the model: params/blocks/9/q/kernel" in str(err.value)
