"""Translation quality metrics: corpus BLEU and chrF (sacreBLEU) through a local `evaluate` module.

`evaluate.load("sacrebleu")` needs the Hugging Face Hub; the module shipped in
`vanilla_transformer/metric_modules/bleu_chrf/` works offline and from an installed (non-editable) package.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import evaluate

METRIC_NAME = "bleu_chrf"


def metric_module_path() -> str:
    """Absolute path of the folder holding the `bleu_chrf` evaluate metric module."""
    path = Path(__file__).resolve().parent / "metric_modules" / METRIC_NAME
    if not (path / f"{METRIC_NAME}.py").is_file():
        raise FileNotFoundError(
            f"The metric module {path / f'{METRIC_NAME}.py'} is missing; the package was installed without "
            "its package data (`metric_modules/*/*.py`)."
        )
    return str(path)


def load_translation_metric() -> evaluate.EvaluationModule:
    """A fresh BLEU + chrF `evaluate` metric (kept in memory: no cache files, safe to use in parallel)."""
    import evaluate  # here, not at the top: it adds about a second to every script's start

    return evaluate.load(metric_module_path(), keep_in_memory=True)


def score_translations(predictions: Sequence[str], references: Sequence[str], **kwargs: Any) -> dict:
    """Corpus BLEU and chrF of `predictions` against one reference each.

    Keyword arguments go to the metric: `target_lang` (the references' language code, which picks
    sacreBLEU's BLEU tokeniser for it: "zh" for Chinese, MeCab's for Japanese and Korean, else "13a"),
    `tokenize` (a BLEU tokeniser of your choice instead; `PAPER_BLEU` for the paper's tokenised BLEU with
    compound splitting, chrF unchanged) and `lowercase` (default False). Both sides are
    NFC-normalised first (canonically equivalent spellings match; sacreBLEU's scores on NFC text).
    Returns the metric's dict: "bleu", "chrf", "bleu_signature", "chrf_signature",
    "bleu_precisions", "brevity_penalty", "sys_len", "ref_len".
    """
    if isinstance(predictions, str) or isinstance(references, str):
        raise ValueError("`predictions` and `references` must be sequences of strings, not a single string.")
    metric = load_translation_metric()
    # Length and emptiness are checked by evaluate and by the metric module itself.
    if kwargs.get("tokenize") != PAPER_BLEU:
        return metric.compute(predictions=list(predictions), references=list(references), **kwargs)
    # The paper's BLEU on the paper's tokens; chrF, which reads characters, on the text as it is.
    plain = metric.compute(
        predictions=list(predictions), references=list(references), **{**kwargs, "tokenize": None}
    )
    language = moses_language(kwargs.get("target_lang"))
    tokenised = metric.compute(
        predictions=paper_tokens(predictions, language),
        references=paper_tokens(references, language),
        # tokens scored as multi-bleu.perl scores them (no smoothing), which sacreBLEU would warn about
        **{**kwargs, "tokenize": "none", "smooth_method": "none", "force": True},
    )
    from sacremoses import __version__ as sacremoses_version

    method = f"tok:{PAPER_BLEU}-{language}-sacremoses-{sacremoses_version}"
    signature = tokenised["bleu_signature"].replace("tok:none", method)
    bleu_fields = ("bleu", "bleu_precisions", "brevity_penalty", "sys_len", "ref_len")
    return {**plain, **{name: tokenised[name] for name in bleu_fields}, "bleu_signature": signature}


# The BLEU of the paper's tables (tensor2tensor's get_ende_bleu.sh): both sides with Unicode punctuation
# made ASCII (replace-unicode-punctuation.perl), tokenised by the Moses tokenizer for the target language
# (tokenizer.perl -l, without -a), every "a-b" of the tokens written "a ##AT##-##AT## b" (one pass, as
# Perl's s{(\S)-(\S)}{...}g: "a-b-c" keeps its second hyphen), and scored on those tokens as multi-bleu.perl
# scores (no tokeniser of sacreBLEU's, no smoothing). Not sacreBLEU's standard score, nor comparable with
# it; nor quite fairseq's compound_split_bleu.sh, which splits tokens its data preparation made with
# tokenizer.perl -a ("Nord @-@ Süd").
PAPER_BLEU = "moses-compound-split"
COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)")
# ISO 639-2/3 codes (FLORES-200's "deu_Latn", say) of the languages the Moses tokenizer has rules for, as
# its two-letter codes; any other language gets its English rules.
MOSES_LANGUAGES = {
    **dict.fromkeys(("deu", "ger"), "de"),
    **dict.fromkeys(("fra", "fre"), "fr"),
    **dict.fromkeys(("nld", "dut"), "nl"),
    **dict.fromkeys(("ces", "cze"), "cs"),
    **dict.fromkeys(("ron", "rum"), "ro"),
    **dict.fromkeys(("slk", "slo"), "sk"),
    **dict.fromkeys(("ell", "gre"), "el"),
    **dict.fromkeys(("isl", "ice"), "is"),
    **dict.fromkeys(("zho", "chi", "cmn"), "zh"),
    **dict.fromkeys(("ori", "ory"), "or"),
    "eng": "en",
    "spa": "es",
    "ita": "it",
    "por": "pt",
    "rus": "ru",
    "pol": "pl",
    "fin": "fi",
    "est": "et",
    "hun": "hu",
    "lit": "lt",
    "lav": "lv",
    "slv": "sl",
    "swe": "sv",
    "cat": "ca",
    "gle": "ga",
    "hin": "hi",
    "ben": "bn",
    "tam": "ta",
    "tel": "te",
    "mar": "mr",
    "guj": "gu",
    "kan": "kn",
    "mal": "ml",
    "pan": "pa",
    "asm": "as",
}


def primary_language(code: str) -> str:
    """A language code's primary tag, lower-cased: "pt" for "pt_BR", "deu" for "deu_Latn"."""
    return code.replace("_", "-").split("-")[0].lower()


def moses_language(code: str | None) -> str:
    """The Moses tokenizer's code for the language `code` names ("de", "DE", "de_DE", "deu_Latn": "de");
    English's where none is given."""
    primary = primary_language(code or "en")
    return MOSES_LANGUAGES.get(primary, primary)


def paper_tokens(texts: Sequence[str], language: str) -> list[str]:
    """`texts` as the paper's BLEU reads them (`PAPER_BLEU`), in the Moses tokenizer's `language`
    (`moses_language`): punctuation made ASCII, Moses-tokenised, hyphenated compounds split."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    punctuation, tokenizer = MosesPunctNormalizer(lang=language), MosesTokenizer(lang=language)
    return [
        COMPOUND_HYPHEN.sub(
            r"\1 ##AT##-##AT## \2",
            tokenizer.tokenize(
                punctuation.replace_unicode_punct(unicodedata.normalize("NFC", text)),
                escape=False,
                return_str=True,
            ),
        )
        for text in texts
    ]


def check_bleu_tokenize(name: str) -> None:
    """Raise ValueError where `name` is no BLEU tokeniser of sacreBLEU's, or one that cannot run here:
    MeCab's for Japanese and Korean need sacrebleu[ja] / sacrebleu[ko], the SentencePiece ones
    (flores101, flores200) the sentencepiece package and a download. Said before a model translates a
    whole test set, not after."""
    from sacrebleu.metrics.bleu import BLEU

    if name == PAPER_BLEU:
        try:
            import sacremoses  # noqa: F401
        except ImportError:
            raise ValueError(
                f"the BLEU tokeniser {name!r} needs the sacremoses package: pip install sacremoses "
                "(or the package's paper_bleu extra)"
            ) from None
        return
    if name not in BLEU.TOKENIZERS:
        raise ValueError(
            f"unknown BLEU tokeniser {name!r}; sacreBLEU's are {', '.join(BLEU.TOKENIZERS)}, and the "
            f"paper's is {PAPER_BLEU}"
        )
    try:
        BLEU(tokenize=name)
    except Exception as error:  # ImportError, RuntimeError (MeCab), OSError (the download)
        raise ValueError(
            f"the BLEU tokeniser {name!r} cannot run here: {' '.join(str(error).split())}"
        ) from error


# Characters of scripts written without spaces between words (Han, kana, Thai, Lao, Myanmar, Khmer): each
# is a word of its own to the repetition check, as sacreBLEU's Chinese tokeniser splits Han characters.
UNSPACED_CHARACTER = (
    "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"  # kana, Han
    "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff"  # Thai and Lao, Myanmar, Khmer
)
WORDS = re.compile(f"[{UNSPACED_CHARACTER}]|[^\\s{UNSPACED_CHARACTER}]+")


def repeats_ngram(text: str, n: int = 4, times: int = 3) -> bool:
    """Whether some word n-gram occurs at least `times` times in `text` (a decoding loop's signature:
    with n = 4 and 3 times, "más más más más más más", or a 3-word phrase said four times, "de la casa
    de la casa de la casa de la casa"; three times is not enough there, each 4-gram occurs twice).
    Words are what whitespace separates (a run of punctuation without spaces, ",,,,,,", is one word),
    and each character of a script written without spaces (`UNSPACED_CHARACTER`: Chinese, Japanese,
    Thai, ...), whose sentence would otherwise be one word and never repeat."""
    words = WORDS.findall(text)
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return any(count >= times for count in counts.values())


def repetition_rate(texts: Sequence[str], n: int = 4, times: int = 3) -> float:
    """Share of `texts` in which some word n-gram occurs at least `times` times (0 for no texts)."""
    if isinstance(texts, str):
        raise ValueError("`texts` must be a sequence of strings, not a single string.")
    return sum(repeats_ngram(text, n, times) for text in texts) / len(texts) if len(texts) else 0.0


__all__ = [
    "PAPER_BLEU",
    "check_bleu_tokenize",
    "load_translation_metric",
    "metric_module_path",
    "moses_language",
    "paper_tokens",
    "primary_language",
    "repeats_ngram",
    "repetition_rate",
    "score_translations",
]
