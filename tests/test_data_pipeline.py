"""Tokenizer, data loading and token-based batching."""

import csv
import json
import os
import random
import tracemalloc
import unicodedata
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, Features, Translation
from transformers import AutoTokenizer

from vanilla_transformer import parallel_data
from vanilla_transformer.batching import TokenBatchSampler
from vanilla_transformer.parallel_data import (
    DataError,
    _to_source_target,
    load_parallel_data,
    tokenize_parallel_data,
)
from vanilla_transformer.tokenization import SPECIAL_TOKENS, train_bpe_tokenizer

SENTENCES = [
    "In the beginning, God created the heavens and the earth.",
    "En el principio crió Dios los cielos y la tierra.",
    "¿Qué es esto? «Nada», dijo él—sí.",
    'He said, "Don\'t go!" (and left)',
    "Jesus wept.",
    "Y lloró Jesús.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(SENTENCES * 20, vocab_size=300)


# Tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_tokens(tokenizer, tmp_path):
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    encoded = tokenizer(SENTENCES, text_target=SENTENCES[::-1])
    assert all(ids[-1] == tokenizer.eos_token_id for ids in encoded["input_ids"] + encoded["labels"])
    assert tokenizer.batch_decode(encoded["input_ids"], skip_special_tokens=True) == SENTENCES
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(SENTENCES)["input_ids"] == encoded["input_ids"]
    assert loaded.decode(loaded("Jesus wept.")["input_ids"], skip_special_tokens=True) == "Jesus wept."


def test_a_tab_or_other_whitespace_between_words_separates_them(tokenizer, tmp_path):
    """A tab was a character of its own (<unk>: no training text had one) and took the next word's
    word-start marker: "God<tab>created" was encoded, and decoded, as one word."""
    spaced = tokenizer("God created the earth.")["input_ids"]
    for text in ("God\tcreated the earth.", "God created\u3000the\u00a0earth.", "God\t created the earth."):
        decoded = tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)
        assert decoded.split() == ["God", "created", "the", "earth."]
    assert tokenizer("God\tcreated the earth.")["input_ids"] == spaced
    tokenizer.save_pretrained(tmp_path)  # the rule is saved with it
    assert AutoTokenizer.from_pretrained(tmp_path)("God\tcreated the earth.")["input_ids"] == spaced


def test_a_run_of_whitespace_reads_as_one_space(tokenizer, tmp_path, monkeypatch):
    """A second space was a word-start token of its own, which no training sentence has: two spaces after
    a full stop, given to the tokenizer directly (as `model.generate(**tokenizer(text))` is called),
    changed a trained model's translation. A tokenizer trained before keeps its rule, and `length_check`
    still judges long texts in pieces with it."""
    from tokenizers import normalizers

    from vanilla_transformer import tokenization

    plain = tokenizer("God created the earth. Jesus wept.")["input_ids"]
    for text in ("God created the earth.  Jesus wept.", "God  created\t\tthe \u3000earth. \n Jesus wept."):
        assert tokenizer(text)["input_ids"] == plain, repr(text)
    tokenizer.save_pretrained(tmp_path)  # the rule is saved with it
    assert (
        AutoTokenizer.from_pretrained(tmp_path)("God created the earth.  Jesus wept.")["input_ids"] == plain
    )
    earlier = AutoTokenizer.from_pretrained(tmp_path)
    earlier.backend_tokenizer.normalizer = tokenization.text_normalizer(runs=False)
    assert earlier("God created the earth.  Jesus wept.")["input_ids"] != plain
    # Judged in pieces (each piece's count lowered by the slack) with either rule, whole with another.
    text = "word " * tokenization.LENGTH_CHECK_CHUNK
    assert all(tokenization.length_check(8, judged)([text]) == [True] for judged in (tokenizer, earlier))
    monkeypatch.setattr(tokenization, "LENGTH_CHECK_SLACK", tokenization.LENGTH_CHECK_CHUNK)
    assert all(tokenization.length_check(8, judged)([text]) == [False] for judged in (tokenizer, earlier))
    earlier.backend_tokenizer.normalizer = normalizers.NFKC()
    assert tokenization.length_check(8, earlier)([text]) == [True]


def test_whitespace_around_a_sentence_is_no_token(tokenizer, tmp_path):
    """A line read with its line break, or a sentence with spaces around it, was encoded with word-start
    tokens at its ends that no training sentence (stripped) has, and translated otherwise."""
    plain = tokenizer("Jesus wept.")["input_ids"]
    for text in ("Jesus wept.\n", "  Jesus wept. ", "\tJesus wept.\r\n", "\u00a0Jesus wept.\u3000"):
        assert tokenizer(text)["input_ids"] == plain, repr(text)
    tokenizer.save_pretrained(tmp_path)  # the rule is saved with it
    assert AutoTokenizer.from_pretrained(tmp_path)(" Jesus wept.\n")["input_ids"] == plain


def test_tokenizer_shares_one_vocabulary_across_languages(tokenizer):
    english, spanish = tokenizer("God created")["input_ids"], tokenizer("crió Dios")["input_ids"]
    assert max(english + spanish) < len(tokenizer)
    assert tokenizer.unk_token_id not in english + spanish
    with pytest.raises(ValueError, match="vocab_size must exceed"):
        train_bpe_tokenizer(SENTENCES, vocab_size=4)


def test_characters_unseen_in_training_are_unk_and_vanish_when_decoded(tokenizer):
    """As README says: one `<unk>` per character no training text (nor the base alphabet) has, and none
    of them in a decoded translation."""
    ids = tokenizer("Jesus 😀 wept 東京 7%")["input_ids"]
    assert ids.count(tokenizer.unk_token_id) == 3  # 😀, 東, 京; the digit and "%" are in the base alphabet
    assert tokenizer.decode(ids, skip_special_tokens=True).split() == ["Jesus", "wept", "7%"]


# Loading and cleaning ---------------------------------------------------------------------------


def test_default_corpus_loads_with_three_splits():
    data, report = load_parallel_data()
    assert set(data) == {"train", "validation", "test"}
    assert data["train"].column_names == ["source", "target"]
    assert len(data["train"]) > 10_000 and report.lines() == []


def write(path, text: str, encoding: str = "utf-8"):
    path.write_bytes(text.encode(encoding))
    return path


def test_local_tsv_jsonl_and_csv(tmp_path):
    tsv = write(tmp_path / "a.tsv", 'en\tes\nHello "there"\tHola\nNA\tnull\n\t\nfoo\t \nbar\tbarra\n')
    data, report = load_parallel_data(train_file=tsv, validation_file=tsv, test_file=tsv)
    assert data["train"]["source"] == ['Hello "there"', "NA", "bar"]  # quotes and "NA" are text
    assert report.empty == {"train": 2, "validation": 2, "test": 2}
    assert "skipped 2 train rows with an empty source or target" in report.lines()

    jsonl = write(tmp_path / "a.jsonl", '{"de": "Hallo", "en": "Hello"}\n{"de": "Welt", "en": "World"}\n')
    data, _ = load_parallel_data(train_file=jsonl, validation_file=jsonl, source_lang="de", target_lang="en")
    assert data["validation"]["target"] == ["Hello", "World"]

    csv = write(tmp_path / "a.csv", 'src,tgt\n"one, two",uno\n')
    data, _ = load_parallel_data(
        train_file=csv, validation_file=csv, source_column="src", target_column="tgt"
    )
    assert data["train"][0] == {"source": "one, two", "target": "uno"}


def test_a_byte_order_mark_is_not_part_of_the_first_column_name(tmp_path):
    """With a BOM, a JSONL file was refused as "not valid JSON" and a TSV's repeated header row passed
    as a sentence pair; both readers of the data itself skip the mark."""
    jsonl = write(tmp_path / "b.jsonl", '\ufeff{"en": "Hi", "es": "Hola"}\n')
    data, _ = load_parallel_data(test_file=jsonl, for_training=False)
    assert data["test"][0] == {"source": "Hi", "target": "Hola"}
    for second in ("en", "\ufeffen"):  # two such files concatenated: the second header has its mark too
        tsv = write(tmp_path / "b.tsv", f"\ufeffen\tes\nHello.\tHola.\n{second}\tes\nBye.\tAdios.\n")
        with pytest.raises(DataError, match=r"b\.tsv, line 3: repeats the header row \['en', 'es'\]"):
            load_parallel_data(test_file=tsv, for_training=False)


