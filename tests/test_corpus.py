"""Tests of the corpus extraction helpers and of the shipped English -> Spanish corpus file."""

from __future__ import annotations

import gzip
import importlib.util
import os
import random
import re
from pathlib import Path

import pytest

from tools import bible_corpus as corpus
from tools.bible_corpus import (
    VersePair,
    detect_shifted_chapters,
    displaced_endings,
    drop_held_out_duplicates,
    find_proper_nouns,
    fix_drop_caps,
    is_shifted_chapter,
    strip_markup,
    strip_subscription,
    write_corpus,
)
from vanilla_transformer.corpus import default_corpus_path, load_default_corpus, read_corpus

GEN_1_1 = (
    '<w lemma="strong:H0430">In</w> <w lemma="strong:H0853">the</w> <w lemma="strong:H7225">beginning</w>, '
    '<w lemma="strong:H0430">God</w><note placement="foot"><reference type="annotateRef">1:1 </reference>'
    "The Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).</note>"
    '<w lemma="strong:H1254">created</w> <w lemma="strong:H0853">the</w> <w lemma="strong:H8064">heavens</w> '
    '<w lemma="strong:H0430">and</w> <w lemma="strong:H0853">the</w> <w lemma="strong:H0776">earth</w>. '
)


# --- markup -------------------------------------------------------------------------------------------


def test_strip_markup_removes_notes_without_gluing_words() -> None:
    assert strip_markup(GEN_1_1) == "In the beginning, God created the heavens and the earth."


def test_strip_markup_replaces_tags_by_spaces() -> None:
    assert strip_markup('<w lemma="a">Yahweh</w><w lemma="b">God</w> <w>made</w>') == "Yahweh God made"
    raw = '<q marker="" who="Jesus"><w>only</w> born</q><note placement="foot">x</note><q><w>Son</w>, </q>'
    assert strip_markup(raw) == "only born Son,"


def test_strip_markup_punctuation_entities_and_pilcrow() -> None:
    raw = '¶ “<w>Go</w>,” <w>he</w> <w>said</w>. ¿<w>Y</w>?—<w>no</w> &amp; <w>God</w>’s <l level="1"/>x'
    assert strip_markup(raw) == "“Go,” he said. ¿Y?—no & God’s x"


def test_strip_markup_titles_speakers_and_glossary() -> None:
    psalm = (
        '<div type="x-milestone" sID="pv1"/><title canonical="true" type="psalm">A Psalm by David.</title> '
        '<lg sID="g1"/><l level="1"/>Yahweh is my shepherd.<l eID="g2"/>'
    )
    assert strip_markup(psalm) == "A Psalm by David. Yahweh is my shepherd."
    assert strip_markup("<speaker>Beloved</speaker> <l/>Let him kiss me") == "Let him kiss me"
    rev = (
        '<w>saints</w>. Amen. <chapter eID="Rev.22"/> <div sID="g3" type="glossary"/> '
        '<title level="1" type="main">World English Bible Glossary</title> Abaddon is Hebrew for destruction.'
    )
    assert strip_markup(rev) == "saints. Amen."


# --- Spanish clean-up ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fixed"),
    [
        ("EN el principio crió Dios los cielos", "En el principio crió Dios los cielos"),
        ("Y HABLÓ Dios todas estas palabras", "Y habló Dios todas estas palabras"),
        ("PABLO, apóstol de Jesucristo", "Pablo, apóstol de Jesucristo"),
        ("¡OH Jehová, cuánto se han multiplicado", "¡Oh Jehová, cuánto se han multiplicado"),
        ("LA SEGUNDA suerte salió por Simeón", "La segunda suerte salió por Simeón"),
        ("En el principio era el Verbo", "En el principio era el Verbo"),
        ("ESTE ES EL REY DE LOS JUDIOS.", "ESTE ES EL REY DE LOS JUDIOS."),
        ("HE. Enséñame, oh Jehová", "HE. Enséñame, oh Jehová"),
        ("Y dijo: YO SOY me ha enviado", "Y dijo: YO SOY me ha enviado"),
    ],
)
def test_fix_drop_caps(raw: str, fixed: str) -> None:
    assert fix_drop_caps(raw) == fixed


