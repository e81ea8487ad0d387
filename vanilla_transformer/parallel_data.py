"""Parallel text in, tokenized examples out: loading, cleaning, splitting and tokenizing with `datasets`.

Sources: the embedded English -> Spanish corpus (default), a Hub dataset (e.g. `wmt/wmt14`, `de-en`,
whose rows hold a `translation` dict), or local TSV/CSV/JSONL files whose columns are named by
language code (or by `source_column`/`target_column`). Every split comes out with the columns
`source` and `target`. Rows with an empty side are dropped and counted, never passed on silently.
"""

from __future__ import annotations

import codecs
import copy
import csv
import errno
import functools
import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # imported where used: `datasets` adds over half a second to every script's start
    from datasets import DatasetDict

from .cli import InputError, first_line
from .corpus import load_default_corpus
from .tokenization import length_check
from .translation import CONVERT_HINT, one_line, wide_encoding

FILE_BUILDERS = {".tsv": "csv", ".csv": "csv", ".jsonl": "json", ".json": "json"}


class DataError(InputError):
    """Parallel data that cannot be used as given (files, columns, contents); the message says why."""


@dataclass
class DataReport:
    """What cleaning removed, per split: rows with an empty side, and pairs over the length limit."""

    empty: dict[str, int] = field(default_factory=dict)
    too_long: dict[str, int] = field(default_factory=dict)
    validation_held_out: bool = False  # the validation split was drawn from train at random, by source
    held_out_short: tuple[int, int] | None = None  # (pairs drawn, pairs asked) where fewer fitted
    # Pairs of a validation or test split given as such (not drawn from train) whose source is also a
    # training source: kept (the split is the user's), but said, as their scores reward memorising.
    sources_in_train: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [
            f"skipped {n} {split} rows with an empty source or target" for split, n in self.empty.items() if n
        ]
        if self.held_out_short:
            drawn, asked = self.held_out_short
            out.append(
                f"held out {drawn} validation pairs, not {asked}: the training file's other source sentences "
                "each have more pairs than the room left (a source's pairs are held out together)"
            )
        out += [
            f"warning: {n} of the {split} pairs have a source sentence that also occurs in train: their "
            "scores reward memorising the training data (remove them from one of the two)"
            for split, n in self.sources_in_train.items()
            if n
        ]
        out += [
            f"skipped {n} {split} pairs longer than max_length" for split, n in self.too_long.items() if n
        ]
        return out


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    with Path(path).open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def text_digest(dataset: Any) -> str:
    """SHA-256 of a split's sentence pairs, in order: other training data with as many pairs (another
    file, an edited one) resumes as if it were the same, batches skipped by count, without this."""
    digest = hashlib.sha256()
    for batch in dataset.select_columns(["source", "target"]).iter(batch_size=10_000):  # not row by row
        for source, target in zip(batch["source"], batch["target"], strict=True):
            digest.update(f"{source}\t{target}\n".encode())
    return digest.hexdigest()


# The first bytes of compressed files and archives: a gzip file named .tsv got the hint for Latin-1 text.
# Those of gzip, xz and zstd are not UTF-8; those of bzip2 ("BZh", a digit, its block's magic number) and
# zip ("PK" and two control characters) begin no text.
COMPRESSED_MAGIC = {
    b"\x1f\x8b": ("gzip-compressed", "gzip -dc"),
    b"\xfd7zXZ\x00": ("xz-compressed", "xz -dc"),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", "zstd -dc"),
    b"PK\x03\x04": ("a zip archive", "unzip -p"),
}
BZIP2_MAGIC = re.compile(rb"BZh[1-9]1AY&SY")


def check_not_compressed(path: Path) -> None:
    """Raise a DataError naming the compression of a compressed file, with the command that decompresses
    it."""
    with path.open("rb") as handle:
        head = handle.read(10)
    found = [value for magic, value in COMPRESSED_MAGIC.items() if head.startswith(magic)]
    if BZIP2_MAGIC.match(head):
        found.append(("bzip2-compressed", "bzip2 -dc"))
    if found:
        (compression, command), text = found[0], f"{path.stem}.text{path.suffix}"
        raise DataError(
            f"{path} is {compression}, not text; decompress it first, e.g. "
            f"`{command} {path.name} > {text}`, and name {text} here."
        )