def test_evaluation_sources_that_occur_in_train_are_reported(tmp_path):
    """A test or validation file sharing sentences with the training file (OPUS splits, a test file cut
    from the same corpus) scored memorised pairs without a word."""
    rows = "".join(f"s{i}\tt{i}\n" for i in range(30))
    train = write(tmp_path / "train.tsv", "en\tes\n" + rows)
    test = write(tmp_path / "test.tsv", "en\tes\ns1\tother\ns2\tt2\nnew\tnuevo\n")
    validation = write(tmp_path / "validation.tsv", "en\tes\nnew\tnuevo\n")
    data, report = load_parallel_data(train_file=train, validation_file=validation, test_file=test)
    assert len(data["test"]) == 3  # kept: the test file is the user's
    assert report.sources_in_train == {"validation": 0, "test": 2}
    assert report.lines()[0].startswith("warning: 2 of the test pairs have a source sentence that")


def test_a_csv_field_that_opens_a_quote_it_does_not_close_is_named(tmp_path):
    """Read leniently, a field opening a quote ran on through the next lines (four pairs read as two, one
    of them ('A', '5 inch OK,Vale Hi,Hola"')) and a quoted start lost its quotes, without a word."""
    for text, line in (
        ('en,es\nA,"5 inch\nOK,Vale\nHi,"Hola"\nBye,Adios\n', "2 through line 4"),
        ('en,es\nHi,Hola\n"Go home" he said.,"Vete a casa" dijo.\n', "3"),
    ):
        path = write(tmp_path / "q.csv", text)
        with pytest.raises(DataError, match=rf"q\.csv, line {line}: not readable as CSV .*quoted whole"):
            load_parallel_data(test_file=path, for_training=False)
    path = write(tmp_path / "ok.csv", 'en,es\n"""Go home"" he said.",Vete.\nHe said 5" or so,Dijo\n')
    data, _ = load_parallel_data(test_file=path, for_training=False)
    assert data["test"]["source"] == ['"Go home" he said.', 'He said 5" or so']


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_lines_ended_by_a_carriage_return_alone_are_read_in_their_columns(tmp_path, suffix):
    """pandas' C parser read a row whose first field is empty, after a blank line, one column to the left
    in a file of old Mac line endings: ('Adios', 'farewell') trained as a pair."""
    sep = "\t" if suffix == ".tsv" else ","
    rows = (
        ["en", "es", "note"],
        ["Hello", "Hola", "hi"],
        [],
        ["", "Adios", "farewell"],
        ["Thanks", "Gracias", "x"],
    )
    path = write(tmp_path / f"cr{suffix}", "\r".join(sep.join(row) for row in rows) + "\r")
    data, report = load_parallel_data(test_file=path, for_training=False)
    assert list(zip(data["test"]["source"], data["test"]["target"], strict=True)) == [
        ("Hello", "Hola"),
        ("Thanks", "Gracias"),
    ]
    assert report.empty == {"test": 1}


def test_a_byte_order_mark_inside_a_file_is_named(tmp_path):
    """A headerless file saved with a byte-order mark, appended: the mark stayed in the sentence (a
    perfect translation scored 48.3 BLEU, not 55.3, with it on the target side)."""
    for suffix, sep in ((".tsv", "\t"), (".csv", ",")):
        path = write(tmp_path / f"m{suffix}", f"\ufeffen{sep}es\nHi{sep}Hola\n\ufeffThanks{sep}Gracias\n")
        with pytest.raises(DataError, match=rf"m\{suffix}, line 3: starts with a byte-order mark"):
            load_parallel_data(test_file=path, for_training=False)


def test_held_out_validation_shares_no_source_with_train_as_the_model_reads_them(tmp_path):
    """Validation held out of the training file kept pairs whose source was also a training source with
    another translation (only identical pairs were dropped), or the same text with a no-break space or
    decomposed accents (NFKC reads them alike), and said nothing: the scores rewarded memorising. Sources
    are drawn whole now (no pair lost, as dropping such validation pairs lost them and left a few), and
    the same variants in a validation or test file given as such are counted in the warning."""
    rows = []
    for i in range(60):
        rows += [f"Thank you {i}.\tGracias {i}.", f"Thank you {i}.\tMuchas gracias {i}."]
        rows += [f"Cafe\u0301 {i} ?\tCafé {i}.", f"Café {i} ?\tUn café {i}.", f"fine {i}!\tbien {i}"]
    train_file = write(tmp_path / "t.tsv", "en\tes\n" + "\n".join(rows) + "\n")
    data, report = load_parallel_data(train_file=train_file, validation_size=60)

    def read(text: str) -> str:  # as the tokenizer reads it: NFKC, whitespace runs one space
        return " ".join(unicodedata.normalize("NFKC", text).split())

    keys = {read(source) for source in data["train"]["source"]}
    assert len(data["validation"]) == 60 and len(data["train"]) + len(data["validation"]) == 300
    assert not any(read(source) in keys for source in data["validation"]["source"])
    assert report.lines() == []
    given = write(tmp_path / "v.tsv", "en\tes\nnew\tnuevo\n")
    test = write(
        tmp_path / "test.tsv", "en\tes\n\ufb01ne 0!\tx\n\uff46\uff49\uff4e\uff45 1!\ty\nnew\tnuevo\n"
    )
    _, report = load_parallel_data(train_file=train_file, validation_file=given, test_file=test)
    assert report.sources_in_train == {"validation": 0, "test": 2}


def test_the_report_says_whether_validation_was_drawn_from_train(tmp_path):
    """An averaged model's card can rescore a split of the data's own, not one drawn at random."""
    rows = "".join(f"s{i}\tt{i}\n" for i in range(30))
    train = write(tmp_path / "train.tsv", "en\tes\n" + rows)
    _, drawn = load_parallel_data(train_file=train, validation_size=5)
    _, own = load_parallel_data(train_file=train, validation_file=train)
    assert drawn.validation_held_out and not own.validation_held_out


def test_hub_style_translation_column_is_flattened(tmp_path):
    rows = '{"translation": {"de": "Hallo", "en": "Hello"}}\n{"translation": {"de": "Welt", "en": "World"}}\n'
    jsonl = write(tmp_path / "t.jsonl", rows)
    data, _ = load_parallel_data(train_file=jsonl, validation_file=jsonl, source_lang="de", target_lang="en")
    assert data["train"][1] == {"source": "Welt", "target": "World"}


def test_a_plain_text_column_named_translation_is_an_ordinary_column(tmp_path):
    """It was taken for a column of translation pairs, and a string's `.items()` ended in a traceback."""
    tsv = write(tmp_path / "a.tsv", "english\ttranslation\nHello\tHola\n")
    jsonl = write(tmp_path / "a.jsonl", '{"english": "Hello", "translation": "Hola"}\n')
    for path in (tsv, jsonl):
        with pytest.raises(DataError, match=r"has no column 'en' \(columns: \['english', 'translation'\]\)"):
            load_parallel_data(test_file=path, for_training=False)
        data, _ = load_parallel_data(
            test_file=path, source_column="english", target_column="translation", for_training=False
        )
        assert data["test"][0] == {"source": "Hello", "target": "Hola"}
    # Pairs and text mixed in one JSON column (datasets 5 reads it as a `Json` feature): the row is named.
    rows = '{"translation": {"en": "Hi", "es": "Hola"}}\n{"translation": "Hola"}\n'
    mixed = write(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataError, match=r"Row 2 of the test data has 'Hola' in its translation column"):
        load_parallel_data(test_file=mixed, for_training=False)


