"""The generation loop: ``generate(model, prompt_ids, max_new_tokens=N)`` -> each prompt's
new tokens, over the model's KV cache (``jaxdist.models.kv_cache``).

1. Prefill: the prompts, right-padded to the longest, T ids, go through the model once at
   positions 0..T-1 (``model.cached_features``), filling the cache's first T slots; each
   row's first token comes from the logits at its own last position.
2. Decode: one token per row at the row's own position (its prompt's length plus the
   tokens so far), by one compiled step for every position: the cache has a fixed
   length, the longest prompt plus N. A shorter prompt's padding slots are masked until
   its own tokens overwrite them, so each row gets what its prompt gets alone.
3. A row stops at ``eos_id`` (not returned) or after N tokens; the loop when all have.

Layout: one device by default; with ``mesh`` the parameters lie as training lays them
(``jaxdist.parallel.layout``: ``model`` splits the heads, the MLP and the vocabulary,
``fsdp`` the embedding axis), the rows are split over ``data`` and ``fsdp`` (padded with
copies of the first prompt to a multiple, dropped again), and the cache's rows likewise,
its key/value heads over ``model`` where that divides them. ``stage`` and ``seq`` do not
apply to one token at a time and are refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError, ModelError
from jaxdist.generate.next_token import Sampling, choose
from jaxdist.parallel.device_mesh import BATCH_AXES, batch_shards
from jaxdist.parallel.layout import state_shardings

NEEDS = ("init_cache", "cached_features", "head")  # a model's decode path
UNUSED_AXES = ("stage", "seq")


@dataclass
class Generated:
    """``ids[i]``: prompt i's new tokens (the EOS that ended it not included);
    ``stopped[i]``: "eos" or "length"; ``logits`` (B, steps, vocab) float32, with
    ``keep_logits``: the logits each step's token was chosen from (rows that stopped
    keep running: their later entries are of tokens not returned)."""

    ids: list[list[int]]
    stopped: list[str]
    logits: np.ndarray | None = None


def generate(
    model: nnx.Module, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
    top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
    context: int | None = None, mesh=None, keep_logits: bool = False,
) -> Generated:  # fmt: skip
    """Up to ``max_new_tokens`` new tokens for each prompt of ``prompt_ids`` (a list of
    id lists, or one list): greedy at ``temperature`` 0, else sampled (``top_k``,
    ``top_p``, ``seed``; ``jaxdist.generate.next_token``). ``context``: the longest
    sequence (prompt + new tokens) the model may read; default the GPT's position table,
    none for the Llama. ``mesh``: a ``jaxdist.make_mesh`` mesh (the module's docstring).
    Bad input raises ``JaxdistError`` (one line)."""
    sampling = Sampling(temperature, top_k, top_p)
    prompts = check(model, prompt_ids, max_new_tokens, context=context, mesh=mesh)
    longest = max(len(p) for p in prompts)
    rows = len(prompts)
    shards = 1 if mesh is None else batch_shards(mesh)
    padded = prompts + [prompts[0]] * (-rows % shards)  # rows to a multiple of the shards
    lengths = np.array([len(p) for p in padded], np.int32)
    tokens = np.zeros((len(padded), longest), np.int32)  # (B, T), right-padded with 0
    for row, prompt in enumerate(padded):
        tokens[row, : len(prompt)] = prompt

    graphdef, params, rest = _inference_split(model)
    params, rest, put = _place(params, rest, mesh)
    cache = _empty(graphdef, mesh, len(padded), longest + max_new_tokens, params, rest)
    key, zeros = jax.random.key(seed), put(np.zeros(len(padded), np.int32))
    step = functools.partial(_step, graphdef, sampling, mesh, params, rest)
    token, logits, cache = step(cache, put(tokens), zeros, put(lengths - 1), key, 0)
    ids: list[list[int]] = [[] for _ in range(rows)]
    stopped = ["length"] * rows
    kept = []
    for i in range(max_new_tokens):
        chosen = np.asarray(token)[:rows]
        if keep_logits:
            kept.append(np.asarray(logits)[:rows])
        for row in range(rows):
            if stopped[row] == "eos":
                continue
            if eos_id is not None and int(chosen[row]) == eos_id:
                stopped[row] = "eos"
            else:
                ids[row].append(int(chosen[row]))
        if i + 1 == max_new_tokens or all(s == "eos" for s in stopped):
            break
        # the token just chosen goes in at its row's position: prompt length + i
        token, logits, cache = step(cache, token, put(lengths + i), zeros, key, i + 1)
    return Generated(ids, stopped, np.stack(kept, axis=1) if keep_logits else None)


def check(model, prompt_ids, max_new_tokens: int, *, context=None, mesh=None) -> list[list[int]]:
    """What ``generate`` refuses, refused before anything compiles (``JaxdistError``, one
    line); the prompts as lists of ids."""
    missing = [name for name in NEEDS if not callable(getattr(model, name, None))]
    if missing:
        raise ModelError(
            f"a {type(model).__name__} has no KV-cache decode path (no {', '.join(missing)}): "
            "jaxdist generates with its built-in GPT and Llama (--model gpt, --model llama)"
        )
    prompts = _prompts(prompt_ids, getattr(model, "vocab_size", None))
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: give 1 or more")
    longest = max(len(p) for p in prompts)
    context = context or getattr(model, "context", None)
    if context and longest >= context:
        raise ConfigError(
            f"a prompt of {longest} tokens leaves no room in the model's context of "
            f"{context} positions; shorten it"
        )
    if context and longest + max_new_tokens > context:
        raise ConfigError(
            f"a prompt of {longest} tokens and {max_new_tokens} new tokens make "
            f"{longest + max_new_tokens}, past the model's context of {context} positions; "
            "shorten the prompt or --max-new-tokens"
        )
    _check_mesh(mesh)
    return prompts


def _prompts(prompt_ids, vocab: int | None) -> list[list[int]]:
    """``prompt_ids`` as a list of non-empty lists of ids below ``vocab``."""
    given = list(prompt_ids)
    if given and np.ndim(given[0]) == 0:  # one prompt, a flat list of ids
        given = [given]
    if not given:
        raise ConfigError("no prompt: give at least one")
    prompts = []
    for i, prompt in enumerate(given):
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not ids:
            raise ConfigError(f"prompt {i + 1} is empty: a prompt needs at least one token")
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ConfigError(
                f"prompt {i + 1}: id {bad[0]} is not in the model's vocabulary of {vocab}"
            )
        prompts.append(ids)
    return prompts


def _check_mesh(mesh) -> None:
    if mesh is None:
        return
    unused = [f"{a}={mesh.shape[a]}" for a in UNUSED_AXES if mesh.shape.get(a, 1) > 1]
    if unused:
        raise ConfigError(
            f"mesh {', '.join(unused)}: generation runs one token at a time, which pipeline "
            "stages and sequence splits do not serve; use data, fsdp and model"
        )


def _inference_split(model: nnx.Module):
    """(graphdef, params, the rest) of a copy of ``model`` in eval mode (no dropout):
    the caller's model keeps its mode, and its arrays are shared, not copied."""
    copy = nnx.merge(*nnx.split(model))
    copy.eval()
    return nnx.split(copy, nnx.Param, ...)


def _place(params, rest, mesh):
    """The state on the mesh (training's layout) and ``put``: a (B, ...) host array
    with its rows split over the batch axes."""
    if mesh is None:
        return params, rest, jnp.asarray
    params = jax.device_put(params, state_shardings(params, mesh))
    rest = jax.device_put(rest, NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P(BATCH_AXES))
    return params, rest, lambda x: jax.device_put(x, rows)


def _constrain(cache, mesh):
    """The cache's rows over the batch axes, its K heads over ``model`` where it divides
    them: (B, S, K, Dh), or (L, B, S, K, Dh) for a stack."""
    if mesh is None:
        return cache

    def spec(x):
        lead = x.ndim - 4
        rows = BATCH_AXES if x.shape[lead] % batch_shards(mesh) == 0 else None
        heads = "model" if x.shape[lead + 2] % mesh.shape["model"] == 0 else None
        sharding = NamedSharding(mesh, P(*[None] * lead, rows, None, heads, None))
        return jax.lax.with_sharding_constraint(x, sharding)

    return jax.tree.map(spec, cache)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty(graphdef, mesh, rows: int, slots: int, params, rest):
    return _constrain(nnx.merge(graphdef, params, rest).init_cache(rows, slots), mesh)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5,))
def _step(graphdef, sampling, mesh, params, rest, cache, tokens, start, last, key, step):
    """``tokens`` (B, T) (or (B,): one each) at slots ``start`` (B,) -> (the next token
    (B,), its logits (B, vocab) read at index ``last`` (B,) of the T, the new cache)."""
    model = nnx.merge(graphdef, params, rest)
    if tokens.ndim == 1:
        tokens = tokens[:, None]
    h, cache = model.cached_features(tokens, cache, start)  # (B, T, D)
    h = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]  # (B, D): each row's last
    logits = model.head(h).astype(jnp.float32)  # (B, vocab)
    token = choose(logits, jax.random.fold_in(key, step), sampling)
    return token, logits, _constrain(cache, mesh)