def check_utf8(path: Path, chunk_size: int = 1 << 20) -> None:
    """Raise a ValueError naming the line of the first byte sequence that is not UTF-8, or the
    compression of a compressed file (`check_not_compressed`)."""
    check_not_compressed(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_size):
            wide = wide_encoding(chunk, start=line == 1)
            if wide is not None:
                bad_line = line + chunk[: max(chunk.find(b"\0"), 0)].count(b"\n")
                raise DataError(
                    f"{path} is not UTF-8 text but {wide}, by its byte-order mark or NUL bytes (line "
                    f"{bad_line}); convert it, e.g. `iconv -f {wide} -t UTF-8`."
                )
            # The bytes of a character begun at the end of the previous chunk: the error's offset counts them.
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                bad_line = line + chunk[: max(error.start - pending, 0)].count(b"\n")
                raise DataError(
                    f"{path} is not UTF-8 text (undecodable bytes on line {bad_line}); {CONVERT_HINT}."
                ) from None
            line += chunk.count(b"\n")
        if decoder.getstate()[0]:  # was a UnicodeDecodeError naming neither file nor line
            raise DataError(
                f"{path} is not UTF-8 text: it ends inside a character, on line {line} (a file cut short, "
                "as an interrupted download or copy leaves it?)."
            )


def check_delimited(path: Path) -> list[str]:
    """Raise a ValueError naming file and line unless every row of a .tsv/.csv has the header's fields;
    return the header's names.

    TSV: fields are split on every tab, with no quoting (a tab inside a sentence is an extra field).
    CSV: standard quoting (fields with commas, quotes or line breaks are double-quoted, quotes doubled).
    A row that repeats the header (files concatenated with their headers) is refused too.
    """
    with unlimited_csv_fields():
        return _check_delimited(path)


FIELD_SIZE_LIMIT = 2**31 - 1  # the largest the csv module takes on every platform


@contextmanager
def unlimited_csv_fields() -> Iterator[None]:
    """The csv module refuses a field over 128 KiB ("field larger than field limit"), which pandas' C
    parser reads: a long sentence is the length checks' to judge. The limit is global, so restored."""
    limit = csv.field_size_limit(FIELD_SIZE_LIMIT)
    try:
        yield
    finally:
        csv.field_size_limit(limit)


def _check_delimited(path: Path) -> list[str]:
    # utf-8-sig: a byte-order mark (as Windows editors write) is not part of the header's first name.
    with path.open(encoding="utf-8-sig", newline="") as handle:
        if path.suffix == ".tsv":
            rows = ((number, line.rstrip("\r\n").split("\t")) for number, line in enumerate(handle, 1))
        else:
            rows = _csv_rows(path, handle)
        header: list[str] | None = None
        pairs = 0
        for line, row in rows:
            # A blank line, or one of spaces only (no field separator): the reader skips it, before the
            # header too.
            if len(row) <= 1 and not "".join(row).strip():
                continue
            if header is None:
                header = row
                continue
            pairs += 1
            if [row[0].removeprefix("\ufeff"), *row[1:]] == header:  # with its own mark, after `cat`
                raise DataError(f"{path}, line {line}: repeats the header row {header}; remove it.")
            if row[0].startswith("\ufeff"):  # a file saved with one, appended
                raise DataError(
                    f"{path}, line {line}: starts with a byte-order mark (U+FEFF), the mark of a file saved "
                    "with one and appended to another (`cat`); remove it (in CSV it leaves a quoted first "
                    "field's quotes in the text)."
                )
            if path.suffix == ".tsv" and (quoted := next(filter(_csv_quoted, row), None)) is not None:
                raise DataError(
                    f"{path}, line {line}: {quoted!r} is quoted the CSV way (in quotes, its own quotes "
                    "doubled), as pandas' to_csv and Python's csv module write TSV by default; TSV is read "
                    "without quoting, so the quotes would stay in the text. Write it with "
                    "quoting=csv.QUOTE_NONE, or as .csv."
                )
            if len(row) != len(header):
                raise DataError(
                    f"{path}, line {line}: {len(row)} fields where the header has {len(header)} "
                    f"({header}). "
                    + (
                        "TSV has no quoting: a tab inside a sentence splits it."
                        if path.suffix == ".tsv"
                        else "Quote fields that contain commas."
                    )
                )
        if header is None:
            raise DataError(f"{path} is empty: it needs a header row naming the columns.")
        if pairs == 0:
            raise DataError(f"{path} has a header row and no sentence pairs under it.")
        return header


