"""Build an English -> German corpus of software messages from gettext catalogs (a second domain and language
pair beside the shipped Bible corpus, used to check that the training recipe is not tuned to one corpus).

Reads every `LANG/LC_MESSAGES/*.mo` under a locale folder: by default the Debian packages in `PACKAGES`
fetched with `apt-get download` (run `apt-get update` once first; nothing is installed) and unpacked into a
temporary folder, or `--locale-dir` (e.g. `/usr/share/locale` of this machine). msgid is the English
side, msgstr the translation. Kept: translated, non-fuzzy singular messages; keyboard accelerators
(`_File`, `&Open`) removed, whitespace collapsed; pairs whose printf/brace placeholders differ between the
sides, with a side longer than `--max-words` words, or identical on both sides are dropped. Whole catalogs
go to validation or test (chosen by a hash of the catalog's name), so near-duplicate messages of one
program never straddle the split. An English message is kept once, from the first catalog (by name) that
has it, in whichever split that catalog is; then held-out messages that differ from a training one only in
case, spaces and punctuation (messages shared by several programs) are dropped. Writes
`train.jsonl`, `validation.jsonl`, `test.jsonl` with fields `en` and the language code into a new (or
empty) folder, which appears once all three are complete. Needs `pip install polib`.

    python scripts/build_messages_corpus.py --output-dir data/messages-en-de
    python scripts/build_messages_corpus.py --locale-dir /usr/share/locale --output-dir /tmp/messages
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from vanilla_transformer.cli import utf8_stdout
from vanilla_transformer.publishing import check_new_folder, publish_folder

# Debian packages that ship German catalogs of command-line tools and libraries.
PACKAGES = (
    "coreutils", "tar", "grep", "sed", "findutils", "diffutils", "gettext", "gpg", "wget", "make",
    "git-man", "dpkg", "apt", "procps", "bash", "libc-l10n", "e2fsprogs", "util-linux-locales",
)  # fmt: skip
# Catalogs of names (languages, countries, scripts, currencies), not sentences.
SKIPPED_CATALOGS = re.compile(r"^(iso_|iso-|xkeyboard-config)")
# printf's conversions ("%s", "%1$-08.3f": a width never starts with 0, which is a flag: read as either,
# a run of zeros had quadratically many ways to match) and Python's "{name}".
PLACEHOLDER = re.compile(
    r"%(?:\d+\$)?[-+ #0']*(?:\*|[1-9]\d*)?(?:\.(?:\*|\d+))?(?:hh|h|ll|l|L|q|j|z|t)?[a-zA-Z%]|\{[^{}]*\}"
)
# A keyboard accelerator: "_" or "&" before the letter it marks, at a word's start (the message's, or after
# a space, a "|" context separator, an opening quote or bracket, or a hyphen: "Von-_links"). Not an "&" that
# starts an entity ("&amp;", "&lt;": text about XML), nor "_" that starts an identifier ("_open_osfhandle")
# or follows other punctuation (the strftime flag "%_d", "`_POSIX2_LOCALEDEF'", "pam_*_item()"): these
# once lost the character, the source and its translation alike.
ACCELERATOR = re.compile(r"(?:^|(?<=[\s|(\[»«\"'“„-]))(?:_|&(?![#\w]+;))(?=[^\W\d_])(?![^\W_]*_\w)")
HELD_OUT_SHARE = {"validation": 0.05, "test": 0.05}


def normalise(text: str) -> str:
    """One line, single spaces, no keyboard accelerators."""
    return " ".join(ACCELERATOR.sub("", text).split())


def placeholders(text: str) -> Counter:
    """The multiset of printf (`%s`, `%2$d`) and brace (`{0}`, `{name}`) placeholders in `text`."""
    return Counter(PLACEHOLDER.findall(text))


def catalog_split(name: str) -> str:
    """Where a whole catalog goes: a stable hash of its name picks ~5% for validation, ~5% for test."""
    share = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    if share < HELD_OUT_SHARE["validation"]:
        return "validation"
    if share < HELD_OUT_SHARE["validation"] + HELD_OUT_SHARE["test"]:
        return "test"
    return "train"


def catalog_pairs(path: Path, max_words: int) -> Iterator[tuple[str, str]]:
    """The usable (English, translation) pairs of one `.mo` catalog; a ValueError names a file that is not
    one (polib's own errors said neither which file nor, for a short one, what was wrong)."""
    import polib

    try:
        catalog = polib.mofile(str(path))
    except (OSError, ValueError, LookupError, struct.error) as error:  # not .mo, cut short, bad charset
        raise ValueError(f"{path} is not a readable .mo catalog ({error})") from None
    for entry in catalog:
        if entry.obsolete or entry.msgid_plural or "fuzzy" in entry.flags or not entry.msgstr:
            continue
        source, target = normalise(entry.msgid), normalise(entry.msgstr)
        if not source or not target or source == target:
            continue
        if len(source.split()) > max_words or len(target.split()) > max_words:
            continue
        if placeholders(entry.msgid) != placeholders(entry.msgstr):
            continue
        yield source, target


def build(catalogs: Iterable[Path], max_words: int) -> dict[str, list[tuple[str, str]]]:
    """Pairs per split: one per English message (its first catalog's translation, in that catalog's
    split); held-out ones unseen in train, also as near-duplicates (`near_key`)."""
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "validation": [], "test": []}
    seen: set[str] = set()
    for path in sorted(catalogs, key=lambda p: p.name):
        name = path.stem
        if SKIPPED_CATALOGS.match(name):
            continue
        split = catalog_split(name)
        for source, target in catalog_pairs(path, max_words):
            if source not in seen:
                seen.add(source)
                splits[split].append((source, target))
    # Messages shared by several programs come with small differences ("cannot open %s" / "cannot open
    # '%s'", "Command line" / "command line"): compared without case, spaces and punctuation.
    train_sources = {near_key(source) for source, _ in splits["train"]}
    for split in ("validation", "test"):
        splits[split] = [pair for pair in splits[split] if near_key(pair[0]) not in train_sources]
    return splits