def test_translation_pairs_in_other_languages_are_named(tmp_path):
    """Once "no usable sentence pairs (all rows are empty)", which hid that the languages were wrong."""
    rows = '{"translation": {"de": "Hallo", "fr": "Bonjour"}}\n'
    jsonl = write(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError, match=r"pairs are in \['de', 'fr'\], not 'en': name the two languages"):
        load_parallel_data(train_file=jsonl, validation_file=jsonl, source_lang="en", target_lang="es")
    folder = tmp_path / "dir.tsv"
    folder.mkdir()
    with pytest.raises(DataError, match=r"train file .*dir\.tsv is a folder; name a file \(\.tsv, \.csv"):
        load_parallel_data(train_file=folder, validation_file=jsonl, source_lang="de", target_lang="fr")
    # A missing or null side, a third language beside it or not, is an empty side, skipped and counted
    # as in flat columns; so is a null dict.
    empty_rows = [
        '{"translation": {"de": "Hallo", "fr": null}}',
        '{"translation": {"de": "Ja", "en": "Yes"}}',
        '{"translation": {"de": null, "en": "Yes", "fr": "Oui"}}',
        '{"translation": null}',
    ]
    null = write(tmp_path / "null.jsonl", "\n".join(empty_rows) + "\n" + rows)
    data, report = load_parallel_data(
        train_file=null, validation_file=jsonl, source_lang="de", target_lang="fr"
    )
    assert len(data["train"]) == 1 and report.empty["train"] == 4
    # One row in other languages among rows in the right ones: once skipped as "empty", now named.
    mixed = write(tmp_path / "mixed.jsonl", '{"translation": {"en": "Hello", "es": "Hola"}}\n' + rows)
    with pytest.raises(
        DataError, match=r"Row 2 of the train data is a translation pair in \['de', 'fr'\], not 'en'-'es'"
    ):
        load_parallel_data(train_file=mixed, validation_file=jsonl, source_lang="en", target_lang="es")


def test_a_translation_pair_side_that_is_not_text_is_named(tmp_path):
    """A number there reached the metric as an int (a traceback after translating the whole file), and a
    list was read as its repr, "['y']", and trained on or scored against as a sentence."""
    good = '{"translation": {"en": "Hello", "es": "Hola"}}\n'
    for value in ("5", '["y"]', '{"x": "y"}'):
        jsonl = write(tmp_path / "v.jsonl", good + f'{{"translation": {{"en": "x", "es": {value}}}}}\n')
        with pytest.raises(DataError, match=r"Row 2 of the test data has .* as its 'es' side, not text"):
            load_parallel_data(test_file=jsonl, for_training=False)


def test_a_hub_translation_feature_row_with_a_null_side_is_empty_not_refused():
    """A Hub dataset's `Translation` rows carry every language: a None there is a null, an empty side."""
    rows = [{"de": "Hallo", "en": "Hi", "fr": "Salut"}, {"de": None, "en": "Yes", "fr": None}]
    features = Features({"translation": Translation(languages=["de", "en", "fr"])})
    data = _to_source_target(
        DatasetDict(train=Dataset.from_dict({"translation": rows}, features=features)), "de", "fr"
    )
    assert data["train"]["source"] == ["Hallo", None] and data["train"]["target"] == ["Salut", None]


def test_a_compressed_file_is_named_as_such(tmp_path):
    """A gzip file named .tsv was "not UTF-8 text ... convert it, e.g. `iconv -f LATIN1 -t UTF-8`"."""
    import bz2
    import gzip
    import io
    import lzma
    import zipfile

    rows = "en\tes\nhi\thola\n"
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as folder:
        folder.writestr("pairs.tsv", rows)
    packed = {
        "gzip-compressed": gzip.compress(rows.encode()),
        "bzip2-compressed": bz2.compress(rows.encode()),
        "xz-compressed": lzma.compress(rows.encode()),
        "a zip archive": archive.getvalue(),
    }
    for kind, data in packed.items():
        (tmp_path / "pairs.tsv").write_bytes(data)
        with pytest.raises(DataError, match=rf"pairs\.tsv is {kind}, not text; decompress it first"):
            load_parallel_data(train_file=tmp_path / "pairs.tsv")


def test_line_breaks_inside_a_sentence_become_spaces(tmp_path):
    """A model trained on targets with line breaks wrote them, and a line-by-line translation gained lines."""
    rows = '{"en": "one\\ntwo", "es": " uno\\r\\n\\r\\ndos\\u2028tres "}\n'
    jsonl = write(tmp_path / "n.jsonl", rows)
    data, _ = load_parallel_data(train_file=jsonl, validation_file=jsonl)
    assert data["train"][0] == {"source": "one two", "target": "uno dos tres"}


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_a_nul_byte_stays_in_its_field_with_any_pandas(tmp_path, monkeypatch, suffix):
    """pandas' C parser before 3.1 ended a field at a NUL byte: "a\\0b" was read as "a", with no error.
    Here read_csv behaves so (a stand-in for pandas 3.0) and the field must still come through whole."""
    import pandas

    read_csv = pandas.read_csv

    def cut_at_nul(frame):
        return frame.map(lambda value: value.split("\0")[0] if isinstance(value, str) else value)

    class CutReader:  # the chunks of read_csv(iterator=True), each cut
        def __init__(self, reader):
            self.reader = reader

        def __iter__(self):
            return map(cut_at_nul, self.reader)

        def __getattr__(self, name):
            return getattr(self.reader, name)

    def like_pandas_before_3_1(*args, **kwargs):
        frames = read_csv(*args, **kwargs)
        if kwargs.get("engine") == "python":  # its Python parser kept the field then too
            return frames
        return CutReader(frames) if kwargs.get("iterator") else cut_at_nul(frames)

    monkeypatch.setattr(pandas, "read_csv", like_pandas_before_3_1)
    separator = "\t" if suffix == ".tsv" else ","
    unique = os.urandom(8).hex()  # new contents, so datasets reads the file instead of its cache
    clean = write(tmp_path / f"clean{suffix}", f"en{separator}es\nhi{separator}hola {unique}\n")
    assert load_parallel_data(train_file=clean, validation_file=clean)[0]["train"]["target"] == [
        f"hola {unique}"
    ]
    long = "w" * 140_000  # over the csv module's default field limit, which pandas' Python parser has
    text = f"en{separator}es\nhi{separator}hola\na\0b{separator}c {unique}\n{long}{separator}x\n"
    data = load_parallel_data(train_file=write(tmp_path / f"nul{suffix}", text), validation_file=clean)[0]
    assert data["train"]["source"] == ["hi", "a\0b", long]
    assert data["train"]["target"] == ["hola", f"c {unique}", "x"]


