"""FLOPs per optimizer step, the devices' peak, and MFU.

Two counts, reported side by side because they can disagree: XLA's cost analysis of the
compiled step (per device, times the devices; it counts a loop body once, so a ``scan``
over layers or microbatches is under-counted) and, for the GPT, the usual formula
6N + 12 L d T FLOPs per token (forward and backward of every weight, plus attention
scores and values), for the Llama 6N + 12 L H Dh T (``llama_flops_per_token``). MFU uses
the formula where there is one. The peak comes from
``--peak-tflops`` or the table below; on a CPU there is none, so no MFU is made up.
"""

from __future__ import annotations

import jax

from jaxdist.sinks.events import StepFlops

T = 1e12
# Dense (no sparsity) peak FLOP/s per GPU from NVIDIA's datasheets, by the substrings of
# jax's device_kind ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", ...); the first match.
PEAKS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H100", "PCIE"), {"bf16": 756 * T, "tf32": 378 * T, "fp32": 51.2 * T}),
    (("H100", "NVL"), {"bf16": 835 * T, "tf32": 418 * T, "fp32": 60 * T}),
    (("H100",), {"bf16": 989 * T, "tf32": 495 * T, "fp32": 66.9 * T}),  # SXM
    (("H200", "NVL"), {"bf16": 835 * T, "tf32": 418 * T, "fp32": 60 * T}),
    (("H200",), {"bf16": 989 * T, "tf32": 495 * T, "fp32": 66.9 * T}),
    (("B200",), {"bf16": 2250 * T, "tf32": 1100 * T, "fp32": 75 * T}),
    (("A100",), {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
]
# Settings of jax_default_matmul_precision under which a float32 matmul is true float32;
# otherwise JAX lets the GPU use TF32 tensor cores for it.
FULL_FP32 = {"highest", "float32", "F32_F32_F32"}


def peak_flops(device_kind: str, dtype: str, peak_tflops: float = 0.0) -> float | None:
    """One device's peak FLOP/s for matmuls in ``dtype`` ("bfloat16" or "float32"):
    ``peak_tflops`` if given, else the table's; None for a device not in it (CPU)."""
    if peak_tflops:
        return peak_tflops * T
    kind = device_kind.upper()
    for names, peaks in PEAKS:
        if all(name in kind for name in names):
            if dtype == "bfloat16":
                return peaks["bf16"]
            precision = str(jax.config.jax_default_matmul_precision or "")
            return peaks["fp32" if precision in FULL_FP32 else "tf32"]
    return None


def gpt_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """6N (forward + backward of every weight) + 12 L d T (attention scores and values):
    124M at T = 1024: 6 * 124.4M + 12 * 12 * 768 * 1024 = 0.86 GFLOP per token."""
    return 6 * n_params + 12 * n_layers * d_model * seq_len


def llama_flops_per_token(
    n_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """6N + 12 L H Dh T: N the weights every token multiplies (each block's q, k, v, o,
    gate, up and down, the head; not an untied input embedding, which is looked up),
    then the scores and values of the H query heads of Dh features against all T keys.
    Grouped-query attention and SwiGLU enter through N (k and v of K heads, three MLP
    matrices); H Dh, not d_model, is the attention width (Qwen3's differ). Neither the
    causal mask nor a sliding window is subtracted: the kernels compute the full T x T
    square and mask it, as XLA counts."""
    return 6 * n_matmul_params + 12 * n_layers * n_heads * head_dim * seq_len


def llama_matmul_params(dp, program, tied: bool) -> int:
    """The Llama's parameters (``n_params``) less its input embedding where the head is
    untied (then the embedding is only looked up): the N of ``llama_flops_per_token``."""
    total = n_params(dp, program)
    if tied:
        return total
    flat = jax.tree_util.tree_leaves_with_path(program.state.params)
    keys = [(tuple(str(getattr(k, "key", k)) for k in path), x.size) for path, x in flat]
    table = sum(size for path, size in keys if path[:2] == ("tok", "embedding"))
    return total - table // (dp.layout.copies or 1)


def xla_step_flops(program, device_count: int) -> float | None:
    """XLA's count for one step over all devices, from the compiled program's cost
    analysis (per device: the partitioned module); None where the backend gives none."""
    try:
        analysis = program.compile().cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no XLA count
        return None
    if isinstance(analysis, list | tuple):  # older JAX: one dict per module
        analysis = analysis[0] if analysis else {}
    flops = (analysis or {}).get("flops")
    return float(flops) * device_count if flops and flops > 0 else None


def n_params(dp, program) -> int:
    """Parameters of the model (one copy: pmap's state holds one per device). For the GPT
    this counts the token embedding's padded rows (``jaxdist.models.gpt.padded_vocab``:
    257 -> 384), as GPT-2 practice does (50304 rows, not 50257): the tied output matmul
    computes their logits too, before they are sliced off."""
    total = sum(x.size for x in jax.tree.leaves(program.state.params))
    return total // (dp.layout.copies or 1)


def for_run(run, batch) -> StepFlops:
    """The command's counts: its compiled step (cached: the first step compiled it), the
    GPT's or the Llama's formula, and the devices' peak."""
    model, cfg = run.config.model, run.config.train
    program = run.dp.program(batch)
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind, model.dtype, cfg.peak_tflops)
    analytic, formula = None, StepFlops.formula
    if model.name == "gpt":
        per_token = gpt_flops_per_token(
            n_params(run.dp, program), model.n_layers, model.d_model, model.seq_len
        )
        analytic = per_token * cfg.global_batch_size * model.seq_len
    elif model.name in ("llama", "gemma"):
        head_dim = model.head_dim or model.d_model // model.n_heads
        matmul = llama_matmul_params(run.dp, program, model.tie_embeddings)
        per_token = llama_flops_per_token(
            matmul, model.n_layers, model.n_heads, head_dim, model.seq_len
        )
        analytic = per_token * cfg.global_batch_size * model.seq_len
        formula = "6N + 12LHDhT"
    return StepFlops(
        xla=xla_step_flops(program, run.mesh.size),
        analytic=analytic,
        peak_flops_per_s=peak * run.mesh.size if peak else None,
        device_kind=kind,
        formula=formula,
    )


def device_memory_gb() -> float | None:
    """Bytes in use on the fullest of this process's devices, in GB; None where the
    platform does not report it (CPU)."""
    in_use = [(d.memory_stats() or {}).get("bytes_in_use") for d in jax.local_devices()]
    in_use = [b for b in in_use if b is not None]
    return max(in_use) / 1e9 if in_use else None