def test_fix_drop_caps_keeps_names_and_handles_psalm_titles() -> None:
    assert fix_drop_caps("Y JEHOVÁ dijo á Moisés", proper_nouns={"jehová"}) == "Y Jehová dijo á Moisés"
    assert fix_drop_caps("Y JEHOVÁ dijo á Moisés") == "Y jehová dijo á Moisés"
    title = "Al Músico principal: Salmo de David. TEN piedad de mí, oh Dios."
    assert (
        fix_drop_caps(title, chapter_start=True)
        == "Al Músico principal: Salmo de David. Ten piedad de mí, oh Dios."
    )
    assert fix_drop_caps(title) == title


def test_find_proper_nouns() -> None:
    texts = ["Y dijo Jehová á Moisés: Ve.", "Habló Jehová con el pueblo.", "y dijo el rey á su siervo."]
    assert find_proper_nouns(texts) == {"jehová", "moisés"}


def test_strip_subscription() -> None:
    text = "La gracia sea con todos vosotros. Amén. Fué escrita á los Hebreos desde Italia con Timoteo."
    assert strip_subscription(text) == "La gracia sea con todos vosotros. Amén."
    assert (
        strip_subscription("Hijitos, guardaos de los ídolos. Amén.")
        == "Hijitos, guardaos de los ídolos. Amén."
    )


# --- alignment ----------------------------------------------------------------------------------------


