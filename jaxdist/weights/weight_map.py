"""A weight map: how the names and shapes of a weights file match a model's parameters.

A YAML file (``--init-map FILE``) or a shipped one by name (``--init-map gpt2``,
``jaxdist/weights/maps/gpt2.yaml``, which documents the format)::

    params:            # one rule per kind of tensor, file name -> model name
      - from: transformer.h.{i}.attn.c_attn.weight
        to: blocks/{i}/qkv/kernel
        rearrange: d (three h e) -> d (h three e)
        sizes: {three: 3, h: n_heads}
      - from: transformer.wte.weight
        to: tok/embedding
        pad_rows: vocab_size   # the file has vocab_size rows; the model pads its own
    ignore: [lm_head\\.weight]  # regular expressions: tensors of the file left unused
    requires: {tie_embeddings: true}  # model settings the format fixes (below)

Names: literal text with fields, ``{i}`` (digits) or ``{name:REGEX}``; a field binds the
same text on both sides, so each rule reads both ways (``python -m jaxdist.export``
applies the map right to left). A size is a number or a name of the model's config
(``n_heads``, ``vocab_size``, a ``--model-args`` key). Model names are the parameter
paths of the unstacked model (``blocks/0/qkv/kernel``: a scanned stack's layers by
number), as checkpoints name them. Without a map, a file's names are the model's.

``stack: FIELD`` (a field of ``from`` that ``to`` lacks): the tensors of the file that
differ only in that field, numbered 0..N-1, are one parameter's slices along a new
first axis, (N, ...): ``...experts.{j}.w1.weight`` (F, D) each -> ``blocks/{i}/moe/gate``
(E, D, F), each slice rearranged as the rule says. Every number 0..N-1 must be there
once, N the parameter's first axis; a process reads only its devices' slices (an
``expert`` mesh axis splits that axis), and export writes the N tensors back.

``requires``: model settings the file's architecture fixes, each a value or a list of
the values it allows. ``--init-from`` and export refuse a model whose settings differ
(``check_requires``): a switch no tensor shows (a sliding window, which the Llama
format cannot hold) would otherwise pass every shape check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from jaxdist.errors import ConfigError
from jaxdist.weights import rearrange

SHIPPED = Path(__file__).parent / "maps"
RULE_KEYS = {"from", "to", "rearrange", "sizes", "pad_rows", "first_rows", "stack"}


@dataclass
class Rule:
    source: str  # the file's name, with fields
    model: str  # the model's name, with the same fields
    rearrange: str = ""  # file layout -> model layout
    sizes: dict = field(default_factory=dict)  # of the rearrange's axes: int or config name
    pad_rows: int | str | None = None  # the file holds this many rows; the model pads more
    first_rows: bool = False  # the model uses the file's first rows (fewer positions)
    stack: str = ""  # a field of `source` only: its 0..N-1 tensors are axis 0 of `model`

    def __post_init__(self):
        fields = {**_fields(self.model), **_fields(self.source)}  # {x:REGEX} on either side
        self.source_re, self.model_re = _regex(self.source, fields), _regex(self.model, fields)
        self.groups = rearrange.parse(self.rearrange) if self.rearrange else None
        if self.groups and (self.pad_rows is not None or self.first_rows):
            raise ConfigError(f"map rule {self.source}: rearrange and rows in one rule")
        if self.stack and (
            self.stack not in _names(self.source) or self.stack in _names(self.model)
            or self.pad_rows is not None or self.first_rows
        ):  # fmt: skip
            raise ConfigError(
                f"map rule {self.source}: stack {self.stack!r} must be a field of 'from' "
                "and not of 'to', in a rule without pad_rows or first_rows"
            )

    def model_name(self, source: str) -> str | None:
        found = self.source_re.fullmatch(source)
        return _fill(self.model, found.groupdict()) if found else None

    def stack_index(self, source: str) -> int:
        """A stacking rule's slice number of one of its tensors (the ``stack`` field)."""
        return int(self.source_re.fullmatch(source).group(self.stack))

    def source_name(self, model: str, index: int | None = None) -> str | None:
        """The file's name of ``model`` (of its slice ``index`` under ``stack``)."""
        found = self.model_re.fullmatch(model)
        if found is None:
            return None
        fields = found.groupdict() | ({self.stack: str(index)} if self.stack else {})
        return _fill(self.source, fields)


@dataclass
class WeightMap:
    rules: list[Rule]
    ignore: list[re.Pattern] = field(default_factory=list)
    config_json: dict = field(default_factory=dict)  # export: config.json, ${name} filled
    check_keys: list[str] = field(default_factory=list)  # import: config.json must agree
    name: str = "(none)"
    requires: dict = field(default_factory=dict)  # setting -> value or allowed values

    def ignored(self, source: str) -> bool:
        return any(p.fullmatch(source) for p in self.ignore)


