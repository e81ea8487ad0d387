"""The embedded default parallel corpus: English -> Spanish Bible verses (public domain).

`data/bible_en_es.jsonl.gz` pairs a WEB-derived English text with the Reina-Valera 1909, verse by verse,
split by whole books (`data/README.md`). `scripts/build_corpus.py` (with `tools/bible_corpus.py`) rebuilds
it from Debian packages; this module only reads it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import DatasetDict

SPLITS = ("train", "validation", "test")


def read_corpus(path: str | Path | None = None) -> list[dict[str, str]]:
    """Records of a corpus file (default: the shipped one), in file order."""
    with gzip.open(path or default_corpus_path(), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def default_corpus_path() -> Path:
    """Path of the shipped English -> Spanish corpus file."""
    return Path(__file__).resolve().parent / "data" / "bible_en_es.jsonl.gz"


def load_default_corpus(path: str | Path | None = None, *, with_ids: bool = False) -> DatasetDict:
    """The shipped corpus as a `DatasetDict` with splits train/validation/test and columns `en`, `es`.

    Works offline (read directly from the package file). `with_ids=True` adds the OSIS `id` column.
    """
    from datasets import Dataset, DatasetDict

    columns = ["id", "en", "es"] if with_ids else ["en", "es"]
    by_split: dict[str, dict[str, list[str]]] = {split: {c: [] for c in columns} for split in SPLITS}
    for record in read_corpus(path):
        for column in columns:
            by_split[record["split"]][column].append(record[column])
    return DatasetDict({split: Dataset.from_dict(data) for split, data in by_split.items()})
