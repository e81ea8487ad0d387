"""Corpus BLEU and chrF (sacreBLEU) as a local `evaluate` metric, loadable offline.

Load it with `evaluate.load(<path of this folder>)`, or through `vanilla_transformer.metrics`. The file is
copied by `evaluate` into its modules cache and imported from there, so it imports nothing from
`vanilla_transformer` and keeps one `import` per line (evaluate scans its imports line by line).
"""

from __future__ import annotations

import unicodedata
import warnings
from typing import Any

import datasets
import evaluate
from sacrebleu.metrics import BLEU, CHRF

_DESCRIPTION = """\
Corpus-level BLEU (Papineni et al., 2002) and chrF (Popović, 2015) computed with sacreBLEU, with one
reference per prediction. Both scores are on a 0-100 scale. The sacreBLEU signatures describe exactly how
they were computed (tokenisation, casing, smoothing, sacreBLEU version) and should be reported with them.
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions (list of str): detokenised system outputs, one per segment.
    references (list of str): detokenised references, one per prediction. Both are NFC-normalised first,
        so canonically equivalent spellings (composed or decomposed accents) match; NFC text is unchanged.
    tokenize (str): BLEU tokeniser, one of sacreBLEU's ("13a", "intl", "zh", "char", "none", ...). chrF
        works on characters and ignores it. Default: the WMT standard for `target_lang`, as sacreBLEU's
        command line chooses it: "zh" for Chinese, "ja-mecab" for Japanese, "ko-mecab" for Korean
        ("char" where sacrebleu[ja] or sacrebleu[ko] is not installed, with a warning), else "13a".
    target_lang (str): language code of the references ("zh", "zh-CN", "zho_Hans", "es", ...), which picks the
        default `tokenize`: 13a splits on spaces and punctuation only, so text without spaces between
        words would be scored as whole sentences.
    lowercase (bool): lowercase predictions and references before scoring (default False).
    smooth_method (str): BLEU's smoothing, sacreBLEU's "exp" (default), "floor", "add-k" or "none"
        (multi-bleu.perl's: 0 where an n-gram order has no match).
    force (bool): score text that looks tokenised without sacreBLEU's warning (for tokenised BLEU).
Returns:
    bleu (float): corpus BLEU, 0-100.
    chrf (float): corpus chrF (character 6-grams, beta 2), 0-100.
    bleu_signature (str), chrf_signature (str): sacreBLEU signatures.
    bleu_precisions (list of float): 1- to 4-gram precisions, 0-100.
    brevity_penalty (float): BLEU's brevity penalty.
    sys_len (int), ref_len (int): prediction and reference lengths in BLEU tokens.
Examples:
    >>> metric = evaluate.load("vanilla_transformer/metric_modules/bleu_chrf")
    >>> result = metric.compute(predictions=["the cat sat on the mat"], references=["the cat sat on the mat"])
    >>> result["bleu"], result["chrf"]
    (100.00000000000004, 100.0)
"""

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    publisher = "Association for Computational Linguistics",
    url = "https://aclanthology.org/W18-6319",
    pages = "186--191",
}
"""


class BleuChrf(evaluate.Metric):
    """Corpus BLEU and chrF from sacreBLEU, one reference per prediction."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Value("string"),
                }
            ),
            codebase_urls=["https://github.com/mjpost/sacrebleu"],
            reference_urls=["https://aclanthology.org/W18-6319", "https://aclanthology.org/W15-3049"],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[str],
        tokenize: str | None = None,
        lowercase: bool = False,
        target_lang: str | None = None,
        smooth_method: str = "exp",
        force: bool = False,
    ) -> dict[str, Any]:
        # Canonically equivalent spellings are one text (a decomposed "ệ", Hangul written as jamo), which
        # sacreBLEU, comparing code points, scored as different: NFC on both sides, a no-op on NFC text. (A
        # missing line is left to sacreBLEU, which names it.)
        predictions, references = ([nfc(text) for text in texts] for texts in (predictions, references))
        if len(predictions) != len(references):
            raise ValueError(
                f"Got {len(predictions)} predictions but {len(references)} references; "
                "pass exactly one reference per prediction."
            )
        if not predictions:
            raise ValueError("No predictions to score: `predictions` and `references` are empty.")
        chosen = tokenize is not None
        if tokenize is None:
            tokenize = default_tokenize(target_lang)
        if tokenize not in BLEU.TOKENIZERS:
            raise ValueError(f"Unknown BLEU `tokenize` {tokenize!r}; choose one of {list(BLEU.TOKENIZERS)}.")

        try:
            bleu = BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method=smooth_method, force=force)
        except RuntimeError as error:  # MeCab's tokenisers need sacrebleu[ja] / sacrebleu[ko]
            if chosen or not tokenize.endswith("-mecab"):
                raise
            warnings.warn(
                f"BLEU for {target_lang!r} is computed on characters (tok:char), not with {tokenize} as "
                f"sacreBLEU's default for it: {' '.join(str(error).split())}",
                stacklevel=2,
            )
            bleu = BLEU(tokenize="char", lowercase=lowercase, smooth_method=smooth_method, force=force)
        chrf = CHRF(lowercase=lowercase)
        bleu_score = bleu.corpus_score(predictions, [references])
        chrf_score = chrf.corpus_score(predictions, [references])
        return {
            "bleu": float(bleu_score.score),
            "chrf": float(chrf_score.score),
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()),
            "bleu_precisions": [float(p) for p in bleu_score.precisions],
            "brevity_penalty": float(bleu_score.bp),
            "sys_len": int(bleu_score.sys_len),
            "ref_len": int(bleu_score.ref_len),
        }


def nfc(text: Any) -> Any:
    """`text` NFC-normalised; anything else as it is."""
    return unicodedata.normalize("NFC", text) if isinstance(text, str) else text


# sacreBLEU's own choice for a target language (its command line's `-l`), 13a for the others; also under
# the languages' ISO 639-2/3 codes (FLORES-200 and NLLB name them so: "zho_Hans", "jpn_Jpan", "kor_Hang"),
# Mandarin's and Cantonese's included, which are written in Chinese characters without spaces too.
LANGUAGE_TOKENIZERS = {
    **dict.fromkeys(("zh", "zho", "chi", "cmn", "yue"), "zh"),
    **dict.fromkeys(("ja", "jpn"), "ja-mecab"),
    **dict.fromkeys(("ko", "kor"), "ko-mecab"),
}


def default_tokenize(target_lang: str | None) -> str:
    """The BLEU tokeniser for references in `target_lang` ("zh", "zh-TW", "zh_Hans", "zho_Hans", "ja")."""
    primary = (target_lang or "").replace("_", "-").split("-")[0].lower()
    return LANGUAGE_TOKENIZERS.get(primary, BLEU.TOKENIZER_DEFAULT)
