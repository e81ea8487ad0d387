"""Command-line flags from dataclasses: one `--field` per field, booleans as `--flag/--no-flag`."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def dataclass_parser(cls: type, description: str) -> argparse.ArgumentParser:
    """An argparse parser for the fields of dataclass `cls`; help from `field(metadata={"help": ...})`."""
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        kind = hints[item.name]
        default = item.default if item.default is not dataclasses.MISSING else None
        options: dict[str, Any] = {"default": default, "required": item.default is dataclasses.MISSING}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = (
                next(a for a in typing.get_args(kind) if a is not type(None))
                if isinstance(kind, types.UnionType)
                else kind
            )
        options["help"] = f"{item.metadata.get('help', '')} (default: {default})".lstrip()
        parser.add_argument(f"--{item.name}", **options)
    return parser


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (beam sizes, batch sizes, token counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_length_penalty_form(parser: argparse.ArgumentParser) -> None:
    """`--length_penalty_form power|gnmt` for the scripts that decode; unset means the model's own."""
    from .modeling_vanilla_transformer import LENGTH_PENALTY_FORMS

    parser.add_argument(
        "--length_penalty_form",
        choices=LENGTH_PENALTY_FORMS,
        help="power: |Y|^alpha (transformers); gnmt: the paper's ((5 + |Y|) / 6)^alpha "
        "(default: the model's)",
    )


def parse_dataclass(cls: type[T], description: str, argv: Sequence[str] | None = None) -> T:
    """Parse flags into `cls`; a ValueError from its validation exits with the usage, like a bad flag."""
    parser = dataclass_parser(cls, description)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


__all__ = ["add_length_penalty_form", "dataclass_parser", "parse_dataclass", "positive_int"]
