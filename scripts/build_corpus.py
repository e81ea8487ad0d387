"""Rebuild the shipped English -> Spanish Bible corpus (`vanilla_transformer/data/bible_en_es.jsonl.gz`).

By default the two Debian packages are fetched with `apt-get download` (run `apt-get update` once
first; nothing is installed) and unpacked into a temporary folder; `--sword-dir` instead points at an
already unpacked `usr/share/sword`. Needs `pip install pysword`. The output is byte-for-byte
reproducible for the same package versions.

    python scripts/build_corpus.py
    python scripts/build_corpus.py --sword-dir /tmp/sword/usr/share/sword --output /tmp/corpus.jsonl.gz
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ folder
from tools.bible_corpus import build_corpus, write_corpus
from vanilla_transformer.cli import check_output_file, utf8_stdout
from vanilla_transformer.corpus import SPLITS, default_corpus_path

PACKAGES = ("sword-text-web", "sword-text-sparv")


def fetch_sword_dir(workdir: Path) -> Path:
    """Download and unpack the SWORD packages into `workdir`; return the unpacked `usr/share/sword`."""
    debs = workdir / "debs"
    root = workdir / "root"
    debs.mkdir()
    root.mkdir()
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True)
    for deb in sorted(debs.glob("*.deb")):
        print(f"unpacking {deb.name}")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root / "usr" / "share" / "sword"


def pysword_missing() -> bool:
    """Whether `pysword`, which reads the SWORD modules, is not installed."""
    return importlib.util.find_spec("pysword") is None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Each flag also takes the underscore spelling of the other scripts (--output_dir as --output-dir).
    parser.add_argument(
        "--sword-dir",
        "--sword_dir",
        type=Path,
        help="an unpacked usr/share/sword (default: apt-get download)",
    )
    parser.add_argument(
        "--output", type=Path, default=default_corpus_path(), help="default: the shipped file"
    )
    parser.add_argument(
        "--max-words", "--max_words", type=int, default=20, help="longest side kept, in words (default 20)"
    )
    args = parser.parse_args(argv)
    # Said before any download: once a traceback after it (no pysword), or every pair dropped and the
    # shipped corpus replaced by an empty file (--max-words 0).
    if args.max_words <= 0:
        parser.error(f"--max-words must be positive, got {args.max_words}")
    if pysword_missing():
        parser.error("reading the SWORD modules needs pysword: pip install pysword")
    if args.sword_dir is not None and not (args.sword_dir / "mods.d").is_dir():
        parser.error(f"--sword-dir {args.sword_dir} is not an unpacked usr/share/sword (no mods.d folder)")
    # The output too, before the download and the build: a folder there once failed only at the write.
    try:  # a folder, a missing or read-only folder: found only at the write, after the build
        check_output_file(args.output)
    except ValueError as error:
        parser.error(f"--output {error}")

    with tempfile.TemporaryDirectory() as tmp:
        sword_dir = args.sword_dir or fetch_sword_dir(Path(tmp))
        build = build_corpus(sword_dir, max_words=args.max_words)
    empty = [split for split in SPLITS if not build.split_counts[split]]
    if empty:  # not written: the shipped corpus would be replaced by one that cannot train or score
        sys.exit(f"error: no pairs left for {', '.join(empty)}; {args.output} not written")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_corpus(build.records, args.output)
    except OSError as error:  # a full disk: the file there is left as it was
        sys.exit(f"error: writing {args.output} failed ({error}); the file there is unchanged")
    print(f"aligned verse pairs: {build.aligned_pairs} (dropped {build.empty_dropped} with an empty side)")
    print(f"shifted chapters ({len(build.shifted_chapters)}): {' '.join(build.shifted_chapters)}")
    print(
        f"displaced chapter endings ({len(build.displaced_chapters)}): {' '.join(build.displaced_chapters)}"
    )
    print(f"pairs dropped with those chapters: {build.chapter_dropped}")
    print(f"pairs dropped as longer than {args.max_words} words: {build.long_dropped}")
    print(f"pairs dropped as length-ratio outliers: {build.outliers_dropped}")
    print(f"held-out pairs dropped as duplicates of train or of each other: {build.duplicates_dropped}")
    for split in SPLITS:
        print(f"{split}: {build.split_counts[split]}")
    print(f"total: {len(build.records)} pairs, {args.output.stat().st_size} bytes -> {args.output}")
    return 0


if __name__ == "__main__":
    utf8_stdout()  # what is printed, in UTF-8 whatever the locale
    sys.exit(main())
