"""Generation over a KV cache (``jaxdist.generate``, ``jaxdist.models.kv_cache``).

- The cache is the model: each token, and its logits within 1e-5 (float32), are what the
  whole prefix recomputed by ``model(tokens)`` gives, for the GPT and a Llama (grouped
  heads, QK-norm, llama3 RoPE, a window shorter than prompt + generation), their blocks
  listed and scanned, prompts of different lengths batched; one compiled decode step
  serves every position.
- Sampling: a seed repeats its tokens and another seed gives others; top-k 1 is greedy;
  top-p keeps the smallest set reaching p (a numpy reference); draws follow the softmax.
- transformers (the ``hf`` extra) is the reference for greedy decoding: a tiny Llama
  (GQA, llama3 RoPE, untied) and a tiny GPT-2, built from their config classes and read
  from ``save_pretrained`` folders, give transformers' ``generate(do_sample=False)``
  tokens, batched prompts of different lengths included.

The command, ``python -m jaxdist.generate``, is tests/test_generate_cli.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdist
from jaxdist.errors import ConfigError, ModelError
from jaxdist.generate import Sampling, choose, generate, generator
from jaxdist.generate.next_token import top_k_mask, top_p_mask
from jaxdist.models import GPT, MLP, Llama
from jaxdist.models.rope import Rope

VOCAB, D, LAYERS, HEADS = 300, 32, 2, 4
PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 8, 120], [11, 2, 200], [64, 64, 1, 290, 33]]  # 9, 3, 5
NEW = 12
WINDOW = 4  # shorter than every prompt + NEW: the cache must mask what it has passed
LLAMA3 = Rope(16, 500.0, "llama3", 8.0, 1.0, 4.0, 8)


def gpt(scan_layers=False):
    return GPT(VOCAB, 32, D, LAYERS, HEADS, scan_layers=scan_layers, attention="xla",
               rngs=nnx.Rngs(0))  # fmt: skip


def llama(scan_layers=False, window=WINDOW):
    return Llama(
        VOCAB, D, LAYERS, HEADS, n_kv_heads=2, head_dim=16, ffn_dim=48, qk_norm=True,
        attention_bias="qkvo", sliding_window=window, tie_embeddings=False, rope=LLAMA3,
        scan_layers=scan_layers, attention="xla", rngs=nnx.Rngs(1),
    )  # fmt: skip


def recomputed(model, prompt, steps, width=32):
    """Greedy tokens and their logits (steps, vocab), the whole prefix run through
    ``model(tokens)`` each step (padded at the end to ``width``: one compiled forward
    pass, and a causal model's logits at the prefix's last position ignore the padding)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    seq, logits = list(prompt), []
    for _ in range(steps):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(seq)] = seq
        last = np.asarray(forward(state, padded)[0, len(seq) - 1])
        logits.append(last)
        seq.append(int(last.argmax()))
    return seq[len(prompt) :], np.stack(logits)


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scanned"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_cache_gives_the_recomputed_tokens_and_logits(family, scan):
    model = gpt(scan) if family == "gpt" else llama(scan)
    before = generator._step._cache_size()
    out = generate(model, PROMPTS, NEW, keep_logits=True)
    # one prefill and one decode step compiled for all NEW positions (none per token)
    assert generator._step._cache_size() - before <= 2
    assert out.logits.shape == (len(PROMPTS), NEW, VOCAB)
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = recomputed(model, prompt, NEW)
        assert out.ids[row] == tokens, (row, out.ids[row], tokens)
        assert np.abs(out.logits[row] - logits).max() < 1e-5, np.abs(out.logits[row] - logits).max()
    assert out.stopped == ["length"] * len(PROMPTS)


def test_a_prompt_batched_gets_what_it_gets_alone_and_eos_stops_its_row():
    model = llama()
    batched = generate(model, PROMPTS, NEW)
    for row, prompt in enumerate(PROMPTS):
        assert generate(model, prompt, NEW).ids == [batched.ids[row]]
    eos = batched.ids[1][4]  # row 1's fifth token: it stops there, the others go on
    stopped = generate(model, PROMPTS, NEW, eos_id=eos)
    assert stopped.ids[1] == batched.ids[1][: batched.ids[1].index(eos)]
    assert stopped.stopped[1] == "eos"
    for row in (0, 2):
        ids = batched.ids[row]
        assert stopped.ids[row] == (ids[: ids.index(eos)] if eos in ids else ids)


def test_on_a_mesh_the_tokens_are_one_devices():
    mesh = jaxdist.make_mesh(data=2, fsdp=2, model=2)  # 3 rows padded to 4
    for model in (gpt(True), llama()):
        assert generate(model, PROMPTS, 6, mesh=mesh).ids == generate(model, PROMPTS, 6).ids
    with pytest.raises(ConfigError, match="stage=2"):
        generate(gpt(), PROMPTS, 4, mesh=jaxdist.make_mesh(data=4, stage=2))


