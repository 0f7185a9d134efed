"""The config's model section (``ModelConfig``: ``--model`` and the flags of the built-in
models), and the settings a Hugging Face folder's config.json fixes in it
(``--model-from-config DIR``)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from jaxdist.errors import ConfigError
from jaxdist.train.config_checks import coerce, flag_name


@dataclass
class ModelConfig:
    # built-in name ("mlp", "gpt", "llama", "gemma") or a user factory "package.module:function"
    name: str = field(default="mlp", metadata={"flag": "--model"})
    # what the model does, so which data and default loss: auto = gpt, llama, gemma -> lm,
    # else classify
    task: Literal["auto", "classify", "lm"] = "auto"
    # a user factory's other parameters: "num_classes=10,widths=[64,64]" (YAML values)
    model_args: str = ""
    # "" -> the task's default; or a user loss "package.module:function"
    loss: str = ""
    # Linen: the __call__ argument that switches training mode; "" = detect train/training/
    # deterministic/use_running_average; "!name": the argument is True in eval
    linen_train_arg: str = ""
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay float32
    # mlp: synthetic classification, inputs (B, in_features) -> (B, num_classes)
    in_features: int = 32
    hidden: int = 128
    depth: int = 2
    num_classes: int = 10
    # gpt: decoder-only transformer, tokens (B, seq_len) -> logits (B, seq_len, vocab_size)
    vocab_size: int = 0  # 0 = the data's (bytes + end of document: 257)
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    # attention kernel: auto = cuDNN flash attention where it applies (GPU, bf16), else XLA
    attention: Literal["auto", "cudnn", "xla"] = "auto"
    # hold the blocks stacked, (n_layers, ...), run by one scan (always with --mesh stage=S)
    scan_layers: bool = False
    # activation checkpointing of each block: none | block (keep matmul outputs) | full
    remat: Literal["none", "block", "full"] = "none"
    # GPT-2's dropout rate, on the embeddings and each residual branch; 0: none (and no
    # RNG stream in the model). Masks follow jaxdist.parallel.step's key contract.
    dropout: float = 0.0
    # gpt: the loss and the tied head in this many slices of the sequence, each slice's
    # gradient formed at once, never the whole (B, T, vocab) logits; 0: the plain loss;
    # -1 (auto): 8 on GPUs where 8 divides seq_len, without --shard-optimizer (the same
    # step time, 16-32% less peak memory at GPT-2 124M/355M on an H200:
    # experiments/PERF.md), else 0
    loss_chunks: int = -1
    # attention over a `seq` mesh axis: gather the keys and values, ring (ppermute), or
    # all-to-all (Ulysses: heads split over seq for attention; seq must divide kv heads)
    seq_attention: Literal["gather", "ring", "all-to-all"] = "ring"
    layer_norm_eps: float = 1e-6  # gpt: LayerNorm's epsilon (GPT-2's is 1e-5)
    # gpt, llama: packed documents (jaxdist/models/documents.py): a token attends only to
    # earlier tokens of its own document (segments cut after each end-of-document id), and
    # the loss skips the targets after an EOS (each begins a new document). Off by
    # default: it changes the model a checkpoint was trained as, and costs an explicit
    # (B, 1, T, T) mask on XLA's attention path (cuDNN's kernel takes no segment ids)
    document_mask: bool = False
    # with --document-mask: positions (the GPT's table, the Llama's RoPE) from 0 per document
    reset_positions: bool = False
    # with --document-mask: the end-of-document id; -1: the data's (a tokenizer's sidecar
    # eos_id, else 256, the byte files' end of document)
    document_eos_id: int = -1
    # llama: the Llama family's decoder (jaxdist/models/llama.py; docs/models.md), sized by
    # vocab_size, d_model, n_layers, n_heads as the GPT, and:
    n_kv_heads: int = 0  # key/value heads (grouped-query attention), dividing n_heads; 0: n_heads
    head_dim: int = 0  # features per head; 0: d_model / n_heads
    ffn_dim: int = 0  # SwiGLU's hidden width (Hugging Face's intermediate_size); 0: 4 x d_model
    rms_norm_eps: float = 1e-6  # RMSNorm's epsilon
    rope_theta: float = 10000.0  # RoPE's base wavelength, in positions
    # RoPE's frequency scaling (Hugging Face's rope_type): default (none), linear, llama3
    rope_type: Literal["default", "linear", "llama3"] = "default"
    rope_factor: float = 1.0  # linear, llama3: the frequencies (low ones, llama3) / factor
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_positions: int = 8192  # llama3: the pre-training context, in tokens
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    # biases of q, k, v (Qwen2) or of q, k, v and o (Llama's and Qwen3's attention_bias)
    attention_bias: Literal["none", "qkv", "qkvo"] = "none"
    # Mistral: each position attends to this many latest positions, itself included, in
    # every layer; 0: to all earlier ones
    sliding_window_tokens: int = 0
    tie_embeddings: bool = True  # the head is the token embedding; false: a head of its own
    # gemma: the Llama's flags above, Gemma 2's blocks (jaxdist/models/gemma.py), and:
    attn_softcap: float = 0.0  # attention logits soft-capped, c tanh(s / c); 0: none
    final_softcap: float = 0.0  # the output logits soft-capped likewise; 0: none
    # attention logits scaled by 1/sqrt(this) (query_pre_attn_scalar); 0: head_dim
    query_scale_dim: int = 0
    # every N-th layer (layer i with (i + 1) % N == 0) attends to all earlier positions,
    # the others within --sliding-window-tokens; 0: all within it (Gemma 2: N = 2)
    global_layer_every: int = 0
    # llama: a mixture of experts in place of each block's SwiGLU (jaxdist/models/moe.py,
    # docs/models.md): E routed experts, each token through its top k; 0: dense
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_dim: int = 0  # each expert's SwiGLU width; 0: --ffn-dim's
    moe_shared_experts: int = 0  # experts every token goes through (DeepSeek): width S x F
    moe_dense_layers: int = 0  # the first D layers keep the dense SwiGLU (DeepSeek)
    # softmax over the E logits (Mixtral, Qwen-MoE) or sigmoid scores (DeepSeek-V3)
    moe_router: Literal["softmax", "sigmoid"] = "softmax"
    moe_norm_topk: bool = True  # the k routing weights divided by their sum (Mixtral)
    moe_route_scale: float = 1.0  # the routing weights times this (DeepSeek-V3: 2.5)
    # per sequence, each expert takes at most ceil(c T k / E) (token, choice) pairs, in
    # position order, the rest dropped; 0: dropless (every pair, grouped matmuls)
    moe_capacity_factor: float = 0.0
    # the weights in the loss of the per-sequence load-balancing loss (1 when balanced)
    # and the router z-loss (mean logsumexp^2), each the mean over layers
    moe_balance_coef: float = 0.01
    moe_z_coef: float = 0.001
    # a Hugging Face folder (or its config.json) of model_type llama, qwen2, qwen3,
    # mistral, mixtral, qwen3_moe (--model llama) or gemma2 (--model gemma): the model
    # and its flags from it
    # (a flag given that disagrees with the file: exit 2, naming both)
    model_from_config: str = ""
    # float8 matmuls in the model's nnx.Linear layers (e4m3 forward, e5m2 gradients,
    # per-tensor current scaling; jaxdist/models/fp8.py); master weights stay float32
    fp8: bool = False
    # start from these weights (a .safetensors file, or a folder with its index JSON),
    # renamed and reshaped by --init-map (a YAML file, or a shipped map: gpt2, llama,
    # qwen2, qwen3, mistral, mixtral, qwen3_moe, gemma2)
    init_from: str = ""
    init_map: str = ""


def with_model_from_config(tree: dict) -> dict:
    """``tree`` with the model settings that ``model.model_from_config``'s config.json
    fixes filled in (``jaxdist.weights.maps.hf_llama``: the translation, per family); a
    setting given (flag or YAML) that disagrees with the file is a ConfigError naming both."""
    model = tree.get("model")
    if not isinstance(model, dict) or not model.get("model_from_config"):
        return tree
    from jaxdist.weights.maps import hf_llama

    source = str(model["model_from_config"])
    hints = typing.get_type_hints(ModelConfig)
    flags_of = {f.name: flag_name(f) for f in dataclasses.fields(ModelConfig)}
    model, wrong = dict(model), []
    for key, (value, said) in hf_llama.model_settings(source).items():
        if key in model:
            given = coerce(f"model.{key}", model[key], hints[key])
            if given != coerce(f"model.{key}", value, hints[key]):
                wrong.append(f"{flags_of[key]} {given} disagrees with its {said}")
        model[key] = value
    if wrong:
        raise ConfigError(
            f"--model-from-config {source}: {'; '.join(wrong)}: drop the flag (the file "
            "sets it) or name another folder"
        )
    return {**tree, "model": model}
