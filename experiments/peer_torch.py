"""The PyTorch peer for bench_gpt.py: the same GPT (pre-LayerNorm blocks, tied
embedding, tanh GELU, biases), or for ``--model llama`` transformers' own
``LlamaForCausalLM`` in the bench's shape (``llama``: grouped-query attention, SwiGLU,
RoPE, tied head, no biases), bf16 autocast over fp32 weights, SDPA causal attention
(flash on an H100), fused AdamW, ``torch.compile``. Imported only where torch is;
transformers only for the Llama."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):  # (B, T, D)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (a.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for a in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T  # tied head


class Llama(nn.Module):
    """transformers' LlamaForCausalLM as the GPT above is called: tokens -> logits."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int,
                 n_heads: int, n_kv_heads: int, ffn_dim: int, rope_theta: float,
                 rms_norm_eps: float):  # fmt: skip
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=d_model, intermediate_size=ffn_dim,
            num_hidden_layers=n_layers, num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads, head_dim=d_model // n_heads,
            max_position_embeddings=seq_len, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
            tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
            attn_implementation="sdpa",
        )  # fmt: skip
        self.hf = transformers.LlamaForCausalLM(config)

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        return self.hf(input_ids=tokens, use_cache=False).logits


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak_flops(cpu: bool) -> float:
    device = torch.device("cpu" if cpu else "cuda")
    n, dtype = (512, torch.float32) if cpu else (8192, torch.bfloat16)
    a = torch.randn(n, n, dtype=dtype, device=device)  # as the JAX side: random bits
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        _sync(device)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def measure(dims: dict, run: dict, cpu: bool, backend: str = "inductor", model="gpt") -> dict:
    """``backend``: torch.compile's; inductor (the default, what the figures use) builds
    C++ or Triton kernels, which takes 40 s for the tiny CPU model on 2 cores.
    ``model``: "gpt" or "llama" (``dims`` the bench's for it)."""
    device = torch.device("cpu" if cpu else "cuda")
    model = {"gpt": GPT, "llama": Llama}[model](run["vocab_size"], run["seq_len"], **dims)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=not cpu)
    amp_dtype = torch.bfloat16 if run["dtype"] == "bfloat16" else torch.float32

    @torch.compile(backend=backend)
    def loss_of(tokens):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            logits = model(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def step(tokens):
        loss = loss_of(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    shape = (run["batch"], run["seq_len"] + 1)
    batches = [torch.randint(0, run["vocab_size"], shape, device=device) for _ in range(4)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(batches[0])
    _sync(device)
    compile_s = time.perf_counter() - start
    for i in range(1, run["warmup"]):
        step(batches[i % 4])
    windows = []  # as bench_gpt_one.timed_windows: each window's mean, after a wait
    for w in range(run["steps"] // run["window"]):
        _sync(device)
        start = time.perf_counter()
        for i in range(run["window"]):
            loss = step(batches[(w + i) % 4])
        _sync(device)
        windows.append((time.perf_counter() - start) / run["window"] * 1e3)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    return {
        "step_ms": statistics.median(windows),
        "window_ms": [round(w, 3) for w in windows],
        "compile_s": compile_s,
        "n_params": int(n_params),
        "loss": float(loss),
        "peak_memory_gb": peak,
    }
