"""How the embedded English -> Spanish Bible corpus is built (used by `scripts/build_corpus.py`).

The shipped file `vanilla_transformer/data/bible_en_es.jsonl.gz` pairs a WEB-derived English text
(from the World English Bible SWORD module `engWEB2015eb`) with the Reina-Valera 1909
(`spaRV1909eb`), aligned verse by verse on the OSIS key, built from the Debian packages
`sword-text-web` and `sword-text-sparv`; `vanilla_transformer/data/README.md` documents provenance,
filtering and splits. Reading the shipped file is `vanilla_transformer.corpus`; this build pipeline is
tooling, outside the installed package.

Only `read_sword_module` needs the `pysword` package (imported lazily; it is not a runtime dependency).
Everything else works on plain strings and lists, so it can be unit-tested without the SWORD modules.
"""

from __future__ import annotations

import gzip
import html
import io
import json
import math
import os
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vanilla_transformer.corpus import SPLITS

ENGLISH_MODULE = "engWEB2015eb"
SPANISH_MODULE = "spaRV1909eb"
MAX_WORDS = 20
# Pairs whose log length ratio is further than this from the corpus median (a factor of about two) are
# almost all local misalignments (a verse merged into its neighbour on one side); they are dropped.
MAX_LENGTH_DEVIATION = 0.7

# Whole books held out, so that near-duplicate verses (parallel passages, refrains) cannot leak
# between splits; books with close parallels elsewhere (Samuel-Kings/Chronicles, the synoptic gospels,
# Ephesians/Colossians) stay in train. Chosen for about 600 validation and 800 test pairs, each
# mixing narrative, poetry or prophecy, and epistles.
VALIDATION_BOOKS = ("Ruth", "Lam", "Dan", "Joel", "Jonah", "Acts", "Phil")
TEST_BOOKS = ("Esth", "Eccl", "Ezek", "John", "Titus", "1Pet")

_NOTE_RE = re.compile(r"<note\b[^>]*>.*?</note>", re.DOTALL)
_DROPPED_ELEMENT_RE = re.compile(r"<(speaker|title)\b([^>]*)>.*?</\1>", re.DOTALL)
_GLOSSARY_RE = re.compile(r"<div\b[^>]*\btype=\"glossary\"")
_TAG_RE = re.compile(r"<[^>]*>")
_SPACE_BEFORE_RE = re.compile(r"\s+([,.;:!?)\]”’»])")
_SPACE_AFTER_RE = re.compile(r"([¿¡(\[“‘«])\s+")
_DASH_RE = re.compile(r"\s*—\s*")

_UPPER = "A-ZÁÉÍÓÚÑÜÂÊÎÔÛ"
_LOWER = "a-záéíóúñüâêîôû"
# A run of fully upper-case words ("EN", "Y HABLÓ", "LA SEGUNDA") followed by optional "," or ":" and
# a word that starts with letters and contains a lower-case letter ("el", "Jehová").
_CAPS_RUN_RE = re.compile(
    rf"(?<![\w])(?P<run>[{_UPPER}]+(?:\s+[{_UPPER}]+)*)(?![\w])(?=[,:]?\s+[{_UPPER}{_LOWER}]*[{_LOWER}])"
)
_VERSE_START_RE = re.compile(r"^[¡¿(“‘«\"]*")
_SUBSCRIPTION_RE = re.compile(r"(\bAmén\.)\s+[^.]*\b(?:escrita|enviada)\b.*$", re.IGNORECASE | re.DOTALL)
_WORD_RE = re.compile(rf"[{_UPPER}{_LOWER}]+")


@dataclass(frozen=True)
class VersePair:
    """One aligned verse: OSIS key (`Book.chapter.verse`) and the two cleaned sides."""

    key: str
    en: str
    es: str

    @property
    def book(self) -> str:
        return self.key.split(".")[0]

    @property
    def chapter(self) -> str:
        """The chapter key, e.g. `Num.13`."""
        return self.key.rsplit(".", 1)[0]


@dataclass
class CorpusBuild:
    """The result of `build_records`: the kept records plus what was dropped, for reporting."""

    records: list[dict[str, str]]
    shifted_chapters: list[str]
    displaced_chapters: list[str]
    aligned_pairs: int
    empty_dropped: int
    chapter_dropped: int
    long_dropped: int
    outliers_dropped: int
    duplicates_dropped: int
    split_counts: dict[str, int] = field(default_factory=dict)