def test_bad_calls_raise_one_line():
    model = gpt()
    cases = [
        (lambda: generate(model, [[1, 2], []], 4), "prompt 2 is empty"),
        (lambda: generate(model, [[1, VOCAB]], 4), f"id {VOCAB} is not in"),
        (lambda: generate(model, [list(range(30))], 4), "past the model's context of 32"),
        (lambda: generate(model, [[1]], 0), "--max-new-tokens 0"),
        (lambda: generate(model, [[1]], 4, top_k=3), "with --temperature 0"),
    ]
    for call, text in cases:
        with pytest.raises(ConfigError, match=text):
            call()
    with pytest.raises(ModelError, match="no KV-cache decode path"):
        generate(MLP(4, 8, 1, 3, rngs=nnx.Rngs(0)), [[1]], 4)


# --- sampling


def test_a_seed_repeats_its_sample_and_another_seed_gives_another():
    model = gpt()
    hot = dict(temperature=1.5, top_k=50, top_p=0.95)
    first = generate(model, PROMPTS, NEW, seed=1, **hot).ids
    assert generate(model, PROMPTS, NEW, seed=1, **hot).ids == first
    assert generate(model, PROMPTS, NEW, seed=2, **hot).ids != first
    assert generate(model, PROMPTS[1], NEW, seed=1, **hot).ids == [first[1]]  # alone: the same
    greedy = generate(model, PROMPTS, NEW).ids
    assert first != greedy
    assert generate(model, PROMPTS, NEW, temperature=1.0, top_k=1, seed=3).ids == greedy


FIXED = np.log(np.array([0.05, 0.30, 0.02, 0.25, 0.15, 0.13, 0.10], np.float32))


def top_p_reference(probs: np.ndarray, p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches p."""
    order = np.argsort(-probs)
    total = np.cumsum(probs[order])
    return set(order[: int(np.searchsorted(total, p)) + 1].tolist())


@pytest.mark.parametrize("p", [0.2, 0.31, 0.5, 0.56, 0.69, 0.9, 0.99, 1.0])
def test_top_p_keeps_the_smallest_set_that_reaches_p(p):
    probs = np.exp(FIXED) / np.exp(FIXED).sum()
    mask = np.asarray(top_p_mask(jnp.asarray(FIXED)[None], p))[0]
    assert set(np.flatnonzero(mask).tolist()) == top_p_reference(probs, p)


def test_top_k_keeps_k_and_the_draws_follow_the_softmax():
    mask = np.asarray(top_k_mask(jnp.asarray(FIXED)[None], 3))[0]
    assert set(np.flatnonzero(mask).tolist()) == {1, 3, 4}
    keys = jax.random.split(jax.random.key(0), 20000)
    logits = jnp.asarray(FIXED)[None]

    def draws(sampling):
        picked = jax.vmap(lambda k: choose(logits, k, sampling)[0])(keys)
        return np.bincount(np.asarray(picked), minlength=len(FIXED)) / len(keys)

    probs = np.exp(FIXED) / np.exp(FIXED).sum()
    np.testing.assert_allclose(draws(Sampling(1.0)), probs, atol=0.012)
    nucleus = draws(Sampling(1.0, top_p=0.56))  # {1, 3, 4}: 0.70, renormalised
    np.testing.assert_allclose(nucleus[[1, 3, 4]], probs[[1, 3, 4]] / 0.70, atol=0.012)
    assert nucleus[[0, 2, 5, 6]].sum() == 0
    cold = draws(Sampling(0.5, top_k=2))  # {1, 3} at T 0.5: 0.3^2 : 0.25^2
    assert cold[[0, 2, 4, 5, 6]].sum() == 0
    assert abs(cold[1] - 0.09 / (0.09 + 0.0625)) < 0.012


# --- transformers' greedy decoding


def hf_folder(tmp_path, family):
    torch = pytest.importorskip("torch", reason="the hf extra: pip install 'jaxdist[hf]'")
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra: pip install 'jaxdist[hf]'"
    )
    torch.manual_seed(0)
    if family == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                "rope_theta": 500.0}  # fmt: skip
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=2, tie_word_embeddings=False,
            rope_parameters=rope, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
    elif family == "gemma2":  # layers 0 and 2 slide over 4 positions; soft-capped logits
        config = transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16, sliding_window=4,
            query_pre_attn_scalar=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=LAYERS, n_head=HEADS,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or "ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


def hf_greedy(model, prompt, steps):
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=steps)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_greedy_tokens_are_transformers(tmp_path, family):
    from jaxdist.generate.rebuild import rebuild

    theirs = hf_folder(tmp_path, family)
    rebuilt = rebuild(tmp_path)
    assert rebuilt.context == {"llama": 2048, "gpt2": 64, "gemma2": 8192}[family]
    ours = generate(rebuilt.model, PROMPTS, 20, context=rebuilt.context)
    for row, prompt in enumerate(PROMPTS):
        assert ours.ids[row] == hf_greedy(theirs, prompt, 20), (family, row)
