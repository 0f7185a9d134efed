"""The matrix's rows (experiments/matrix.py): each layout with its mesh, its processes and
its model's flags, the flags every run shares, and where a feature does not apply."""

from __future__ import annotations

from pathlib import Path

LAYOUTS = {  # name -> (--mesh, processes)
    "data=8": ("data=8", 1),
    "data=4,model=2": ("data=4,model=2", 1),
    "fsdp=8": ("fsdp=8", 1),
    "data=2,fsdp=2,model=2": ("data=2,fsdp=2,model=2", 1),
    "stage=2,data=4": ("stage=2,data=4", 1),
    "stage=2,fsdp=2,model=2": ("stage=2,fsdp=2,model=2", 1),
    "seq=2,fsdp=2,model=2": ("seq=2,fsdp=2,model=2", 1),  # the sequence split 2 ways
    # each fsdp pair spans the 2 processes, each model group stays inside one
    "2 procs x 4: fsdp=2,model=4": ("fsdp=2,model=4", 2),
    # a model in JAX's explicit-sharding style, naming its tensor-parallel axis "tp"
    # (tests/explicit_model.py): the layouts its annotations allow, 2 processes among them
    "explicit: data=8": ("data=8", 1),
    "explicit: data=2,fsdp=2,model=2": ("data=2,fsdp=2,model=2", 1),
    "explicit, 2 procs x 4: fsdp=4,model=2": ("fsdp=4,model=2", 2),
    # the built-in Llama (LLAMA below), split every way a layer can be and pipelined
    "llama: data=2,fsdp=2,model=2": ("data=2,fsdp=2,model=2", 1),
    "llama: stage=2,fsdp=2,model=2": ("stage=2,fsdp=2,model=2", 1),
    # Gemma 2 (GEMMA below): its sliding and global layers' kinds through pipeline stages
    "gemma: stage=2,fsdp=2,model=2": ("stage=2,fsdp=2,model=2", 1),
    # the Llama with experts (MOE below): 2 experts a device, all-to-all over expert=2
    "moe: expert=2,fsdp=2,model=2": ("expert=2,fsdp=2,model=2", 1),
}
RUN = ["--global-batch-size", "16", "--steps", "6", "--log-every", "1"]
GPT = ["--model", "gpt"]
# the explicit model on the same data (bytes: vocabulary 257, padded to 258 for tp=2)
EXPLICIT = [
    *("--model", "explicit_model:build", "--model-args", "vocab=258"),
    *("--loss", "explicit_model:loss", "--task", "lm", "--axis-names", "tp=model"),
]
# the built-in Llama with its switches on (heads 4 of 16 features, 2 key/value heads split
# over model=2; a window of 48 of the 64 positions; llama3 RoPE stretching 16 positions)
LLAMA = [
    *("--model", "llama", "--n-kv-heads", "2", "--qk-norm", "--attention-bias", "qkv"),
    *("--sliding-window-tokens", "48", "--no-tie-embeddings", "--rope-type", "llama3"),
    *("--rope-factor", "4", "--rope-original-max-positions", "16", "--ffn-dim", "128"),
]
# Gemma 2 with its differences on: layers 0 and 2 slide over 24 of the 64 positions, 1 and
# 3 global; both soft-caps low enough to bend these logits; its own query scale
GEMMA = [
    *("--model", "gemma", "--n-layers", "4", "--n-kv-heads", "2", "--ffn-dim", "128"),
    *("--sliding-window-tokens", "24", "--global-layer-every", "2", "--attn-softcap", "5"),
    *("--final-softcap", "3", "--query-scale-dim", "12"),
]
# a mixture of experts in the Llama: 3 layers, the first dense, then 4 routed experts of
# width 32 (top 2, dropless) and a shared one; over expert=2 each device holds 2 experts
MOE = [
    *("--model", "llama", "--n-layers", "3", "--n-kv-heads", "2", "--ffn-dim", "128"),
    *("--moe-experts", "4", "--moe-top-k", "2", "--moe-ffn-dim", "32"),
    *("--moe-shared-experts", "1", "--moe-dense-layers", "1"),
]
TESTS = Path(__file__).resolve().parents[1] / "tests"  # where explicit_model.py lives
# The GPT's own flags: what the explicit model (its own blocks, float32) has no use for
GPT_ONLY = {"bfloat16", "remat block", "dropout", "1f1b", "interleaved"}
REFERENCE = "1 device"  # every cell's reference: the same flags on one device


def model_flags(layout: str) -> list[str]:
    if layout.startswith("explicit"):
        return EXPLICIT
    if layout.startswith("gemma"):
        return GEMMA
    if layout.startswith("moe"):
        return MOE
    return LLAMA if layout.startswith("llama") else GPT


def layout_of(layout: str) -> tuple[str, int]:
    """(--mesh, processes) of a row, or of a mesh named after a row's model
    ("llama: data=8", the llama rows' elastic target)."""
    return LAYOUTS.get(layout) or (layout.rpartition(": ")[2], 1)


def mesh_of(layout: str) -> str:
    return layout_of(layout)[0]


def elastic_target(layout: str) -> str:
    """Where an elastic resume goes: data=8, with the layout row's model; the MoE row's
    onto twice the expert split (each device 1 expert, not 2: the kernels re-split)."""
    if layout.startswith("moe"):
        return "moe: expert=4,data=2"
    for model in ("explicit", "llama", "gemma"):  # the rows of a model other than the GPT
        if layout.startswith(model):
            return f"{model}: data=8"
    return "data=8"


def slug(*parts: str) -> str:
    return "-".join(p.replace("=", "").replace(",", "_").replace(" ", "") for p in parts)


# Features that only mean something on some layouts: (feature, why not elsewhere)
ONLY_WITH_STAGE = {"1f1b", "interleaved"}
NO_STAGE_WITH_EXPERT = "stage with expert is refused (--mesh): no pipeline to schedule"


def applies(layout: str, feature: str) -> str:
    """ "" where ``feature`` applies to ``layout``; else why it does not (the cell: n/a)."""
    if layout.startswith("explicit") and feature in GPT_ONLY:
        return "a flag of the built-in GPT's (its dtype, remat, dropout, pipeline blocks)"
    if feature in ONLY_WITH_STAGE and "expert" in mesh_of(layout):
        return NO_STAGE_WITH_EXPERT
    if feature in ONLY_WITH_STAGE and "stage" not in mesh_of(layout):
        return "no stage axis: no pipeline to schedule (the flag is ignored, as --microbatches)"
    return ""