def _csv_rows(path: Path, handle: Any) -> Iterator[tuple[int, list[str]]]:
    """The rows of a CSV file with the line each ends on; a row the csv module cannot read is named.
    Read strictly: leniently, a field that opens with a quote it does not close ran on through the
    next lines (three pairs read as one, without a word), and `"Go home" he said.` lost its quotes."""
    reader = csv.reader(handle, strict=True)
    start = 1  # the line the next row starts on (a quoted field may hold line breaks)
    try:
        for row in reader:
            yield reader.line_num, row
            start = reader.line_num + 1
    except csv.Error as error:
        through = f" through line {reader.line_num}" if reader.line_num > start else ""
        raise DataError(
            f"{path}, line {start}{through}: not readable as CSV ({error}). A field that starts with a "
            'double quote must be quoted whole, its own quotes doubled ("""Go home"" he said.").'
        ) from None


def _csv_quoted(field: str) -> bool:
    """A field written with CSV quoting: in double quotes, with the quotes inside it doubled."""
    return len(field) >= 4 and field[0] == field[-1] == '"' and '""' in field[1:-1]


LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate's escape: alone, or half of a pair


JSON_TYPES = {bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}


def check_jsonl(path: Path, columns: Collection[str] = ()) -> None:
    """Raise a ValueError naming file and line unless every non-blank line is one JSON object, whose
    `columns` (those it has) hold strings or null."""
    with path.open(encoding="utf-8-sig") as handle:  # a byte-order mark, as datasets' reader skips it
        rows = 0
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise DataError(f"{path}, line {number}: not valid JSON ({error}).") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {number}: a JSON {type(row).__name__}, not an object.")
            # A \uD800-\uDFFF escape alone (half of a character, as text cut by UTF-16 code units is): valid
            # JSON, but not text, which datasets' reader then failed on as "An error occurred while
            # generating the dataset".
            if LONE_SURROGATE.search(line):
                try:
                    json.dumps(row, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise DataError(
                        f"{path}, line {number}: a \\u escape of half a character (a lone UTF-16 surrogate), "
                        "which is not text; fix or remove the row."
                    ) from None
            for column in columns:
                if row.get(column) is not None and not isinstance(row[column], str):
                    raise DataError(
                        f"{path}, line {number}: {column!r} holds a JSON {JSON_TYPES[type(row[column])]}, "
                        "not a string: every sentence must be text."
                    )
            rows += 1
    if rows == 0:
        raise DataError(f"{path} is empty: it needs one JSON object per line.")


BARE_CR = re.compile(rb"\r(?!\n)")  # a line that ends in a carriage return alone (old Mac files)


def _misread_by_pandas_c_parser(path: Path, block: int = 1 << 20) -> bool:
    """Whether a delimited file has what pandas' C parser misreads without an error: a NUL byte (before
    pandas 3.1 a field ended there, "a\0b" read as "a") or a line ending in a carriage return alone
    (pandas 3.1: after a blank line, a row whose first field is empty was read one column to the left)."""
    carried = b""  # a carriage return that ended the last block: a line feed may start the next one
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(block), b""):
            chunk, carried = carried + chunk, b""
            if chunk.endswith(b"\r"):
                chunk, carried = chunk[:-1], b"\r"
            if b"\0" in chunk or BARE_CR.search(chunk):
                return True
    return bool(carried)


def _empty_json(path: Path, head: int = 4096) -> bool:
    """Whether a .json file holds nothing, or an empty array (judged on its first `head` bytes)."""
    with path.open("rb") as handle:
        text = handle.read(head).removeprefix(codecs.BOM_UTF8)
    return len(text) < head and text.replace(b"[", b"", 1).replace(b"]", b"", 1).strip() == b""


T = TypeVar("T")


def _naming_cache_problems(function: Callable[..., T]) -> Callable[..., T]:
    """`function`, whose datasets operations write the cache (filters, maps, splits): a full or read-only
    cache is said as such (`_cache_write_problem`), not as an OSError's traceback."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except OSError as error:
            files = (kwargs.get(name) for name in ("train_file", "validation_file", "test_file"))
            problem = _cache_write_problem(error, *files)
            if problem is None:
                raise
            raise DataError(f"Preparing the data failed: {problem}") from error

    return wrapper


def _cache_write_problem(error: BaseException, *paths: str | Path | None) -> str | None:
    """What to say where reading data failed on writing datasets' cache, not on the data files `paths`:
    a full disk or quota, a read-only or another user's cache folder (None for any other error)."""
    from datasets import config

    from .publishing import out_of_space

    if not isinstance(error, OSError) or not (
        out_of_space(error) or error.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    ):
        return None
    own = {Path(path).resolve() for path in paths if path}
    if error.filename is not None and Path(error.filename).resolve() in own:
        return None  # a data file's own
    return (
        f"datasets' cache in {config.HF_DATASETS_CACHE} could not be written ({error.strerror or error}): "
        "free some space there, or set HF_DATASETS_CACHE (or HF_HOME) to a writable folder with room."
    )


