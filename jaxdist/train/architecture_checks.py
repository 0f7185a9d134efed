"""The model section's settings that only work together (``--model llama`` and
``gemma``'s heads and RoPE, Gemma's attention, ``--loss-chunks``): called by
``config_checks.validate`` before anything runs."""

from __future__ import annotations

import dataclasses

from jaxdist.errors import ConfigError


def check(model, mesh: str) -> None:
    check_llama(model)
    check_gemma(model, mesh)
    check_moe(model)
    check_loss_chunks(model)


def check_moe(model) -> None:
    """``--moe-*``: experts for the Llama only; the other MoE flags only with experts."""
    from jaxdist.train.own_flags import MOE_FLAGS

    given = [f"--{k.replace('_', '-')} {getattr(model, k)}" for k, v in MOE_FLAGS.items()
             if k != "moe_experts" and getattr(model, k) != v]  # fmt: skip
    e = model.moe_experts
    if not e:
        if given:
            raise ConfigError(
                f"{', '.join(given)} without --moe-experts: the model is dense, so they "
                "would change nothing; give --moe-experts E or drop them"
            )
        return
    if model.name == "gemma":
        raise ConfigError(
            "--moe-experts with --model gemma: its GELU-tanh MLP has no MoE form here; "
            "use --model llama"
        )
    if model.moe_top_k > e:
        raise ConfigError(f"--moe-top-k {model.moe_top_k} exceeds --moe-experts {e}")
    if model.moe_dense_layers >= model.n_layers:
        raise ConfigError(
            f"--moe-dense-layers {model.moe_dense_layers} leaves none of the "
            f"{model.n_layers} layers (--n-layers) with experts"
        )


LLAMA_FAMILY = ("llama", "gemma")  # the built-in models of the Llama's blocks and flags


def check_gemma(model, mesh: str) -> None:
    """Gemma's soft-capped attention: XLA's kernel only, split over ``seq`` by all-to-all."""
    if model.name != "gemma":
        return
    if model.attention == "cudnn":
        raise ConfigError(
            "--attention cudnn: Gemma's attention soft-caps its logits, which cuDNN's fused "
            "kernel does not; use --attention auto or xla (XLA's kernel)"
        )
    if model.global_layer_every and not model.sliding_window_tokens:
        raise ConfigError(
            f"--global-layer-every {model.global_layer_every} without --sliding-window-tokens:"
            " every layer attends globally already, so it would change nothing"
        )
    from jaxdist.parallel.device_mesh import parse_mesh

    seq = parse_mesh(mesh).get("seq", 1) if mesh else 1
    if seq != 1 and model.seq_attention != "all-to-all":
        raise ConfigError(
            f"--mesh {mesh} with --seq-attention {model.seq_attention}: --model gemma's "
            "soft-capped attention splits over seq the all-to-all way only (the ring and "
            "gather compute plain softmax attention); use --seq-attention all-to-all"
        )


def check_llama(model) -> None:
    """The Llama's settings that only work together: grouped heads dividing the query
    heads, an even head size (RoPE rotates pairs), RoPE's scaling values only with the
    scaling that reads them."""
    if model.name not in LLAMA_FAMILY:
        return  # set for another model, jaxdist.train.build_model refuses them by name
    if model.n_kv_heads and model.n_heads % model.n_kv_heads:
        raise ConfigError(
            f"--n-kv-heads {model.n_kv_heads} does not divide --n-heads {model.n_heads}: "
            "each key/value head serves an equal group of query heads"
        )
    head_dim = model.head_dim or model.d_model // model.n_heads
    if head_dim % 2:
        raise ConfigError(f"RoPE rotates pairs of features: the head size {head_dim} is odd")
    reads = {"rope_factor": ("linear", "llama3"), "rope_low_freq_factor": ("llama3",),
             "rope_high_freq_factor": ("llama3",),
             "rope_original_max_positions": ("llama3",)}  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(model)}
    unread = [
        f"--{key.replace('_', '-')} {getattr(model, key)}"
        for key, types_ in reads.items()
        if getattr(model, key) != defaults[key] and model.rope_type not in types_
    ]
    if unread:
        raise ConfigError(
            f"{', '.join(unread)}: --rope-type {model.rope_type} does not read it; "
            "--rope-type linear reads --rope-factor, llama3 all four"
        )
    if model.rope_type == "llama3" and model.rope_high_freq_factor <= model.rope_low_freq_factor:
        raise ConfigError(
            f"--rope-high-freq-factor {model.rope_high_freq_factor} must exceed "
            f"--rope-low-freq-factor {model.rope_low_freq_factor} (llama3 RoPE blends between)"
        )


FUSED_LOSS_MODELS = ("gpt", *LLAMA_FAMILY)  # the built-in models with features() and head()


def check_loss_chunks(model) -> None:
    """``--loss-chunks``: a built-in model's own loss, in slices that divide the sequence."""
    chunks = model.loss_chunks
    if chunks <= 0:  # the plain loss, or auto (which picks only what applies)
        return
    if model.name not in FUSED_LOSS_MODELS or model.loss:
        what = f"--loss {model.loss}" if model.loss else f"--model {model.name}"
        raise ConfigError(
            f"--loss-chunks {chunks}: only for --model gpt's or llama's own loss, not {what}"
        )
    if model.seq_len % chunks:
        raise ConfigError(
            f"--loss-chunks {chunks} does not divide --seq-len {model.seq_len}: use a divisor"
        )
