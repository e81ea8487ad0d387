"""BLEU/chrF metric module, batched translation, model card rendering and training-curve plots."""

import importlib
import math
import unicodedata
import warnings
from pathlib import Path

import jinja2
import pytest
import sacrebleu
import torch
from huggingface_hub import ModelCard
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tests.conftest import tiny_config, tiny_model
from vanilla_transformer.metrics import load_translation_metric, metric_module_path, score_translations
from vanilla_transformer.model_card import (
    TRANSFORMERS_DECODING,
    _card_data,
    _template_variables,
    base_license,
    build_model_card,
    decoding_settings,
    default_template_path,
    write_model_card,
)
from vanilla_transformer.plotting import plot_training_curves
from vanilla_transformer.translation import (
    LineError,
    SentenceError,
    translate,
    translate_lines,
    translate_stream,
)

REFERENCES = [
    "In the beginning, God created the heavens and the earth.",
    "The earth was formless and empty.",
    "God said, “Let there be light,” and there was light.",
    "Jesus wept.",
]
PREDICTIONS = [
    "In the beginning God made the heaven and the earth.",
    "The earth was without form and void.",
    "And God said, Let there be light: and there was light.",
    "Jesus wept.",
]


# ---------------------------------------------------------------- metric


def test_metric_equals_sacrebleu_corpus_scores():
    result = score_translations(PREDICTIONS, REFERENCES)
    bleu = sacrebleu.corpus_bleu(PREDICTIONS, [REFERENCES])
    chrf = sacrebleu.corpus_chrf(PREDICTIONS, [REFERENCES])
    assert 0 < result["bleu"] < 100
    assert result["bleu"] == pytest.approx(bleu.score, abs=1e-9)
    assert result["chrf"] == pytest.approx(chrf.score, abs=1e-9)
    assert result["bleu_precisions"] == pytest.approx(bleu.precisions)
    assert result["brevity_penalty"] == pytest.approx(bleu.bp)
    assert (result["sys_len"], result["ref_len"]) == (bleu.sys_len, bleu.ref_len)
    assert (
        result["bleu_signature"].startswith("nrefs:1|case:mixed|") and "tok:13a" in result["bleu_signature"]
    )
    assert result["chrf_signature"].startswith("nrefs:1|case:mixed|") and "nc:6" in result["chrf_signature"]
    assert f"version:{sacrebleu.__version__}" in result["bleu_signature"]


def test_metric_passes_tokenize_and_lowercase():
    predictions = [p.upper() for p in PREDICTIONS]
    result = score_translations(predictions, REFERENCES, tokenize="intl", lowercase=True)
    expected = sacrebleu.corpus_bleu(predictions, [REFERENCES], tokenize="intl", lowercase=True)
    assert result["bleu"] == pytest.approx(expected.score)
    lowered = sacrebleu.corpus_chrf([p.lower() for p in predictions], [[r.lower() for r in REFERENCES]])
    assert result["chrf"] == pytest.approx(lowered.score)
    assert "case:lc" in result["bleu_signature"] and "tok:intl" in result["bleu_signature"]


def test_bleu_tokenises_as_sacrebleu_does_for_the_target_language(monkeypatch):
    """13a splits on spaces and punctuation only: Chinese references were scored as whole sentences, so a
    translation one character off scored BLEU 0. The references' language picks sacreBLEU's tokeniser."""
    references = ["我喜欢吃香蕉。", "今天天气很好。"]
    predictions = ["我喜欢吃苹果。", "今天天气很好。"]
    for language in ("zh", "zh-CN", "zh_Hant"):
        result = score_translations(predictions, references, target_lang=language)
        assert result["bleu"] == pytest.approx(
            sacrebleu.corpus_bleu(predictions, [references], tokenize="zh").score
        )
        assert result["bleu"] > 50 and "tok:zh" in result["bleu_signature"]
    assert "tok:13a" in score_translations(PREDICTIONS, REFERENCES, target_lang="es")["bleu_signature"]
    chosen = score_translations(predictions, references, target_lang="zh", tokenize="13a")  # yours wins
    assert chosen["bleu"] == 0 and "tok:13a" in chosen["bleu_signature"]

    # Japanese and Korean: MeCab's tokenisers where sacrebleu[ja]/[ko] is installed, else characters.
    def without_mecab(self):
        raise RuntimeError("Japanese tokenization requires extra dependencies: pip install sacrebleu[ja]")

    mecab = importlib.import_module("sacrebleu.tokenizers.tokenizer_ja_mecab")
    monkeypatch.setattr(mecab.TokenizerJaMecab, "__init__", without_mecab)
    with pytest.warns(UserWarning, match=r"computed on characters \(tok:char\), not with ja-mecab"):
        result = score_translations(["猫が好き"], ["猫が好きです"], target_lang="ja")
    assert "tok:char" in result["bleu_signature"]


def test_bleu_tokeniser_for_three_letter_language_codes():
    """ISO 639-2/3 codes ("zho", "cmn", "yue") and FLORES-200's ("zho_Hans", the NLLB data's column and
    config names) name Chinese, Japanese and Korean too: they got 13a, which scored Chinese references as
    whole sentences (BLEU 0 for a translation one character off)."""
    references = ["我喜欢吃香蕉。", "今天天气很好。"]
    predictions = ["我喜欢吃苹果。", "今天天气很好。"]
    expected = sacrebleu.corpus_bleu(predictions, [references], tokenize="zh").score
    for language in ("zho", "chi", "cmn", "yue", "zho_Hans", "yue_Hant", "ZHO-Hant"):
        result = score_translations(predictions, references, target_lang=language)
        assert "tok:zh" in result["bleu_signature"], language
        assert result["bleu"] == pytest.approx(expected)
    with warnings.catch_warnings():  # MeCab's tokenisers, or characters where sacrebleu[ja]/[ko] is not here
        warnings.simplefilter("ignore")
        for language, short in (("jpn", "ja"), ("jpn_Jpan", "ja"), ("kor", "ko"), ("kor_Hang", "ko")):
            signature = score_translations(["猫が好き"], ["猫です"], target_lang=language)["bleu_signature"]
            assert "tok:13a" not in signature, language
            assert signature == score_translations(["猫が"], ["猫"], target_lang=short)["bleu_signature"]
    for language in ("spa_Latn", "tha_Thai", "por"):  # sacreBLEU's 13a for the others, as for "es"
        result = score_translations(PREDICTIONS, REFERENCES, target_lang=language)
        assert "tok:13a" in result["bleu_signature"], language


def test_evaluate_model_scores_with_the_target_languages_tokeniser(tmp_path, monkeypatch):
    from vanilla_transformer import evaluation

    test = tmp_path / "test.tsv"
    test.write_text("en\tzh\nI like bananas.\t我喜欢吃香蕉。\nIt is fine today.\t今天天气很好。\n")
    monkeypatch.setattr(evaluation, "load_model_folder", lambda *_: (None, None))
    monkeypatch.setattr(evaluation, "translate", lambda *_, **__: ["我喜欢吃苹果。", "今天天气很好。"])
    options = {"test_file": str(test), "source_lang": "en", "target_lang": "zh"}
    result = evaluation.evaluate_model("model", data_options=options)
    assert "tok:zh" in result["bleu_signature"] and result["bleu"] > 50


def test_evaluate_model_scores_with_the_bleu_tokeniser_named(tmp_path, monkeypatch):
    """sacreBLEU's default for Thai is 13a, which scores a sentence written without spaces as one word;
    `bleu_tokenize` (evaluate_model.py --bleu_tokenize) names another, checked before any translation."""
    from vanilla_transformer import evaluation

    references = ["ฉันชอบกินกล้วย", "วันนี้อากาศดีมาก"]
    predictions = ["ฉันชอบกินแอปเปิ้ล", "วันนี้อากาศดีมาก"]
    test = tmp_path / "test.tsv"
    test.write_text("en\tth\n" + "".join(f"source {i}\t{text}\n" for i, text in enumerate(references)))
    monkeypatch.setattr(evaluation, "load_model_folder", lambda *_: (None, None))
    monkeypatch.setattr(evaluation, "translate", lambda *_, **__: predictions)
    options = {"test_file": str(test), "source_lang": "en", "target_lang": "th"}
    default = evaluation.evaluate_model("model", data_options=options)
    assert "tok:13a" in default["bleu_signature"]
    result = evaluation.evaluate_model("model", data_options=options, bleu_tokenize="char")
    assert "tok:char" in result["bleu_signature"]
    assert result["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(predictions, [references], tokenize="char").score
    )
    assert result["chrf"] == default["chrf"]  # chrF works on characters whatever the BLEU tokeniser

    def without_mecab(self):
        raise RuntimeError("Japanese tokenization requires extra dependencies: pip install sacrebleu[ja]")

    mecab = importlib.import_module("sacrebleu.tokenizers.tokenizer_ja_mecab")
    monkeypatch.setattr(mecab.TokenizerJaMecab, "__init__", without_mecab)
    monkeypatch.setattr(evaluation, "load_parallel_data", lambda **_: pytest.fail("read the data first"))
    for name, message in (
        ("chars", "unknown BLEU tokeniser 'chars'; sacreBLEU's are none, zh, 13a, intl, char"),
        ("ja-mecab", "the BLEU tokeniser 'ja-mecab' cannot run here: .*pip install sacrebleu\\[ja\\]"),
    ):
        with pytest.raises(ValueError, match=message):
            evaluation.evaluate_model("model", data_options=options, bleu_tokenize=name)