def check_data_paths(files: Mapping[str, str | Path]) -> None:
    """Refuse a data file (by split) that is missing, a folder, or of a type no loader reads: what can
    be told before any work (a fine-tune checks it before loading its model)."""
    for split, name in files.items():
        path = Path(name)
        if path.is_dir():
            raise DataError(f"{split} file {path} is a folder; name a file ({', '.join(FILE_BUILDERS)}).")
        if not path.is_file():
            raise FileNotFoundError(f"{split} file {path} does not exist.")
        if path.suffix not in FILE_BUILDERS:
            raise DataError(
                f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}."
            )
        try:  # another user's file, say: said here, not as a traceback from the first read
            path.open("rb").close()
        except OSError as error:
            raise DataError(f"{split} file {path} cannot be read: {error.strerror or error}.") from error


def _load_files(files: Mapping[str, str | Path], columns: set[str]) -> DatasetDict:
    """The data files' splits; `columns`, the names the run reads, must each name one column of a
    delimited file."""
    paths = {split: Path(path) for split, path in files.items()}
    suffixes = set()
    fields: dict[str, int] = {}  # a delimited file's number of columns
    python_parser: set[str] = set()  # the delimited files' splits that pandas' C parser misreads
    digests: dict[str, str] = {}  # a file's contents, which name its cache (see below)
    check_data_paths(paths)
    for split, path in paths.items():
        check_utf8(path)
        digests[split] = file_sha256(path)
        if FILE_BUILDERS[path.suffix] == "csv":
            header = check_delimited(path)
            fields[split] = len(header)
            if _misread_by_pandas_c_parser(path):
                python_parser.add(split)
            # pandas renames a repeated name ("es", "es.1"): the run would read the first column of the
            # name without a word, whichever of them the user meant. (A name the run does not read, or
            # columns without a name, a spreadsheet's trailing empty ones, read as "Unnamed: 2", are none
            # of its business.)
            if repeated := sorted({name for name in header if name in columns and header.count(name) > 1}):
                raise DataError(
                    f"{path}: the header names {repeated[0]!r} more than once ({header}); name each column "
                    "once."
                )
        elif path.suffix == ".jsonl":
            check_jsonl(path, columns)
        elif _empty_json(path):  # datasets said "Could not parse F: " with no reason, or "... no data!"
            raise DataError(f"{path} is empty: it needs a JSON array of objects (or JSON Lines, as .jsonl).")
        suffixes.add(path.suffix)
    if len({FILE_BUILDERS[s] for s in suffixes}) > 1 or suffixes == {".tsv", ".csv"}:
        raise DataError(f"All data files must have the same type, got {sorted(suffixes)}.")
    suffix = suffixes.pop()
    options: dict[str, Any] = {}
    if FILE_BUILDERS[suffix] == "csv":
        # Text is data: no quote processing in TSV, and "NA"/"null" stay strings.
        options = {"keep_default_na": False, "na_filter": False}
        if suffix == ".tsv":
            options |= {"delimiter": "\t", "quoting": csv.QUOTE_NONE}
    from datasets import DatasetDict, load_dataset

    # One split at a time: files whose columns differ then reach the column check below, which names
    # them, instead of failing inside datasets' schema merge.
    data = DatasetDict()
    for split, path in paths.items():
        # Every delimited field is text: pandas would otherwise read a column, or a block of 10,000 rows
        # of one (datasets reads a file in such chunks), that looks numeric as numbers, turning "007" into
        # 7 and "1.50" into 1.5, or refusing the file.
        parsing: dict[str, Any] = (
            {"converters": dict.fromkeys(range(fields[split]), str)} if split in fields else {}
        )
        # pandas' Python parser (the csv module's, so with its field limit lifted) reads a NUL byte and
        # lines ended by a carriage return alone as the checks above did (slower, so only for such files).
        if split in python_parser:
            parsing["engine"] = "python"
        # datasets finds its cache of a local file by the file's path and modification time alone: a file
        # rewritten with the same time (`cp -p`, `rsync -a`, `touch -r`, a coarse-clock file system) was
        # read as its earlier contents, after the checks above had passed the new ones. The contents'
        # digest as the configuration's name keeps one cache per contents.
        try:
            with unlimited_csv_fields():
                data[split] = load_dataset(
                    FILE_BUILDERS[suffix],
                    name=f"sha256-{digests[split]}",
                    data_files={split: str(path)},
                    split=split,
                    **options,
                    **parsing,
                )
        except Exception as error:  # datasets wraps parser errors in several exception types
            # ... and says "An error occurred while generating the dataset": the reason is its cause's
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if cache_problem := _cache_write_problem(cause, path):
                raise DataError(f"Could not load {path}: {cache_problem}") from error
            hint = (
                " (a .json file holds one JSON array of objects, each with a text per column; JSON Lines, "
                "an object per line, go in a .jsonl file)"
                if suffix == ".json"
                else ""
            )
            raise DataError(f"Could not parse {path}: {first_line(cause)}{hint}") from error
    return data