def test_bad_data_gives_clear_errors(tmp_path):
    good = write(tmp_path / "good.tsv", "en\tes\nhi\thola\n")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_parallel_data(train_file=tmp_path / "missing.tsv", validation_file=good)
    with pytest.raises(ValueError, match=r"not UTF-8 text \(undecodable bytes on line 3\)"):
        load_parallel_data(train_file=write(tmp_path / "l1.tsv", "en\tes\nhi\thola\nno\tadiós\n", "latin-1"))
    # UTF-16 (as some Windows tools save text): the hint was Latin-1's, which turns it into garbage.
    for encoding, wide in (("utf-16", "UTF-16"), ("utf-16-le", "UTF-16"), ("utf-32", "UTF-32")):
        data = write(tmp_path / f"{encoding}.tsv", "en\tes\nhi\thola\n", encoding)
        hint = rf"not UTF-8 text but {wide}, .*\(line 1\); convert it, e.g. `iconv -f {wide} -t UTF-8`"
        with pytest.raises(ValueError, match=hint):
            load_parallel_data(train_file=data)
    # Cut inside its last character: a UnicodeDecodeError naming neither file nor line.
    for cut, line in (
        (b"en\tes\nhi\thola\n" + "é".encode()[:1], 3),
        (b"en\tes\nhi\thol" + "€".encode()[:2], 2),
    ):
        (tmp_path / "cut.tsv").write_bytes(cut)
        with pytest.raises(
            DataError, match=rf"cut\.tsv is not UTF-8 text: it ends inside a character, on line {line}"
        ):
            load_parallel_data(train_file=tmp_path / "cut.tsv")
    stray = write(tmp_path / "stray.tsv", "en\tes\nhi\thola\na\x00b\tc\n")  # UTF-8 with a stray NUL
    assert load_parallel_data(train_file=stray, validation_file=stray)[0]["train"][1]["source"] == "a\x00b"
    with pytest.raises(ValueError, match="has no column 'de'"):
        load_parallel_data(train_file=good, validation_file=good, source_lang="de")
    with pytest.raises(
        DataError, match=r"The embedded corpus is English-Spanish \(columns \['en', 'es'\]\), not fr-es"
    ):
        load_parallel_data(source_lang="fr", for_training=False)  # once "The train data has no column 'fr'"
    with pytest.raises(DataError, match="the same column, 'en'"):  # once a KeyError inside datasets
        load_parallel_data(train_file=good, validation_file=good, source_lang="en", target_lang="en")
    with pytest.raises(ValueError, match=r"unsupported file type .\.txt."):
        load_parallel_data(train_file=write(tmp_path / "a.txt", "hi"))
    with pytest.raises(ValueError, match="no usable sentence pairs"):
        load_parallel_data(train_file=write(tmp_path / "e.tsv", "en\tes\n\t\n \t \n"), validation_file=good)
    with pytest.raises(ValueError, match=r"too small to hold out .* \(--validation_file\)"):
        load_parallel_data(train_file=good)
    with pytest.raises(ValueError, match=r"j\.jsonl, line 2: not valid JSON"):
        load_parallel_data(
            train_file=write(tmp_path / "j.jsonl", '{"en": "a", "es": "b"}\n{"en": "a", "es": \n')
        )
    # Half of a character (a lone surrogate escape) was "Could not parse s.jsonl: An error occurred while
    # generating the dataset"; an escaped pair is one character, and an escaped backslash no escape.
    pair = '{"en": "smile \\ud83d\\ude00", "es": "sonrisa \\\\ud800"}\n'
    assert json.loads(pair) == {"en": "smile \U0001f600", "es": "sonrisa \\ud800"}
    data, _ = load_parallel_data(test_file=write(tmp_path / "s.jsonl", pair), for_training=False)
    assert data["test"][0] == {"source": "smile \U0001f600", "target": "sonrisa \\ud800"}
    with pytest.raises(DataError, match=r"s\.jsonl, line 2: a \\u escape of half a character"):
        load_parallel_data(
            test_file=write(tmp_path / "s.jsonl", pair + '{"en": "cut \\ud83d", "es": "cortado"}\n'),
            for_training=False,
        )
    with pytest.raises(ValueError, match=r"k\.jsonl, line 1: a JSON list, not an object"):
        load_parallel_data(train_file=write(tmp_path / "k.jsonl", '["a", "b"]\n'))
    with pytest.raises(DataError, match=r"h\.tsv has a header row and no sentence pairs"):  # once "Could not
        load_parallel_data(train_file=write(tmp_path / "h.tsv", "en\tes\n\n"))  # parse: ... no data!"
    with pytest.raises(ValueError, match=r"e\.jsonl is empty"):
        load_parallel_data(train_file=write(tmp_path / "e.jsonl", "\n"))
    for text in ("", " \n", "\ufeff", "[]", "[ \n ]\n"):  # once "Could not parse e.json: " and no reason
        with pytest.raises(DataError, match=r"e\.json is empty: it needs a JSON array of objects"):
            load_parallel_data(test_file=write(tmp_path / "e.json", text), for_training=False)
    # datasets' own message for these is "An error occurred while generating the dataset": the reason is
    # its exception's cause (a file cut short in a copy; a top level that is no array of objects)
    # (its words differ between pyarrow releases: "... decoding array value (2)", "... at position 23")
    for text in ('[{"en": "a", "es": "b"}', '"hello"'):
        with pytest.raises(DataError, match=r"c\.json: .* \(a \.json file holds one JSON array") as error:
            load_parallel_data(test_file=write(tmp_path / "c.json", text), for_training=False)
        cause = error.value.__cause__
        while cause.__cause__ is not None:
            cause = cause.__cause__
        reason = str(cause).splitlines()[0]
        assert reason and f"c.json: {reason} (a .json file" in str(error.value)
        assert "An error occurred while generating the dataset" not in str(error.value)
    with pytest.raises(ValueError, match="same type"):
        load_parallel_data(train_file=good, validation_file=write(tmp_path / "v.jsonl", '{"en": "a"}\n'))


def test_delimited_files_are_parsed_strictly(tmp_path):
    """One extra tab in the first data row once made pandas take a column as the index: 301 of 302 rows
    were then "skipped as empty" and training ran on one mangled pair."""
    good = write(tmp_path / "good.tsv", "en\tes\nhi\thola\n")
    rows = "".join(f"s{i}\tt{i}\n" for i in range(300))
    extra_tab = write(tmp_path / "tab.tsv", "en\tes\nIn the\tbeginning\tEn el principio\n" + rows)
    with pytest.raises(ValueError, match=r"tab\.tsv, line 2: 3 fields where the header has 2"):
        load_parallel_data(train_file=extra_tab, validation_file=good)
    pandas_tsv = write(tmp_path / "p.tsv", 'en\tes\n"He said ""hi"""\t"Dijo ""hola"""\n')
    with pytest.raises(ValueError, match=r"p\.tsv, line 2: .* is quoted the CSV way"):
        load_parallel_data(train_file=pandas_tsv, validation_file=good)
    with pytest.raises(ValueError, match="line 3: repeats the header row"):
        load_parallel_data(train_file=write(tmp_path / "cat.tsv", "en\tes\na\tb\nen\tes\nc\td\n"))
    comma = write(tmp_path / "c.csv", 'en,es\n"one, two",uno\none, two,dos\n')
    with pytest.raises(ValueError, match=r"c\.csv, line 3: 3 fields where the header has 2"):
        load_parallel_data(train_file=comma, validation_file=comma)
    # A JSON Lines file is named with its line (its column, datasets' type for it, were "Json(decode=True)")
    lists = write(tmp_path / "l.jsonl", '{"en": "a", "es": "x"}\n\n{"en": ["c"], "es": "y"}\n')
    with pytest.raises(DataError, match=r"l\.jsonl, line 3: 'en' holds a JSON array, not a string"):
        load_parallel_data(train_file=lists, validation_file=lists)
    flag = write(tmp_path / "b.jsonl", '{"en": "a", "es": "x", "id": 7}\n{"en": "c", "es": false}\n')
    with pytest.raises(DataError, match=r"b\.jsonl, line 2: 'es' holds a JSON boolean, not a string"):
        load_parallel_data(train_file=flag, validation_file=flag)
    array = write(tmp_path / "a.json", '[{"en": "a", "es": "x"}, {"en": 5, "es": "y"}]')
    with pytest.raises(DataError, match=r"column 'en' holds values of type \w+, not text"):
        load_parallel_data(train_file=array, validation_file=array)
    with pytest.raises(ValueError, match="is empty: it needs a header row"):
        load_parallel_data(train_file=write(tmp_path / "empty.tsv", ""), validation_file=good)
    # pandas read the second "es" as "es.1": the first column was trained on, whichever was meant.
    for name, text in (("twice.tsv", "en\tes\tes\nHi\tHola\tBuenas\n"), ("twice.csv", "es,en,es\na,b,c\n")):
        with pytest.raises(DataError, match=rf"{name}: the header names 'es' more than once"):
            load_parallel_data(test_file=write(tmp_path / name, text), for_training=False)
    # A name the run does not read may repeat, as it could before that check.
    data, _ = load_parallel_data(
        test_file=write(tmp_path / "notes.tsv", "en\tes\tnote\tnote\nHi\tHola\ta\tb\n"), for_training=False
    )
    assert data["test"][:] == {"source": ["Hi"], "target": ["Hola"]}
    # Columns without a name (a spreadsheet's trailing empty ones) are no name said twice: pandas reads
    # them as "Unnamed: 2", "Unnamed: 3", and they were read so before that check.
    for name, text in (("blank.tsv", "en\tes\t\t\nHi\tHola\t\t\n"), ("blank.csv", "en,es,,\nHi,Hola,,\n")):
        data, _ = load_parallel_data(test_file=write(tmp_path / name, text), for_training=False)
        assert data["test"][:] == {"source": ["Hi"], "target": ["Hola"]}