def test_the_papers_bleu_is_tokenised_with_compound_splitting(tmp_path, monkeypatch, caplog):
    """The paper's EN-DE BLEU (tensor2tensor's get_ende_bleu.sh): replace-unicode-punctuation.perl and
    tokenizer.perl -l de (their Python port, sacremoses), then Perl's s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g
    (run here as Perl itself), scored on the tokens as multi-bleu.perl does (no smoothing)."""
    import shutil
    import subprocess

    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    from vanilla_transformer import evaluation
    from vanilla_transformer.metrics import PAPER_BLEU

    if shutil.which("perl") is None:
        pytest.skip("needs perl, the reference's compound splitting")
    references = [
        "Die Nord-Süd-Verbindung wurde 2014 eröffnet.",
        "Das ist ein “Testfall” für die Bundes-Regierung.",
    ]
    predictions = [
        "Die Nord-Süd-Verbindung wurde im Jahr 2014 eröffnet.",
        'Das ist ein "Test-Fall" für die Bundes-Regierung.',
    ]
    moses, punctuation = MosesTokenizer(lang="de"), MosesPunctNormalizer(lang="de")

    def reference_tokens(texts):
        lines = [
            moses.tokenize(punctuation.replace_unicode_punct(t), escape=False, return_str=True) for t in texts
        ]
        perl = ["perl", "-CSD", "-ple", "s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g"]
        split = subprocess.run(
            perl, input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
        )
        return split.stdout.splitlines()

    tokens = (reference_tokens(predictions), [reference_tokens(references)])
    expected = sacrebleu.corpus_bleu(*tokens, tokenize="none", smooth_method="none")
    scores = score_translations(predictions, references, target_lang="de", tokenize=PAPER_BLEU)
    assert scores["bleu"] == pytest.approx(expected.score) and scores["sys_len"] == expected.sys_len
    assert "|tok:moses-compound-split-de-sacremoses-" in scores["bleu_signature"]
    assert "|smooth:none|" in scores["bleu_signature"]
    plain = score_translations(predictions, references, target_lang="de")
    assert scores["chrf"] == plain["chrf"] and scores["bleu"] > plain["bleu"]  # chrF: the text's

    # German's rules under any spelling of its code ("z. B." one token in German, two in English)
    abbreviated = ["Das ist z. B. ein Test.", "Am 3. Mai, um 10 Uhr."]
    german = score_translations(abbreviated, abbreviated, target_lang="de", tokenize=PAPER_BLEU)
    for code in ("DE", "de_DE", "deu", "deu_Latn"):
        same = score_translations(abbreviated, abbreviated, target_lang=code, tokenize=PAPER_BLEU)
        assert same["sys_len"] == german["sys_len"], code
    english = score_translations(abbreviated, abbreviated, target_lang="en", tokenize=PAPER_BLEU)
    assert english["sys_len"] > german["sys_len"]
    # Tokenised lines (each ending " .") are what this score reads: no "forgot to detokenize" warning.
    lines = [f"Er sagte {i} Mal ja." for i in range(120)]
    with caplog.at_level("WARNING"):
        assert score_translations(lines, lines, target_lang="de", tokenize=PAPER_BLEU)[
            "bleu"
        ] == pytest.approx(100)
    assert "detokenize" not in caplog.text

    # through evaluate_model.py's flag
    test = tmp_path / "test.tsv"
    test.write_text("en\tde\n" + "".join(f"source {i}\t{text}\n" for i, text in enumerate(references)))
    monkeypatch.setattr(evaluation, "load_model_folder", lambda *_: (None, None))
    monkeypatch.setattr(evaluation, "translate", lambda *_, **__: predictions)
    options = {"test_file": str(test), "source_lang": "en", "target_lang": "de"}
    result = evaluation.evaluate_model("model", data_options=options, bleu_tokenize=PAPER_BLEU)
    assert result["bleu"] == pytest.approx(expected.score)
    monkeypatch.setitem(__import__("sys").modules, "sacremoses", None)  # not installed
    with pytest.raises(ValueError, match="needs the sacremoses package: pip install sacremoses"):
        evaluation.evaluate_model("model", data_options=options, bleu_tokenize=PAPER_BLEU)


def test_canonically_equivalent_spellings_score_as_the_same_text():
    """A model writes NFC text (its tokenizer normalises targets so), and sacreBLEU compares code points:
    against decomposed references (as macOS and some corpora write Vietnamese and Korean) a perfect
    translation scored BLEU 5.3 and chrF 24.0 (Vietnamese), 0.7 and 0.9 (Korean)."""
    for references, language in (
        (["Tôi không biết tiếng Việt.", "Hôm nay trời đẹp quá."], "vi"),
        (["한국어 문장입니다.", "오늘은 날씨가 좋다."], "ko"),
    ):
        decomposed = [unicodedata.normalize("NFD", text) for text in references]
        assert decomposed != references
        with warnings.catch_warnings():  # Korean: characters where sacrebleu[ko] is not installed
            warnings.simplefilter("ignore")
            for predictions, wanted in ((references, decomposed), (decomposed, references)):
                result = score_translations(predictions, wanted, target_lang=language)
                assert result["bleu"] == pytest.approx(100.0) and result["chrf"] == pytest.approx(100.0)


def test_perfect_translations_score_100():
    result = load_translation_metric().compute(predictions=REFERENCES, references=REFERENCES)
    assert result["bleu"] == pytest.approx(100.0)
    assert result["chrf"] == pytest.approx(100.0)
    assert result["brevity_penalty"] == 1.0


@pytest.mark.parametrize(
    ("predictions", "references", "match"),
    [
        (PREDICTIONS[:3], REFERENCES, r"number of predictions \(3\) and references \(4\)"),
        ([], [], "empty"),
        ("a sentence", "a sentence", "not a single string"),
    ],
)
def test_score_translations_rejects_bad_inputs(predictions, references, match):
    with pytest.raises(ValueError, match=match):
        score_translations(predictions, references)


def test_metric_module_rejects_bad_inputs():
    metric = load_translation_metric()
    with pytest.raises(ValueError, match="predictions"):
        metric.compute(predictions=PREDICTIONS[:2], references=REFERENCES)
    with pytest.raises(ValueError, match="empty"):
        metric.compute(predictions=[], references=[])
    with pytest.raises(ValueError, match="tokenize"):
        metric.compute(predictions=PREDICTIONS, references=REFERENCES, tokenize="no-such-tokenizer")


def test_metric_module_keeps_one_import_per_line():
    source = (Path(metric_module_path()) / "bleu_chrf.py").read_text(encoding="utf-8")
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all("," not in line for line in imports if line.startswith("import "))
    assert not any("vanilla_transformer" in line for line in imports)


# ---------------------------------------------------------------- translate