def _chapter(n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    english = [rng.randint(30, 200) for _ in range(n)]
    spanish = [max(5, round(length * rng.uniform(0.9, 1.1))) for length in english]
    return english, spanish


def test_is_shifted_chapter_on_synthetic_chapters() -> None:
    for seed in range(5):
        english, spanish = _chapter(25, seed)
        assert not is_shifted_chapter(english, spanish, norm=0.0)
        # Spanish verse i holds English verse i-1 (a verse moved in from the chapter before).
        assert is_shifted_chapter(english, [40, *spanish[:-1]], norm=0.0)
        # Only the second half shifted (two verses merged in the middle).
        assert is_shifted_chapter(english, [*spanish[:12], *spanish[13:], 60], norm=0.0)


def test_detect_shifted_chapters_on_verse_pairs() -> None:
    pairs = []
    for number, shift in ((1, False), (2, True), (3, False)):
        english, spanish = _chapter(20, number)
        if shift:
            spanish = [*spanish[1:], 50]
        pairs += [
            VersePair(f"Gen.{number}.{v + 1}", "e" * en, "s" * es)
            for v, (en, es) in enumerate(zip(english, spanish, strict=True))
        ]
    assert detect_shifted_chapters(pairs) == ["Gen.2"]


def test_displaced_endings() -> None:
    english = {"Job.35.15": "a", "Job.35.16": "b", "Job.36.1": "c", "Acts.8.37": "", "Acts.8.38": "d"}
    spanish = {"Job.35.15": "a b", "Job.35.16": "", "Job.36.1": "c", "Acts.8.37": "e", "Acts.8.38": "d"}
    assert displaced_endings(english, spanish) == ["Job.35"]


def test_drop_held_out_duplicates() -> None:
    records = [
        {"id": "Gen.1.1", "split": "train", "en": "A", "es": "a"},
        {"id": "Gen.1.2", "split": "train", "en": "A", "es": "a"},
        {"id": "Ezek.1.1", "split": "test", "en": "A", "es": "x"},
        {"id": "Ezek.1.2", "split": "test", "en": "B", "es": "b"},
        {"id": "Ezek.1.3", "split": "test", "en": "B", "es": "c"},
        {"id": "Ruth.1.1", "split": "validation", "en": "B", "es": "b"},
    ]
    kept = [r["id"] for r in drop_held_out_duplicates(records)]
    assert kept == ["Gen.1.1", "Gen.1.2", "Ezek.1.2", "Ruth.1.1"]


def test_write_corpus_is_deterministic(tmp_path) -> None:
    records = [{"id": "Gen.1.1", "split": "train", "en": "In the beginning", "es": "En el principio"}]
    write_corpus(records, tmp_path / "a.jsonl.gz")
    write_corpus(records, tmp_path / "b.jsonl.gz")
    data = (tmp_path / "a.jsonl.gz").read_bytes()
    assert data == (tmp_path / "b.jsonl.gz").read_bytes()
    assert data[4:8] == b"\0\0\0\0"  # gzip mtime
    assert read_corpus(tmp_path / "a.jsonl.gz") == records


def test_a_failed_write_leaves_the_corpus_that_was_there(tmp_path, monkeypatch) -> None:
    """The file was written in place: a full disk part way left a truncated gzip where the shipped corpus
    had been."""
    output = tmp_path / "corpus.jsonl.gz"
    records = [{"id": "Gen.1.1", "split": "train", "en": "In the beginning", "es": "En el principio"}]
    write_corpus(records, output)
    before = output.read_bytes()
    written = Path.write_bytes

    def full_disk(self: Path, data: bytes) -> int:
        written(self, data[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_corpus(records * 2, output)
    assert output.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [output.name]

    script, sword = load_build_corpus_script(monkeypatch, tmp_path)
    build = corpus.CorpusBuild(records * 2, [], [], 0, 0, 0, 0, 0, 0, dict.fromkeys(corpus.SPLITS, 1))
    monkeypatch.setattr(script, "build_corpus", lambda *_, **__: build)
    with pytest.raises(SystemExit, match=r"No space left on device.*the file there is unchanged"):
        script.main(["--sword-dir", str(sword), "--output", str(output)])
    assert output.read_bytes() == before


# --- the shipped file ---------------------------------------------------------------------------------


def test_build_corpus_script_refuses_what_would_fail_or_empty_the_corpus_before_any_work(
    tmp_path, monkeypatch, capsys
) -> None:
    """Without pysword it ended in a traceback after the download; with --max-words 0 every pair was
    dropped and the shipped corpus replaced by an empty file."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "build_corpus.py"
    spec = importlib.util.spec_from_file_location("build_corpus_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "fetch_sword_dir", lambda _: pytest.fail("downloaded"))
    monkeypatch.setattr(script, "pysword_missing", lambda: False)
    output = tmp_path / "corpus.jsonl.gz"
    sword = tmp_path / "sword"
    (sword / "mods.d").mkdir(parents=True)
    for argv, message in (
        (["--max-words", "0"], "--max-words must be positive, got 0"),
        (["--sword-dir", str(tmp_path)], "is not an unpacked usr/share/sword"),
        (["--max_words", "0"], "--max-words must be positive, got 0"),  # the other scripts' spelling
        (["--sword_dir", str(tmp_path)], "is not an unpacked usr/share/sword"),
    ):
        with pytest.raises(SystemExit):
            script.main([*argv, "--output", str(output)])
        assert message in capsys.readouterr().err
    monkeypatch.setattr(script, "pysword_missing", lambda: True)
    with pytest.raises(SystemExit):
        script.main(["--sword-dir", str(sword), "--output", str(output)])
    assert "needs pysword: pip install pysword" in capsys.readouterr().err
    monkeypatch.setattr(script, "pysword_missing", lambda: False)  # installed, and the build empties splits
    counts = {"train": 3, "validation": 0, "test": 0}
    build = corpus.CorpusBuild([], [], [], 0, 0, 0, 0, 0, 0, counts)
    monkeypatch.setattr(script, "build_corpus", lambda *_, **__: build)
    with pytest.raises(SystemExit, match="no pairs left for validation, test"):
        script.main(["--sword-dir", str(sword), "--output", str(output)])
    assert not output.exists()


def load_build_corpus_script(monkeypatch, tmp_path):
    """scripts/build_corpus.py as a module, with pysword taken as installed and no download allowed, and an
    unpacked SWORD folder for --sword-dir."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "build_corpus.py"
    spec = importlib.util.spec_from_file_location("build_corpus_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "fetch_sword_dir", lambda _: pytest.fail("downloaded"))
    monkeypatch.setattr(script, "pysword_missing", lambda: False)
    sword = tmp_path / "sword"
    (sword / "mods.d").mkdir(parents=True)
    return script, sword


def test_build_corpus_script_refuses_an_output_it_cannot_write_before_the_build(
    tmp_path, monkeypatch, capsys
) -> None:
    """A folder as --output, or a file on its way or a folder that does not exist, once failed with a
    traceback after the whole build."""
    script, sword = load_build_corpus_script(monkeypatch, tmp_path)
    monkeypatch.setattr(script, "build_corpus", lambda *_, **__: pytest.fail("built"))
    (tmp_path / "a-file").write_text("")
    for output, message in (
        (tmp_path, "is a folder; name a file to write"),
        (tmp_path / "a-file" / "corpus.jsonl.gz", f"the folder {tmp_path / 'a-file'} does not exist"),
        (tmp_path / "new" / "corpus.jsonl.gz", f"the folder {tmp_path / 'new'} does not exist"),
    ):
        with pytest.raises(SystemExit):
            script.main(["--sword-dir", str(sword), "--output", str(output)])
        assert message in capsys.readouterr().err


def test_build_corpus_script_refuses_an_output_in_a_read_only_folder_before_the_build(
    tmp_path, monkeypatch, capsys
) -> None:
    """A read-only folder (the shipped file of a package installed system-wide) failed only at the write,
    after the download and the build."""
    script, sword = load_build_corpus_script(monkeypatch, tmp_path)
    monkeypatch.setattr(script, "build_corpus", lambda *_, **__: pytest.fail("built"))
    folder = tmp_path / "read-only"
    folder.mkdir()
    access = os.access

    def read_only(path, mode, *args, **kwargs):  # as for a read-only mount (a folder's mode binds no root)
        return not (mode & os.W_OK and Path(path) == folder) and access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", read_only)
    with pytest.raises(SystemExit):
        script.main(["--sword-dir", str(sword), "--output", str(folder / "corpus.jsonl.gz")])
    assert f"the folder {folder} is not writable" in capsys.readouterr().err


@pytest.fixture(scope="module")
def shipped() -> list[dict[str, str]]:
    return read_corpus()


def test_shipped_file_is_small_gzip() -> None:
    path = default_corpus_path()
    assert path.name == "bible_en_es.jsonl.gz"
    assert path.stat().st_size < 1_000_000
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        assert handle.readline().startswith('{"id": "Gen.1.1", "split": "train", "en": ')


def test_load_default_corpus() -> None:
    dataset = load_default_corpus()
    assert set(dataset) == {"train", "validation", "test"}
    assert dataset["train"].column_names == ["en", "es"]
    assert 9_000 <= dataset["train"].num_rows <= 12_000
    assert 400 <= dataset["validation"].num_rows <= 900
    assert 500 <= dataset["test"].num_rows <= 1_100
    assert load_default_corpus(with_ids=True)["test"].column_names == ["id", "en", "es"]


def test_shipped_text_is_clean(shipped) -> None:
    for record in shipped:
        for side in ("en", "es"):
            text = record[side]
            assert text and text == text.strip(), record
            assert not re.search(r"[<>&¶]|\s\s|\s[,.;:!?]", text), record
            assert len(text.split()) <= corpus.MAX_WORDS, record
        assert not re.match(r"\W*(?:[A-ZÁÉÍÓÚÑ]+\s+)?[A-ZÁÉÍÓÚÑ]{2,}[,;]?\s+[a-záéíóúñ]", record["es"]), (
            record
        )


def test_shipped_ids_and_splits(shipped) -> None:
    ids = [r["id"] for r in shipped]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"[1-3]?[A-Z][A-Za-z]+\.\d+\.\d+", i) for i in ids)
    books: dict[str, set[str]] = {}
    for record in shipped:
        books.setdefault(record["split"], set()).add(record["id"].split(".")[0])
    assert books["validation"] == set(corpus.VALIDATION_BOOKS)
    assert books["test"] == set(corpus.TEST_BOOKS)
    assert not books["train"] & (books["validation"] | books["test"])
    train_en = {r["en"] for r in shipped if r["split"] == "train"}
    assert not any(r["en"] in train_en for r in shipped if r["split"] != "train")


def test_shipped_known_verses(shipped) -> None:
    by_id = {r["id"]: r for r in shipped}
    assert by_id["Gen.1.1"]["en"] == "In the beginning, God created the heavens and the earth."
    assert by_id["Gen.1.1"]["es"] == "En el principio crió Dios los cielos y la tierra."
    assert by_id["John.11.35"] == {
        "id": "John.11.35",
        "split": "test",
        "en": "Jesus wept.",
        "es": "Y lloró Jesús.",
    }
    assert "Num.13.2" not in by_id  # a shifted chapter in the Spanish module


def test_the_corpus_carries_its_own_description():
    """The model card's dataset text comes from here, not from the training code."""
    from vanilla_transformer.parallel_data import load_parallel_data, tokenize_parallel_data
    from vanilla_transformer.tokenization import train_bpe_tokenizer

    info = load_default_corpus()["train"].info
    assert info.license == "public domain" and "Reina-Valera 1909" in info.description
    data, report = load_parallel_data()
    tokenizer = train_bpe_tokenizer(data["train"]["source"][:200] + data["train"]["target"][:200], 300)
    tokenized = tokenize_parallel_data(data, tokenizer, 64, report)
    assert tokenized["test"].info.dataset_name == info.dataset_name  # it survives loading and tokenizing