def load(spec: str, flag: str = "--init-map") -> WeightMap:
    """``--init-map``: "" (names as they are), a shipped map's name, or a YAML file."""
    if not spec:
        return IDENTITY
    path = SHIPPED / f"{spec}.yaml" if (SHIPPED / f"{spec}.yaml").is_file() else Path(spec)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.yaml")))
        raise ConfigError(f"{flag} {spec}: no such file, nor a shipped map ({shipped})")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{flag} {path}: not valid YAML ({err})") from None
    return from_tree(tree, f"{flag} {spec}")


def from_tree(tree: dict, name: str) -> WeightMap:
    """The map of a parsed YAML file; ``name`` says which in errors ("--init-map F")."""
    unknown = set(tree) - {"params", "ignore", "config_json", "check_keys", "requires"}
    if unknown or not isinstance(tree.get("params"), list):
        raise ConfigError(
            f"{name}: needs a list 'params' (and may have ignore, config_json, check_keys, "
            f"requires){'; unknown: ' + ', '.join(sorted(unknown)) if unknown else ''}"
        )
    if not isinstance(tree.get("requires") or {}, dict):
        raise ConfigError(f"{name}: 'requires' must map settings to values")
    rules = []
    for i, entry in enumerate(tree["params"]):
        if not isinstance(entry, dict) or {"from", "to"} - set(entry) or set(entry) - RULE_KEYS:
            raise ConfigError(
                f"{name}: rule {i + 1} ({entry!r}) needs 'from' and 'to' and may "
                f"have {', '.join(sorted(RULE_KEYS - {'from', 'to'}))}"
            )
        args = {k: v for k, v in entry.items() if k not in ("from", "to")}
        rules.append(Rule(str(entry["from"]), str(entry["to"]), **args))
    try:
        ignore = [re.compile(p) for p in tree.get("ignore") or []]
    except re.error as err:
        raise ConfigError(f"{name}: a bad 'ignore' pattern ({err})") from None
    return WeightMap(
        rules, ignore, dict(tree.get("config_json") or {}), list(tree.get("check_keys") or []),
        name, dict(tree.get("requires") or {}),
    )  # fmt: skip


def check_requires(weight_map: WeightMap, names: dict, what: str) -> None:
    """ConfigError naming each setting of ``names`` that the map's ``requires`` does not
    allow; ``what`` says which model ("the run's model")."""
    wrong = []
    for key, allowed in weight_map.requires.items():
        values = allowed if isinstance(allowed, list) else [allowed]
        if names.get(key) not in values:
            shown = " or ".join(repr(v) for v in values)
            wrong.append(f"{key} is {names.get(key)!r} in {what}, the format holds {shown}")
    if wrong:
        raise ConfigError(f"{weight_map.name}: {'; '.join(wrong)}")


def resolve(value, names: dict, what: str) -> int:
    """A size: an int, or the name of a model config value."""
    if isinstance(value, int):
        return value
    if isinstance(value, str) and isinstance(names.get(value), int):
        return names[value]
    raise ConfigError(f"{what}: size {value!r} is neither a number nor a model setting")


def fill_config(template: dict, names: dict) -> dict:
    """``config_json`` with each ``${name}`` replaced by the model setting."""
    out = {}
    for key, value in template.items():
        found = re.fullmatch(r"\$\{(\w+)\}", value) if isinstance(value, str) else None
        if found and found.group(1) not in names:
            raise ConfigError(f"config_json {key}: {value} is not a model setting")
        out[key] = names[found.group(1)] if found else value
    return out


FIELD = re.compile(r"\{(\w+)(?::([^{}]+))?\}")


def _fields(template: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in FIELD.finditer(template) if m.group(2)}


def _names(template: str) -> set[str]:
    return {m.group(1) for m in FIELD.finditer(template)}


def _regex(template: str, fields: dict[str, str]) -> re.Pattern:
    """A regex of the literal text with a named group per field ("a.{i}.b{x:[qkv]}"): a
    field matches digits unless either side of the rule gives its regex."""
    parts, at = [], 0
    for found in FIELD.finditer(template):
        parts.append(re.escape(template[at : found.start()]))
        name = found.group(1)
        parts.append(f"(?P<{name}>{fields.get(name, '[0-9]+')})")
        at = found.end()
    parts.append(re.escape(template[at:]))
    try:
        return re.compile("".join(parts))
    except re.error as err:
        raise ConfigError(f"map name {template!r}: {err}") from None


def _fill(template: str, fields: dict) -> str:
    return FIELD.sub(lambda m: fields[m.group(1)], template)


# no --init-map: the file names tensors as the model does (what export writes without --map)
IDENTITY = WeightMap([Rule("{name:.+}", "{name}")], name="(none: the model's own names)")