def test_blank_lines_before_the_header_are_skipped_as_the_reader_skips_them(tmp_path):
    """A delimited file that starts with blank lines, which pandas reads (it skips them), was refused as
    "line 3: 2 fields where the header has 1 ([''])", blaming a tab inside a sentence; a file of blank
    lines only was said to have "a header row and no sentence pairs under it"."""
    for name, text in (("a.tsv", "\n\nen\tes\nHi\tHola\n"), ("a.csv", "\r\n\r\nen,es\r\nHi,Hola\r\n")):
        data, _ = load_parallel_data(test_file=write(tmp_path / name, text), for_training=False)
        assert data["test"][:] == {"source": ["Hi"], "target": ["Hola"]}
    with pytest.raises(DataError, match=r"a\.tsv, line 5: 3 fields where the header has 2"):  # lines counted
        load_parallel_data(
            test_file=write(tmp_path / "a.tsv", "\n\nen\tes\nHi\tHola\nA\tB\tC\n"), for_training=False
        )
    # A line of spaces (at the end of a file, say), which pandas skips too, was "1 fields where the header
    # has 2 ... a tab inside a sentence splits it".
    for name, text in (("w.tsv", " \nen\tes\nHi\tHola\n  \n"), ("w.csv", "en,es\n \nHi,Hola\n\t\n")):
        data, _ = load_parallel_data(test_file=write(tmp_path / name, text), for_training=False)
        assert data["test"][:] == {"source": ["Hi"], "target": ["Hola"]}
    for name, text in (("b.tsv", "\n \n\n"), ("b.csv", "\r\n  \r\n")):
        with pytest.raises(DataError, match=rf"{name} is empty: it needs a header row"):
            load_parallel_data(test_file=write(tmp_path / name, text), for_training=False)


def test_delimited_fields_that_look_like_numbers_stay_text(tmp_path):
    """pandas read a column (or a 10,000-row chunk of one, as datasets reads a file) that looked numeric
    as numbers: a file of such targets was refused as "not text", and the last rows of a longer one
    silently became other text ("01.50" -> "1.5", "007" -> "7")."""
    numbers = write(tmp_path / "n.tsv", "en\tes\nAgent\t007\nPrice\t1.50\n")
    data, _ = load_parallel_data(test_file=numbers, for_training=False)
    assert data["test"]["target"] == ["007", "1.50"]
    rows = "".join(f"Hello {i}\tHola {i}\n" for i in range(10_000))
    for suffix, delimiter in ((".tsv", "\t"), (".csv", ",")):
        long = write(tmp_path / f"long{suffix}", f"en{delimiter}es\n" + rows.replace("\t", delimiter))
        long.write_text(long.read_text() + f"Item 1{delimiter}01.50\nItem 2{delimiter}007\n")
        data, _ = load_parallel_data(test_file=long, for_training=False)
        assert data["test"]["target"][-3:] == ["Hola 9999", "01.50", "007"]


def test_a_csv_field_over_128_kib_is_read(tmp_path, monkeypatch):
    """The csv module's field limit (128 KiB) ended the strict check in a traceback, "_csv.Error: field
    larger than field limit", on a file pandas reads; a long sentence is the length checks' to judge."""
    long = write(tmp_path / "long.csv", 'en,es\nhi,hola\n"' + "word " * 40_000 + '",b\n')
    data, _ = load_parallel_data(test_file=long, for_training=False)
    assert len(data["test"][1]["source"]) == 199_999
    assert csv.field_size_limit() == 131072  # the module's limit is restored
    monkeypatch.setattr(parallel_data, "FIELD_SIZE_LIMIT", 1000)  # a row it still cannot read is named
    with pytest.raises(DataError, match=r"long\.csv, line 3: not readable as CSV \(field larger"):
        load_parallel_data(test_file=long, for_training=False)


def test_tokenization_filters_long_training_pairs_only(tokenizer, tmp_path):
    rows = "en\tes\n" + "short\tcorto\n" * 3 + ("long " * 40 + "\tlargo\n")
    tsv = write(tmp_path / "a.tsv", rows)
    data, report = load_parallel_data(train_file=tsv, validation_file=tsv)
    tokenized = tokenize_parallel_data(data, tokenizer, max_length=16, report=report)
    assert len(tokenized["train"]) == 3 and len(tokenized["validation"]) == 4
    assert report.too_long == {"train": 1}
    assert tokenized["train"][0]["source_length"] == len(tokenized["train"][0]["input_ids"])


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole", "in-chunks"])
def test_the_length_check_never_refuses_a_text_that_fits(tokenizer, chunk, monkeypatch):
    """`length_check` judges from length alone; the reference is the tokenizer's own count. Random
    texts around the bound (long words, spaces, punctuation, characters the vocabulary lacks, an NFKC
    ligature that expands, combining accents that NFKC composes) are never said to be over the limit
    when they encode within it, and the long ones are caught; also where they are judged in pieces of 24
    characters (as a text longer than LENGTH_CHECK_CHUNK is), cut anywhere."""
    from vanilla_transformer import tokenization
    from vanilla_transformer.tokenization import MAX_TOKEN_CHARACTERS, characters_per_token, length_check

    if chunk is not None:
        monkeypatch.setattr(tokenization, "LENGTH_CHECK_CHUNK", chunk)

    rng = random.Random(0)
    pieces = ["the", "Dios", "cielos", " ", "  ", ",", "«", "жжж", "\ufb03", "e\u0301", "\t", "x" * 40]
    longest = characters_per_token(tokenizer)[0]
    for max_length in (2, 5, 9):
        caught = 0
        for _ in range(150):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4 * max_length)))
            if rng.random() < 0.3:  # one long word
                text += "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 40 * max_length)))
            over = length_check(max_length, tokenizer)([text])[0]
            fits = len(tokenizer(text, split_special_tokens=True)["input_ids"]) <= max_length
            assert not (over and fits), (max_length, text)
            caught += over
        assert caught > 10  # the check decides, not only passes
    # Without a tokenizer: the bound of any tokenizer train_bpe_tokenizer trains (exact for a text
    # judged whole; in pieces, each piece counts LENGTH_CHECK_SLACK characters fewer).
    assert longest <= MAX_TOKEN_CHARACTERS
    if chunk is None:
        assert length_check(4)(["a" * (4 * MAX_TOKEN_CHARACTERS + 1), "a" * (4 * MAX_TOKEN_CHARACTERS)]) == [
            True,
            False,
        ]


