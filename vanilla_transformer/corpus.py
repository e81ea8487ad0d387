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
# What a model card says about this corpus (it travels with the datasets as their `DatasetInfo`).
NAME = "WEB-derived / Reina-Valera 1909 Bible verses (en-es)"
DESCRIPTION = (
    "Short verse pairs (<= 20 words a side) from the public-domain World English Bible (modified, so "
    "'WEB-derived') and Reina-Valera 1909, shipped with vanilla_transformer; validation and test are "
    "whole held-out books."
)
LICENSE = "public domain"


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
    Each split's `info` carries the corpus's name, description and license (the model card's source).
    """
    from datasets import Dataset, DatasetDict, DatasetInfo

    info = DatasetInfo(dataset_name=NAME, description=DESCRIPTION, license=LICENSE)
    columns = ["id", "en", "es"] if with_ids else ["en", "es"]
    by_split: dict[str, dict[str, list[str]]] = {split: {c: [] for c in columns} for split in SPLITS}
    for record in read_corpus(path):
        for column in columns:
            by_split[record["split"]][column].append(record[column])
    return DatasetDict({split: Dataset.from_dict(data, info=info) for split, data in by_split.items()})