def _to_source_target(data: DatasetDict, source_column: str, target_column: str) -> DatasetDict:
    from datasets import Value

    if source_column == target_column:
        raise DataError(
            f"The source and the target are the same column, {source_column!r}: name two languages (or "
            "--source_column/--target_column) for the two sides."
        )

    def flatten(batch: dict[str, list], indices: list[int], split: str, typed: bool) -> dict[str, list]:
        pairs = [pair or {} for pair in batch["translation"]]  # a null dict: an empty row
        for index, pair in zip(indices, pairs, strict=True):
            if not isinstance(pair, dict):  # a `Json` column's rows may hold anything
                raise DataError(
                    f"Row {index + 1} of the {split} data has {pair!r:.60} in its translation column, not a "
                    f'translation pair such as {{"{source_column}": "...", "{target_column}": "..."}}.'
                )
            # A JSON file's dicts share one schema: a language a row lacks reads as None, as a null does.
            # A row with neither language but others is in other languages: refused. One with a side
            # missing or null is empty (skipped and counted), as in a Hub dataset's `Translation` rows
            # (`typed`), which have every language.
            has = sorted(language for language, text in pair.items() if text is not None)
            if not typed and has and not {source_column, target_column} & set(has):
                raise DataError(
                    f"Row {index + 1} of the {split} data is a translation pair in {has}, not "
                    f"{source_column!r}-{target_column!r}: every row needs the two languages."
                )
            for language in (source_column, target_column):
                # As in plain columns: a number or a list is not a sentence (its repr would be read as
                # one, or a number reach the tokenizer and the metric).
                if pair.get(language) is not None and not isinstance(pair[language], str):
                    raise DataError(
                        f"Row {index + 1} of the {split} data has {pair[language]!r:.60} as its "
                        f"{language!r} side, not text: every value must be a string."
                    )
        return {
            "source": [pair.get(source_column) for pair in pairs],
            "target": [pair.get(target_column) for pair in pairs],
        }

    for split, dataset in data.items():
        feature = dataset.features.get("translation")
        # Translation pairs: a Hub dataset's `Translation` feature, or a JSON file's dicts. (A column of
        # plain text that happens to be named "translation" is an ordinary column, checked below.)
        # (datasets 5 reads a JSON file's dicts of differing keys as a `Json` feature.)
        pairs = isinstance(feature, dict) or type(feature).__name__ == "Json"
        pairs = pairs or bool(getattr(feature, "languages", None))
        if pairs and source_column not in dataset.column_names:
            # A Hub dataset's `Translation` feature lists its languages; a JSON file's dicts, their keys.
            languages = getattr(feature, "languages", None) or (
                list(feature) if isinstance(feature, dict) else []
            )
            missing = [c for c in (source_column, target_column) if languages and c not in languages]
            if missing:
                raise DataError(
                    f"The {split} data's translation pairs are in {sorted(languages)}, not {missing[0]!r}: "
                    "name the two languages with --source_lang and --target_lang."
                )
            data[split] = dataset.map(
                flatten,
                batched=True,
                with_indices=True,
                fn_kwargs={"split": split, "typed": bool(getattr(feature, "languages", None))},
                remove_columns=dataset.column_names,
            )
            continue
        missing = [c for c in (source_column, target_column) if c not in dataset.column_names]
        if missing:
            raise DataError(
                f"The {split} data has no column {missing[0]!r} (columns: {dataset.column_names}). Name the "
                "columns by language code, or pass --source_column/--target_column."
            )
        for column in (source_column, target_column):
            kind = dataset.features[column]
            if not (isinstance(kind, Value) and kind.dtype in ("string", "large_string", "null")):
                held = (
                    f"{kind.dtype} values"
                    if isinstance(kind, Value)
                    else f"values of type {type(kind).__name__}"
                )
                raise DataError(
                    f"The {split} data's column {column!r} holds {held}, not text: every value must be a "
                    "string (a JSON number, list or object is not a sentence)."
                )
        data[split] = dataset.select_columns([source_column, target_column]).rename_columns(
            {source_column: "source", target_column: "target"}
        )
    return data