def near_key(message: str) -> str:
    """`message` lowercased, letters and digits only: near-duplicates compare equal."""
    return re.sub(r"[\W_]+", "", message.lower())


def fetch_locale_dir(workdir: Path) -> Path:
    """Download and unpack `PACKAGES` (those that exist) into `workdir`; return the unpacked locale folder."""
    debs, root = workdir / "debs", workdir / "root"
    debs.mkdir()
    root.mkdir()
    for package in PACKAGES:  # one at a time: a name missing from this release skips only itself
        if subprocess.run(["apt-get", "download", package], cwd=debs, check=False).returncode != 0:
            print(f"skipped {package}: not downloadable here", file=sys.stderr)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root / "usr" / "share" / "locale"


def write_jsonl(pairs: Iterable[tuple[str, str]], path: Path, language: str) -> None:
    with path.open("w", encoding="utf-8") as file:
        for source, target in pairs:
            file.write(json.dumps({"en": source, language: target}, ensure_ascii=False) + "\n")


def polib_missing() -> bool:
    """Whether `polib`, which reads the catalogs, is not installed."""
    return importlib.util.find_spec("polib") is None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Each flag also takes the underscore spelling of the other scripts (--output_dir as --output-dir).
    parser.add_argument(
        "--locale-dir", "--locale_dir", type=Path, help="a locale folder (default: apt-get download)"
    )
    parser.add_argument("--language", default="de", help="target language code (default de)")
    parser.add_argument(
        "--output-dir", "--output_dir", type=Path, required=True, help="a new (or empty) folder"
    )
    parser.add_argument(
        "--max-words", "--max_words", type=int, default=30, help="longest side kept, in words (default 30)"
    )
    args = parser.parse_args(argv)
    if args.max_words <= 0:
        parser.error(f"--max-words must be positive, got {args.max_words}")
    if args.language == "en":  # the rows' "en" field is the English source
        parser.error("--language is the target language; English is the source side")
    if polib_missing():  # said before the download: once a traceback after it
        parser.error('reading the catalogs needs polib: pip install polib (or pip install -e ".[corpus]")')
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"--output-dir {args.output_dir} is a file")
    try:  # an earlier corpus, or someone's own train.jsonl, was overwritten without a word
        check_new_folder(args.output_dir)
    except ValueError as error:
        parser.error(f"--output-dir {error}")

    with tempfile.TemporaryDirectory() as tmp:
        locale_dir = args.locale_dir or fetch_locale_dir(Path(tmp))
        catalogs = list((locale_dir / args.language / "LC_MESSAGES").glob("*.mo"))
        if not catalogs:
            parser.error(f"no catalogs in {locale_dir / args.language / 'LC_MESSAGES'}")
        try:
            splits = build(catalogs, args.max_words)
        except ValueError as error:
            parser.error(str(error))

    empty = [split for split, pairs in splits.items() if not pairs]
    if empty:  # too few catalogs: whole catalogs go to validation and test
        print(f"warning: {len(catalogs)} catalogs left no pairs for {', '.join(empty)}", file=sys.stderr)
    try:
        # All three files, or none (an interrupted run leaves no split half written); nothing of an
        # earlier run into the same name.
        with publish_folder(args.output_dir, keep_other_files=False) as staging:
            for split, pairs in splits.items():
                write_jsonl(pairs, staging / f"{split}.jsonl", args.language)
    except OSError as error:  # a full disk
        sys.exit(f"error: writing {args.output_dir} failed ({error}); nothing was written there")
    for split, pairs in splits.items():
        print(f"{split}: {len(pairs)} pairs")
    print(f"from {len(catalogs)} catalogs -> {args.output_dir}")
    return 0


if __name__ == "__main__":
    utf8_stdout()  # what is printed, in UTF-8 whatever the locale
    sys.exit(main())