def strip_markup(raw: str) -> str:
    """Turn a raw OSIS verse into plain text.

    Footnotes (`<note>`, content included), Song of Songs speaker labels and non-psalm titles are removed;
    every other tag is replaced by a space (psalm titles keep their text, as the Spanish module has them
    inline); entities are unescaped, the pilcrow is dropped, whitespace is collapsed, and the spaces that
    tag removal leaves before closing or after opening punctuation (and around em dashes) are removed.
    """
    glossary = _GLOSSARY_RE.search(raw)
    if glossary:
        raw = raw[: glossary.start()]
    text = _NOTE_RE.sub(" ", raw)
    text = _DROPPED_ELEMENT_RE.sub(lambda m: m.group(0) if 'type="psalm"' in m.group(2) else " ", text)
    text = _TAG_RE.sub(" ", text)
    text = html.unescape(text).replace("¶", " ")
    text = " ".join(text.split())
    text = _SPACE_BEFORE_RE.sub(r"\1", text)
    text = _SPACE_AFTER_RE.sub(r"\1", text)
    return _DASH_RE.sub("—", text)


def _is_sentence_initial(text: str, start: int) -> bool:
    before = text[:start].rstrip(' ¡¿(“‘«"')
    return not before or before[-1] in ".:?!"


def find_proper_nouns(texts: Iterable[str]) -> set[str]:
    """Lower-cased words that, inside sentences, are written capitalised more often than in lower case.

    Used by `fix_drop_caps` to restore the capital of names inside an upper-case run ("Y JEHOVÁ").
    """
    capitalised: Counter[str] = Counter()
    lower: Counter[str] = Counter()
    for text in texts:
        for match in _WORD_RE.finditer(text):
            word = match.group(0)
            if word.islower():
                lower[word] += 1
            elif word.istitle() and len(word) > 1 and not _is_sentence_initial(text, match.start()):
                capitalised[word.lower()] += 1
    return {word for word, count in capitalised.items() if count > lower[word]}


def _recase_run(run: str, proper_nouns: Container[str]) -> str:
    words = run.split()
    out = [words[0][0] + words[0][1:].lower()]
    for word in words[1:]:
        lowered = word.lower()
        out.append(lowered.capitalize() if lowered in proper_nouns else lowered)
    return " ".join(out)


def fix_drop_caps(text: str, *, chapter_start: bool = False, proper_nouns: Container[str] = ()) -> str:
    """Re-case a Spanish drop-capital opening: "EN el principio" -> "En el principio".

    A run of fully upper-case words containing one of two or more letters is re-cased when it opens the
    verse (after opening punctuation) and is followed by a word with lower-case letters. When
    `chapter_start` is true, the first such run after a sentence end is also re-cased, because psalm
    titles and book headings precede the drop capital inside verse 1. Words of the run after the first
    are lower-cased unless they are in `proper_nouns` (lower-cased), which keeps their capital.
    Inscriptions such as "ESTE ES EL REY DE LOS JUDIOS." are left alone (not followed by lower case).
    """
    for match in _CAPS_RUN_RE.finditer(text):
        run = match.group("run")
        if not any(len(word) >= 2 for word in run.split()):
            continue
        at_start = _VERSE_START_RE.match(text).end() == match.start()
        if at_start or (chapter_start and _is_sentence_initial(text, match.start())):
            return text[: match.start()] + _recase_run(run, proper_nouns) + text[match.end() :]
        if not chapter_start:
            break
    return text


def strip_subscription(text: str) -> str:
    """Drop the colophon that the Reina-Valera appends to the last verse of most epistles.

    "... Amén. Fué escrita á los Hebreos desde Italia con Timoteo." -> "... Amén."
    """
    return _SUBSCRIPTION_RE.sub(r"\1", text)


def word_count(text: str) -> int:
    """Number of whitespace-separated words."""
    return len(text.split())


def read_sword_module(sword_dir: str | Path, module: str) -> dict[str, str]:
    """Raw OSIS text of every verse of a SWORD module, keyed `Book.chapter.verse` in canonical order.

    `sword_dir` is an unpacked `usr/share/sword` (holding `mods.d/` and `modules/`). Needs `pysword`.
    """
    from pysword.modules import SwordModules

    modules = SwordModules(str(sword_dir))
    found = modules.parse_modules()
    if module not in found:
        raise KeyError(f"SWORD module {module!r} not found in {sword_dir} (found: {sorted(found)})")
    bible = modules.get_bible_from_module(module)
    books = bible.get_structure().get_books()
    verses: dict[str, str] = {}
    for testament in ("ot", "nt"):
        for book in books.get(testament, []):
            for chapter, n_verses in enumerate(book.chapter_lengths, start=1):
                texts = list(bible.get_iter(books=book.osis_name, chapters=chapter, clean=False))
                if len(texts) != n_verses:
                    raise ValueError(f"{module} {book.osis_name} {chapter}: {len(texts)} != {n_verses}")
                for verse, text in enumerate(texts, start=1):
                    verses[f"{book.osis_name}.{chapter}.{verse}"] = text
    return verses