def _drop_empty(data: DatasetDict, report: DataReport) -> DatasetDict:
    # One line per sentence: line breaks inside one become spaces, so that a model never learns to write
    # them (a line-by-line output would gain lines).
    def clean(batch: dict[str, list]) -> dict[str, list]:
        return {
            "source": [one_line(str(s)) if s is not None else "" for s in batch["source"]],
            "target": [one_line(str(t)) if t is not None else "" for t in batch["target"]],
        }

    for split, dataset in data.items():
        cleaned = dataset.map(clean, batched=True).filter(lambda row: bool(row["source"] and row["target"]))
        report.empty[split] = len(dataset) - len(cleaned)
        if len(cleaned) == 0:
            raise DataError(
                f"The {split} split has no usable sentence pairs (all {len(dataset)} rows are empty)."
            )
        data[split] = cleaned
    return data


# The embedded corpus's languages: the default where no column is named.
DEFAULT_LANGUAGES = {"source": "en", "target": "es"}


# A language code as ISO 639 and BCP 47 spell them ("en", "pt-BR", "zh_Hant", "zho_Hans", "yue"): a
# primary tag of 2 or 3 letters, then subtags; or BCP 47's private-use and grandfathered ones ("x-...",
# "i-klingon").
LANGUAGE_CODE = re.compile(r"(?:[A-Za-z]{2,3}|[xXiI](?=[-_]))(?:[-_][A-Za-z0-9]{1,8})*")


def resolve_languages(config: Any) -> None:
    """Set `config.source_lang` and `config.target_lang` where they are None: the embedded corpus's
    (`DEFAULT_LANGUAGES`), unless that side's column is named (`source_column`, `target_column`), whose
    language cannot be guessed: then ValueError. A model card once named English and Spanish for a
    model trained on columns of other languages, and sacreBLEU's tokenizer, chosen by the target
    language (zh, ja, ko), was the wrong one. A given language that is no language code (a column's name,
    "chinese") is a ValueError too: it was written into the card and chose the 13a tokenizer."""
    for side, default in DEFAULT_LANGUAGES.items():
        if (language := getattr(config, f"{side}_lang")) is not None:
            if not LANGUAGE_CODE.fullmatch(language):  # a column's name: 13a BLEU, a card in "chinese"
                column = getattr(config, f"{side}_column") or language
                raise ValueError(
                    f"--{side}_lang {language} is not a language code (ISO 639 and BCP 47 ones: en, "
                    "zh, pt-BR, zho_Hans): it picks the BLEU tokeniser and is the model card's language. A "
                    f"column of another name is given as --{side}_column {column}, with --{side}_lang its "
                    "language's code."
                )
            continue
        column = getattr(config, f"{side}_column")
        if column is not None:
            raise ValueError(
                f"--{side}_column {column} names the column, not its language: give --{side}_lang too "
                "(the model card names it, and the target language chooses sacreBLEU's tokenizer)."
            )
        setattr(config, f"{side}_lang", default)