def other_bpe_tokenizer(kind: str):
    """Fast BPE tokenizers (no fuse_unk) built offline with the `tokenizers` library, each with a text it
    encodes within 3 tokens that is longer than 3 times its longest token once normalised and
    pre-tokenized: "no unk" drops characters it lacks (`models.BPE()`'s default has no unknown token);
    the added tokens cover more of the pre-tokenized text than their own length (the byte-level
    pre-tokenizer writes "ж" as two characters), and a normalizer (Strip, NFC) shortens the text as given."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if kind == "no unk":
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(vocab_size=60, show_progress=False)
    else:
        backend.normalizer = normalizers.Strip() if kind == "added token, Strip" else normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=alphabet, max_token_length=4, show_progress=False
        )
    backend.train_from_iterator(["the cat sat on the mat", "a dog ran far away"] * 50, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    if kind == "no unk":
        return tokenizer, "the cat " + "ж" * 500
    if kind == "added token, Strip":
        tokenizer.add_tokens(["жжжж"])
        return tokenizer, "жжжж" * 3 + " " * 40
    tokenizer.add_tokens([AddedToken("éééé", normalized=True)])  # matched after NFC: "e" + U+0301
    return tokenizer, "e\u0301" * 12


@pytest.mark.parametrize("kind", ["no unk", "added token, Strip", "added token, NFC"])
def test_the_length_check_never_refuses_a_text_that_fits_with_other_bpe_tokenizers(kind):
    """The promise holds for any fast BPE tokenizer without fuse_unk, not only the ones this package
    trains: a text these tokenizers encode within max_length is not judged too long (with added tokens
    other than special ones there is no check at all: None)."""
    from vanilla_transformer.tokenization import length_check

    tokenizer, text = other_bpe_tokenizer(kind)
    assert len(tokenizer(text, split_special_tokens=True)["input_ids"]) <= 3
    check = length_check(3, tokenizer)
    assert (check is None) == kind.startswith("added token")
    assert check is None or check([text]) == [False]
    # Still caught where the tokenizer would in fact go over.
    if kind == "no unk":
        assert check(["the cat " * 20]) == [True]


def test_text_judged_in_pieces_never_counts_more_than_judged_whole(monkeypatch):
    """A cut can add to a piece's count what the whole text does not have (a word-start marker at each
    piece's start, an accent composed across the cut): each piece counts LENGTH_CHECK_SLACK fewer. With a
    one-character bound per token, the limit is the count itself: a text judged whole at exactly its
    count is not over, and judged in pieces of 7 characters, cut anywhere, it must not be either."""
    from vanilla_transformer import tokenization

    monkeypatch.setattr(tokenization, "MAX_TOKEN_CHARACTERS", 1)
    rng = random.Random(1)
    pieces = ["the", "Dios", " ", "  ", ",", "«", "\ufb03", "e\u0301", "\u0301", "\t", "a."]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(4, 30)))
        whole = next(n for n in range(1, 200) if tokenization.length_check(n)([text]) == [False])
        with monkeypatch.context() as patched:
            patched.setattr(tokenization, "LENGTH_CHECK_CHUNK", 7)
            assert tokenization.length_check(whole)([text]) == [False], (whole, text)


def test_another_tokenizers_normaliser_is_judged_on_the_whole_text(monkeypatch):
    """A normaliser that deletes a match of any length (HTML tags) deletes nothing where a cut runs
    through the match: judged in pieces, a text of 6 tokens with a 70,000-character tag was "surely over"
    128 tokens, and its pair would have been dropped. Only this package's normaliser and pre-tokenizer
    are judged in pieces."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vanilla_transformer import tokenization

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(Regex(r"<[^>]*>"), "")
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["the cat sat on the mat", "a dog ran far away"] * 50, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    text = 'the cat sat <img src="data:image/png;base64,' + "A" * 70_000 + '"> on the mat'
    assert len(tokenizer(text, split_special_tokens=True)["input_ids"]) == 6
    monkeypatch.setattr(tokenization, "LENGTH_CHECK_CHUNK", 1000)
    assert tokenization.length_check(128, tokenizer)([text]) == [False]
    assert tokenization.length_check(128, tokenizer)(["the cat " * 5000]) == [True]


def test_a_huge_text_is_judged_in_bounded_pieces(monkeypatch):
    """Judging a 50 MB line normalised and pre-tokenized it whole, at about 64 bytes a character: over
    3 GB before the check that exists to spare that memory had answered. Now no piece handed to the
    normaliser is longer than LENGTH_CHECK_CHUNK, a line surely over stops at its first piece, and a long
    line of spaces around a few words (which fits) is read to its end and passes."""
    from vanilla_transformer import tokenization

    lengths = []
    plain = tokenization.text_normalizer

    class Recording:
        def __init__(self):
            self.normalizer = plain()

        def normalize_str(self, text):
            lengths.append(len(text))
            return self.normalizer.normalize_str(text)

    monkeypatch.setattr(tokenization, "text_normalizer", Recording)
    check = tokenization.length_check(128)
    chunk = tokenization.LENGTH_CHECK_CHUNK
    assert check(["word " * 1_000_000]) == [True]
    assert lengths == [chunk]  # the first piece decided
    lengths.clear()
    spaces = " " * (10 * chunk)
    assert check([spaces + "In the beginning God created the heaven and the earth." + spaces]) == [False]
    assert len(lengths) == 21 and max(lengths) == chunk


def test_a_pair_surely_over_max_length_is_never_encoded(tokenizer, tmp_path, monkeypatch):
    """A line of millions of characters (a corrupted file) took gigabytes to encode before the length
    filter dropped it; one surely over `max_length` from its length is dropped unencoded, counted with the
    other long pairs. A validation file of its own is still encoded whole."""
    giant = "x" * 100_000
    rows = "en\tes\n" + "short\tcorto\n" * 3 + ("long " * 40 + "\tlargo\n") + f"{giant}\tgrande\n"
    tsv = write(tmp_path / "a.tsv", rows)
    data, report = load_parallel_data(train_file=tsv, validation_file=tsv)
    encoded = []
    call = type(tokenizer).__call__

    def recording(self, text=None, *args, **kwargs):
        encoded.extend(text if isinstance(text, list) else [text])
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording)
    tokenized = tokenize_parallel_data(data, tokenizer, max_length=16, report=report)
    assert report.too_long == {"train": 2} and len(tokenized["train"]) == 3
    assert encoded.count(giant) == 1  # the validation split's, not the training split's
    assert len(tokenized["validation"]) == 5 and len(data["train"]) == 5  # the caller's data as it was


def test_the_tokenizers_length_bound_is_read_once_per_tokenization(tokenizer, monkeypatch):
    """The bound (the tokenizer's whole vocabulary read) is read once per `tokenize_parallel_data`, not
    once per batch of 1,000 pairs: at a 150,000-token vocabulary that was tens of milliseconds a batch.
    The check also runs in worker processes (`num_proc`)."""
    from vanilla_transformer import tokenization

    reads = []
    bound = tokenization.characters_per_token
    monkeypatch.setattr(tokenization, "characters_per_token", lambda t: reads.append(1) or bound(t))
    pairs = {"source": ["short"] * 2500 + ["x" * 10_000], "target": ["corto"] * 2500 + ["grande"]}
    data = DatasetDict({"train": Dataset.from_dict(pairs)})
    report = parallel_data.DataReport()
    tokenized = tokenize_parallel_data(data, tokenizer, max_length=16, report=report)
    assert len(reads) == 1 and report.too_long == {"train": 1} and len(tokenized["train"]) == 2500
    report = parallel_data.DataReport()
    tokenized = tokenize_parallel_data(data, tokenizer, max_length=16, report=report, num_proc=2)
    assert report.too_long == {"train": 1} and len(tokenized["train"]) == 2500


def test_bpe_training_skips_a_text_surely_over_max_length(tmp_path):
    """One line of a million characters without a space made BPE training take 9 minutes instead of half a
    second: a text surely over --max_length (its pair is not trained on) is not given to BPE training. Its
    characters, which no other text has, are then not in the vocabulary."""
    from accelerate import Accelerator

    from vanilla_transformer import training as training_module

    pairs = SENTENCES * 20
    giant = "ж" * 50_000
    data = DatasetDict(
        {"train": Dataset.from_dict({"source": [*pairs[::2], giant], "target": [*pairs[1::2], "grande"]})}
    )
    config = training_module.parse_config(["--output_dir", str(tmp_path), "--vocab_size", "300"])
    tokenizer = training_module.load_or_train_tokenizer(config, data, Accelerator(), tmp_path, None)
    assert not any("ж" in token for token in tokenizer.get_vocab())
    assert tokenizer.unk_token_id in tokenizer("ж")["input_ids"]
    reference = train_bpe_tokenizer([*pairs[::2], *pairs[1::2], "grande"], 300)  # its pair's target stays
    assert tokenizer.get_vocab() == reference.get_vocab()