SOURCES = [
    "In the beginning God created the heavens and the earth .",
    "Jesus wept .",
    "And God said , Let there be light : and there was light .",
    "",
    "The earth was formless and empty .",
    "God saw the light , and saw that it was good .",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over SOURCES: <pad> 0, <s> 1, </s> 2, <unk> 3; every encoding ends with </s>."""
    words = sorted({word for sentence in SOURCES for word in sentence.split()})
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def generate_one_by_one(model, tokenizer, sentences, **kwargs) -> list[str]:
    outputs = []
    with torch.no_grad():
        for sentence in sentences:
            if not sentence.strip():  # `translate` keeps a blank sentence blank, without the model
                outputs.append("")
                continue
            input_ids = torch.tensor([tokenizer(sentence)["input_ids"]])
            generated = model.generate(input_ids=input_ids, **kwargs)
            outputs.append(tokenizer.decode(generated[0], skip_special_tokens=True).strip())
    return outputs


@pytest.mark.parametrize("batch_size", [1, 2, 4, 32])
def test_translate_equals_one_sentence_at_a_time(tokenizer, batch_size):
    model = tiny_model(vocab_size=len(tokenizer), seed=6)
    kwargs = {"num_beams": 1, "do_sample": False, "max_new_tokens": 7}
    expected = generate_one_by_one(model, tokenizer, SOURCES, **kwargs)
    assert len(set(expected)) >= 3, "pick a seed whose random model gives distinct outputs"
    assert translate(model, tokenizer, SOURCES, batch_size=batch_size, **kwargs) == expected


def test_translate_detokenises_as_the_tokenizer_decodes():
    """With a word-level tokenizer a translation's tokens joined by spaces are its text: outputs written
    as tokens would pass the test above. With this package's BPE tokenizer they are not."""
    from vanilla_transformer.tokenization import train_bpe_tokenizer

    bpe = train_bpe_tokenizer(SOURCES * 5, 80)
    model = tiny_model(vocab_size=len(bpe), seed=9)
    kwargs = {"num_beams": 1, "do_sample": False, "max_new_tokens": 9}
    expected = generate_one_by_one(model, bpe, SOURCES, **kwargs)
    pieces = [" ".join(bpe.tokenize(text)) for text in expected]
    assert sum(a != b for a, b in zip(expected, pieces, strict=True)) >= 3, "pick a seed with longer outputs"
    assert translate(model, bpe, SOURCES, batch_size=4, **kwargs) == expected


class EchoModel(torch.nn.Module):
    """Stands in for a seq2seq model: "translates" a batch into its own (padded) input ids."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.batches: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return self.layer.weight.device

    def generate(self, input_ids, attention_mask, **kwargs):
        assert not self.training and torch.is_inference_mode_enabled()
        self.batches.append(attention_mask.sum(1))
        self.inputs.append(input_ids)
        return input_ids


def test_translate_sorts_by_length_and_restores_order(tokenizer):
    model = EchoModel().train()
    model.layer.eval()  # a mixed train/eval state must come back exactly
    assert translate(model, tokenizer, SOURCES, batch_size=2) == [s.strip() for s in SOURCES]
    lengths = torch.cat(model.batches).tolist()
    assert lengths == sorted(lengths, reverse=True)
    assert [len(batch) for batch in model.batches] == [2, 2, 1]  # the blank sentence is not sent
    assert model.training and not model.layer.training


def test_translate_edge_cases(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    assert translate(model, tokenizer, []) == []
    # A blank sentence is "" (the model, given only the end token, wrote its most frequent words); the
    # others are translated as they would be alone, and an error names the place in the whole list.
    kwargs = {"num_beams": 1, "max_new_tokens": 5}
    alone = translate(model, tokenizer, ["Jesus wept ."], **kwargs)
    assert translate(model, tokenizer, ["", "Jesus wept .", " \t"], **kwargs) == ["", *alone, ""]
    assert translate(model, tokenizer, ["", "  "]) == ["", ""]
    with pytest.raises(ValueError, match=r"sentences\[1\] is a int"):
        translate(model, tokenizer, ["Jesus wept .", 3])
    with pytest.raises(ValueError, match="single string"):
        translate(model, tokenizer, "Jesus wept .")
    with pytest.raises(ValueError, match="batch_size"):
        translate(model, tokenizer, ["Jesus wept ."], batch_size=0)


def test_translate_reads_a_sentence_as_the_training_data_reads_it(keeping_spaces_at_the_ends):
    """Training sources are `one_line` (stripped, line breaks made spaces), and translate.py strips its
    lines. A sentence given with its line break (as `readlines()` gives it), in Windows' form, with
    spaces around it or across lines was encoded with word-start tokens that no training source has
    (by this package's tokenizers from before they stripped texts' ends, as here, and by others that keep
    spaces) and translated otherwise; so was one with two spaces or tabs between its words (by every
    tokenizer of this package: a second space is a token of its own)."""
    from vanilla_transformer.tokenization import train_bpe_tokenizer

    tokenizer = keeping_spaces_at_the_ends(train_bpe_tokenizer(SOURCES * 5, 80))
    clean = [sentence for sentence in SOURCES if sentence]
    given = [
        clean[0] + "\n",
        clean[1] + "\r\n",
        "  " + clean[2] + " ",
        clean[3].replace(" ", " \n ", 1),
        " \t" + clean[4],
        clean[0].replace(" ", "  ", 2),
        clean[1].replace(" ", "\t\t").replace(".", ".\u3000 "),
    ]
    clean += clean[:2]
    expected = [tokenizer(text)["input_ids"] for text in clean]
    for raw, ids in zip(given, expected, strict=True):  # the tokenizer alone reads each of them otherwise
        assert tokenizer(raw)["input_ids"] != ids, raw
    model = EchoModel()
    translate(model, tokenizer, given, batch_size=1)
    received = [ids[0, : int(count)].tolist() for ids, count in zip(model.inputs, model.batches, strict=True)]
    assert sorted(received) == sorted(expected)  # sorted: `translate` sends the longest first
    assert translate(model, tokenizer, ["\n", " \r\n "]) == ["", ""]


def test_invisible_characters_of_joined_files_are_no_text(tokenizer):
    """Files saved with a byte-order mark and joined (`cat a.txt b.txt`) start lines with it: such a line
    was translated otherwise (the mark an unknown token before its first word), and one of the mark alone
    (an empty file's), or of a zero-width space, was translated into made-up text, not kept blank."""
    lines = ["Jesus wept .\n", "\ufeffJesus wept .\n", "\ufeff\n", "\u200b\u2060\r\n", "Jesus \u200b wept ."]
    model = EchoModel()
    assert list(translate_lines(model, tokenizer, lines)) == [
        "Jesus wept .",
        "Jesus wept .",
        "",
        "",
        "Jesus wept .",
    ]
    assert sum(len(batch) for batch in model.batches) == 3  # the blank lines are not sent


def test_translate_keeps_one_line_per_sentence(tokenizer, monkeypatch):
    """A model trained on text with line breaks may write them: each translation stays on one line, so
    that a line-by-line output keeps one line per input."""
    monkeypatch.setattr(tokenizer, "batch_decode", lambda sequences, **_: ["uno\ndos\r\n"] * len(sequences))
    lines = ["Jesus wept .\n", "\n", "In the beginning\n"]
    assert list(translate_lines(EchoModel(), tokenizer, lines)) == ["uno dos", "", "uno dos"]


class OutOfMemoryModel(EchoModel):
    """Runs out of memory, as a CPU allocation does, in any batch holding a sentence of 4 or more tokens."""

    def __init__(self, message: str = "[enforce fail at alloc_cpu.cpp:127] you tried to allocate 57 GB."):
        super().__init__()
        self.message = message

    def generate(self, input_ids, attention_mask, **kwargs):
        if attention_mask.sum(1).max() >= 4:
            raise RuntimeError(self.message)
        return input_ids


def test_a_sentence_too_long_for_memory_is_named(tokenizer):
    """A 60,000-token line once ended translate.py with the allocator's message and no line number."""
    sentences = ["Jesus wept .", "In the beginning God created", "wept ."]
    with pytest.raises(SentenceError, match=r"^sentences\[1\] \(6 tokens\) needs more memory than there is"):
        translate(OutOfMemoryModel(), tokenizer, sentences, batch_size=2)
    with pytest.raises(LineError, match=r"^line 3 \(6 tokens\) needs more memory"):
        list(translate_lines(OutOfMemoryModel(), tokenizer, ["wept .\n", "\n", sentences[1] + "\n"]))
    # Out of memory in a batch of several: the batch size may be the cause, not the sentence alone.
    with pytest.raises(
        SentenceError, match=r"to translate in a batch of 2 \(a smaller batch size may fit\): "
    ):
        translate(OutOfMemoryModel(), tokenizer, sentences, batch_size=2)
    alone = r"^sentences\[1\] \(6 tokens\) needs more memory than there is to translate: \[enforce"
    with pytest.raises(SentenceError, match=alone):  # a batch of one: the sentence alone
        translate(OutOfMemoryModel(), tokenizer, sentences, batch_size=1)
    with pytest.raises(RuntimeError, match=r"^a bug$"):  # not about memory: not blamed on a sentence
        translate(OutOfMemoryModel("a bug"), tokenizer, sentences)


def test_translate_stream_names_the_line_of_a_sentence_error():
    """An engine's SentenceError names a place in the non-blank lines of one window; the stream names the
    line of the input (blank lines and earlier windows counted)."""

    def engine(texts: list[str]) -> list[str]:
        for index, text in enumerate(texts):
            if text == "too long":
                raise SentenceError(index, "is too long.")
        return [text.upper() for text in texts]

    lines = ["a\n", "\n", "b\n", "c\n", "\n", "d\n", "too long\n", "e\n"]
    assert list(translate_stream(engine, lines[:6], window=3)) == ["A", "", "B", "C", "", "D"]
    with pytest.raises(LineError, match=r"^line 7 is too long\.$") as error:
        list(translate_stream(engine, lines, window=3))
    assert error.value.number == 7
    with pytest.raises(LineError, match=r"^line 7 is too long\.$"):
        list(translate_stream(engine, lines, window=100))
    # In a full window before the last one, after blank lines.
    with pytest.raises(LineError, match=r"^line 3 is too long\.$"):
        list(translate_stream(engine, ["a\n", "\n", "too long\n", "c\n"], window=3))


def test_lines_are_read_to_a_mebibyte_each():
    """Input without line breaks was read whole (`--input /dev/zero` grew until the system stopped the
    process). A line of MAX_LINE_BYTES and its line break ("\n" or "\r\n") is read whole, the next one
    after it; a longer one is named once that much has been read; a byte-order mark starts no line."""
    import io

    from vanilla_transformer.translation import MAX_LINE_BYTES, decoded_lines

    full = "x" * MAX_LINE_BYTES
    for ending in ("\n", "\r\n"):
        data = f"\ufeffa\n{full}{ending}b\nlast".encode()
        assert list(decoded_lines(io.BytesIO(data))) == ["a\n", full + ending, "b\n", "last"]
    # One byte more, with either line break or none, is refused (with "\n", it was read).
    for longer in (
        b"\0" * (MAX_LINE_BYTES + 5),
        (full + "y\n").encode(),
        (full + "y\r\n").encode(),
        b"y" + full.encode(),
    ):
        reader = decoded_lines(io.BytesIO(b"a\n" + longer))
        assert next(reader) == "a\n"
        with pytest.raises(LineError, match=r"^line 2 is longer than 1,048,576 bytes"):
            next(reader)

    class Failing(io.BytesIO):  # a network share gone after the first line
        def readline(self, *args):
            if self.tell():
                raise OSError(5, "Input/output error")
            return super().readline(*args)

    # A read error is the input's (translate.py names the input and the line), not the output's
    reader = decoded_lines(Failing(b"a\nb\n"))
    assert next(reader) == "a\n"
    with pytest.raises(LineError, match=r"^line 2 could not be read: \[Errno 5\] Input/output error"):
        next(reader)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16", "utf-32-le", "utf-32"])
def test_translation_input_in_utf16_or_utf32_is_refused_not_translated(encoding):
    """NUL bytes are UTF-8: UTF-16 text without a byte-order mark was read as UTF-8 and translated (each
    NUL an unknown token, one line more than the input had) with success; with a mark, the message did
    not say what the input is. The data files' check said it (`check_utf8`); the input's now too."""
    import io

    from vanilla_transformer.translation import decoded_lines

    wide = "UTF-32" if "32" in encoding else "UTF-16"
    reader = decoded_lines(io.BytesIO("Jesus wept.\nGod is love.\n".encode(encoding)))
    with pytest.raises(LineError, match=rf"^line 1 is not UTF-8 text but {wide}.*`iconv -f {wide} -t UTF-8`"):
        next(reader)
    # A stray NUL in UTF-8 text is text, as in the data files, in a short line too (the share of NUL
    # bytes there named it UTF-16); bytes of another 8-bit encoding get a hint
    stray = b"a\0b c d\nx\0y\n\0\nHello\0\0\0 there\n"
    assert list(decoded_lines(io.BytesIO(stray))) == stray.decode().splitlines(keepends=True)
    lines = decoded_lines(io.BytesIO("a\nbb\nhello there\n".encode("utf-32-le")))  # a short first line
    with pytest.raises(LineError, match=r"^line 2 is not UTF-8 text but UTF-32"):
        list(lines)
    with pytest.raises(LineError, match=r"^line 1 is not UTF-8 text \(.*\); convert it from the encoding"):
        next(decoded_lines(io.BytesIO("caf\u00e9\n".encode("cp1252"))))


def test_translate_stream_stops_its_output_at_the_line_it_names():
    """A line that cannot be read (not UTF-8) or translated stopped the stream with the lines read before
    it in its window untranslated: translate.py's standard output ended at the window before (16 lines of
    a run stopped at line 21), so that the output looked complete up to the line named, and a run resumed
    from there lost lines. Every line before the one named is yielded first."""

    def engine(texts: list[str]) -> list[str]:
        for index, text in enumerate(texts):
            if text.startswith("too long"):
                raise SentenceError(index, "is too long.")
        return [text.upper() for text in texts]

    def unreadable(lines: list[str], number: int):  # as translate.py's decoding raises for a line
        yield from lines[: number - 1]
        raise LineError(number, "is not UTF-8 text.")

    lines = ["a\n", "\n", "b\n", "c\n", "\n", "d\n", "e\n", "f\n"]
    for window in (1, 3, 4, 100):
        for number in (1, 2, 5, 7):
            written = []
            with pytest.raises(LineError, match=rf"^line {number} is not UTF-8 text\.$"):
                written.extend(translate_stream(engine, unreadable(lines, number), window=window))
            assert written == [line.strip().upper() for line in lines[: number - 1]], (window, number)
            given = [*lines[: number - 1], "too long\n", *lines[number:]]
            written = []
            with pytest.raises(LineError, match=rf"^line {number} is too long\.$"):
                written.extend(translate_stream(engine, given, window=window))
            assert written == [line.strip().upper() for line in lines[: number - 1]], (window, number)
    # Two that cannot be translated in one window: the first is named, after the lines before it.
    written = []
    with pytest.raises(LineError, match=r"^line 3 is too long\.$"):
        written.extend(translate_stream(engine, ["a\n", "\n", "too long 1\n", "too long 2\n"], window=8))
    assert written == ["A", ""]

    def last_named(texts: list[str]) -> list[str]:  # as `translate` names the longest of a failed batch
        bad = [index for index, text in enumerate(texts) if text.startswith("too long")]
        if bad:
            raise SentenceError(bad[-1], "is too long.")
        return texts

    # Each try on the lines before the one named fails again, down to the first: a try per line, not a
    # nested call per line (a window of 2,000 exceeded Python's recursion limit).
    given = ["a\n", "\n"] + ["too long\n"] * 2000
    written = []
    with pytest.raises(LineError, match=r"^line 3 is too long\.$"):
        written.extend(translate_stream(last_named, given, window=4000))
    assert written == ["a", ""]


# ---------------------------------------------------------------- model card

METRICS = {
    "bleu": 23.4567,
    "chrf": 48.1234,
    "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
    "val_loss": 3.1416,
    "test_loss": 3.2718,
}
TRAINING = {
    "steps": 12345,
    "epochs": 17,
    "train_time_s": 5432,
    "hardware": "2 CPU cores",
    "batch_tokens": 4096,
    "warmup_steps": 4000,
    "lr_peak": 7e-4,
    "label_smoothing": 0.1,
    "dropout": 0.1,
    "averaged_checkpoints": 5,
    "command": "python scripts/train.py --preset tiny",
}
DATASET = {
    "name": "Bible verses en-es",
    "hub_id": "someone/bible-en-es",
    "description": "Short parallel verses.",
    "license": "public domain",
    "train_pairs": 11022,
    "validation_pairs": 604,
    "test_pairs": 605,
}


def card_kwargs(**overrides):
    values = {
        "model_name": "someone/vanilla-transformer-en-es",
        "config": tiny_config(),
        "metrics": METRICS,
        "training": TRAINING,
        "dataset": DATASET,
        "source_lang": "en",
        "target_lang": "es",
    }
    return {**values, **overrides}


def test_model_card_language_metadata_takes_language_codes_with_regions_and_scripts():
    """The Hub's `language` metadata takes ISO 639 codes only, lowercase (a card with "pt-BR" or "sr-Latn"
    showed a YAML metadata error, and the languages were not indexed); language tags with a region or a
    script go to `language_bcp47`, as the Hub asks, and the language list names each language once."""
    cases = [
        (("sr-Latn", "pt_BR"), ["sr", "pt"], ["sr-Latn", "pt-BR"]),
        (("zh-Hant", "zh-Hans"), ["zh"], ["zh-Hant", "zh-Hans"]),
        (("eng_Latn", "zho_Hans"), ["eng", "zho"], ["eng-Latn", "zho-Hans"]),
        (("EN", "de"), ["en", "de"], None),
        (("en", "pt-BR"), ["en", "pt"], ["en", "pt-BR"]),  # both languages named in the tags
        # Private-use and grandfathered tags (train.py takes them) have no ISO 639 language: they gave
        # `language` the codes "x" and "i".
        (("es-419", "x-klingon"), ["es"], ["es-419", "x-klingon"]),
        (("en", "i-klingon"), ["en"], ["en", "i-klingon"]),
        (("x-one", "x-two"), None, ["x-one", "x-two"]),
    ]
    for (source, target), language, bcp47 in cases:
        data = ModelCard(str(build_model_card(**card_kwargs(source_lang=source, target_lang=target)))).data
        assert data.to_dict().get("language") == language, (source, target)
        assert data.to_dict().get("language_bcp47") == bcp47, (source, target)


def test_model_card_names_a_language_by_its_primary_tag():
    """A code with a region or script was named as the code ("This model translates English into
    zh_CN."): the language is named by its primary tag, with the code where the code says more."""
    from vanilla_transformer.model_card import language_name

    assert [language_name(code) for code in ("en", "EN", "zh_CN", "pt-BR", "ko", "th", "xx", "eng")] == [
        "English",
        "English",
        "Chinese (zh_CN)",
        "Portuguese (pt-BR)",
        "Korean",
        "Thai",
        "xx",
        "eng",
    ]
    text = str(build_model_card(**card_kwargs(source_lang="en", target_lang="zh_CN")))
    assert "English into Chinese (zh_CN)" in text and "Translation English to Chinese (zh_CN)" in text


def test_model_card_shows_metrics_in_text_and_model_index():
    card = build_model_card(**card_kwargs())
    text = str(card)
    assert text.startswith("---\n")
    for expected in (
        "| BLEU | 23.46 |",
        "| chrF | 48.12 |",
        METRICS["bleu_signature"],
        METRICS["chrf_signature"],
    ):
        assert expected in text
    for expected in ("12,345", "11,022", "1 h 30 min", "2 CPU cores", "4,000", "python scripts/train.py"):
        assert expected in text
    assert "arxiv.org/abs/1706.03762" in text and "@inproceedings{vaswani2017attention" in text

    data = ModelCard(text).data.to_dict()  # offline re-parse of the YAML header
    assert data["language"] == ["en", "es"]
    assert data["license"] == "apache-2.0" and data["pipeline_tag"] == "translation"
    assert data["library_name"] == "transformers" and data["datasets"] == ["someone/bible-en-es"]
    assert {"translation", "vanilla-transformer"} <= set(data["tags"])
    (entry,) = data["model-index"]
    (result,) = entry["results"]
    assert entry["name"] == "someone/vanilla-transformer-en-es"
    assert result["dataset"]["split"] == "test" and result["dataset"]["type"] == "someone/bible-en-es"
    metrics = {m["type"]: m for m in result["metrics"]}
    assert metrics["bleu"]["value"] == 23.46 and metrics["chrf"]["value"] == 48.12
    assert metrics["bleu"]["config"] == METRICS["bleu_signature"]


def test_model_card_states_the_recipe_and_the_repetition_share():
    training = TRAINING | {
        "preset": "tiny",
        "lr_schedule": "linear",
        "max_steps": 1650,
        "max_train_minutes": 8.5,
        "qkv_init_gain": 2**-0.5,
    }
    metrics = METRICS | {"repetition": 0.0125, "reference_repetition": 0.0}
    text = " ".join(str(build_model_card(**card_kwargs(training=training, metrics=metrics))).split())
    assert (
        "Xavier-uniform linear layers with zero biases, with gain 0.7071 for the attention's query, key and "
        "value projections (fairseq's 2^-0.5; the paper does not say how it initialised)." in text
    )
    plain = str(build_model_card(**card_kwargs(training=training | {"qkv_init_gain": 1.0})))
    assert (
        "with gain 1 for the attention's query" in " ".join(plain.split())
        and "(fairseq's 2^-0.5" not in plain
    )
    assert "The `tiny` recipe: the paper's (Section 5) adapted to a short run" in text
    assert "end of the run (1,650 updates or 8.5 minutes of training, whichever comes first)" in text
    # One limit: nothing to come first (the card said "(1,650 updates, whichever comes first)").
    for limits, said in (({"max_train_minutes": None}, "(1,650 updates)"), ({"max_steps": None}, "(8.5 min")):
        one = " ".join(str(build_model_card(**card_kwargs(training=training | limits))).split())
        assert f"end of the run {said}" in one and "whichever" not in one
    assert "| outputs with a word 4-gram repeated 3+ times | 1.2% (references: 0.0%) |" in text
    paper = " ".join(str(build_model_card(**card_kwargs(training=TRAINING | {"preset": "base"}))).split())
    assert "The recipe of the paper (Section 5):" in paper and "min(step^-0.5" in paper
    assert "repeated 3+ times" not in paper
    assert "n-gram blocking" not in text and "n-gram blocking" not in paper
    blocked = build_model_card(**card_kwargs(metrics=metrics | {"no_repeat_ngram_size": 3}))
    assert "No 3-token sequence may appear twice in an output (n-gram blocking" in " ".join(
        str(blocked).split()
    )
    # no decoding settings given: the model's generation config's default, the paper's 0.6
    assert "length penalty 0.6 in transformers' form (a beam's log-probability over length^0.6)" in text
    paper_form = metrics | {"length_penalty": 0.6, "length_penalty_form": "gnmt"}
    gnmt = " ".join(str(build_model_card(**card_kwargs(metrics=paper_form))).split())
    assert "0.6 in the paper's form (a beam's log-probability over ((5 + length) / 6)^0.6)" in gnmt


def test_template_renders_with_optional_values_missing():
    minimal = {"bleu": 12.5, "chrf": 40.0, "bleu_signature": "nrefs:1|tok:13a"}
    card = build_model_card(**card_kwargs(metrics=minimal, training={}, dataset={}))
    text = str(card)
    assert "| BLEU | 12.50 |" in text and "nrefs:1|tok:13a" in text
    assert "None" not in text
    table_rows = [line for line in text.splitlines() if line.startswith("|")]
    assert all(cell.strip() for row in table_rows for cell in row.strip("|").split("|")[1:])
    assert "training steps" not in text and "validation loss" not in text and "chrF:" not in text
    assert "datasets" not in ModelCard(text).data.to_dict()
    assert "\n\n\n\n" not in text.split("```python")[0]


def test_the_cards_fine_tuning_example_loads_a_hub_dataset_with_its_config_and_translation_pairs(monkeypatch):
    """A run on `--dataset_name wmt/wmt14 --dataset_config de-en` (rows of `translation` dicts): the card's
    example must name the config (load_dataset refuses a dataset of several configs without one) and
    give `preprocess` the language columns it reads."""
    import datasets

    dataset = DATASET | {"hub_id": "wmt/wmt14", "hub_config": "de-en"}
    text = str(build_model_card(**card_kwargs(dataset=dataset, target_lang="de")))
    example = text[text.index("from datasets import load_dataset") : text.index("def preprocess")]
    rows = {"translation": [{"de": "Hallo.", "en": "Hello."}, {"de": "Ja.", "en": "Yes."}]}
    calls = []

    def load_dataset(*args):
        calls.append(args)
        return datasets.DatasetDict(train=datasets.Dataset.from_dict(rows))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    namespace: dict = {}
    exec(example, namespace)
    assert calls == [("wmt/wmt14", "de-en")]
    assert namespace["dataset"]["train"]["en"] == ["Hello.", "Yes."]
    assert namespace["dataset"]["train"]["de"] == ["Hallo.", "Ja."]
    assert 'return tokenizer(batch["en"], text_target=batch["de"])' in text
    # Trained with --source_column/--target_column: the example reads those columns, not the languages'.
    dataset |= {"hub_id": "org/pairs", "hub_config": None, "hub_columns": ["english", "german"]}
    text = str(build_model_card(**card_kwargs(dataset=dataset, target_lang="de")))
    assert 'load_dataset("org/pairs")\n' in text
    assert 'return tokenizer(batch["english"], text_target=batch["german"])' in text


def test_the_model_index_names_the_hub_datasets_config_as_loaded():
    """`--dataset_name wmt/wmt14 --dataset_config de-en --source_lang en --target_lang de` (README's
    example): the model-index's dataset config is the one `load_dataset` took, "de-en"; it said "en-de",
    a config wmt/wmt14 does not have. A Hub dataset loaded without a config names none."""
    dataset = DATASET | {"hub_id": "wmt/wmt14", "hub_config": "de-en"}
    card = build_model_card(**card_kwargs(dataset=dataset, target_lang="de"))
    (result,) = card.data.eval_results[:1]
    assert result.dataset_type == "wmt/wmt14" and result.dataset_config == "de-en"
    (entry,) = ModelCard(str(card)).data.to_dict()["model-index"]
    assert entry["results"][0]["dataset"]["config"] == "de-en"
    unconfigured = build_model_card(**card_kwargs(dataset=DATASET | {"hub_config": None}))
    assert {r.dataset_config for r in unconfigured.data.eval_results} == {None}
    (entry,) = ModelCard(str(unconfigured)).data.to_dict()["model-index"]
    assert "config" not in entry["results"][0]["dataset"]


def test_a_fine_tuned_model_card_links_its_hub_base_model_and_no_recipe_of_its_own():
    hub_base = {
        "finetuned_from": "Helsinki-NLP/opus-mt-en-es",
        "finetuned_from_hub": True,
        "max_grad_norm": 1.0,
    }
    tuned = build_model_card(
        **card_kwargs(training=TRAINING | hub_base, metrics=METRICS | {"max_length_offset": None})
    )
    assert tuned.data.base_model == "Helsinki-NLP/opus-mt-en-es"
    assert "\nbase_model_relation: finetune\n" in str(tuned)  # the Hub's model tree: a fine-tune of it
    text = " ".join(tuned.text.split())
    assert "fine-tuned from `Helsinki-NLP/opus-mt-en-es` on" in text and "trained from scratch" not in text
    assert "transformers' `inverse_sqrt`" in text and "The recipe of the paper" not in text
    assert "Far less training" not in text and "Rare repetition loops" not in text
    assert "source length +" not in text.split("Decoding:")[1].split("The paper")[0]  # no length rule set
    assert "clipped to norm 1.0 (Trainer's default; the paper does not clip)" in text
    local = build_model_card(
        **card_kwargs(training=TRAINING | {"finetuned_from": "tiny-en-es", "max_grad_norm": 5.0})
    )
    assert local.data.base_model is None and "fine-tuned from `tiny-en-es`" in " ".join(local.text.split())
    assert "clipped to norm 5.0 (the paper does not clip)" in " ".join(local.text.split())
    assert "base_model_relation" not in str(local)
    scratch = build_model_card(**card_kwargs())
    assert scratch.data.base_model is None and "trained from scratch" in " ".join(scratch.text.split())


def test_a_converted_model_card_describes_no_training_and_links_its_hub_source():
    hub = {"converted_from": "Helsinki-NLP/opus-mt-en-es", "converted_from_hub": True}
    converted = build_model_card(**card_kwargs(training=hub, dataset={}))
    assert converted.data.base_model == "Helsinki-NLP/opus-mt-en-es"
    assert "base_model_relation" not in str(converted)  # no relation of the Hub's fits a conversion
    text = " ".join(converted.text.split())
    assert "holding the weights of `Helsinki-NLP/opus-mt-en-es`, a MarianMTModel" in text
    assert "trained from scratch" not in text and "Not trained here: the card of" in text
    training = text.split("## Training procedure")[1].split("## Results")[0]
    assert "Not trained here." in training
    assert "Optimiser" not in training and "Label smoothing" not in training
    assert "**Converted.**" in text and "Far less training" not in text
    # The other cards are as they were: the converted branch only where asked for.
    for card in (build_model_card(**card_kwargs()), build_model_card(**card_kwargs(training=TRAINING))):
        assert "Not trained here" not in card.text and "**Optimiser**" in card.text


LICENCE_FIELDS = ("license", "license_name", "license_link")


def test_a_licence_without_an_identifier_keeps_its_name_and_link(tmp_path, monkeypatch, caplog):
    """A start model under a licence of its own (`license: other`, with `license_name` and `license_link`,
    as the Hub asks) gave fine-tuned and converted cards `license: other` alone: which licence, and its
    terms, were lost. A link to the repo's own file becomes its address on the Hub; from a local folder
    the file comes along."""
    from vanilla_transformer import model_card

    metadata = "---\nlicense: other\nlicense_name: opus-research\nlicense_link: {}\n---\n# A model\n"
    local = tmp_path / "local"
    local.mkdir()
    (local / "README.md").write_text(metadata.format("LICENSE"))
    (local / "LICENSE").write_text("The terms.\n")
    fields = base_license(str(local))
    assert fields == {"license": "other", "license_name": "opus-research", "license_link": "LICENSE"}
    folder = tmp_path / "derived"
    model_card.copy_license_file(str(local), folder, fields["license_link"])
    assert (folder / "LICENSE").read_text() == "The terms.\n"
    data = ModelCard(str(build_model_card(**card_kwargs(**fields)))).data.to_dict()
    assert {key: data.get(key) for key in LICENCE_FIELDS} == fields

    (local / "LICENSE").unlink()
    with caplog.at_level("WARNING", logger="vanilla_transformer.model_card"):
        model_card.copy_license_file(str(local), tmp_path / "other", "LICENSE")
    assert "links its licence to LICENSE, which is not in that folder" in caplog.text

    # A link out of the folder ("../LICENSE") is no file of it: not copied (it was written beside the new
    # folder), and not made an address in the start model's repo.
    (tmp_path / "LICENSE").write_text("elsewhere")
    model_card.copy_license_file(str(local), tmp_path / "climbing" / "model", "../LICENSE")
    assert not (tmp_path / "climbing").exists()
    for link, expected in (
        ("../LICENSE", "../LICENSE"),
        ("LICENSE", "https://huggingface.co/org/model/blob/main/LICENSE"),
        ("./docs/LICENSE.md", "https://huggingface.co/org/model/blob/main/docs/LICENSE.md"),
        ("https://example.org/terms", "https://example.org/terms"),
    ):
        card = ModelCard(metadata.format(link))
        monkeypatch.setattr(model_card.ModelCard, "load", lambda *args, card=card, **kwargs: card)
        monkeypatch.setattr(model_card.constants, "ENDPOINT", "https://huggingface.co")
        assert base_license("org/model")["license_link"] == expected


def test_base_license_reads_a_card_and_says_when_it_cannot(tmp_path, caplog, monkeypatch):
    """Offline, a Hub model's licence went unread without a word and the new card stated none."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vanilla_transformer import model_card

    (tmp_path / "licensed").mkdir()
    (tmp_path / "licensed" / "README.md").write_text("---\nlicense: cc-by-4.0\n---\n# A model\n")
    (tmp_path / "bare").mkdir()  # a folder without a card states no licence: nothing to say
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    with caplog.at_level("WARNING", logger="vanilla_transformer.model_card"):
        assert base_license(str(tmp_path / "licensed"))["license"] == "cc-by-4.0"
        assert base_license(str(tmp_path / "bare")) == dict.fromkeys(LICENCE_FIELDS)
        assert not caplog.records
        assert base_license(str(tmp_path / "broken")) == dict.fromkeys(LICENCE_FIELDS)
        assert "licence of" in caplog.text and "broken could not be read" in caplog.text
        caplog.clear()

        def offline(*args, **kwargs):
            raise LocalEntryNotFoundError("Cannot reach the Hub, and the file is not in the cache")

        monkeypatch.setattr(model_card.ModelCard, "load", offline)
        assert base_license("Helsinki-NLP/opus-mt-en-es") == dict.fromkeys(LICENCE_FIELDS)
        assert "Helsinki-NLP/opus-mt-en-es could not be read (Cannot reach the Hub" in caplog.text
        assert "the new model card states none" in caplog.text


def test_a_card_of_separate_vocabularies_gives_both_sizes():
    """A converted Marian model with separate vocabularies was described as having one joint vocabulary."""
    config = tiny_config(share_encoder_decoder_embeddings=False, vocab_size=40, decoder_vocab_size=30)
    text = build_model_card(**card_kwargs(config=config)).text
    assert "| vocabulary sizes of the source (en) and target (es) embeddings | 40 and 30 |" in text
    assert "(joint en/es)" not in text
    assert "| vocabulary (joint en/es) |" in build_model_card(**card_kwargs()).text


def test_decoding_settings_fill_what_a_generation_config_leaves_unset_as_generate_does():
    """A converted OPUS-MT generation config may leave num_beams and length_penalty unset (None in
    transformers 5): a card stated "beam search with None beams"."""
    from transformers import GenerationConfig

    unset = decoding_settings(GenerationConfig(max_length=64))
    assert unset == {
        "num_beams": 1,
        "length_penalty": 1.0,
        "length_penalty_form": "power",
        "max_length_offset": None,
        "no_repeat_ngram_size": None,
        "max_new_tokens": None,
        "max_length": 64,
    }
    set_ = decoding_settings(GenerationConfig(num_beams=6, length_penalty=0.6, no_repeat_ngram_size=4))
    assert (set_["num_beams"], set_["length_penalty"], set_["no_repeat_ngram_size"]) == (6, 0.6, 4)
    # No length at all: transformers' 20 tokens, which cut a converted model's translations short
    # while its card stated no limit; this package's offset rule where it is set, and no other.
    # (transformers' default `max_length` counts the tokens after the decoder's start token)
    assert (set_["max_new_tokens"], set_["max_length_is_default"], set_["max_length"]) == (20, True, None)
    assert set_["max_length_offset"] is None
    offset = GenerationConfig(num_beams=4)
    offset.max_length_offset = 50
    assert (
        decoding_settings(offset)["max_length_offset"] == 50
        and decoding_settings(offset)["max_length"] is None
    )
    offset.max_new_tokens = 30  # a length set wins over the rule, as in generate()
    assert decoding_settings(offset)["max_length_offset"] is None
    new_tokens = decoding_settings(offset)
    assert new_tokens["max_new_tokens"] == 30 and new_tokens["max_length"] is None
    cards = {
        kind: " ".join(build_model_card(**card_kwargs(metrics=METRICS | settings)).text.split())
        for kind, settings in (
            ("default", decoding_settings(GenerationConfig(num_beams=4))),
            ("new tokens", decoding_settings(offset)),
            ("length", decoding_settings(GenerationConfig(num_beams=4, max_length=512))),
            # a metrics.json of before the default was stated in new tokens keeps its note when rendered
            ("old record", {"max_length": 20, "max_length_is_default": True, "max_length_offset": None}),
        )
    }
    assert (
        "at most 20 tokens per output, the decoder's start token included (transformers' default where"
        in cards["old record"]
    )
    assert (
        "at most 20 output tokens (transformers' default where the generation config sets no length"
        in cards["default"]
    )
    assert "at most 30 output tokens." in cards["new tokens"]
    assert "at most 512 tokens per output, the decoder's start token included." in cards["length"]
    # Seq2SeqTrainer fills this model's generation config with transformers' defaults, max_length 20
    # among them, which its generate() unsets again: the card kept stating 20 tokens.
    model_config = tiny_model().generation_config
    model_config.update(max_length=20, num_beams=1, defaults_only=True)
    filled = decoding_settings(model_config)
    assert filled["max_length_offset"] == 50 and filled["max_length"] is None
    assert model_config.max_length == 20  # the model's own config is left as it is
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)  # transformers' own
    if defaults is not None:
        assert {key: defaults()[key] for key in TRANSFORMERS_DECODING} == TRANSFORMERS_DECODING


@pytest.mark.parametrize("full", [True, False])
def test_template_uses_only_variables_it_is_given(full):
    """StrictUndefined: a misspelt variable in the template fails instead of silently rendering empty."""
    kwargs = (
        card_kwargs() if full else card_kwargs(metrics={k: METRICS[k] for k in ("bleu", "chrf")}, training={})
    )
    kwargs["metrics"] = {**kwargs["metrics"], "bleu_signature": "sig"}
    card_keys = ("model_name", "metrics", "dataset", "source_lang", "target_lang")
    card_data = _card_data(license="mit", **{k: kwargs[k] for k in card_keys})
    variables = _template_variables(**kwargs)
    template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(
        default_template_path().read_text(encoding="utf-8")
    )
    text = template.render(card_data=card_data.to_yaml(), **{**card_data.to_dict(), **variables})
    assert "| BLEU |" in text


def test_model_card_errors_and_writing(tmp_path):
    with pytest.raises(ValueError, match="bleu_signature"):
        build_model_card(**card_kwargs(metrics={"bleu": 1.0, "chrf": 2.0}))
    with pytest.raises(FileNotFoundError):
        build_model_card(**card_kwargs(base_template=tmp_path / "missing.md"))
    custom = tmp_path / "custom.md"
    custom.write_text("---\n{{ card_data }}\n---\n\n# {{ model_name }}: BLEU {{ bleu }}\n", encoding="utf-8")
    assert "# someone/vanilla-transformer-en-es: BLEU 23.4567" in str(
        build_model_card(**card_kwargs(base_template=custom))
    )
    path = write_model_card(tmp_path / "out", **card_kwargs())
    assert path == tmp_path / "out" / "README.md"
    assert "model-index" in ModelCard.load(path).data.to_dict()


def test_packaged_template_is_the_repository_template():
    """The template the package renders (a file in a wheel, a link in a checkout) is model_card.md."""
    repository = Path(__file__).resolve().parents[1] / "model_card.md"
    assert default_template_path().read_bytes() == repository.read_bytes()


# ---------------------------------------------------------------- plots


def test_plot_training_curves_writes_png(tmp_path, monkeypatch):
    """Three panels, each with the history's own series: training and validation loss, validation BLEU
    with its best value starred, the learning rate. (Read from the lines drawn: a PNG of the right
    size alone came from a plot that left out a series or a panel, or starred the worst BLEU.)"""
    from matplotlib.axes import Axes

    drawn = []
    original_plot = Axes.plot

    def recording_plot(self, x, y, *args, **kwargs):
        drawn.append((self, kwargs.get("label"), list(x), list(y)))
        return original_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    history = [
        {"step": step, "train_loss": 9.0 / (1 + step / 100), "lr": 1e-3 * min(1, step / 200)}
        for step in range(0, 1001, 50)
    ]
    validation = {250: 30.0, 500: 45.0, 1000: 20.0}  # BLEU: best in the middle, not at the end
    history += [
        {"step": step, "val_loss": 8.0 / (1 + step / 120), "val_bleu": bleu}
        for step, bleu in validation.items()
    ]
    path = plot_training_curves(history, tmp_path / "plots" / "curves.png")
    assert path == tmp_path / "plots" / "curves.png"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert int.from_bytes(data[20:24], "big") == round(3 * 2.6 * 120)  # the PNG's height: three panels

    def series(key):
        entries = [entry for entry in history if key in entry]
        return [entry["step"] for entry in entries], [entry[key] for entry in entries]

    panels = {}
    for ax, label, steps, values in drawn:
        panels.setdefault(ax.get_ylabel(), []).append((label, steps, values))
    assert list(panels) == ["loss", "BLEU", "learning rate"]
    assert panels["loss"] == [("train", *series("train_loss")), ("validation", *series("val_loss"))]
    assert panels["BLEU"] == [("validation BLEU", *series("val_bleu")), (None, [500.0], [45.0])]
    assert panels["learning rate"] == [(None, *series("lr"))]


def test_a_single_logged_point_is_drawn_in_every_panel(tmp_path, monkeypatch):
    """A short run logs once: its one learning-rate value was drawn as a line without a marker, which
    is nothing, leaving an empty panel."""
    from matplotlib.axes import Axes

    styles = {}
    original_plot = Axes.plot

    def recording_plot(self, x, y, *args, **kwargs):
        lines = original_plot(self, x, y, *args, **kwargs)
        styles[(self.get_ylabel() or "pending", kwargs.get("label"))] = [line.get_marker() for line in lines]
        return lines

    monkeypatch.setattr(Axes, "plot", recording_plot)
    plot_training_curves([{"step": 20, "train_loss": 5.0, "lr": 1e-3}], tmp_path / "curves.png")
    assert styles and all(markers == ["o"] for markers in styles.values()), styles


def test_plot_training_curves_rejects_empty_history(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        plot_training_curves([], tmp_path / "curves.png")
    with pytest.raises(ValueError, match="step"):
        plot_training_curves([{"train_loss": 1.0}], tmp_path / "curves.png")
    assert not (tmp_path / "curves.png").exists()


def test_model_card_follows_the_run_it_describes():
    """Schedule scale and cooldown, greedy decoding, the preset by shape whatever the dropout, and
    limitations that depend on the corpus and the length of training."""
    from vanilla_transformer import VanillaTransformerConfig

    def render(**overrides) -> str:
        return " ".join(str(build_model_card(**card_kwargs(**overrides))).split())

    scaled = render(training=TRAINING | {"lr_scale": 0.6, "lr_cooldown": 0.2})
    assert "`lrate = 0.6 · d_model^-0.5 · min(step^-0.5" in scaled
    assert "scaled down linearly to zero over the last 20% of the run" in scaled
    paper = render(training=TRAINING | {"lr_scale": 1.0, "lr_cooldown": 0.0})
    assert "`lrate = d_model^-0.5 · min(" in paper and "scaled down linearly" not in paper

    greedy = render(metrics=METRICS | {"num_beams": 1})
    assert "Decoding: greedy search, and at most source length + 50 output tokens." in greedy
    assert "beam search with 1 beams" not in greedy

    tiny = VanillaTransformerConfig.from_preset("tiny", vocab_size=4000, dropout=0.0)  # the recipe's
    assert "| size | `tiny` preset |" in render(config=tiny)

    shipped = render(dataset=DATASET | {"embedded": True})
    other = render(dataset=DATASET | {"embedded": False, "train_pairs": 4_500_000})
    assert "Bible-domain" in shipped and "Bible-domain" not in other and "Bible-domain" not in render()
    assert "**Small corpus.** The model learnt from 11,022 sentence pairs" in shipped
    assert "Small corpus" not in other
    assert "**Far less training than the paper's.** 12,345 updates" in shipped
    long_run = render(
        training=TRAINING | {"steps": 100_000}, config=VanillaTransformerConfig.from_preset("base")
    )
    assert "Far less training" not in long_run and "Smaller than the paper's base model" not in long_run
    assert "**Smaller than the paper's base model**: d_model = 32" in render(
        training=TRAINING | {"steps": 100_000}
    )


def test_model_card_states_the_architecture_optimiser_and_test_size_of_this_run():
    """The card once claimed the paper's post-LN, tied ReLU network and Adam settings whatever
    `--config_overrides` and `--adam_*` said, and the whole test split when `--test_samples` scored a part."""

    def render(**overrides) -> str:
        return " ".join(str(build_model_card(**card_kwargs(**overrides))).split())

    paper = render()
    assert "As in the paper: - **Post-LN residual blocks**" in paper
    assert "not the paper's" not in paper and "implemented exactly as published" not in paper
    assert (
        "output projections are plain matrices (the paper's W^Q, W^K, W^V and W^O, without biases)" in paper
    )
    # The attention biases (a converted Marian model, --config_overrides attention_bias=true) are marked.
    biased = render(config=tiny_config(attention_bias=True))
    assert "As in the paper, except where marked:" in biased and "have biases (not in the paper" in biased
    assert "without biases" not in biased
    assert "ReLU position-wise feed-forward" in paper and "- **Shared embeddings**" in paper
    assert "Adam with β1 = 0.9, β2 = 0.98, ε = 1e-09 (the paper's)" in paper
    changed = render(
        config=tiny_config(norm_first=True, activation_function="gelu", tie_word_embeddings=False),
        training=TRAINING | {"adam_beta2": 0.997},
    )
    assert "As in the paper, except where marked: - **Pre-LN residual blocks** (not the paper's)" in changed
    assert "Post-LN residual" not in changed and "- **Shared embeddings**" not in changed
    assert "separate output projection** (the paper shares both)" in changed
    assert "a gelu (the paper's is ReLU) position-wise" in changed
    assert "β2 = 0.997" in changed and "(the paper's) (torch's" not in changed
    assert "On the test split (605 sentence pairs)" in paper
    part = render(metrics=METRICS | {"scored_pairs": 8})
    assert "On the test split (its first 8 of 605 sentence pairs)" in part
    assert "(605 sentence pairs)" in render(metrics=METRICS | {"scored_pairs": 605})
    # The embeddings, positions and logits of a converted Marian model or of --config_overrides: the
    # card once said "As in the paper" and "scaled by sqrt(d_model)" for these too.
    marian_like = render(
        config=tiny_config(
            scale_embedding=False,
            share_encoder_decoder_embeddings=False,
            decoder_vocab_size=50,
            position_encoding_layout="concatenated",
            add_final_logits_bias=True,
        )
    )
    assert "As in the paper, except where marked" in marian_like
    assert "in the `concatenated` layout (not the paper's interleaved sines and cosines)" in marian_like
    assert "- **Separate source and target embedding matrices** (the paper shares one matrix" in marian_like
    assert "not scaled by sqrt(d_model) (the paper scales them)" in marian_like
    assert "- **A bias on the output logits** (not in the paper" in marian_like
    assert (
        "| embeddings | separate source and target matrices; output projection shares the target's"
        in marian_like
    )
    assert "scaled by sqrt(d_model)" not in marian_like.replace("not scaled by sqrt(d_model)", "")
    # Dropout inside the sub-layers, which the paper does not apply: the card once said "As in the paper".
    inner = render(config=tiny_config(attention_dropout=0.1, activation_dropout=0.2))
    assert "As in the paper, except where marked" in inner
    assert "- **Dropout inside the sub-layers** (not in the paper" in inner
    assert "0.1 on the attention probabilities, 0.2 on the feed-forward hidden layer." in inner
    assert "(attention 0.1) (feed-forward hidden layer 0.2) |" in inner


def test_usage_examples_translate_the_given_sentences_as_python_literals():
    examples = ['Click "OK" to save.', "Datei\\nöffnen", "Quit"]
    text = str(build_model_card(**card_kwargs(examples=examples)))
    assert 'inputs = tokenizer(["Click \\"OK\\" to save."], return_tensors="pt")' in text
    assert 'translator(["Datei\\\\nöffnen", "Quit"], batch_size=16' in text
    code = text.split("### 2. `pipeline")[1].split("```python")[1].split("```")[0]
    calls = [line for line in code.splitlines() if line.startswith("translator(")]
    import ast

    assert ast.literal_eval(ast.parse(calls[1]).body[0].value.args[0]) == examples[1:]
    default = str(build_model_card(**card_kwargs()))
    assert '["In the beginning, God created the heavens and the earth."]' in default


def test_loop_count_power_against_closed_forms_and_a_simulation():
    """`tools.loop_count_power`: where B never loops the test shows it once the total reaches 5
    (2**-5 <= 0.05 < 2**-4), so the power is P(Poisson(mean_a) >= 5); equal rates are shown no more often
    than alpha (the conditional test is exact or conservative); and a seeded simulation of both counts
    agrees with the exact sum."""
    import numpy as np

    from tools.loop_count_power import binomial_lower_tail, power

    assert binomial_lower_tail(0, 5) == pytest.approx(1 / 32)
    assert binomial_lower_tail(3, 6) == pytest.approx(42 / 64)
    mean_a = 4.0
    at_least_five = 1 - sum(math.exp(-mean_a) * mean_a**k / math.factorial(k) for k in range(5))
    assert power(mean_a, 0.0) == pytest.approx(at_least_five, abs=1e-9)
    for mean in (0.5, 3.0, 20.0):
        assert power(mean, mean) <= 0.05

    rng = np.random.default_rng(0)
    draws = 20_000
    counts_a, counts_b = rng.poisson(9.0, draws), rng.poisson(4.5, draws)
    pairs = zip(counts_a, counts_b, strict=True)
    shown = np.mean([binomial_lower_tail(b, a + b) <= 0.05 if a + b else False for a, b in pairs])
    # Binomial standard error of a share near 0.3 over 20,000 draws is about 0.003.
    assert power(9.0, 4.5) == pytest.approx(shown, abs=0.015)


def test_model_card_names_repetition_loops_as_a_limitation_of_short_runs():
    """A short run's card warns about rare loops and names the remedy; it points at the measured share
    only where the test split's share was measured; a run of the paper's length gets no such warning."""

    def limitations(**overrides) -> str:
        text = " ".join(str(build_model_card(**card_kwargs(**overrides))).split())
        return text[text.index("## Limitations") :]

    short = limitations(metrics=METRICS | {"repetition": 0.001, "reference_repetition": 0.0})
    assert "Rare repetition loops" in short and "no_repeat_ngram_size=4" in short
    assert "share of such outputs on the test split is under Results" in short
    assert "under Results" not in limitations(metrics={k: v for k, v in METRICS.items() if k != "repetition"})
    assert "Rare repetition loops" not in limitations(training=TRAINING | {"steps": 100_000})


def test_a_card_says_whose_steps_ended_in_the_warm_up():
    """An average of checkpoints written during the warm-up of a longer run: its card said the run had
    stopped there."""
    early = TRAINING | {"steps": 250, "warmup_steps": 600}
    run = " ".join(str(build_model_card(**card_kwargs(training=early))).split())
    assert "600 warm-up steps (the run stopped after 250, still warming up)" in run
    averaged = early | {"averaged_steps": [200, 250]}
    text = " ".join(str(build_model_card(**card_kwargs(training=averaged))).split())
    assert "600 warm-up steps (the averaged checkpoints end at update 250, still warming up)" in text
    assert "the run stopped" not in text
    one = early | {"averaged_steps": [250]}  # average_checkpoints.py given one checkpoint
    text = " ".join(str(build_model_card(**card_kwargs(training=one))).split())
    assert "600 warm-up steps (the checkpoint is from update 250, still warming up)" in text


def test_card_limitations_name_the_scored_split_and_the_blocking_already_applied():
    """They once said "on the test split" of validation scores, and advised n-gram blocking to a model
    whose scores (and generation config) already used it."""
    metrics = METRICS | {"split": "validation", "repetition": 0.01, "no_repeat_ngram_size": 3}
    text = " ".join(build_model_card(**card_kwargs(metrics=metrics)).text.split())
    limitation = text[text.index("Rare repetition") : text.index("BLEU is not comparable")]
    assert "on the validation split is under Results" in limitation, limitation
    assert "no_repeat_ngram_size=4" not in limitation and "3-token n-gram blocking" in limitation
    plain = " ".join(build_model_card(**card_kwargs(metrics=METRICS | {"repetition": 0.0})).text.split())
    assert "on the test split is under Results. `generate(..., no_repeat_ngram_size=4)`" in plain


def test_model_card_does_not_say_a_model_without_attention_biases_computes_marians_function():
    """MarianMTModel's attention always has biases: only a model with them computes its function (the
    benchmark builds both so); the paper's network, the default, is another function."""

    def render(**overrides):
        return " ".join(str(build_model_card(**card_kwargs(**overrides))).split())

    paper, biased = render(), render(config=tiny_config(attention_bias=True))
    claim = "computes the same function faster than transformers' `MarianMTModel` of the same shape"
    assert claim in biased and claim not in paper
    assert "faster than transformers' `MarianMTModel` of the same shape" in paper
    assert "its attention biases added" in paper and "its attention biases added" not in biased
