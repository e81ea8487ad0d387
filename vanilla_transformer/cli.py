"""Command-line helpers: flags from dataclasses (one `--field` per field, booleans as
`--flag/--no-flag`), argument types, and output files that are replaced only when complete."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import stat
import sys
import threading
import types
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")


class InputError(ValueError):
    """The user's input (flags, data files, a checkpoint to resume) cannot be used as given; the message
    says why. Scripts print it alone: a traceback would point at this package, not at the input."""


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends with each option's default, unless the help states it already ("(default:
    recipe)"), the option is required, or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.required or action.default in (None, "", argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def json_field(path: Path, name: str) -> Any:
    """`name` of the JSON object in `path`; None where the file, the object or the field is missing."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))  # not the locale's (tokenizer.json's "\u2581")
    except (OSError, ValueError):
        return None
    return value.get(name) if isinstance(value, dict) else None


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name when it
    has none: enough to name a library's failure in a one-line error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def dataclass_parser(cls: type, description: str) -> argparse.ArgumentParser:
    """An argparse parser for the fields of dataclass `cls`; help from `field(metadata={"help": ...})`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=DefaultsOnce)
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        kind = hints[item.name]
        default = item.default if item.default is not dataclasses.MISSING else None
        options: dict[str, Any] = {"default": default, "required": item.default is dataclasses.MISSING}
        if kind is bool or (
            isinstance(kind, types.UnionType) and set(typing.get_args(kind)) == {bool, type(None)}
        ):
            options["action"] = argparse.BooleanOptionalAction  # `bool | None`: unset stays None
        else:
            options["type"] = (
                next(a for a in typing.get_args(kind) if a is not type(None))
                if isinstance(kind, types.UnionType)
                else kind
            )
        # argparse prints no help line for an empty help, so a field without one shows its default alone
        # (where it has one: not "(default: None)").
        shown = default not in (None, "") and not options["required"]
        options["help"] = item.metadata.get("help") or ("(default: %(default)s)" if shown else "")
        parser.add_argument(f"--{item.name}", **options)
    return parser


LARGEST_INT = 2**63 - 1  # what torch and CTranslate2 take: integer flags are refused above it


def _int_from(text: str, least: int, kind: str) -> int:
    """An argparse integer of at least `least`, `kind` naming what it must be in the messages."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {kind}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a {kind}, got {value}")
    if value > LARGEST_INT:  # torch and CTranslate2 take 64-bit integers: a traceback from inside them
        raise argparse.ArgumentTypeError(f"must be at most {LARGEST_INT} (2**63 - 1), got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (beam sizes, batch sizes, token counts)."""
    return _int_from(text, 1, "positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0 (a size where 0 means off)."""
    return _int_from(text, 0, "non-negative integer (0: off)")


def input_bytes(value: str) -> IO[bytes]:
    """argparse type: a file opened to read bytes, "-" for standard input, as `argparse.FileType("rb")`,
    except that a closed standard input (a shell's `<&-`, a service started without one) is the flag's
    error, not an AttributeError traceback from inside argparse."""
    if value == "-" and sys.stdin is None:
        raise argparse.ArgumentTypeError("standard input is closed; name a file to read (--input FILE)")
    return argparse.FileType("rb")(value)


def check_output_file(output: str | Path, *inputs: str | Path | IO | None) -> Path:
    """An output file's path, checked before any work: its folder exists, it is not a folder, the folder
    can be written where the file is written beside its name and renamed (`replaced_when_complete`), it
    is none of the `inputs` (paths, or files open for reading, standard input included) and no existing
    file inside an input that is a folder (a model folder: writing it would destroy them). Raises
    ValueError saying which. A new file inside an input folder is allowed."""
    path = Path(output)
    if path.is_dir():
        raise ValueError(f"{output} is a folder; name a file to write.")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise ValueError(f"{output}: the folder {folder} does not exist.")
    if not _written_through(path) and not os.access(folder, os.W_OK):
        raise ValueError(
            f"{output}: the folder {folder} is not writable (read-only, or another user's); the file is "
            "written there beside its name, then renamed. Name a file in a writable folder."
        )
    if not path.exists():
        return path
    from .publishing import mount_points

    status = os.stat(path)
    # The entry named `path` is what is replaced (a link there, not its target): its folder resolved
    if stat.S_ISREG(status.st_mode) and path.absolute().parent.resolve() / path.name in mount_points():
        raise ValueError(
            f"{output} is a mount point (a file mounted on its own, as `docker run -v FILE:{output}` does). "
            "The file is written beside it and renamed into place, which cannot replace a mount point: "
            "name a file in a mounted folder instead."
        )
    for given in inputs:  # an open input (standard input too): the file or pipe it reads, by any name
        if hasattr(given, "fileno") and os.path.samestat(os.fstat(given.fileno()), status):
            reads = "standard input reads it" if given.name == "<stdin>" else given.name
            if stat.S_ISREG(status.st_mode):
                raise ValueError(f"{output} is also an input ({reads}); writing it would destroy it.")
            if stat.S_ISFIFO(status.st_mode):  # (`--output /dev/stdin`, input piped in): a write end of its
                # own input held open in this process, which then waits for the pipe's end forever
                raise ValueError(f"{output} is the pipe an input reads ({reads}); name another output.")
    if not stat.S_ISREG(status.st_mode):
        return path  # a device or a pipe is written, not replaced: no input can be destroyed through it
    # The output replaces the entry named `path` (a symlink there is replaced, not what it points to), so
    # what counts is the folder that entry lives in and that folder's parents.
    folders = [
        folder for folder in (path.absolute().parent, *path.absolute().parent.parents) if folder.exists()
    ]
    for given in inputs:
        if hasattr(given, "fileno") or given is None or not Path(given).exists():  # open ones: above
            continue
        if Path(given).is_dir():
            if any(os.path.samefile(folder, given) for folder in folders):
                raise ValueError(
                    f"{output} is a file of the input folder {given}; writing it would destroy it. Name "
                    "a new file."
                )
        elif os.path.samefile(path, given):
            raise ValueError(f"{output} is also an input ({given}); writing it would destroy it.")
    return path


def _written_through(path: Path) -> bool:
    """Whether `replaced_when_complete` writes `path` directly rather than beside it and renaming: a path
    that is not a regular file (a device, a pipe), or any path under /dev or /proc."""
    special = os.name == "posix" and path.absolute().parts[1:2] in (("dev",), ("proc",))  # not C:\\dev
    return special or (path.exists() and not stat.S_ISREG(os.stat(path).st_mode))


@contextmanager
def replaced_when_complete(path: str | Path, binary: bool = False) -> Iterator[IO[Any]]:
    """A UTF-8 text stream (a byte stream with `binary`) whose contents become `path` only when the block
    ends without an exception (written beside it under a name of its own, then renamed): an interrupted or
    failed run leaves the old file, never half of a new one, and two runs writing the same path leave one's
    file whole.

    A path that is not a regular file (a device such as /dev/null, a named pipe, the /dev/fd/N of a
    shell's `>(...)`), or any path under /dev or /proc (/dev/stdout is a link to whatever standard output
    is, a regular file too), is written directly: renaming would replace it with a file."""
    path = Path(path)
    mode, encoding = ("wb", None) if binary else ("w", "utf-8")
    if _written_through(path):
        with path.open(mode, encoding=encoding) as stream:
            yield stream
        return
    # A name of this writer's own; created with mode 0666, which the system narrows by the umask.
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    # SIGTERM (`kill`, `timeout`, a job scheduler) and SIGHUP (the terminal closed, an ssh session
    # dropped) would end the process without this block's cleanup: while it runs, each ends the process
    # as Ctrl-C does, through the `finally` below (exit status 128 + its number: 143, 129). Only over the
    # default action: a handler of the program's own, or the signal ignored (`nohup`), stays as it is.
    restore = {}
    if threading.current_thread() is threading.main_thread():
        for number in (getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)):
            if signal.getsignal(number) is signal.SIG_DFL:
                restore[number] = signal.signal(number, lambda signum, frame: sys.exit(128 + signum))
    try:
        with open(handle, mode, encoding=encoding) as stream:
            yield stream
        with contextlib.suppress(FileNotFoundError):  # a file replaced keeps its mode
            os.chmod(partial, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        for number, handler in restore.items():
            signal.signal(number, handler)


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


def utf8_stdout() -> None:
    """Write standard output in UTF-8, as files are, whatever the locale's encoding: with Windows' cp1252
    (output redirected to a file) a script that prints a translation, a sample sentence or a token
    ("\u2581" starts every word) ended in a UnicodeEncodeError after its work was done. A stream put in its
    place that cannot be reconfigured is left as it is."""
    if callable(getattr(sys.stdout, "reconfigure", None)):
        sys.stdout.reconfigure(encoding="utf-8")


__all__ = [
    "DefaultsOnce",
    "add_length_penalty_form",
    "check_output_file",
    "dataclass_parser",
    "first_line",
    "input_bytes",
    "json_field",
    "parse_dataclass",
    "positive_int",
    "replaced_when_complete",
    "utf8_stdout",
]
