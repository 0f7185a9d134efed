"""The command line's flags: one per config field (``--global-batch-size`` and the dotted
``--train.global_batch_size``), parsed by argparse, whose every error is one
``ConfigError`` line (exit 2), never its usage, which lists every flag."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from typing import Any, Literal

from jaxdist.errors import ConfigError
from jaxdist.train.config_checks import flag_name

PROG = "python -m jaxdist.train"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a ConfigError: one ``jaxdist: error:`` line and exit 2
    (``jaxdist.train.ending``). argparse's own prints the usage first, some 75 lines
    burying the one that says what is wrong."""

    def error(self, message: str):
        raise ConfigError(message)


def build_parser(leaf_fields) -> argparse.ArgumentParser:
    """A flag for each (section, field, type) of ``leaf_fields``; a bool also gets
    ``--no-flag``. Only the flags given are set (``SUPPRESS``): YAML values stand."""
    parser = OneLineParser(
        prog=PROG, description="Data-parallel training of a Flax model on every visible device."
    )
    parser.add_argument("--config", help="YAML file with sections model/optim/train")
    for section, f, typ in leaf_fields:
        kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
        if typing.get_origin(typ) is Literal:
            kwargs["choices"] = typing.get_args(typ)
        elif typ is bool:  # "--flag" alone means true; "--flag false" also works
            kwargs.update(type=_cli_bool, nargs="?", const=True)
            no_flag = "--no-" + flag_name(f).removeprefix("--")  # and "--no-flag"
            parser.add_argument(
                no_flag,
                dest=kwargs["dest"],
                action="store_const",
                const=False,
                default=argparse.SUPPRESS,
                help=f"{section}.{f.name} = false",
            )
        else:
            kwargs["type"] = typ if typ in (int, float) else str
        default = f.default if f.default is not dataclasses.MISSING else None
        kwargs["help"] = f"{section}.{f.name} (default: {default!r})"
        parser.add_argument(flag_name(f), f"--{section}.{f.name}", **kwargs)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> dict[str, Any]:
    """The flags given, by dotted name (and ``config``); ConfigError for any error."""
    known, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(_unrecognized(unknown, parser))
    return vars(known)


def _unrecognized(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's words for unknown arguments, and the real flag closest to the first
    unknown one, if one is close: a typo (``--stepz``) is the usual cause."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flag = next((a.split("=", 1)[0] for a in unknown if a.startswith("--")), None)
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    # 0.7: --stepz -> --steps, --batch-size -> --global-batch-size; nothing for a mere
    # shared prefix (--no-such-flag is not --no-scan-layers)
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.7) if flag else []
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{message}{hint} ({PROG} --help lists the flags)"


def _cli_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")