@_naming_cache_problems
def load_parallel_data(
    *,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    train_file: str | Path | None = None,
    validation_file: str | Path | None = None,
    test_file: str | Path | None = None,
    source_lang: str = "en",
    target_lang: str = "es",
    source_column: str | None = None,
    target_column: str | None = None,
    validation_size: int = 500,
    seed: int = 0,
    for_training: bool = True,
) -> tuple[DatasetDict, DataReport]:
    """Load parallel text as a `DatasetDict` of `source`/`target` columns.

    With neither `dataset_name` nor files, the embedded English -> Spanish corpus is used. For
    training (`for_training`) a train split is required, and without a validation split
    `validation_size` pairs are held out of train at random; otherwise any file alone will do.
    """
    files = {"train": train_file, "validation": validation_file, "test": test_file}
    files = {split: path for split, path in files.items() if path}
    if dataset_name and files:
        raise DataError("Pass either dataset_name or data files, not both.")
    if dataset_name:
        from datasets import load_dataset

        try:
            data = load_dataset(dataset_name, dataset_config)
        except (OSError, ValueError) as error:  # not found, no network, a malformed id or config name
            raise DataError(
                f"The dataset {dataset_name!r} could not be loaded from the Hub or its cache: "
                f"{first_line(error).rstrip('.')}. "
                "Without Hub access, pass local --train_file/--validation_file/--test_file instead."
            ) from None
    elif files:
        data = _load_files(files, {source_column or source_lang, target_column or target_lang})
    else:
        data = load_default_corpus()
        wanted = {source_column or source_lang, target_column or target_lang}
        if not wanted <= set(data["train"].column_names):  # said for the corpus, not its first split
            raise DataError(
                f"The embedded corpus is English-Spanish (columns {data['train'].column_names}), not "
                f"{source_column or source_lang}-{target_column or target_lang}: for other languages, "
                "name data files of them."
            )
    data = _to_source_target(data, source_column or source_lang, target_column or target_lang)

    report = DataReport()
    data = _drop_empty(data, report)
    if not for_training:
        return data, report
    if "train" not in data:
        raise DataError(f"The data has no train split (splits: {list(data)}).")
    if "validation" not in data:
        if len(data["train"]) <= 2 * validation_size:
            raise DataError(
                f"No validation split, and train ({len(data['train'])} pairs) is too small to hold out "
                f"{validation_size} for validation: pass a validation file (--validation_file), or in "
                "scripts/finetune.py hold out fewer pairs (--validation_size)."
            )
        data["train"], data["validation"] = _hold_out_by_source(data["train"], validation_size, seed)
        report.validation_held_out = True
        if len(data["validation"]) < validation_size:
            report.held_out_short = (len(data["validation"]), validation_size)
    report.sources_in_train = sources_in_train(data, [] if report.validation_held_out else ["validation"])
    return data, report


def _hold_out_by_source(train: Any, size: int, seed: int) -> tuple[Any, Any]:
    """`train` split in two: a validation split of up to `size` pairs drawn at random by source sentence
    (every pair of a source drawn goes with it; a source with more pairs than the room left is passed
    over, so that a frequent one does not swell the split: fewer where no other fits), and the rest. A
    source the file repeats ("Thank you." is common in OPUS data, with one translation or several) drawn
    pair by pair could land on both sides, and the validation scores would reward memorising it;
    dropping such validation pairs lost them and left a few of `size` (12 of 200 with two translations a
    source). The draw is a seeded hash of each source's `sentence_key`, read in batches: a set of every
    training pair held gigabytes for millions."""
    import numpy as np

    salt = (seed % (1 << 64)).to_bytes(8, "little")
    draws = np.empty(len(train), dtype=np.uint64)
    filled = 0
    for batch in train.select_columns(["source"]).iter(batch_size=10_000):
        for source in batch["source"]:
            digest = hashlib.blake2b(sentence_key(source).encode(), digest_size=8, salt=salt).digest()
            draws[filled] = int.from_bytes(digest, "little")
            filled += 1
    order = np.argsort(draws, kind="stable")  # a source's pairs side by side, sources in random order
    ordered = draws[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))  # each source's first
    counts = np.diff(np.append(starts, len(order)))
    taken: list[np.ndarray] = []
    room = size
    for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
        if not room:
            break
        if count <= room:
            taken.append(order[start : start + count])
            room -= count
    if not taken:
        raise DataError(
            f"The training data repeats its source sentences too much to hold out {size} pairs for "
            "validation by source (each source has more pairs than that): pass a validation file "
            "(--validation_file)."
        )
    drawn = np.concatenate(taken)
    validation = train.select(drawn)  # in the random order drawn
    rest = np.setdiff1d(np.arange(len(order)), drawn)  # in the file's order
    return train.select(rest), validation


def sentence_key(text: str) -> str:
    """`text` as a model reads it, for finding the same sentence in two splits: NFKC-normalised (as the
    tokenizers this package trains read text: a no-break space, decomposed accents), then as `one_line`
    reads every sentence."""
    return one_line(unicodedata.normalize("NFKC", text))


def _sources_in(train: Any, wanted: set[str]) -> set[str]:
    """Those of the sentence keys `wanted` that are the key of a source of `train`, read in batches: a set
    of every training source held gigabytes for millions of them."""
    seen: set[str] = set()
    for batch in train.select_columns(["source"]).iter(batch_size=10_000):
        seen.update(key for key in map(sentence_key, batch["source"]) if key in wanted)
    return seen