def test_a_validation_split_drawn_from_train_is_length_filtered_as_train_is(tokenizer, tmp_path):
    """Held out of train, a long pair was skipped as a training pair by some seeds, and by others kept as a
    validation pair, which stopped the run as longer than a batch (`check_evaluation_lengths`)."""
    rows = "".join(f"short {i}\tcorto {i}\n" for i in range(40)) + "long " * 40 + "\tlargo\n"
    tsv = write(tmp_path / "t.tsv", "en\tes\n" + rows)
    held_out = []
    for seed in range(8):
        data, report = load_parallel_data(train_file=tsv, validation_size=10, seed=seed)
        held_out.append("long " * 39 + "long" in data["validation"]["source"])
        tokenized = tokenize_parallel_data(data, tokenizer, max_length=16, report=report)
        kept = [*tokenized["train"]["source"], *tokenized["validation"]["source"]]
        assert sorted(kept) == sorted(f"short {i}" for i in range(40))  # every short pair, once
        assert report.too_long == {"train": int(not held_out[-1]), "validation": int(held_out[-1])}
    assert True in held_out and False in held_out  # both cases met
    assert "skipped 1 validation pairs longer than max_length" in report.lines() or not held_out[-1]


def test_a_tag_added_as_a_token_is_one_token_and_as_a_special_token_is_text(tokenizer, tmp_path):
    """README: special tokens added later (`add_special_tokens`) are text too, split into pieces; a tag
    added with `add_tokens` is one token (and so is a special one with `split_special_tokens=False`)."""
    tokenizer.save_pretrained(tmp_path / "saved")
    tagged = AutoTokenizer.from_pretrained(tmp_path / "saved")
    tagged.add_tokens(["<2es>"])
    special = AutoTokenizer.from_pretrained(tmp_path / "saved")
    special.add_special_tokens({"additional_special_tokens": ["<2fr>"]})
    tag = tagged.convert_tokens_to_ids("<2es>")
    assert tagged("<2es> the earth")["input_ids"][0] == tag and tag == len(tagged) - 1
    assert tagged("<2es> the earth")["input_ids"][1:] == tokenizer("the earth")["input_ids"]
    split = special("<2fr> the earth")["input_ids"]
    assert special.convert_tokens_to_ids("<2fr>") not in split and len(split) > 4
    whole = special("<2fr> the earth", split_special_tokens=False)["input_ids"]
    assert whole[0] == special.convert_tokens_to_ids("<2fr>")


def test_special_token_spellings_in_the_data_are_text(tokenizer, tmp_path):
    """ "<s>here</s>" (HTML strikethrough, markup in software messages) became the start and end tokens:
    a training target ended where "</s>" stood, and decoding dropped the words' markup. Spelled in the
    data, they are text: with this package's tokenizers (saved so) and, in the data pipeline, with any."""
    from transformers import PreTrainedTokenizerFast

    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    source, target = "Click <s>here</s> to <unk>go", "Haga clic <s>aquí</s> <pad>"
    tokenizer.save_pretrained(tmp_path / "saved")
    for tok in (tokenizer, AutoTokenizer.from_pretrained(tmp_path / "saved")):
        encoded = tok(source, text_target=target)
        for ids in (encoded["input_ids"], encoded["labels"]):
            assert ids[-1] == tok.eos_token_id and not special & set(ids[:-1]), ids
    plain = PreTrainedTokenizerFast(  # a tokenizer that reads the spellings as the tokens
        tokenizer_object=tokenizer.backend_tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    assert tokenizer.eos_token_id in plain(target)["input_ids"][:-1]
    rows = f"en\tes\n{source}\t{target}\nshort\tcorto\n"
    data, report = load_parallel_data(
        train_file=write(tmp_path / "a.tsv", rows), validation_file=write(tmp_path / "v.tsv", rows)
    )
    tokenized = tokenize_parallel_data(data, plain, max_length=64, report=report)
    for row in tokenized["train"]:
        for ids in (row["input_ids"], row["labels"]):
            assert ids[-1] == tokenizer.eos_token_id and not special & set(ids[:-1]), ids


# Token-based batching ----------------------------------------------------------------------------


def lengths(count: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randint(2, 60) for _ in range(count)], [rng.randint(2, 60) for _ in range(count)]


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_token_batches_cover_every_example_once_within_budget(num_shards):
    source, target = lengths(1000)
    sampler = TokenBatchSampler(source, target, max_tokens=1000, seed=1, num_shards=num_shards)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) and len(batches) % num_shards == 0
        flat = [i for batch in batches for i in batch]
        assert sorted(flat) == list(range(1000)), "every example exactly once per epoch"
        for batch in batches:
            padded = len(batch) * (max(source[i] for i in batch) + max(target[i] for i in batch))
            assert padded <= 1000
        # Length grouping: batches are nearly full on average.
        used = sum(source[i] + target[i] for i in flat)
        assert used / (1000 * len(batches)) > 0.6
        # Round-robin shards (as Accelerate deals them) are equal and disjoint.
        shards = [batches[r::num_shards] for r in range(num_shards)]
        assert len({len(s) for s in shards}) == 1


def test_token_batches_are_deterministic_per_epoch_and_shuffled_across_epochs():
    source, target = lengths(500)
    first, second = (TokenBatchSampler(source, target, 800, seed=3) for _ in range(2))
    assert list(first) == list(second)
    epoch0 = list(first)
    first.set_epoch(1)
    epoch1 = list(first)
    assert epoch1 != epoch0
    # The batches themselves come in a random order, not short to long (tie-breaking inside the length
    # sort alone also changes the epoch's batches).
    by_length = [[source[b[0]] for b in batches] for batches in (epoch0, epoch1)]
    assert all(lengths != sorted(lengths) for lengths in by_length)
    assert by_length[0] != by_length[1]
    unshuffled = TokenBatchSampler(source, target, 800, shuffle=False)
    order = [source[b[0]] for b in unshuffled]
    assert order == sorted(order)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_token_batches_shuffle_each_epoch_in_an_accelerate_loop(num_processes):
    """A training loop of one's own (`accelerator.prepare(DataLoader(..., batch_sampler=sampler))`, then
    `for batch in loader` each epoch): Accelerate's loader sets its epoch at each iteration, but with
    several processes it wraps the batch sampler in a `BatchSamplerShard` and reaches a wrapped sampler's
    `set_epoch` only through `.sampler`. Every epoch then repeated the first one's batch order. Reference:
    each epoch, the processes' batches together are the sampler's own batches of that epoch, round-robin."""
    import torch
    from accelerate.data_loader import prepare_data_loader

    source, target = lengths(120)

    def sampler() -> TokenBatchSampler:
        return TokenBatchSampler(source, target, 400, seed=3, num_shards=num_processes)

    loaders = [
        prepare_data_loader(
            torch.utils.data.DataLoader(range(120), batch_sampler=sampler()),
            num_processes=num_processes,
            process_index=index,
            put_on_device=False,
        )
        for index in range(num_processes)
    ]
    orders = []
    for epoch in range(3):
        reference = sampler()
        reference.set_epoch(epoch)
        expected = list(reference)
        for index, loader in enumerate(loaders):
            assert [batch.tolist() for batch in loader] == expected[index::num_processes], (epoch, index)
        orders.append(expected)
    assert orders[0] != orders[1] != orders[2]


def test_token_batching_rejects_impossible_budgets():
    with pytest.raises(ValueError, match="alone has 120 source \\+ target tokens"):
        TokenBatchSampler([10, 60], [5, 60], max_tokens=100)
    with pytest.raises(ValueError, match="cannot fill a batch on each of 4 processes"):
        TokenBatchSampler([5, 5], [5, 5], max_tokens=100, num_shards=4)
    with pytest.raises(ValueError, match="3 source lengths but 2"):
        TokenBatchSampler([5, 5, 5], [5, 5], max_tokens=100)


