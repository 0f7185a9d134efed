"""``--init-from``: a model's parameters from safetensors, each process reading only the
regions its devices hold.

``plan`` pairs every tensor of the file with a model parameter through the weight map
and checks the pairing before anything is read: each parameter matched exactly once,
each tensor of the file used or ignored, each shape what the map makes of it. Its error
lists everything unmatched, on both sides, with shapes. ``read`` then builds one region
of a parameter: ``jax.make_array_from_callback`` asks for each device's region, and
only those bytes of the file are read (a folder of shards: only the files they are in).
A rule's ``stack`` makes one parameter of N tensors (a mixture's experts, (E, ...)):
a region's slices of axis 0 are read from those tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.weights import rearrange
from jaxdist.weights.files import Reader
from jaxdist.weights.weight_map import Rule, WeightMap, check_requires, fill_config, resolve

SHOWN = 12  # unmatched names listed per side; the count says how many more


@dataclass
class Source:
    name: str  # the tensor in the file
    rule: Rule
    shape: tuple[int, ...]  # in the file (a stack's: each of its tensors')
    parts: tuple[str, ...] = ()  # a stacking rule's tensors, slice 0 first


def plan(
    reader: Reader, weight_map: WeightMap, model: dict[str, tuple[int, ...]], names: dict
) -> dict[str, Source]:
    """Model parameter -> the tensor it is read from; a ConfigError lists every problem."""
    found: dict[str, list[Source]] = {}
    unused = []
    for tensor, (shape, _) in reader.shapes.items():
        hit = next(((m, r) for r in weight_map.rules if (m := r.model_name(tensor)) in model), None)
        if hit is None:
            if not weight_map.ignored(tensor):
                unused.append(f"{tensor} {list(shape)}")
            continue
        found.setdefault(hit[0], []).append(Source(tensor, hit[1], shape))
    stacks, bad_stacks = [], set()
    for m, sources in found.items():
        if sources[0].rule.stack and all(s.rule is sources[0].rule for s in sources):
            stacked = _stacked(sources)
            if isinstance(stacked, Source):
                found[m] = [stacked]
            else:  # what is wrong with them
                stacks.append(f"{m} <- {sources[0].rule.source}: {stacked}")
                found[m], bad_stacks = sources[:1], bad_stacks | {m}
    missing = [f"{m} {list(s)}" for m, s in model.items() if m not in found]
    twice = [f"{m} <- {', '.join(s.name for s in v)}" for m, v in found.items() if len(v) > 1]
    shapes = []
    for m, sources in found.items():
        problem = "" if m in bad_stacks else _misfit(sources[0], model[m], names)
        if problem:
            shapes.append(f"{sources[0].name} -> {m}: {problem}")
    problems = [
        _listed("parameters of the model that no tensor of the file gives", missing),
        _listed("tensors of the file that match no parameter (nor 'ignore')", unused),
        _listed("parameters matched more than once", twice),
        _listed("stacks whose tensors are not numbered 0..N-1 once each, of one shape", stacks),
        _listed("shapes that do not fit", shapes),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(
            f"--init-from {reader.path} with {weight_map.name}: " + "; ".join(problems)
        )
    return {m: v[0] for m, v in found.items()}


def _stacked(sources: list[Source]) -> Source | str:
    """A stacking rule's tensors as one Source (``parts`` by slice number), or what is
    wrong with them: a number missing or twice, shapes that differ."""
    rule = sources[0].rule
    by_index: dict[int, list[Source]] = {}
    for source in sources:
        by_index.setdefault(rule.stack_index(source.name), []).append(source)
    gaps = sorted(set(range(max(by_index) + 1)) - set(by_index))
    twice = sorted(j for j, v in by_index.items() if len(v) > 1)
    shapes = {s.shape for s in sources}
    if gaps or twice or len(shapes) > 1:
        return "; ".join(filter(None, [
            gaps and f"no {rule.stack}={', '.join(map(str, gaps))}",
            twice and f"{rule.stack}={', '.join(map(str, twice))} more than once",
            len(shapes) > 1 and f"shapes {sorted(map(list, shapes))}",
        ]))  # fmt: skip
    parts = tuple(by_index[j][0].name for j in range(len(by_index)))
    return Source(parts[0], rule, sources[0].shape, parts)


def _listed(what: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return f"{len(items)} {what}: {', '.join(items[:SHOWN])}{more}"


def _misfit(source: Source, model_shape: tuple[int, ...], names: dict) -> str:
    """What is wrong with reading ``source`` into a parameter of ``model_shape``, or ""."""
    rule, shape = source.rule, source.shape
    if source.parts:  # (N, what each of the N tensors makes)
        if not model_shape or len(source.parts) != model_shape[0]:
            return f"{len(source.parts)} tensors stacked, the model has {list(model_shape)}"
        return _misfit(Source(source.name, rule, shape), tuple(model_shape[1:]), names)
    what = f"{source.name} ({rule.rearrange})"
    if rule.groups:
        sizes = _sizes(rule, names)
        made = rearrange.out_shape(*rule.groups, shape, sizes, what)
    elif rule.pad_rows is not None:
        rows = resolve(rule.pad_rows, names, f"{source.name} pad_rows")
        if not shape or shape[0] != rows:
            return f"pad_rows {rule.pad_rows}={rows}, the file has {list(shape)}"
        made = (max(rows, model_shape[0]), *shape[1:]) if rows <= model_shape[0] else shape
    elif rule.first_rows:
        made = (model_shape[0], *shape[1:]) if shape and shape[0] >= model_shape[0] else shape
    else:
        made = shape
    if tuple(made) != tuple(model_shape):
        return f"the file's {list(shape)} makes {list(made)}, the model has {list(model_shape)}"
    return ""


def _sizes(rule: Rule, names: dict) -> dict[str, int]:
    return {k: resolve(v, names, f"{rule.source} sizes") for k, v in rule.sizes.items()}


def read(reader: Reader, source: Source, index: tuple, shape, names: dict) -> np.ndarray:
    """``parameter[index]`` (index: a tuple of slices of the model's ``shape``)."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=False))
    index = index + tuple(slice(0, n) for n in shape[len(index) :])
    rule = source.rule
    if source.parts:  # the slices index[0] of axis 0, each read from its own tensor only
        return np.stack([
            read(reader, Source(source.parts[j], rule, source.shape), index[1:], shape[1:], names)
            for j in range(index[0].start, index[0].stop)
        ])  # fmt: skip
    if rule.groups:
        return rearrange.read(
            lambda at: reader.read(source.name, at), source.shape, *rule.groups,
            _sizes(rule, names), index, source.name,
        )  # fmt: skip
    if rule.pad_rows is None or not index:
        return reader.read(source.name, index)
    rows = index[0]  # the model's rows past the file's are padding: zeros
    held = slice(min(rows.start, source.shape[0]), min(rows.stop, source.shape[0]))
    part = reader.read(source.name, (held, *index[1:])) if held.stop > held.start else None
    out_shape = (rows.stop - rows.start, *(s.stop - s.start for s in index[1:]))
    out = np.zeros(out_shape, part.dtype if part is not None else np.float32)
    if part is not None:
        out[: part.shape[0]] = part
    return out


def init_params(dp, state, path: str, weight_map: WeightMap, names: dict):
    """``state`` (a ``Parallel``'s) with its parameters and batch statistics read from
    ``path``; the rest (optimizer, step, RNG) as it was: training starts afresh from them."""
    import jax

    targets = dp.named_targets  # checkpoint names -> ShapeDtypeStruct, in the layout
    model = {}  # "blocks/0/qkv/kernel" -> "params/blocks/0/qkv/kernel"
    for full in targets:
        kind, _, name = full.partition("/")
        if kind in ("params", "batch_stats"):
            model[name] = full
    reader = Reader(path)
    check_requires(weight_map, names, "the model")
    check_config_json(reader, weight_map, names)
    sources = plan(reader, weight_map, {m: targets[f].shape for m, f in model.items()}, names)
    arrays = dp.named_state(state)
    for name, full in model.items():
        target = targets[full]
        cache: dict[str, np.ndarray] = {}  # replicas ask for the same region: read it once

        def region(index, name=name, target=target, cache=cache):
            key = repr(index)
            if key not in cache:
                part = read(reader, sources[name], index, target.shape, names)
                cache[key] = np.asarray(part).astype(target.dtype)
            return cache[key]

        arrays[full] = jax.make_array_from_callback(target.shape, target.sharding, region)
    return dp.from_named(arrays)


def check_config_json(reader: Reader, weight_map: WeightMap, names: dict) -> None:
    """The folder's ``config.json`` (Hugging Face's) against the model's settings, for
    the map's ``check_keys``: a GPT-2 of 12 heads read into a model of 4 is refused here,
    naming both, rather than read into the wrong shapes or, worse, the right ones."""
    config_file = reader.path / "config.json"
    if not weight_map.check_keys or not config_file.is_file():
        return
    import json

    theirs = json.loads(config_file.read_text())
    from jaxdist.weights.maps import hf_llama

    if theirs.get("model_type") in hf_llama.FAMILIES:  # as transformers reads it
        theirs = hf_llama.normalized(theirs, f"--init-from {reader.path}")
    ours = fill_config({k: weight_map.config_json[k] for k in weight_map.check_keys}, names)
    wrong = [
        f"{key} is {theirs[key]!r} there, {value!r} here"
        for key, value in ours.items()
        if key in theirs and not _same(theirs[key], value)
    ]
    if wrong:
        raise ConfigError(
            f"--init-from {reader.path}: its config.json differs from the model "
            f"({'; '.join(wrong)}): set the model's flags to match (the map, "
            f"{weight_map.name}, says which setting each key is)"
        )


def _same(a, b) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1)
    return a == b