def align_verses(english: Mapping[str, str], spanish: Mapping[str, str]) -> tuple[list[VersePair], int]:
    """Pair cleaned verses present on both sides, in the English order; drop pairs with an empty side.

    Returns the pairs and the number of common keys dropped for being empty on either side.
    """
    pairs: list[VersePair] = []
    empty = 0
    for key, en in english.items():
        if key not in spanish:
            continue
        es = spanish[key]
        if en.strip() and es.strip():
            pairs.append(VersePair(key, en, es))
        else:
            empty += 1
    return pairs, empty


def length_deviation(en: str, es: str, norm: float = 0.0) -> float:
    """Signed deviation of the log character-length ratio of a pair from the corpus norm."""
    return math.log((len(en) + 1) / (len(es) + 1)) - norm


def best_shift(
    en_lengths: Sequence[int],
    es_lengths: Sequence[int],
    norm: float,
    *,
    offsets: Sequence[int] = (-3, -2, -1, 1, 2, 3),
    min_run: int = 3,
    cap: float = 1.5,
) -> tuple[float, float]:
    """How much better a run of verses fits when the Spanish side is moved by a few verses.

    For every offset and every run of at least `min_run` consecutive verses, English verse i is compared
    with Spanish verse i (aligned) and i+offset (shifted), each by its absolute log length-ratio deviation
    from `norm` (capped at `cap`). Returns `(gain, ratio)` of the run with the largest gain, where gain is
    the summed aligned minus shifted deviation and ratio is shifted over aligned; `(0.0, 1.0)` if none.
    """
    n = min(len(en_lengths), len(es_lengths))

    def misfit(i: int, j: int) -> float:
        return min(abs(math.log((en_lengths[i] + 1) / (es_lengths[j] + 1)) - norm), cap)

    best = (0.0, 1.0)
    for offset in offsets:
        indices = [i for i in range(n) if 0 <= i + offset < n]
        aligned = [misfit(i, i) for i in indices]
        shifted = [misfit(i, i + offset) for i in indices]
        for start in range(len(indices)):
            aligned_sum = shifted_sum = 0.0
            for stop in range(start, len(indices)):
                aligned_sum += aligned[stop]
                shifted_sum += shifted[stop]
                gain = aligned_sum - shifted_sum
                if stop - start + 1 >= min_run and gain > best[0]:
                    best = (gain, shifted_sum / aligned_sum)
    return best


def is_shifted_chapter(
    en_lengths: Sequence[int],
    es_lengths: Sequence[int],
    norm: float,
    *,
    min_gain: float = 1.6,
    max_ratio: float = 0.5,
) -> bool:
    """Whether a chapter (or a run of at least three of its verses) looks shifted, judged on lengths alone.

    True when moving the Spanish side by one to three verses cuts the length-ratio misfit of some run to
    at most `max_ratio` of the aligned misfit, with a summed gain of at least `min_gain`
    (see `best_shift`). On this corpus real shifts gain 1.9 to 9.3, unshifted chapters at most 1.45.
    """
    gain, ratio = best_shift(en_lengths, es_lengths, norm)
    return gain >= min_gain and ratio <= max_ratio


def length_norm(pairs: Iterable[VersePair]) -> float:
    """Corpus norm: the median log character-length ratio English/Spanish."""
    return statistics.median(length_deviation(p.en, p.es) for p in pairs)


def detect_shifted_chapters(pairs: Sequence[VersePair], norm: float | None = None) -> list[str]:
    """Chapter keys (e.g. `Num.13`) whose verses seem shifted between the two sides, in corpus order."""
    norm = length_norm(pairs) if norm is None else norm
    chapters: dict[str, list[VersePair]] = defaultdict(list)
    for pair in pairs:
        chapters[pair.chapter].append(pair)
    return [
        chapter
        for chapter, members in chapters.items()
        if is_shifted_chapter([len(p.en) for p in members], [len(p.es) for p in members], norm)
    ]