def test_held_out_validation_shares_no_pair_with_train(tmp_path):
    """A pair the training file repeats once landed on both sides of the held-out split."""
    rows = "".join(f"s{i}\tt{i}\n" for i in range(60)) + "Thank you.\tGracias.\n" * 40
    train_file = write(tmp_path / "t.tsv", "en\tes\n" + rows)
    for seed in range(4):
        data, report = load_parallel_data(train_file=train_file, validation_size=30, seed=seed)
        train = set(zip(data["train"]["source"], data["train"]["target"], strict=True))
        validation = list(zip(data["validation"]["source"], data["validation"]["target"], strict=True))
        assert not train & set(validation) and len(train) + len(set(validation)) == 61  # nothing lost
        # Exactly the size asked for: a source with more pairs than that stays in train whole (it swelled
        # the split to all 40 of its pairs and more where it was drawn).
        assert len(validation) == 30 and ("Thank you.", "Gracias.") in train
        assert report.lines() == []
    # Fewer pairs than asked where no source left fits the room (each twice, 31 asked): said.
    twice = write(
        tmp_path / "twice.tsv", "en\tes\n" + "".join(f"s{i}\tt{i}\ns{i}\tu{i}\n" for i in range(40))
    )
    data, report = load_parallel_data(train_file=twice, validation_size=31)
    assert len(data["validation"]) == 30 and len(data["train"]) == 50
    assert report.lines() == [
        "held out 30 validation pairs, not 31: the training file's other source sentences each have more "
        "pairs than the room left (a source's pairs are held out together)"
    ]


@pytest.mark.parametrize("suffix", [".tsv", ".jsonl"])
def test_a_file_rewritten_with_its_old_modification_time_is_read_anew(tmp_path, suffix):
    """datasets keys its cache of a local file by path and modification time: a file replaced by other
    contents with the same time (`cp -p`, `rsync -a`, `touch -r`) was read as the earlier contents."""

    def contents(words):
        if suffix == ".tsv":
            return "en\tes\n" + "".join(f"{word}\tx\n" for word in words)
        return "".join(json.dumps({"en": word, "es": "x"}) + "\n" for word in words)

    path = write(tmp_path / f"data{suffix}", contents(["old", "pairs"]))
    first, _ = load_parallel_data(test_file=path, for_training=False)
    assert list(first["test"]["source"]) == ["old", "pairs"]
    stat = path.stat()
    write(path, contents(["the", "new", "file"]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second, _ = load_parallel_data(test_file=path, for_training=False)
    assert list(second["test"]["source"]) == ["the", "new", "file"]
    again, _ = load_parallel_data(test_file=path, for_training=False)  # unchanged: its cache
    assert again["test"].cache_files == second["test"].cache_files


def test_an_undecodable_byte_after_a_character_cut_by_the_read_is_on_its_own_line(tmp_path):
    """The UTF-8 check reads 1 MiB at a time; where a character straddled two reads, the line of a bad
    byte just after it was counted from the wrong offset: a line break after the byte counted too."""
    lines = b"en\tes\n" + b"hi\thola\n" * (2**20 // 8)
    prefix = lines[: lines.rindex(b"\n", 0, 2**20 - 4) + 1]  # whole lines, then a line's start up to
    prefix += b"a" * (2**20 - 2 - len(prefix))  # the euro sign, whose third byte is in the second read
    path = write(tmp_path / "cut.tsv", "")
    path.write_bytes(prefix + "€".encode() + b"\xff\nnext\tline\n")
    line = prefix.count(b"\n") + 1
    with pytest.raises(DataError, match=rf"undecodable bytes on line {line}\)"):
        load_parallel_data(train_file=path)


def test_held_out_validation_check_does_not_hold_every_training_pair(tmp_path):
    """The check above once built a set of every training pair: 2.5 GB (against 0.8 GB) for a 1.5M-pair
    file. Its Python memory now follows the held-out pairs and one batch of train, not the corpus (the
    40,000 pairs' set alone is over 10 MB; the file's parsing, pandas' chunks, is about 3 MB)."""
    rows = "".join(f"source sentence {i}\tfrase de destino {i}\n" for i in range(40_000))
    train_file = write(tmp_path / "t.tsv", "en\tes\n" + rows)
    tracemalloc.start()
    try:
        data, _ = load_parallel_data(train_file=train_file, validation_size=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data["train"]) == 40_000 - 10 and len(data["validation"]) == 10
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MB"


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            ConnectionError("Couldn't reach 'wmt/wmt14' on the Hub"),
            r"could not be loaded .*local --train_file",
        ),
        (
            ValueError("BuilderConfig 'xx-yy' not found. Available: ['de-en', 'fr-en']"),
            r"not found\. Available: \['de-en', 'fr-en'\]\. Without",
        ),
    ],
)
def test_an_unreachable_hub_dataset_is_a_data_error(monkeypatch, error, message):
    """Without network access, or with a config name the dataset lacks, `--dataset_name` ended in a
    traceback."""
    import datasets

    from vanilla_transformer import parallel_data

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(parallel_data.DataError, match=message):
        load_parallel_data(dataset_name="wmt/wmt14", dataset_config="xx-yy")


def test_splits_that_leave_nothing_to_train_or_validate_on_are_named(tmp_path, tokenizer):
    """The ends of the data checks: a file of one pair repeated (every held-out pair is also a training
    pair), a length bound nothing fits, and a bound too small for a word and the end token."""
    repeated = write(tmp_path / "same.tsv", "en\tes\n" + "thank you\tgracias\n" * 30)
    with pytest.raises(DataError, match="repeats its source sentences too much to hold out 5 pairs"):
        load_parallel_data(train_file=repeated, validation_size=5)
    pairs = {"source": ["a long sentence " * 8] * 3, "target": ["una frase larga " * 8] * 3}
    data = DatasetDict({"train": Dataset.from_dict(pairs), "validation": Dataset.from_dict(pairs)})
    with pytest.raises(DataError, match="No training pair is within max_length=4 tokens"):
        tokenize_parallel_data(data, tokenizer, max_length=4)
    held_out = parallel_data.DataReport(validation_held_out=True)
    data["train"] = Dataset.from_dict({"source": ["a"], "target": ["b"]})
    with pytest.raises(DataError, match="No held-out validation pair is within max_length=4 tokens"):
        tokenize_parallel_data(data, tokenizer, max_length=4, report=held_out)
    assert len(tokenize_parallel_data(data, tokenizer, max_length=4)["validation"]) == 3  # its own: whole
    for bound in (1, 0):
        with pytest.raises(DataError, match=f"max_length must be at least 2 tokens, got {bound}"):
            tokenize_parallel_data(data, tokenizer, max_length=bound)


def test_a_cache_or_file_that_cannot_be_used_is_named_not_the_data(tmp_path, monkeypatch):
    """A full or read-only datasets cache was reported as the data file being unparseable ("Could not
    parse train.tsv: An error occurred while generating the dataset"), and a data file this user may not
    read ended in a PermissionError traceback. Each is now said as what it is."""
    import errno

    import datasets

    good = write(tmp_path / "good.tsv", "en\tes\nhi\thola\n")
    for cause, said in (
        (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
        (OSError(errno.EROFS, "Read-only file system", "/ro/hf"), "Read-only file system"),
    ):

        def failing(*args, cause=cause, **kwargs):
            raise RuntimeError("An error occurred while generating the dataset") from cause

        with monkeypatch.context() as patched:
            patched.setattr(datasets, "load_dataset", failing)
            with pytest.raises(DataError) as error:
                load_parallel_data(test_file=good, for_training=False)
        message = str(error.value)
        assert message.startswith(f"Could not load {good}: datasets' cache in ") and said in message
        assert "set HF_DATASETS_CACHE (or HF_HOME) to a writable folder" in message

    # Loaded, then a filter's cache write fails (the cache had room for the data, not its copy)
    def filling_up(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(parallel_data, "_drop_empty", filling_up)
        with pytest.raises(DataError, match=r"^Preparing the data failed: datasets' cache in .*\(No space"):
            load_parallel_data(test_file=good, for_training=False)
    own = OSError(errno.EACCES, "Permission denied", str(good))  # the data file's own: not the cache's

    def unreadable(*args, **kwargs):
        raise RuntimeError("An error occurred while generating the dataset") from own

    with monkeypatch.context() as patched:
        patched.setattr(datasets, "load_dataset", unreadable)
        with pytest.raises(DataError, match=r"^Could not parse .*good\.tsv: \[Errno 13\] Permission denied"):
            load_parallel_data(test_file=good, for_training=False)
    opening = Path.open

    def denied(self, *args, **kwargs):
        if self == Path(good):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return opening(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(DataError, match=r"^train file .*good\.tsv cannot be read: Permission denied\.$"):
        load_parallel_data(train_file=good, validation_file=good)
