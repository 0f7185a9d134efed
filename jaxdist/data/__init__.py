"""The input pipeline: sources on disk or synthetic, samplers, host batches, prefetch.
Building sources from the command line's ``--data`` is ``jaxdist.train.build_data``.

Loaders yield host-local numpy (this process's rows); ``jaxdist.shard_batch`` is the one
seam to global device arrays. grain's datasets are sources too (``grain_source``; grain
is imported only when one is used). ``python -m jaxdist.data prepare`` writes token files,
byte-level or with a Hugging Face tokenizer (``jaxdist.data.tokenizer``: ``tokenizers`` is
imported only when one is loaded).
"""

from jaxdist.data.arrays import NpzArrays
from jaxdist.data.fingerprint import file_fingerprint
from jaxdist.data.grain_source import GrainSource
from jaxdist.data.loader import Batch, DataSource, Prefetcher, eval_batches, host_batches
from jaxdist.data.sampler import DistributedSampler, EvalSampler
from jaxdist.data.text import (
    BYTE_VOCAB,
    EOT,
    collect_files,
    default_cache_dir,
    prepare,
    stdlib_corpus,
)
from jaxdist.data.tokens import TokenWindows, read_sidecar, write_token_file


def model_input(task: str, batch: Batch, inputs: str = "x"):
    """What the model is called on, e.g. to initialise a Linen module: the tokens but the
    last (lm), else the batch entry named ``inputs`` (``--npz-inputs``); None when the
    batch has no such entry (a user loss may read other names)."""
    if task == "lm":
        return batch["tokens"][:, :-1] if "tokens" in batch else None
    return batch.get(inputs)


__all__ = [
    "BYTE_VOCAB",
    "EOT",
    "Batch",
    "DataSource",
    "DistributedSampler",
    "EvalSampler",
    "GrainSource",
    "NpzArrays",
    "Prefetcher",
    "TokenWindows",
    "collect_files",
    "default_cache_dir",
    "eval_batches",
    "file_fingerprint",
    "host_batches",
    "model_input",
    "prepare",
    "read_sidecar",
    "stdlib_corpus",
    "write_token_file",
]