def sources_in_train(data: DatasetDict, splits: list[str]) -> dict[str, int]:
    """For each of `splits` (and the test split, where there is one), how many of its pairs have a
    source sentence that is also a source of the train split (compared as `sentence_key`s). The
    evaluation splits' sources are kept in memory and train is read in batches."""
    held_out = {
        split: [sentence_key(source) for source in data[split]["source"][:]]  # whole
        for split in [*splits, "test"]
        if split in data
    }
    seen = _sources_in(data["train"], {key for keys in held_out.values() for key in keys})
    return {split: sum(key in seen for key in keys) for split, keys in held_out.items()}


@_naming_cache_problems
def tokenize_parallel_data(
    data: DatasetDict,
    tokenizer: Any,
    max_length: int,
    report: DataReport | None = None,
    num_proc: int | None = None,
) -> DatasetDict:
    """Add `input_ids`, `attention_mask`, `labels` and their lengths; drop training pairs over `max_length`.

    Only the training data is length-filtered: the train split, and a validation split drawn from it at
    random (`report.validation_held_out`), a sample of the same pairs. A validation or test split of its
    own keeps every pair so that scores cover the whole split (long ones are still translated in full).
    """
    if max_length <= 1:
        raise DataError(f"max_length must be at least 2 tokens, got {max_length}.")

    def encode(batch: dict[str, list[str]]) -> dict[str, list]:
        # A special token's spelling in the data ("</s>" as HTML) is text, with any tokenizer: read as
        # the token, it would end a target sentence where it stands, or vanish from the text.
        encoded = tokenizer(batch["source"], text_target=batch["target"], split_special_tokens=True)
        encoded["source_length"] = [len(ids) for ids in encoded["input_ids"]]
        encoded["target_length"] = [len(ids) for ids in encoded["labels"]]
        return encoded

    # Held out of train, a long pair was skipped as a training pair by some seeds and by others kept as a
    # validation pair, which then stopped the run as too long for a batch.
    held_out = report is not None and report.validation_held_out
    filtered = ["train", "validation"] if held_out else ["train"]

    given = {split: len(data[split]) for split in filtered}
    # A pair surely over max_length from its length alone is not encoded: a line of millions of characters
    # (a corrupted file) took gigabytes to encode, only to be dropped. The tokenizer's bound is read once,
    # not per batch; a tokenizer without one gets no pass over the data for it.
    too_long = length_check(max_length, tokenizer)
    if too_long is not None:
        from datasets import DatasetDict

        def may_fit(batch: dict[str, list[str]]) -> list[bool]:
            over = (too_long(batch[side]) for side in ("source", "target"))
            return [not (source or target) for source, target in zip(*over, strict=True)]

        data = DatasetDict(data)  # the caller's own is left as it was
        for split in filtered:
            data[split] = data[split].filter(may_fit, batched=True, num_proc=num_proc)
    tokenized = data.map(encode, batched=True, num_proc=num_proc, desc="Tokenizing")
    for split in filtered:
        pairs = tokenized[split]
        kept = pairs.filter(
            lambda row: row["source_length"] <= max_length and row["target_length"] <= max_length,
            num_proc=num_proc,
        )
        if report is not None:
            report.too_long[split] = given[split] - len(kept)
        if len(kept) == 0:
            what = "training" if split == "train" else "held-out validation"
            raise DataError(f"No {what} pair is within max_length={max_length} tokens.")
        tokenized[split] = kept
    return tokenized


def seq2seq_collator(tokenizer: Any, model: Any) -> Any:
    """transformers' `DataCollatorForSeq2Seq` for `model`, its labels padded with -100, padding on the
    right whatever side `tokenizer` pads on. It pads the labels on the tokenizer's side, and a
    tokenizer saved to pad on the left (as many are, for decoder-only generation) gave a short target
    the decoder input `<s> <pad> <pad> ... y1 ...`, a context no translation is decoded from, and the
    stutter augmentation (which reads targets as right-padded) lost every label of the targets it
    changed."""
    from transformers import DataCollatorForSeq2Seq

    if tokenizer.padding_side != "right":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.padding_side = "right"
    return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)


__all__ = [
    "DEFAULT_LANGUAGES",
    "DataError",
    "DataReport",
    "check_delimited",
    "check_jsonl",
    "check_utf8",
    "file_sha256",
    "load_parallel_data",
    "seq2seq_collator",
    "tokenize_parallel_data",
]
