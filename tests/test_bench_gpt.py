"""experiments/bench_gpt.py --cpu: the plain-JAX references are the same models as
jaxdist's GPT and Llama (and the torch peer's Llama, transformers' own, is jaxdist's
Llama where torch is installed), and the benchmark writes one complete record per
measurement of each model, the three of a model with one parameter count and one FLOPs
count per token."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist.losses import next_token_loss
from jaxdist.models.gpt import GPT

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import bench_gpt  # noqa: E402
import bench_gpt_one  # noqa: E402
import peer_plain_jax as plain  # noqa: E402
import peer_plain_jax_llama as plain_llama  # noqa: E402


def test_plain_jax_reference_computes_jaxdists_gpt_loss_and_update():
    # Unpadded (97 rows, not 128): the reference's tied head is the whole table, as the
    # bench's GPT's is (its vocabularies, 512 and 50304, are multiples of 128).
    model = GPT(97, 16, 32, 2, 4, rngs=nnx.Rngs(0), attention="xla", pad_vocab_to=1)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, 97)
    # jitted, as the step is: run eagerly, each operation compiles on its own (~10 s)
    want, _ = nnx.jit(next_token_loss)(model, {"tokens": tokens})
    plain_loss = jax.jit(plain.loss_fn, static_argnames=("n_heads", "dtype", "attention"))
    got = plain_loss(params, tokens, n_heads=4, dtype=jnp.float32, attention="xla")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # One step of each from the same weights gives the same weights. SGD, not Adam: the
    # key bias's gradient is zero up to rounding (softmax ignores a constant shift of the
    # scores), and Adam would scale that rounding noise up to +-lr.
    tx = optax.sgd(0.5)
    new, _, _ = plain.make_step(tx, n_heads=4, dtype=jnp.float32, attention="xla")(
        jax.tree.map(jnp.copy, params), tx.init(params), tokens
    )
    assert_one_step_is_jaxdists(model, tokens, tx, new)


def assert_one_step_is_jaxdists(model, tokens, tx, new) -> None:
    """``new``, a peer's parameters after one ``tx`` step on ``tokens``, equals one step
    of jaxdist's ``model`` with jaxdist's loss (within 1e-5)."""
    graphdef, state = nnx.split(model, nnx.Param)

    def jaxdist_loss(p):
        return next_token_loss(nnx.merge(graphdef, p), {"tokens": tokens})[0]

    grads = jax.jit(jax.grad(jaxdist_loss))(state)
    updates, _ = tx.update(grads, tx.init(state), state)
    ref = nnx.to_pure_dict(optax.apply_updates(state, updates))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def run_bench(tmp_path, *args) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / "bench_gpt.py"), "--cpu", "--steps", "3"]
        + ["--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, [json.loads(x) for x in out.read_text().splitlines()]


def check_record(r: dict, model: str = "gpt") -> None:
    """A complete measurement of the tiny CPU model: no error, consistent throughput."""
    assert "error" not in r and "skipped" not in r, r
    assert r["model"] == model and r["size"] == "tiny" and r["step_ms"] > 0 and 0 < r["mfu"] < 1
    assert math.isfinite(r["loss"]) and r["loss"] > 0
    tokens_per_s = r["batch"] * r["seq_len"] / (r["step_ms"] / 1e3)
    assert abs(r["tokens_per_s"] - tokens_per_s) < 1e-6 * tokens_per_s
    # N counted from the model: 2 layers, d = 64, vocabulary 512, T = 64
    d, v, t = 64, 512, 64
    if model == "gpt":  # 6N + 12 L d T
        assert r["n_params"] == v * d + t * d + 2 * (12 * d * d + 13 * d) + 2 * d
        return
    # tied; q and o d x d, k and v d x 32 (2 of 4 heads), gate, up and down d x 192, 3 norms
    assert r["n_params"] == v * d + 2 * (2 * d * d + 2 * d * 32 + 3 * d * 192 + 2 * d) + d
    # 6N + 12 L H Dh T, the same for the three: the FLOPs that MFU is of
    flops = r["mfu"] * r["matmul_peak_tflops"] * 1e12 / r["tokens_per_s"]
    assert flops == pytest.approx(6 * r["n_params"] + 12 * 2 * 4 * 16 * t, rel=1e-9)


def test_bench_gpt_cpu_writes_a_record_per_measurement(tmp_path):
    """jaxdist and plain JAX, and torch.compile where torch is installed, in one run of
    the benchmark (each measurement is a process of its own). torch.compile runs with its
    aot_eager backend: dynamo's graph and AOT autograd, as inductor's, without inductor's
    C++ build (40 s of the suite's 20 minutes on 2 cores). Its --cache-study (two more
    jaxdist processes, cold and warm) is not run here either: 13 s."""
    try:
        import torch  # noqa: F401

        peers = ["jaxdist", "plain-jax", "torch.compile"]
    except ImportError:
        peers = ["jaxdist", "plain-jax"]  # test_bench_gpt_without_torch_... covers it
    profile = tmp_path / "profile"
    proc, records = run_bench(
        tmp_path, "--who", ",".join(peers), "--profile", str(profile), "--torch-backend",
        "aot_eager",
    )  # fmt: skip
    by_who = {r["who"]: r for r in records}
    assert sorted(by_who) == sorted(peers)
    for who in peers:
        check_record(by_who[who])
    if "torch.compile" in by_who:
        assert by_who["torch.compile"]["torch_backend"] == "aot_eager"
    for who in ("jaxdist", "plain-jax"):
        # 3 timed steps: one window; step_ms is the median of the windows' means
        assert len(by_who[who]["window_ms"]) == 1
        assert by_who[who]["step_ms"] == pytest.approx(by_who[who]["window_ms"][0], abs=1e-3)
    assert 0 <= by_who["jaxdist"]["data_wait_frac"] < 1
    # jaxdist's traced steps: the trace, gzipped, and its summary (no GPU plane on CPU)
    assert (profile / "jaxdist_step.xplane.pb.gz").stat().st_size > 0
    summary = json.loads((profile / "profile_summary.json").read_text())
    assert summary["steps"] == 3 and "kinds" in summary
    assert "jaxdist" in proc.stdout and "tokens/s" in proc.stdout


def test_bench_gpt_without_torch_records_why_it_skipped(monkeypatch):
    """Where torch cannot be imported, the torch.compile measurement is a record that says
    so (and the table shows it), not a crash of the whole benchmark."""
    monkeypatch.setitem(sys.modules, "peer_torch", None)  # import peer_torch -> ImportError
    args = argparse.Namespace(attention="xla", cpu=True)
    sizes, run = bench_gpt.settings(bench_gpt.parse(["--cpu"]))
    record = bench_gpt_one.measure(args, "torch.compile", "tiny", sizes["tiny"], run)
    assert record["skipped"].startswith("torch not installed")
    assert "step_ms" not in record and "error" not in record
    assert "torch not installed" in bench_gpt.table([record])


# --- the Llama (--model llama)


def bench_llama(attention: str = "xla"):
    """The bench's tiny Llama, built by jaxdist as the bench builds it: (model, dims)."""
    from jaxdist.train.build_model import build_model

    args = bench_gpt.parse(["--cpu", "--model", "llama", "--attention", attention])
    sizes, run = bench_gpt.settings(args)
    dims = sizes["tiny"]
    model, _ = build_model(bench_gpt_one._config(args, dims, run, "").model, seed=0)
    return model, dims, run


