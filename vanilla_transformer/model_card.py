"""Hugging Face model cards (README.md with YAML metadata and a model-index) for trained models.

The card is rendered from the Jinja2 template `model_card.md` at the repository root, shipped inside the
package as `model_card_template.md`, with `huggingface_hub.ModelCard.from_template`.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData, constants
from huggingface_hub.errors import RemoteEntryNotFoundError
from transformers import GenerationConfig

from .cli import first_line
from .configuration_vanilla_transformer import PRESETS, VanillaTransformerConfig
from .metrics import primary_language

TEMPLATE_NAME = "model_card_template.md"
logger = logging.getLogger(__name__)

TAGS = ["translation", "transformer", "vanilla-transformer", "seq2seq"]
REQUIRED_METRICS = ("bleu", "chrf", "bleu_signature")
# Decoding defaults of the paper (Section 6.1) and of the model's generation config.
DEFAULT_DECODING = {
    "num_beams": 4,
    "length_penalty": 0.6,
    "length_penalty_form": "power",
    "max_length_offset": 50,
}
# What `generate` uses where a generation config leaves a setting unset (None in transformers 5); the
# length where no length rule is set either (this package's `max_length_offset` one included).
TRANSFORMERS_DECODING = {"num_beams": 1, "length_penalty": 1.0, "max_length": 20}
LANGUAGE_NAMES = {
    "ar": "Arabic",
    "cs": "Czech",
    "de": "German",
    "el": "Greek",
    "en": "English",
    "es": "Spanish",
    "fi": "Finnish",
    "fr": "French",
    "he": "Hebrew",
    "hi": "Hindi",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "nl": "Dutch",
    "pl": "Polish",
    "pt": "Portuguese",
    "ro": "Romanian",
    "ru": "Russian",
    "sv": "Swedish",
    "th": "Thai",
    "tr": "Turkish",
    "uk": "Ukrainian",
    "vi": "Vietnamese",
    "zh": "Chinese",
}


def language_name(code: str) -> str:
    """The English name of the language `code` names, by its primary tag, with the code where it says
    more ("Chinese (zh_CN)", "Portuguese (pt-BR)"); the code itself for a language not in LANGUAGE_NAMES."""
    name = LANGUAGE_NAMES.get(primary_language(code))
    if name is None:
        return code
    return name if code.lower() in LANGUAGE_NAMES else f"{name} ({code})"


ARCHITECTURE_FIELDS = (
    "vocab_size",
    "decoder_vocab_size",
    "d_model",
    "num_heads",
    "head_dim",
    "d_ff",
    "num_encoder_layers",
    "num_decoder_layers",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "activation_function",
    "norm_first",
    "position_encoding_layout",
    "tie_word_embeddings",
)
# Source sentences of the card's usage examples when the caller gives none (the embedded corpus's language).
DEFAULT_EXAMPLES = ("In the beginning, God created the heavens and the earth.", "Jesus wept.", "God is love.")
# The shape that names a preset; dropout is a training setting (the tiny recipe trains without).
PRESET_FIELDS = ("d_model", "num_heads", "d_ff", "num_encoder_layers", "num_decoder_layers")


def default_template_path() -> Path:
    """The packaged template (a link to the repository's `model_card.md` in a source checkout)."""
    packaged = Path(__file__).resolve().parent / TEMPLATE_NAME
    if packaged.is_file():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "model_card.md"
    if checkout.is_file():
        return checkout
    raise FileNotFoundError(
        f"The model-card template {packaged} is missing; the package was installed without its package data."
    )


def _format_duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


def _preset_name(config: VanillaTransformerConfig) -> str | None:
    defaults = VanillaTransformerConfig()
    for name, overrides in PRESETS.items():
        if all(getattr(config, f) == overrides.get(f, getattr(defaults, f)) for f in PRESET_FIELDS):
            return name
    return None


def _count_parameters(config: VanillaTransformerConfig) -> int | None:
    from .modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration

    try:
        with torch.device("meta"):  # no memory, no initialisation cost
            model = VanillaTransformerForConditionalGeneration(config)
        return model.num_parameters()
    except Exception:
        return None


def _template_variables(
    *,
    model_name: str,
    config: VanillaTransformerConfig,
    metrics: Mapping[str, Any],
    training: Mapping[str, Any],
    dataset: Mapping[str, Any],
    source_lang: str,
    target_lang: str,
    examples: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every variable the template uses; missing optional values are None."""
    variables: dict[str, Any] = {field: getattr(config, field) for field in ARCHITECTURE_FIELDS}
    train_time_s = training.get("train_time_s")
    # The text columns the fine-tuning example reads: a Hub dataset's as trained on, else by language.
    source_column, target_column = dataset.get("hub_columns", (source_lang, target_lang))
    variables.update(
        model_name=model_name,
        source_lang=source_lang,
        target_lang=target_lang,
        source_language=language_name(source_lang),
        target_language=language_name(target_lang),
        preset=_preset_name(config),
        num_parameters=_count_parameters(config),
        dataset_name=dataset.get("name"),
        dataset_hub_id=dataset.get("hub_id"),
        dataset_hub_config=dataset.get("hub_config"),
        source_column=source_column,
        target_column=target_column,
        dataset_description=dataset.get("description"),
        dataset_license=dataset.get("license"),
        train_pairs=dataset.get("train_pairs"),
        validation_pairs=dataset.get("validation_pairs"),
        test_pairs=dataset.get("test_pairs"),
        embedded_corpus=bool(dataset.get("embedded")),
        steps=training.get("steps"),
        epochs=training.get("epochs"),
        train_time=_format_duration(train_time_s) if train_time_s is not None else None,
        hardware=training.get("hardware"),
        mixed_precision=training.get("mixed_precision"),
        batch_tokens=training.get("batch_tokens"),
        batch_pairs=training.get("batch_pairs"),
        max_grad_norm=training.get("max_grad_norm"),
        finetuned_from=training.get("finetuned_from"),
        converted_from=training.get("converted_from"),
        warmup_steps=training.get("warmup_steps"),
        recipe=training.get("preset"),
        lr_schedule=training.get("lr_schedule", "inverse_sqrt"),
        max_steps=training.get("max_steps"),
        max_train_minutes=training.get("max_train_minutes"),
        lr_peak=training.get("lr_peak"),
        lr_scale=training.get("lr_scale"),
        lr_cooldown=training.get("lr_cooldown"),
        label_smoothing=training.get("label_smoothing", config.label_smoothing),
        unlikelihood_weight=training.get("unlikelihood_weight", config.unlikelihood_weight),
        stutter_rate=training.get("stutter_rate"),
        stutter_repeats=training.get("stutter_repeats", 1),
        dropout_training=training.get("dropout", config.dropout),
        qkv_init_gain=training.get("qkv_init_gain"),
        averaged_checkpoints=training.get("averaged_checkpoints"),
        averaged_steps=training.get("averaged_steps"),
        adam_beta1=training.get("adam_beta1", 0.9),
        adam_beta2=training.get("adam_beta2", 0.98),
        adam_epsilon=training.get("adam_epsilon", 1e-9),
        paper_architecture=not config.norm_first
        and config.activation_function == "relu"
        and config.tie_word_embeddings is not False
        and config.scale_embedding
        and config.share_encoder_decoder_embeddings
        and config.position_encoding_layout == "interleaved"
        and not config.add_final_logits_bias
        and not config.attention_bias
        and not config.attention_dropout
        and not config.activation_dropout,
        scale_embedding=config.scale_embedding,
        share_encoder_decoder_embeddings=config.share_encoder_decoder_embeddings,
        add_final_logits_bias=config.add_final_logits_bias,
        attention_bias=config.attention_bias,
        scored_pairs=metrics.get("scored_pairs"),
        command=training.get("command"),
        bleu=float(metrics["bleu"]),
        chrf=float(metrics["chrf"]),
        bleu_signature=metrics["bleu_signature"],
        chrf_signature=metrics.get("chrf_signature"),
        val_loss=metrics.get("val_loss"),
        test_loss=metrics.get("test_loss"),
        repetition=metrics.get("repetition"),
        reference_repetition=metrics.get("reference_repetition"),
        eval_split=metrics.get("split", "test"),
        # A validation split drawn from the training data at random: no split the data has.
        held_out=bool(metrics.get("held_out")),
        # The scored pairs' data, and the size of the split they are the first of.
        eval_dataset_name=metrics.get("dataset_name") or dataset.get("name"),
        split_pairs=metrics.get("split_pairs") or dataset.get(f"{metrics.get('split', 'test')}_pairs"),
        default_num_beams=metrics.get("default_num_beams"),
        # Python string literals for the usage examples: three, the given ones first.
        examples=[
            json.dumps(text, ensure_ascii=False) for text in [*(examples or ()), *DEFAULT_EXAMPLES][:3]
        ],
        translate_command=(
            f"python scripts/translate.py --model {model_name} --input {source_lang}.txt "
            f"--output {target_lang}.txt"
        ),
    )
    for key, default in DEFAULT_DECODING.items():
        variables[key] = metrics.get(key, default)
    variables["no_repeat_ngram_size"] = metrics.get("no_repeat_ngram_size")
    variables["max_new_tokens"] = metrics.get("max_new_tokens")
    variables["max_length"] = metrics.get("max_length")
    variables["max_length_is_default"] = bool(metrics.get("max_length_is_default"))
    return variables


def _hub_languages(*codes: str) -> tuple[list[str], list[str] | None]:
    """The metadata's `language` and `language_bcp47` for language codes as given ("en", "pt-BR",
    "zh_Hant", "zho_Hans"). The Hub takes ISO 639 codes only, lowercase, in `language` (a region or a
    script is an error there): each code's language, once; a tag whose first part is no such code (a
    private-use "x-klingon", a grandfathered "i-klingon") has none there. Where a code has a region, a
    script or no ISO 639 language, every code goes to `language_bcp47` as given ("_" written "-"), so
    that it names both languages; None where none has."""
    tags = [code.replace("_", "-") for code in codes]
    primary = [tag.split("-")[0].lower() for tag in tags]
    languages = [code if 2 <= len(code) <= 3 and code.isalpha() else None for code in primary]
    bcp47 = [tag for tag, language in zip(tags, languages, strict=True) if tag.lower() != language]
    iso = [language for language in languages if language is not None]
    return list(dict.fromkeys(iso)), (list(dict.fromkeys(tags)) if bcp47 else None)


def _card_data(
    *,
    model_name: str,
    metrics: Mapping[str, Any],
    dataset: Mapping[str, Any],
    source_lang: str,
    target_lang: str,
    license: str | None,
    license_name: str | None = None,
    license_link: str | None = None,
    base_model: str | None = None,
    base_model_relation: str | None = None,
) -> ModelCardData:
    dataset_name = metrics.get("dataset_name") or dataset.get("name") or "unnamed dataset"  # the scored data
    hub_id = dataset.get("hub_id")
    common = {
        "task_type": "translation",
        "task_name": f"Translation {language_name(source_lang)} to {language_name(target_lang)}",
        "dataset_type": hub_id or dataset_name,
        "dataset_name": dataset_name,
        # A Hub dataset's config is the name load_dataset took (wmt/wmt14's "de-en" also for en -> de;
        # none where it took none); other data has none, and the language pair stands for one.
        "dataset_config": dataset.get("hub_config") if hub_id else f"{source_lang}-{target_lang}",
        # (none for pairs held out of the training data: the dataset has no such split to point to)
        "dataset_split": None if metrics.get("held_out") else metrics.get("split", "test"),
    }
    eval_results = [
        EvalResult(
            **common,
            metric_type="bleu",
            metric_name="BLEU",
            metric_value=round(float(metrics["bleu"]), 2),
            metric_config=str(metrics["bleu_signature"]),
        ),
        EvalResult(
            **common,
            metric_type="chrf",
            metric_name="chrF",
            metric_value=round(float(metrics["chrf"]), 2),
            metric_config=str(metrics["chrf_signature"]) if metrics.get("chrf_signature") else None,
        ),
    ]
    language, language_bcp47 = _hub_languages(source_lang, target_lang)
    return ModelCardData(
        model_name=model_name,
        language=language or None,
        **({"language_bcp47": language_bcp47} if language_bcp47 else {}),
        license=license,
        **({"license_name": license_name} if license_name else {}),
        **({"license_link": license_link} if license_link else {}),
        base_model=base_model,
        **({"base_model_relation": base_model_relation} if base_model_relation else {}),
        library_name="transformers",
        pipeline_tag="translation",
        tags=list(TAGS),
        datasets=[hub_id] if hub_id else None,
        metrics=["bleu", "chrf"],
        eval_results=eval_results,
    )


def build_model_card(
    *,
    model_name: str,
    config: VanillaTransformerConfig,
    metrics: dict,
    training: dict,
    dataset: dict,
    source_lang: str,
    target_lang: str,
    license: str | None = "apache-2.0",
    license_name: str | None = None,
    license_link: str | None = None,
    base_template: str | Path | None = None,
    examples: Sequence[str] | None = None,
) -> ModelCard:
    """Render the model card of a trained model.

    `metrics` needs "bleu", "chrf" and "bleu_signature", scored on the split named by "split" (default
    "test"; "held_out" true: a validation split drawn from the training data at random); optional:
    "chrf_signature", "val_loss", "test_loss", the decoding settings "num_beams", "length_penalty",
    "length_penalty_form", "max_length_offset", "no_repeat_ngram_size", and
    "default_num_beams" where the model's generation config decodes with other beams than the scores;
    "dataset_name" where the scored pairs come from other data than the training data, and
    "split_pairs", the size of the split whose first pairs were scored (default: the dataset's
    count for the split). `training` and `dataset` keys are all optional (see the template); a
    fine-tuned model's `training` names the model it started from as "finetuned_from" (a folder's
    name or a Hub id), and with "finetuned_from_hub" true the metadata's `base_model` links that Hub
    model; a converted one's names the model whose weights it holds as "converted_from" (and
    "converted_from_hub"), and the card then describes no training. `license` None leaves the
    licence unstated; `license_name` and `license_link` name a licence the Hub has no identifier for
    (`license` "other"). `base_template` is the path of a Jinja2 template (default: the packaged
    `model_card_template.md`). `examples`: source sentences for the usage examples (e.g. from the
    test split; default: three English Bible verses). The YAML metadata carries a model-index with
    the scores; the card is re-parsed to check it.
    """
    missing = [key for key in REQUIRED_METRICS if metrics.get(key) is None]
    if missing:
        raise ValueError(f"`metrics` lacks {missing}; it needs {list(REQUIRED_METRICS)}.")
    for name, value in (
        ("model_name", model_name),
        ("source_lang", source_lang),
        ("target_lang", target_lang),
    ):
        if not value:
            raise ValueError(f"`{name}` must be a non-empty string.")
    template_path = Path(base_template) if base_template is not None else default_template_path()
    if not template_path.is_file():
        raise FileNotFoundError(f"No model-card template at {template_path}.")

    # The model this one started from, or holds the weights of, where it is a Hub model.
    origins = [training[key] for key in ("finetuned_from", "converted_from") if training.get(f"{key}_hub")]
    base_model = origins[0] if origins else None
    # The Hub's model tree files a fine-tune under its base model's "Finetunes". A conversion (the same
    # weights in another architecture) has no relation of the Hub's (adapter, merge, quantized,
    # finetune) that fits, and is left for the Hub to infer.
    relation = "finetune" if training.get("finetuned_from_hub") else None
    card_data = _card_data(
        model_name=model_name,
        metrics=metrics,
        dataset=dataset,
        source_lang=source_lang,
        target_lang=target_lang,
        license=license,
        license_name=license_name,
        license_link=license_link,
        base_model=base_model,
        base_model_relation=relation,
    )
    variables = _template_variables(
        model_name=model_name,
        config=config,
        metrics=metrics,
        training=training,
        dataset=dataset,
        source_lang=source_lang,
        target_lang=target_lang,
        examples=examples,
    )
    card = ModelCard.from_template(card_data, template_path=str(template_path), **variables)
    _check_metadata(str(card))
    return card


def decoding_settings(generation: GenerationConfig) -> dict[str, Any]:
    """The decoding settings of `generation` that a card states (`build_model_card`'s metrics keys), as
    `generate` applies them: where the config leaves one unset, transformers' default."""
    if hasattr(generation, "unset_default_max_length"):  # this package's model's own config
        # A `max_length` Seq2SeqTrainer filled in from transformers' defaults is not chosen: `generate`
        # unsets it, and decodes by the source length rule.
        generation = copy.copy(generation)
        generation.unset_default_max_length()
    settings = {
        "num_beams": generation.num_beams,
        "length_penalty": generation.length_penalty,
        "length_penalty_form": getattr(generation, "length_penalty_form", None) or "power",
        "no_repeat_ngram_size": generation.no_repeat_ngram_size or None,
        "max_new_tokens": None,
        "max_length": None,
        "max_length_offset": None,
    }
    for key in ("num_beams", "length_penalty"):
        if settings[key] is None:
            settings[key] = TRANSFORMERS_DECODING[key]
    # The output length that applies, in generate's order: a set number of new tokens, a set length, this
    # package's source length + offset rule, else transformers' default maximum.
    offset = getattr(generation, "max_length_offset", None)
    if generation.max_new_tokens is not None:
        settings["max_new_tokens"] = generation.max_new_tokens
    elif generation.max_length is not None:
        settings["max_length"] = generation.max_length
    elif offset is not None:
        settings["max_length_offset"] = offset
    else:  # transformers' default `max_length` counts new tokens only: 20 after the decoder's start token
        settings |= {"max_new_tokens": TRANSFORMERS_DECODING["max_length"], "max_length_is_default": True}
    return settings


def evaluation_metrics(
    scores: Mapping[str, Any], generation: GenerationConfig, dataset_name: str | None
) -> dict[str, Any]:
    """`build_model_card`'s `metrics` from an `evaluate_model` result (`scores`), decoded with
    `generation`, on the pairs of `dataset_name` (None: the training data's)."""
    measured = ("bleu", "chrf", "bleu_signature", "chrf_signature", "repetition", "reference_repetition")
    return {
        "split": scores["split"],
        "dataset_name": dataset_name,
        "scored_pairs": scores["sentences"],
        "split_pairs": scores["split_pairs"],
        **{key: scores[key] for key in measured},
        **decoding_settings(generation),
    }


def _check_metadata(content: str) -> None:
    """Re-parse the rendered card offline; raise ValueError unless its YAML has a model-index."""
    data = ModelCard(content).data.to_dict()
    if not data.get("model-index"):
        raise ValueError("The rendered model card has no `model-index` in its YAML metadata.")


def write_model_card(output_dir: str | Path, **kwargs: Any) -> Path:
    """Build the card (`build_model_card` keyword arguments) and write it to `output_dir/README.md`."""
    card = build_model_card(**kwargs)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "README.md"
    path.write_text(str(card), encoding="utf-8")
    return path


def base_license(model: str) -> dict[str, str | None]:
    """The licence stated by the card of `model` (a folder's README.md, or the Hub repo's): what a model
    fine-tuned from it, or converted from it, inherits, as `build_model_card`'s `license`,
    `license_name` and `license_link` (None where the card states none). A link relative to a Hub
    repo (its LICENSE file, say) becomes the file's address there; one relative to a local folder
    stays as it is, and `copy_license_file` brings the file along."""
    fields: dict[str, str | None] = dict.fromkeys(("license", "license_name", "license_link"))
    readme = Path(model) / "README.md"
    if Path(model).exists() and not readme.is_file():
        return fields
    try:
        card = ModelCard.load(readme if Path(model).exists() else model)
    except RemoteEntryNotFoundError:  # a Hub repo without a card states no licence
        return fields
    except Exception as error:  # no network, a malformed card: the licence is unknown, not absent
        logger.warning(
            "The licence of %s could not be read (%s); the new model card states none. If it has one, "
            "add it to the card's metadata before publishing.",
            model,
            first_line(error),
        )
        return fields
    data = card.data.to_dict()
    fields |= {key: data.get(key) for key in fields}
    link = fields["license_link"]
    if link and _relative(link) and not Path(model).exists():
        fields["license_link"] = f"{constants.ENDPOINT}/{model}/blob/main/{link.removeprefix('./')}"
    return fields


def _relative(link: str) -> bool:
    """Whether a card's `license_link` names a file of its own repo or folder (not an address, and not a
    path out of it: "../LICENSE")."""
    return (
        "://" not in link
        and not link.startswith(("/", "mailto:"))
        and ".." not in PurePosixPath(link.removeprefix("./")).parts
    )


def copy_license_file(model: str, folder: str | Path, license_link: str | None) -> None:
    """Copy the licence file that the card of a local folder `model` links relatively (`license_link`, as
    `base_license` gives it) into `folder`, where the new card's same link then finds it; a link to a
    file the folder lacks is said."""
    if not license_link or not _relative(license_link) or not Path(model).is_dir():
        return
    source = Path(model) / license_link
    if not source.is_file():
        logger.warning(
            "The card of %s links its licence to %s, which is not in that folder; the new card's link "
            "finds nothing until the file is added.",
            model,
            license_link,
        )
        return
    target = Path(folder) / license_link
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


__all__ = [
    "base_license",
    "build_model_card",
    "copy_license_file",
    "decoding_settings",
    "default_template_path",
    "evaluation_metrics",
    "write_model_card",
]