def displaced_endings(english: Mapping[str, str], spanish: Mapping[str, str]) -> list[str]:
    """Chapters whose last common verse is empty on exactly one side.

    There the module has merged that verse into the one before or moved it to the next chapter, so
    the end of the chapter is misaligned (e.g. `2Sam.20`, `Job.40`, `Num.12`). Verses left empty
    mid-chapter (textual omissions such as Acts 8:37 in the WEB) do not count.
    """
    last_key: dict[str, str] = {}
    for key in english:
        if key in spanish:
            last_key[key.rsplit(".", 1)[0]] = key
    return [
        chapter
        for chapter, key in last_key.items()
        if bool(english[key].strip()) != bool(spanish[key].strip())
    ]


def assign_split(book: str) -> str:
    """The split a book belongs to: `validation`, `test` or `train`."""
    if book in VALIDATION_BOOKS:
        return "validation"
    if book in TEST_BOOKS:
        return "test"
    return "train"


def clean_module(raw_verses: Mapping[str, str], *, spanish: bool = False) -> dict[str, str]:
    """Strip markup from every verse; for Spanish also re-case drop capitals and drop subscriptions."""
    cleaned = {key: strip_markup(text) for key, text in raw_verses.items()}
    if not spanish:
        return cleaned
    proper_nouns = find_proper_nouns(cleaned.values())
    return {
        key: strip_subscription(
            fix_drop_caps(text, chapter_start=key.endswith(".1"), proper_nouns=proper_nouns)
        )
        for key, text in cleaned.items()
    }


def drop_held_out_duplicates(records: Sequence[Mapping[str, str]]) -> list[Mapping[str, str]]:
    """Remove held-out records that repeat a side of a train record or of an earlier record of their split.

    Validation and test records whose English or Spanish text already occurs in train, or earlier in the
    same split (refrains such as "Yahweh's word came to me, saying,"), are dropped; train is untouched.
    """
    train_sides = {(side, r[side]) for r in records if r["split"] == "train" for side in ("en", "es")}
    seen: dict[str, set[tuple[str, str]]] = defaultdict(set)
    kept = []
    for record in records:
        sides = {("en", record["en"]), ("es", record["es"])}
        if record["split"] != "train":
            if sides & (train_sides | seen[record["split"]]):
                continue
            seen[record["split"]] |= sides
        kept.append(record)
    return kept


def build_records(
    english: Mapping[str, str],
    spanish: Mapping[str, str],
    *,
    max_words: int = MAX_WORDS,
    max_deviation: float = MAX_LENGTH_DEVIATION,
) -> CorpusBuild:
    """Align cleaned verses, drop misaligned chapters, long pairs and length outliers; split by book."""
    pairs, empty = align_verses(english, spanish)
    norm = length_norm(pairs)
    shifted = detect_shifted_chapters(pairs, norm)
    displaced = displaced_endings(english, spanish)
    dropped = set(shifted) | set(displaced)
    kept = [p for p in pairs if p.chapter not in dropped]
    short = [p for p in kept if word_count(p.en) <= max_words and word_count(p.es) <= max_words]
    final = [p for p in short if abs(length_deviation(p.en, p.es, norm)) <= max_deviation]
    candidates = [{"id": p.key, "split": assign_split(p.book), "en": p.en, "es": p.es} for p in final]
    records = [dict(r) for r in drop_held_out_duplicates(candidates)]
    counts = Counter(r["split"] for r in records)
    return CorpusBuild(
        records=records,
        shifted_chapters=shifted,
        displaced_chapters=displaced,
        aligned_pairs=len(pairs),
        empty_dropped=empty,
        chapter_dropped=len(pairs) - len(kept),
        long_dropped=len(kept) - len(short),
        outliers_dropped=len(short) - len(final),
        duplicates_dropped=len(candidates) - len(records),
        split_counts={split: counts.get(split, 0) for split in SPLITS},
    )


def build_corpus(sword_dir: str | Path, *, max_words: int = MAX_WORDS) -> CorpusBuild:
    """Read both SWORD modules from an unpacked `usr/share/sword` and build the corpus records."""
    english = clean_module(read_sword_module(sword_dir, ENGLISH_MODULE))
    spanish = clean_module(read_sword_module(sword_dir, SPANISH_MODULE), spanish=True)
    return build_records(english, spanish, max_words=max_words)


def write_corpus(records: Iterable[Mapping[str, str]], path: str | Path) -> None:
    """Write records as gzipped JSON lines, byte-for-byte reproducibly (gzip mtime 0, no file name).

    Written beside `path` and renamed: a write that fails (a full disk) or is killed leaves the file
    that was there (by default the shipped corpus), not a truncated one."""
    lines = "".join(json.dumps(dict(record), ensure_ascii=False) + "\n" for record in records)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as handle:
        handle.write(lines.encode("utf-8"))
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(buffer.getvalue())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
