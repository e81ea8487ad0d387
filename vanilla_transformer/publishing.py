"""Replace a model folder all at once: a reader (or a resumed run) sees the old folder or the new one,
never a mix, whatever moment the writing process is killed at.

The new files are written into a hidden sibling, `.NAME.partial`, renamed `.NAME.ready` once complete.
Publishing then moves everything of the old folder that the new one does not replace (the run's
checkpoints, logs and tokenizer, a user's own files) into `.NAME.ready`, renames the old folder
`.NAME.replaced`, renames `.NAME.ready` to NAME and deletes `.NAME.replaced`. Every step is one rename
on one file system, and `finish_interrupted_publish` completes (or undoes) whatever a kill left
half done; training calls it before it reads anything from its output folder.
"""

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from .cli import first_line

try:
    import fcntl
except ImportError:  # Windows: folders are not locked
    fcntl = None

logger = logging.getLogger(__name__)

# A tokenizer that AutoTokenizer loads from a folder: a fast tokenizer, or a configuration naming one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds one of `TOKENIZER_FILES`."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_has_tokenizer(folder: str | Path) -> None:
    """A FileNotFoundError naming `folder` where it holds no tokenizer (`has_tokenizer`)."""
    if not has_tokenizer(folder):
        raise FileNotFoundError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}).")