def test_plain_jax_reference_computes_jaxdists_llama_loss_and_update():
    """The bench's tiny Llama (grouped heads, SwiGLU, RoPE of theta 500000, tied, its
    vocabulary of 512 a multiple of 128: no padded rows) and the plain-JAX reference from
    the same weights: one loss, and one SGD step gives the same weights."""
    model, dims, run = bench_llama()
    assert (dims["n_kv_heads"], dims["ffn_dim"], model.lm_head) == (2, 192, None)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, run["vocab_size"])
    shape = dict(n_heads=4, n_kv_heads=2, dtype=jnp.float32, attention="xla")
    shape.update(rope_theta=dims["rope_theta"], eps=dims["rms_norm_eps"])
    want, _ = nnx.jit(next_token_loss)(model, {"tokens": tokens})
    got = jax.jit(lambda p, t: plain_llama.loss_fn(p, t, **shape))(params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    tx = optax.sgd(0.5)
    new, _, _ = plain.make_step(tx, loss=plain_llama.loss_fn, **shape)(
        jax.tree.map(jnp.copy, params), tx.init(params), tokens
    )
    assert_one_step_is_jaxdists(model, tokens, tx, new)


def test_the_torch_peers_llama_is_jaxdists_llama():
    """transformers' LlamaForCausalLM as the torch peer builds it, given jaxdist's
    weights (torch's (out, in) = the kernels' transpose), gives jaxdist's logits: the
    same shapes, heads, RoPE, eps and tied head; and the same parameter count."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import peer_torch

    model, dims, run = bench_llama()
    peer = peer_torch.Llama(run["vocab_size"], run["seq_len"], **dims)
    p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sum(x.numel() for x in peer.parameters()) == sum(x.size for x in jax.tree.leaves(p))
    weights = {
        "model.embed_tokens.weight": p["tok"]["embedding"],
        "model.norm.weight": p["norm"]["scale"],
    }
    names = {x: f"self_attn.{x}_proj" for x in "qkvo"}
    names.update({x: f"mlp.{x}_proj" for x in ("gate", "up", "down")})
    for i, block in p["blocks"].items():
        pre = f"model.layers.{i}."
        weights[pre + "input_layernorm.weight"] = block["attn_norm"]["scale"]
        weights[pre + "post_attention_layernorm.weight"] = block["mlp_norm"]["scale"]
        weights.update({f"{pre}{hf}.weight": block[ours]["kernel"].T for ours, hf in names.items()})
    state = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
    missing, unexpected = peer.hf.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head: the tied table
    tokens = np.random.default_rng(0).integers(0, run["vocab_size"], (2, run["seq_len"]))
    with torch.no_grad():
        theirs = peer(torch.from_numpy(tokens)).numpy()
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    np.testing.assert_allclose(theirs, ours, atol=2e-5)
    assert np.abs(ours).max() > 0.1  # not all zero: the comparison sees the weights


def test_bench_llama_cpu_writes_a_record_per_measurement(tmp_path):
    """--model llama: jaxdist, plain JAX and (where torch is) transformers' Llama under
    torch.compile (aot_eager, as above), each a complete record of one parameter count
    and one FLOPs count per token; the table names the model."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        peers = ["jaxdist", "plain-jax", "torch.compile"]
    except ImportError:
        peers = ["jaxdist", "plain-jax"]
    proc, records = run_bench(
        tmp_path, "--model", "llama", "--who", ",".join(peers), "--torch-backend", "aot_eager"
    )
    assert sorted(r["who"] for r in records) == sorted(peers)
    for r in records:
        check_record(r, "llama")
        assert (r["n_kv_heads"], r["ffn_dim"], r["rope_theta"]) == (2, 192, 500000.0)
    assert len({r["n_params"] for r in records}) == 1
    assert "llama" in proc.stdout.splitlines()[-1]
