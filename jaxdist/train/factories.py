"""Calling a user's factory (``--model pkg.mod:fn``, ``--data pkg.mod:fn``) by parameter
name: what jaxdist supplies goes to the parameter of that name, ``--model-args`` to the
others, so ``make_resnet18(num_classes=10)`` or a model class works as it is written."""

from __future__ import annotations

import importlib
import inspect
import re
import traceback
from collections.abc import Callable
from typing import Any

import yaml

from jaxdist.errors import ConfigError, JaxdistError

_P = inspect.Parameter
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def import_object(ref: str, what: str):
    """Imports ``package.module:name``; a clear ConfigError when it cannot."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {ref!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{what} {ref!r}: cannot import module {module_name!r}: {err}") from None
    except (Exception, SystemExit) as err:  # the module's own code failed as it ran
        raise ConfigError(
            f"{what} {ref!r}: importing module {module_name!r} raised {describe_exception(err)}"
        ) from None
    if not hasattr(module, attr):
        raise ConfigError(f"{what} {ref!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def describe_exception(err: BaseException) -> str:
    """``RuntimeError: boom (at my_models.py:3)`` on one line: the type, the first line
    of the message, and where it was raised (a SyntaxError names its own place)."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    frames = traceback.extract_tb(err.__traceback__)
    if frames and not isinstance(err, SyntaxError):
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


def parse_model_args(text: str) -> dict[str, Any]:
    """``"num_classes=10,widths=[64,64],bias=true"`` -> ``{"num_classes": 10, "widths":
    [64, 64], "bias": True}``: values read as YAML; commas inside brackets or quotes do not
    split."""
    out: dict[str, Any] = {}
    for item in _split_top_level(text):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key.isidentifier():
            raise ConfigError(
                f"--model-args: {item!r} is not key=value (e.g. num_classes=10,widths=[64,64])"
            )
        if key in out:
            raise ConfigError(f"--model-args: {key} is given twice")
        out[key] = _value(key, value)
    return out


def _value(key: str, text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:  # one line: the problem, not YAML's source excerpt
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"--model-args: {key}={text} is not a YAML value ({problem})") from None
    if isinstance(value, str) and NUMBER.fullmatch(value):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    return value


def _split_top_level(text: str) -> list[str]:
    items, current, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def signature(factory) -> inspect.Signature | None:
    """The parameters ``factory`` takes. For a class, those of the first ``__init__`` in
    its MRO with named parameters: a subclass's ``(*args, **kwargs)`` pass-through, and
    the metaclass ``__call__`` that ``inspect.signature`` may report, say nothing. None
    when nothing says."""
    if not inspect.isclass(factory):
        try:
            return inspect.signature(factory)
        except (TypeError, ValueError):  # some builtins have none
            return None
    for klass in factory.__mro__[:-1]:  # object.__init__ takes nothing of ours
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = list(inspect.signature(init).parameters.values())[1:]  # less self
        except (TypeError, ValueError):
            continue
        if any(p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) for p in params):
            return inspect.Signature(params)
    return None


def bind(
    factory,
    what: str,
    supplied: dict[str, Callable[[], Any]],
    extra: dict[str, Any] | None = None,
    *,
    fallback: str | None = None,
) -> Callable[[], Any]:
    """``factory`` as a zero-argument call, checked now, made later (e.g. inside
    ``jax.jit``). A parameter named in ``supplied`` gets ``supplied[name]()``; one named in
    ``extra`` (``--model-args``) that value; others keep their defaults. Without a
    signature, ``fallback`` (a supplied name) and ``extra`` are passed by keyword.

    A required parameter nothing supplies, or an ``extra`` key the factory does not take,
    is a ConfigError naming the factory, the parameter and what it accepts."""
    extra = dict(extra or {})
    name = getattr(factory, "__qualname__", None) or repr(factory)
    reserved = sorted(set(extra) & set(supplied))
    if reserved:
        raise ConfigError(f"{what}: --model-args {reserved[0]} is supplied by jaxdist")
    sig = signature(factory)
    if sig is None:
        names = ([fallback] if fallback else []) + list(extra)
        return _call(factory, [], {k: supplied.get(k) or _const(extra[k]) for k in names}, what)
    params = sig.parameters
    takes_any = any(p.kind is _P.VAR_KEYWORD for p in params.values())
    named = {k for k, p in params.items() if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
    unknown = [k for k in extra if k not in named and not (takes_any and k not in params)]
    if unknown:
        raise ConfigError(
            f"{what}: {name} takes no parameter {unknown[0]!r} (from --model-args); it "
            f"accepts {name}{sig}"
        )
    args, kwargs = [], {}
    for param in params.values():
        if param.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            continue
        make = _const(extra.pop(param.name)) if param.name in extra else supplied.get(param.name)
        if make is None and param.default is _P.empty:
            raise ConfigError(_missing(what, name, sig, param.name, supplied))
        if param.kind is _P.POSITIONAL_ONLY:
            args.append(make or _const(param.default))
        elif make is not None:
            kwargs[param.name] = make
    kwargs.update({k: _const(v) for k, v in extra.items()})  # the rest go to **kwargs
    return _call(factory, args, kwargs, what)


def _missing(what: str, name: str, sig, param: str, supplied: dict) -> str:
    hint = "; give the others with --model-args key=value,..." if what.startswith("--model") else ""
    return (
        f"{what}: {name} needs parameter {param!r}, which nothing supplies; it accepts "
        f"{name}{sig}; jaxdist passes {', '.join(supplied)} by name{hint}"
    )


def _const(value) -> Callable[[], Any]:
    return lambda: value


def _call(factory, args: list, kwargs: dict, what: str) -> Callable[[], Any]:
    """The call, whose failure is one ConfigError naming the factory and the exception."""
    name = getattr(factory, "__qualname__", None) or repr(factory)

    def call():
        positional, named = [make() for make in args], {k: make() for k, make in kwargs.items()}
        try:
            return factory(*positional, **named)
        except JaxdistError:
            raise
        except Exception as err:
            raise ConfigError(f"{what}: {name} raised {describe_exception(err)}") from err

    return call
