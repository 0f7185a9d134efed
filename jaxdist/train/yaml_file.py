"""The ``--config`` YAML file, read: plain YAML only, every problem one ``ConfigError``."""

from __future__ import annotations

from pathlib import Path

import yaml

from jaxdist.errors import ConfigError


def load_yaml(path: Path) -> dict:
    """The ``--config`` file as a mapping. Plain YAML only (``yaml.safe_load``: a
    ``!!python/...`` tag is refused); any problem is one ConfigError naming the file and,
    for bad YAML, the line, the column and the problem."""
    if not path.is_file():
        raise ConfigError(f"--config: no such file {path}")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: {_yaml_problem(err)}") from None
    if not isinstance(loaded, dict | None):
        raise ConfigError(f"--config {path}: top level must be a mapping")
    return loaded or {}


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``line 3, column 7: mapping values are not allowed here``: YAML's own message
    without its excerpt of the file."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    if "tag:yaml.org,2002:python/" in problem:
        problem += " (Python tags are not read: write plain values)"
    return f"not valid YAML: {where}{problem}"