# The JSON files transformers reads from a model folder. It reads a generation_config.json that is not
# valid JSON (a copy cut short, a full disk) as none at all, without a word: greedy search instead of the
# model's beam search. A broken tokenizer file fails with the parser's message alone, naming no file.
FOLDER_JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def read_json_object(path: Path) -> dict:
    """The JSON object in file `path`; a ValueError says what it holds instead."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    except OSError as error:  # unreadable (permissions, a folder by that name): transformers reads none
        raise ValueError(f"{path} cannot be read: {error.strerror or error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object.")
    return value


def check_folder_json(folder: str | Path) -> None:
    """Raise a ValueError naming the first of `FOLDER_JSON_FILES` in `folder` that is not a JSON object."""
    for name in FOLDER_JSON_FILES:
        if (Path(folder) / name).is_file():
            read_json_object(Path(folder) / name)


def check_files_readable(folder: str | Path) -> None:
    """Raise PermissionError naming the first file of `folder` that loading a model reads (weights, JSON
    settings, tokenizer files, sentencepiece's too, a chat template, modeling code) and this process
    cannot open: safetensors reports an unreadable weights file as missing ("No such file or
    directory"), and a folder written by another user with mode 0600 files is common. Other files (a
    log, an editor's swap file) are not its business."""
    for path in sorted(Path(folder).iterdir()):
        if (
            path.suffix not in {".safetensors", ".bin", ".json", ".py", ".model", ".spm", ".txt", ".jinja"}
            or not path.is_file()
        ):
            continue
        try:
            path.open("rb").close()
        except OSError as error:
            raise PermissionError(
                f"{path} cannot be read ({error.strerror or error}): it may belong to another user; ask "
                "them for read access (chmod a+r), or copy the folder."
            ) from error


def hidden_sibling(folder: str | Path, kind: str) -> Path:
    """`.NAME.kind` beside `folder` (a link: beside its target; "..": beside the folder itself)."""
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.{kind}"


def staging_paths(folder: str | Path) -> tuple[Path, Path, Path]:
    """The hidden siblings of `folder`: (being written, complete, old folder being replaced)."""
    return tuple(hidden_sibling(folder, kind) for kind in ("partial", "ready", "replaced"))


def check_renamable(folder: str | Path) -> None:
    """Raise ValueError if a folder written beside `folder` could not be renamed into its place: `folder`
    is a mount point (a Docker or Kubernetes volume, say), a file system of its own, and a rename does
    not cross file systems. A folder inside it can be replaced."""
    folder = Path(folder).resolve()
    if folder.is_dir() and (os.path.ismount(folder) or folder in mount_points()):
        raise ValueError(
            f"{folder} is a mount point (a file system of its own). The finished folder is written beside "
            f"it and renamed into place, which cannot cross file systems: name a folder inside it, such as "
            f"{folder / 'model'}."
        )


def check_not_dangling_link(folder: str | Path) -> None:
    """Raise ValueError if `folder` is a symbolic link to a folder not yet made: a run writes into it
    (its tokenizer, Trainer's checkpoints), and making a folder inside a dangling link fails."""
    if Path(folder).is_symlink() and not Path(folder).exists():
        raise ValueError(
            f"{folder} is a symbolic link to {os.readlink(folder)}, which does not exist: make that folder "
            "first, or name another."
        )


def check_writable_place(folder: str | Path) -> None:
    """Raise ValueError, naming `folder` as given first, unless it can be written as `publish_folder`
    writes it: the first of its parents that exists must be a folder (not a file) that can be written
    (the new folder and its hidden siblings are made there), and `folder`, where it exists, writable too
    (its other files are moved out of it). Without this check such a folder failed only once the work
    was done, with a traceback."""
    path = Path(folder).resolve()  # a link: its target; "..": the folder it names
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        raise ValueError(f"{folder} cannot be written: {existing} is a file, not a folder.")
    for place in (existing, path):
        if place.exists() and not os.access(place, os.W_OK):
            raise ValueError(
                f"{folder} cannot be written: {place} is not writable (read-only, or another user's); name "
                "a folder in a writable place."
            )


def check_not_current_folder(folder: str | Path) -> None:
    """Raise ValueError if `folder` is the current folder or holds it (an empty name, an unset shell
    variable, is the current folder): it is written beside itself and renamed into place, which would
    leave this process, and the shell that started it, in a folder that no longer exists."""
    path, here = Path(folder).resolve(), Path.cwd().resolve()
    if path == here or path in here.parents:
        named = str(folder) or "'' (an empty name)"
        raise ValueError(
            f"{named} is the current folder or holds it; the folder is "
            "written beside it and renamed into place, so name a subfolder."
        )


def check_new_folder(folder: str | Path) -> None:
    """Raise ValueError unless `folder` is absent or empty (a tool that writes a whole folder must not mix
    its files into another's), is not the current folder (`check_not_current_folder`), could be renamed
    into place (`check_renamable`) and can be written there (`check_writable_place`)."""
    check_not_current_folder(folder)
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} exists and is not an empty folder; name a new one.")
    check_renamable(folder)
    check_writable_place(folder)


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> set[Path]:
    """Linux's mount points, bind mounts of a folder of the same file system included (which
    `os.path.ismount` does not see, and across which a rename fails all the same); empty elsewhere."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return set()
    # The fifth field is the mount point, a space or a tab in it written as an octal escape ("\040").
    fields = (line.split() for line in lines)
    return {Path(_OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), f[4])) for f in fields if len(f) > 4}


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def lock_folder(folder: str | Path) -> Any:
    """Hold an exclusive lock on `folder` until the returned file is closed (or the process ends, a kill
    included: the system releases it); `BlockingIOError` if another process holds it. The lock file is
    a hidden sibling, `.NAME.lock`, so that publishing does not move it and it is not published. Where
    the system has no `fcntl` (Windows) nothing is locked."""
    path = hidden_sibling(folder, "lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a")
    if fcntl is not None:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise
    return handle


def finish_interrupted_publish(folder: str | Path) -> None:
    """Bring `folder` to a consistent state after a publish that was killed part way.

    A complete new folder (`.ready`) is published; an incomplete one (`.partial`) is deleted, since
    nothing but new files was ever put there; a leftover `.replaced` is deleted once `folder` exists.
    """
    folder = Path(folder).resolve()  # a link: its target; "..": the folder itself
    partial, ready, replaced = staging_paths(folder)
    if partial.exists():
        logger.warning("Removing %s, an unfinished model folder of an interrupted run.", partial)
        shutil.rmtree(partial)
    if ready.exists():
        logger.warning("Completing the interrupted publication of %s.", folder)
        _swap_in(ready, folder)
    elif replaced.exists():
        if folder.exists():
            shutil.rmtree(replaced)
        else:  # not a state publishing leaves; restore rather than lose anything
            os.replace(replaced, folder)


# In a complete folder waiting to be published, this empty file says that the old folder's other files
# are not kept (`publish_folder(..., keep_other_files=False)`), also when a later run finishes the swap.
REPLACES_WHOLE_FOLDER = ".replaces-whole-folder"


def _swap_in(ready: Path, folder: Path) -> None:
    replaced = staging_paths(folder)[2]
    if folder.exists():
        if not (ready / REPLACES_WHOLE_FOLDER).exists():
            for entry in folder.iterdir():
                if not os.path.lexists(ready / entry.name):
                    os.replace(entry, ready / entry.name)
        if replaced.exists():
            shutil.rmtree(replaced)
        os.replace(folder, replaced)
    os.replace(ready, folder)
    (folder / REPLACES_WHOLE_FOLDER).unlink(missing_ok=True)
    shutil.rmtree(replaced, ignore_errors=True)


def sync_folder(folder: Path) -> None:
    """Flush `folder`'s entries (the renames into it) to disk; nothing where folders cannot be opened
    (Windows)."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_file(path: Path) -> None:
    """Flush file `path` to disk. POSIX flushes through a read-only descriptor (so also a file without
    write permission); Windows' `os.fsync` (`_commit`: FlushFileBuffers) refuses one, "[Errno 9] Bad file
    descriptor", and needs the file open for writing, so there a read-only file is left as it is."""
    try:
        handle = path.open("rb" if os.name == "posix" else "r+b")
    except PermissionError:
        if os.name == "posix":
            raise
        return  # read-only on Windows: not written by this process, nothing of its own to flush
    with handle:
        os.fsync(handle.fileno())


def sync_tree(folder: Path) -> None:
    """Flush every file under `folder`, and the folders themselves, to disk. A rename is what makes a
    written folder count as complete (a checkpoint, a model folder); without this, a crash of the
    machine soon after could leave the renamed folder with empty or short files. About 25 ms for 50 MiB
    on a virtual disk."""
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders holding them
        if path.is_file() and not path.is_symlink():
            sync_file(path)
        elif path.is_dir() and not path.is_symlink():
            sync_folder(path)
    sync_folder(folder)


@contextmanager
def publish_folder(folder: str | Path, *, keep_other_files: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder; when the block ends without an exception, its files become
    `folder` in one rename, keeping the old folder's other files (checkpoints, logs), or none of them
    without `keep_other_files` (an earlier export's files that this one does not write would be read
    with it).

    If the block raises (or the process dies), `folder` is untouched; the staging folder is removed
    (on an exception now, after a kill by the next `finish_interrupted_publish`).
    """
    folder = Path(folder).resolve()  # a link: its target; "..": the folder itself
    check_renamable(folder)
    finish_interrupted_publish(folder)
    partial, ready, _ = staging_paths(folder)
    partial.mkdir(parents=True)
    try:
        yield partial
        if not keep_other_files:
            (partial / REPLACES_WHOLE_FOLDER).touch()
        sync_tree(partial)  # on disk before it is named complete: a crash cannot publish empty files
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.replace(partial, ready)
    _swap_in(ready, folder)
    sync_folder(folder.parent)


# How the writers in Rust report a full disk or quota: "... No space left on device (os error 28)", in
# safetensors' `SafetensorError` and in the plain `Exception` of tokenizers' `save`, neither an OSError.
NO_SPACE_MESSAGE = re.compile(rf"\(os error ({errno.ENOSPC}|{errno.EDQUOT})\)")
# What a failed write raises: OSError, torch's RuntimeError ("iostream error", with no reason), and
# safetensors' error; tokenizers' plain Exception is one where its message says so (`out_of_space`).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def out_of_space(error: BaseException) -> bool:
    """Whether `error` says that the disk (or the user's quota) is full: an OSError's errno, or the
    message of the Rust writers' errors (safetensors', tokenizers'), which are not OSErrors."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return NO_SPACE_MESSAGE.search(str(error)) is not None


def write_failure(error: BaseException, free: int, needed: int) -> bool:
    """Whether `error`, raised while writing, is a full disk's: said so, or a write error (of a writer
    that may not say why: torch's) where less than `needed` bytes are `free`."""
    return out_of_space(error) or (isinstance(error, WRITE_ERRORS) and free < needed)


def some_of(names: list[str], shown: int = 5) -> str:
    """`names` for a message: the first `shown` of them, and how many more there are."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def mebibytes(size: int) -> str:
    """`size` bytes in MiB for a message: "0.6" below 10 MiB, "1,234" above."""
    return f"{size / 2**20:,.1f}" if size < 10 * 2**20 else f"{size / 2**20:,.0f}"


def weight_bytes(model: Any) -> int:
    """The bytes `model`'s parameters take: about what its weights file needs on disk."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def disk_full_message(
    error: BaseException, folder: str | Path, model: Any, then: str, what: str | None = None
) -> str | None:
    """What to tell the user when writing `folder` (`what`, default its path) failed with `error` because
    the disk (or the quota) is full, as `error` says or as the space left shows (torch's writer says only
    "iostream error"): the space free where it is written, the space `model`'s weights take, and `then`
    (what to do once space is freed). None for any other error, which should be raised as it is."""
    place = Path(folder).resolve().parent
    free = shutil.disk_usage(place).free if place.is_dir() else 0
    needed = weight_bytes(model)
    if not write_failure(error, free, needed):
        return None
    return (
        f"Writing {what or folder} failed ({first_line(error)}): {mebibytes(free)} MiB free in {place}, and "
        f"the weights alone take about {mebibytes(needed)} MiB. {then}"
    )


__all__ = [
    "check_files_readable",
    "check_new_folder",
    "check_not_current_folder",
    "check_not_dangling_link",
    "check_renamable",
    "check_writable_place",
    "disk_full_message",
    "finish_interrupted_publish",
    "hidden_sibling",
    "lock_folder",
    "mebibytes",
    "out_of_space",
    "publish_folder",
    "some_of",
    "staging_paths",
    "sync_file",
    "sync_folder",
    "sync_tree",
    "weight_bytes",
    "write_failure",
]
