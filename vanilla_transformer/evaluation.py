"""Scoring a trained model folder on a split or a file: BLEU and chrF with sacreBLEU through `evaluate`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from .cli import first_line
from .configuration_vanilla_transformer import VanillaTransformerConfig
from .export_ctranslate2 import SETTINGS_FILE
from .metrics import check_bleu_tokenize, repetition_rate, score_translations
from .model_card import language_name
from .parallel_data import DEFAULT_LANGUAGES, load_parallel_data
from .publishing import check_files_readable, check_folder_json, check_has_tokenizer
from .translation import translate

logger = logging.getLogger(__name__)


def looks_local(path: str | Path) -> bool:
    """Whether `path` names a local folder rather than a Hub id. "outputs/tiny-en-e" has a Hub id's
    form, but with a folder "outputs" here it is a mistyped path: asking the Hub would end, offline, in
    a timeout and a message about the network."""
    text = str(path)
    return (
        text.startswith(("/", ".", "~"))
        or text.count("/") > 1
        or (text.count("/") == 1 and Path(text).parent.is_dir())
    )


def load_model_folder(
    path: str | Path, device: str | None = None, trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """Model and tokenizer of a folder written by the training script (or any seq2seq folder, or Hub
    repo). A folder whose config names model code of its own (`auto_map`, a model type transformers does
    not know) is loaded only with `trust_remote_code`, as transformers does: that code runs on loading.
    Every local folder's code used to run unasked. This package's folders need none: its model is
    registered with transformers."""
    folder = Path(path)
    if not folder.exists() and looks_local(path):
        raise FileNotFoundError(f"No model folder at {folder}.")
    if (folder / SETTINGS_FILE).is_file() and (folder / "model.bin").is_file():
        raise ValueError(
            f"{folder} is a CTranslate2 export: translate with it through `scripts/translate.py --engine "
            "ctranslate2` or `CTranslate2Translator`, or name the model folder it was exported from."
        )
    if folder.exists() and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no config.json).")
    if folder.exists():
        check_files_readable(folder)
        check_has_tokenizer(folder)
        check_folder_json(folder)  # named here: transformers reads a broken generation config as none
    try:
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise ValueError(f"Unknown device {device!r}: {error}") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Device {device!r}: this machine's torch has no CUDA device.")
    if target.type == "meta":
        raise ValueError(f"Device {device!r} holds shapes, not values: it cannot translate.")
    try:
        model, loading = AutoModelForSeq2SeqLM.from_pretrained(
            path, trust_remote_code=trust_remote_code, output_loading_info=True
        )
    except Exception as error:  # e.g. a truncated model.safetensors: say which folder, keep the cause
        if not trust_remote_code and "trust_remote_code" in str(error):
            raise ValueError(
                f"{path} holds model code of its own, which loading it runs: give --trust_remote_code "
                "(`trust_remote_code=True`) only if you trust its source."
            ) from None
        if not folder.exists():  # a Hub id, or a mistyped folder name without a slash ("tiny-en-e")
            cause = first_line(error)
            raise OSError(
                f"No model folder at {path}, and no Hub model {str(path)!r} could be loaded: {cause}"
            ) from error
        if isinstance(error, (OSError, ValueError)):
            raise
        raise OSError(f"The model in {folder} could not be read: {error}") from error
    # transformers initialises a weight missing from the file at random and only logs it: such a model
    # translates (badly) and scores, without a word. Tied copies, which files leave out, do not count.
    missing = sorted(set(loading["missing_keys"]) - set(getattr(model, "all_tied_weights_keys", ())))
    if missing:
        raise ValueError(
            f"The weights in {folder} lack {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): they would be random."
        )
    if folder.exists():
        warn_without_generation_config(folder, model)
    # Explicit: where left unset, a tokenizer with code of its own is asked about at the terminal, on
    # standard input (translate.py's input)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.to(target).eval(), tokenizer


def warn_without_generation_config(folder: Path, model: Any) -> None:
    """Warn where `folder` (that `model` was loaded from) has no generation_config.json: transformers then
    derives the generation config from config.json, which holds no decoding settings: greedy search,
    where the model was saved (and its card scored) with its own."""
    if (folder / "generation_config.json").is_file():
        return
    beams = model.generation_config.num_beams or 1
    decoding = "greedy search" if beams == 1 else f"beam search with {beams} beams"
    own = model.config.model_type == VanillaTransformerConfig.model_type
    own = " (this package's training writes the paper's beam 4 and length penalty 0.6 there)" if own else ""
    logger.warning(
        f"{folder} has no generation_config.json: it decodes with what transformers derives from its "
        f"config.json ({decoding}), not with the settings it was saved with{own}, so its outputs and "
        "scores may differ from its card's. Copy generation_config.json from the folder the model came "
        "from."
    )


def model_card_languages(path: str | Path) -> list[str] | None:
    """The [source, target] language codes a local model folder's card (written by this package, whose
    `language` metadata is that pair in order) names; None for any other folder or card."""
    readme = Path(path) / "README.md"
    if not readme.is_file():
        return None
    try:
        data = ModelCard.load(readme).data
    except Exception:  # a malformed card: nothing to compare with
        return None
    # A code with a region or a script ("pt-BR") is in `language_bcp47`, its language alone in `language`.
    metadata = data.to_dict()
    languages = metadata.get("language_bcp47") or metadata.get("language")
    if (
        "vanilla-transformer" not in (data.tags or [])
        or not isinstance(languages, list)
        or len(languages) != 2
    ):
        return None
    return [str(code) for code in languages]


def same_language(first: str, second: str) -> bool:
    """Whether two language codes are one ("pt_BR" and "pt-br" are)."""
    return first.replace("_", "-").lower() == second.replace("_", "-").lower()


def evaluate_model(
    model_path: str | Path,
    *,
    split: str = "test",
    max_samples: int | None = None,
    batch_size: int = 32,
    device: str | None = None,
    data_options: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    bleu_tokenize: str | None = None,
    **generate_kwargs: Any,
) -> dict[str, Any]:
    """Translate a split and score it. `data_options` go to `load_parallel_data` (default: embedded corpus);
    `trust_remote_code` to `load_model_folder`; `bleu_tokenize` names sacreBLEU's BLEU tokeniser ("char",
    "intl", "13a", ...; default: sacreBLEU's for the target language, see `score_translations`), or
    `metrics.PAPER_BLEU` for the paper's tokenised BLEU.

    Returns the scores, the sacreBLEU signatures, the share of outputs (and of references) with a word
    4-gram repeated three or more times, the number of pairs scored and the split's size, and the
    sources, references and hypotheses.
    """
    if bleu_tokenize is not None:
        check_bleu_tokenize(bleu_tokenize)
    data, report = load_parallel_data(**(data_options or {}), for_training=False)
    if split not in data:
        raise ValueError(f"No {split!r} split in the data (splits: {sorted(data)}).")
    rows = data[split]
    split_pairs = len(rows)
    if max_samples is not None:
        rows = rows.select(range(min(max_samples, len(rows))))
    options = data_options or {}
    languages = [options.get(f"{side}_lang") or DEFAULT_LANGUAGES[side] for side in ("source", "target")]
    card_languages = model_card_languages(model_path)
    if card_languages is not None and not all(map(same_language, card_languages, languages)):
        # The embedded corpus (no --test_file) is English-Spanish whatever the model translates.
        named = [language_name(code) for code in (*card_languages, *languages)]
        logger.warning(
            f"{model_path}'s model card says it translates {named[0]} into {named[1]} "
            f"({'-'.join(card_languages)}), but the pairs scored are {named[2]} to {named[3]} "
            f"({'-'.join(languages)}): name the card's languages (--source_lang, --target_lang) and a "
            "file of them (--test_file), or the scores describe another task."
        )
    model, tokenizer = load_model_folder(model_path, device, trust_remote_code)
    hypotheses = translate(model, tokenizer, rows["source"], batch_size=batch_size, **generate_kwargs)
    # The references' language picks sacreBLEU's BLEU tokeniser (zh, ja, ko: not 13a), unless one is named.
    target_lang = languages[1]  # the embedded corpus's where none is named (the paper's BLEU tokenises by it)
    chosen = {"tokenize": bleu_tokenize} if bleu_tokenize is not None else {}
    scores = score_translations(hypotheses, rows["target"], target_lang=target_lang, **chosen)
    return {
        **{k: scores[k] for k in ("bleu", "chrf", "bleu_signature", "chrf_signature")},
        "repetition": repetition_rate(hypotheses),
        "reference_repetition": repetition_rate(rows["target"]),
        "split": split,
        "sentences": len(rows),
        "split_pairs": split_pairs,  # the split's size, of which `sentences` were scored
        "skipped": report.lines(),
        "sources": rows["source"],
        "references": rows["target"],
        "hypotheses": hypotheses,
    }


def format_scores(result: dict[str, Any]) -> list[str]:
    """The lines the scripts print for an `evaluate_model` result: what was skipped, the pairs scored,
    BLEU and chrF with their signatures, and the share of outputs repeating a 4-gram."""
    return [
        *result["skipped"],
        f"{result['split']}: {result['sentences']} sentences",
        f"BLEU  {result['bleu']:.2f}   {result['bleu_signature']}",
        f"chrF  {result['chrf']:.2f}   {result['chrf_signature']}",
        f"outputs with a word 4-gram repeated 3+ times: {result['repetition']:.1%} "
        f"(references: {result['reference_repetition']:.1%})",
    ]


__all__ = ["evaluate_model", "format_scores", "load_model_folder", "looks_local"]
