"""Export a trained model folder to CTranslate2, OpenNMT's C++ inference engine, and translate with it.

CTranslate2 runs the paper's Transformer (post-LN or pre-LN, ReLU, sinusoidal positions) natively and
much faster than `generate()` on CPU, in float32 or quantized (int8, float16, ...). Its own converters
know MarianMTModel, BART, fairseq and OpenNMT checkpoints, not this model, so `export_ctranslate2`
builds the model description (`ctranslate2.specs.TransformerSpec`) from the folder's configuration,
weights and tokenizer directly:

- post-LN or pre-LN from `norm_first`; the activation; `scale_embedding`; tied or separate output
  projection; the final logits bias of converted Marian models;
- position encodings written as a table in this model's own layout (interleaved sin/cos, or
  concatenated) up to `max_positions` positions: the exported model translates sources of at most
  that many tokens and stops every output there (this model itself has no maximum length);
- one vocabulary for source and target, the tokenizer's tokens in id order, and the decoder start and
  end tokens that generate() reads (the generation config's; config.json's where it sets none).

What CTranslate2 cannot represent exactly (separate source and target vocabularies, an activation it
does not have) is refused with the reason; the layer-norm epsilon is carried. Float32 exports translate
token for token like `generate()` (tests/test_export_ctranslate2.py); `CTranslate2Translator` applies
the same decoding rules: beam size, length penalty, each sentence's own source length + 50. CTranslate2
divides a beam's log-probability by |Y|^alpha, transformers' form; a model whose generation config asks
for the paper's ((5 + |Y|) / 6)^alpha (`length_penalty_form="gnmt"`) is exported with the form recorded,
and the export and `CTranslate2Translator` warn, whenever beams are used, that beam search there may end
differently.

Needs the optional extra: `pip install -e ".[ctranslate2]"`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .configuration_vanilla_transformer import VanillaTransformerConfig, is_integer
from .hub import TOKENIZER_FILES
from .modeling_vanilla_transformer import (
    DEFAULT_MAX_LENGTH_OFFSET,
    VanillaTransformerForConditionalGeneration,
    check_beam_settings,
    sinusoidal_position_encoding,
)
from .publishing import (
    check_has_tokenizer,
    check_not_current_folder,
    check_writable_place,
    hidden_sibling,
    lock_folder,
    publish_folder,
    some_of,
)
from .translation import SentenceError, checked_sentences, one_line

logger = logging.getLogger(__name__)

QUANTIZATIONS = (
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)
# The decoding rules the export carries (CTranslate2's model folder has no generation config of its own).
SETTINGS_FILE = "vanilla_transformer_decoding.json"
DEFAULT_MAX_POSITIONS = 1024
# The position table is built in memory and written into the export: a bound that fails before either.
MAX_POSITION_TABLE_BYTES = 2**30
# transformers' activation names -> CTranslate2's (ctranslate2.specs.Activation member names): each
# of transformers' activations that one of CTranslate2's computes (the exact GELU, its tanh and sigmoid
# approximations under all their names, SiLU, tanh, sigmoid)
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu_python": "GELU", "quick_gelu": "GELUSigmoid"}
ACTIVATIONS |= dict.fromkeys(
    ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python_tanh"), "GELUTanh"
)
ACTIVATIONS |= {"silu": "SWISH", "swish": "SWISH", "tanh": "Tanh", "sigmoid": "Sigmoid"}


CTRANSLATE2_MISSING = (
    'CTranslate2 exports and translation need the `ctranslate2` package: pip install "ctranslate2>=4.5" '
    '(in a checkout of this project: pip install -e ".[ctranslate2]")'
)


def import_ctranslate2() -> Any:
    """The `ctranslate2` module; an ImportError that says how to install it where it is missing."""
    try:
        import ctranslate2
    except ImportError as error:  # an optional extra
        raise ImportError(CTRANSLATE2_MISSING) from error
    return ctranslate2


def check_exportable(config: VanillaTransformerConfig, tokenizer: Any = None) -> None:
    """Raise a ValueError naming what CTranslate2's Transformer cannot represent exactly.

    Separate embedding matrices over one vocabulary (`share_encoder_decoder_embeddings=False` with one
    tokenizer: a model trained so, or a converted Marian model whose matrices differ) export exactly, each
    stack its own; separate vocabularies do not (the export writes one). Without the `tokenizer` there is
    no telling the two apart, and separate matrices are refused."""
    problems = []
    separate = config.decoder_vocab_size != config.vocab_size or (
        not config.share_encoder_decoder_embeddings
        and (tokenizer is None or getattr(tokenizer, "separate_vocabs", False))
    )
    if separate:
        problems.append("separate source and target vocabularies (the export writes one vocabulary)")
    if config.activation_function not in ACTIVATIONS:
        problems.append(f"the activation {config.activation_function!r} (supported: {sorted(ACTIVATIONS)})")
    if problems:
        raise ValueError("This model cannot be exported to CTranslate2 exactly: " + "; ".join(problems) + ".")


def _linear(spec: Any, layer: torch.nn.Linear) -> None:
    spec.weight = layer.weight.detach()
    if layer.bias is not None:
        spec.bias = layer.bias.detach()


def _layer_norm(spec: Any, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = norm.weight.detach(), norm.bias.detach()


def _attention(spec: Any, attention: Any, self_attention: bool) -> None:
    """CTranslate2 keeps self-attention's Q, K, V as one fused matrix, cross-attention's K, V as one."""
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    weights = [p.weight.detach() for p in projections]
    fused = [torch.cat(weights)] if self_attention else [weights[0], torch.cat(weights[1:])]
    for linear, weight in zip(spec.linear, fused, strict=False):
        linear.weight = weight
    if attention.q_proj.bias is not None:  # without them (the paper's), the specs' biases stay unset
        biases = [p.bias.detach() for p in projections]
        fused = [torch.cat(biases)] if self_attention else [biases[0], torch.cat(biases[1:])]
        for linear, bias in zip(spec.linear, fused, strict=False):
            linear.bias = bias
    _linear(spec.linear[-1], attention.out_proj)


def _stack(spec: Any, stack: Any, positions: torch.Tensor, decoder: bool) -> None:
    config = stack.config
    spec.scale_embeddings = math.sqrt(config.d_model) if config.scale_embedding else 1.0
    spec.position_encodings.encodings = positions
    embeddings = spec.embeddings if decoder else spec.embeddings[0]
    embeddings.weight = stack.embed_tokens.weight.detach()
    if stack.layer_norm is not None:  # pre-LN: a final LayerNorm after the stack
        _layer_norm(spec.layer_norm, stack.layer_norm)
    for layer_spec, layer in zip(spec.layer, stack.layers, strict=True):
        _attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
        if decoder:
            _attention(layer_spec.attention, layer.encoder_attn, self_attention=False)
            _layer_norm(layer_spec.attention.layer_norm, layer.encoder_attn_layer_norm)
        _linear(layer_spec.ffn.linear_0, layer.fc1)
        _linear(layer_spec.ffn.linear_1, layer.fc2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.final_layer_norm)


def ctranslate2_spec(
    model: VanillaTransformerForConditionalGeneration, tokenizer: Any, max_positions: int
) -> Any:
    """The `ctranslate2.specs.TransformerSpec` of `model` (weights shared, not copied), with the
    tokenizer's vocabulary in id order and position encodings for `max_positions` positions."""
    ctranslate2 = import_ctranslate2()
    config = model.config
    check_exportable(config, tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if len(tokens) > config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokens)} tokens but the model's vocabulary is {config.vocab_size}: "
            "resize the model's embeddings to the tokenizer "
            "(`model.resize_token_embeddings(len(tokenizer))`, then train them) and save it again."
        )
    # Rows past the tokenizer's last token (`resize_token_embeddings(..., pad_to_multiple_of=N)`): CTranslate2
    # names every row, so they get names no token has; generate()'s decoding drops such ids, and so does
    # the translator (`CTranslate2Translator.translate`).
    taken = set(tokens)
    for row in range(len(tokens), config.vocab_size):
        name = f"<unused_row_{row}>"
        while name in taken:
            name += "_"
        tokens.append(name)
    spec = ctranslate2.specs.TransformerSpec.from_config(
        (config.num_encoder_layers, config.num_decoder_layers),
        config.num_heads,
        pre_norm=config.norm_first,
        activation=getattr(ctranslate2.specs.Activation, ACTIVATIONS[config.activation_function]),
    )
    positions = sinusoidal_position_encoding(
        torch.arange(max_positions), config.d_model, config.position_encoding_layout
    )
    _stack(spec.encoder, model.model.encoder, positions, decoder=False)
    _stack(spec.decoder, model.model.decoder, positions, decoder=True)
    _linear(spec.decoder.projection, model.lm_head)  # the embedding matrix itself when tied
    if model.final_logits_bias is not None:
        spec.decoder.projection.bias = model.final_logits_bias.detach()[0]
    spec.register_source_vocabulary(list(tokens))
    spec.register_target_vocabulary(list(tokens))
    # CTranslate2 starts each output with the decoder start token (generate() with the beginning-of-
    # sequence token where none is set); its own bos_token serves only where that is absent, and to begin
    # sources if asked (add_source_bos, off): a converted Marian model has no bos_token_id. The ids are
    # those generate() reads, its generation config's (config.json's where that sets none).
    start = _one_token_id(model, "decoder_start_token_id", "bos_token_id")
    unset = all(getattr(c, "bos_token_id", None) is None for c in (model.generation_config, config))
    bos = start if unset else _one_token_id(model, "bos_token_id")
    spec.config.bos_token = tokens[bos]
    spec.config.eos_token = tokens[_one_token_id(model, "eos_token_id")]
    spec.config.decoder_start_token = tokens[start]
    if tokenizer.unk_token is not None:
        spec.config.unk_token = tokenizer.unk_token
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    return spec


def _one_token_id(model: Any, field: str, fallback: str | None = None) -> int:
    """The model's `field` (else its `fallback` field, where `field` is unset) as one token id (a
    one-element list too): an export has one of each. Read as generate() reads it, from the generation
    config (generation_config.json: where it differs from config.json, generate() follows it), else from
    the configuration."""
    places = ((model.generation_config, "generation_config.json"), (model.config, "config.json"))
    fields = (field,) if fallback is None else (field, fallback)
    value, place = None, "config.json"
    for settings, name in places:
        named = next((f for f in fields if getattr(settings, f, None) is not None), None)
        if named is not None:
            field, value, place = named, getattr(settings, named), name
            break
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not is_integer(value) or not 0 <= value < model.config.vocab_size:
        raise ValueError(
            f"The model's {field} is {value!r} ({place}); a CTranslate2 export needs exactly one such "
            f"token id, of the {model.config.vocab_size} of its vocabulary: set `{field}` in the model "
            f"folder's {place} to that token's id in its tokenizer, and export again."
        )
    return int(value)


def check_position_table(max_positions: int, width: int) -> None:
    """Raise unless a float32 table of `max_positions` positions of `width` values fits the bound."""
    table = max_positions * width * 4  # bytes, built in memory and stored in the export
    if table > MAX_POSITION_TABLE_BYTES:
        raise ValueError(
            f"max_positions {max_positions:,} would make a position table of {table / 2**30:.1f} GiB "
            f"(at most {MAX_POSITION_TABLE_BYTES // 2**30} GiB: "
            f"{MAX_POSITION_TABLE_BYTES // (width * 4):,} positions at this width)."
        )


# What an export writes, for an earlier export that did not list its files: CTranslate2's model, config and
# vocabularies, the settings, and the tokenizer's files.
EXPORT_FILES = (
    "model.bin",
    "config.json",
    "shared_vocabulary.json",
    "source_vocabulary.json",
    "target_vocabulary.json",
    SETTINGS_FILE,
    # by name, not the model folder's patterns ("*.model" would take a user's own language model)
    *(name for name in TOKENIZER_FILES if "*" not in name),
    "source.spm",
    "target.spm",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# What file managers and notebooks leave in any folder they show: nothing of the user's to lose.
SYSTEM_CLUTTER = (".DS_Store", "._*", "Thumbs.db", "desktop.ini", ".ipynb_checkpoints")


def check_replaceable_export(export_dir: Path, model_dir: str | Path) -> None:
    """Raise ValueError unless replacing the earlier export `export_dir` as a whole loses nothing: the model
    folder being exported must not lie in it, and it must hold only what that export wrote (the files
    its settings list; for a folder exported before they were listed, files an export writes,
    `EXPORT_FILES`), or a file manager's clutter. A model folder kept inside its export (and a
    user's notes there) was deleted without a word."""
    source = Path(model_dir)
    here = export_dir.resolve()
    if source.exists() and (source.resolve() == here or here in source.resolve().parents):  # not a Hub id
        raise ValueError(
            f"{model_dir} lies inside {export_dir}, an earlier export that this one would replace as a whole "
            "(deleting the model folder): move the model folder out of it, or export to another folder."
        )
    try:
        written = json.loads((export_dir / SETTINGS_FILE).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a JSON object
        written = None
    if isinstance(written, list):
        wrote = set(written)
    else:
        wrote = {
            entry.name for entry in export_dir.iterdir() if entry.is_file() and entry.name in EXPORT_FILES
        }
    foreign = sorted(
        entry.name
        for entry in export_dir.iterdir()
        if entry.name not in wrote
        and not any(fnmatch.fnmatchcase(entry.name, junk) for junk in SYSTEM_CLUTTER)
    )
    if foreign:
        raise ValueError(
            f"{export_dir} is an earlier export, but it also holds {some_of(foreign)}, which the export did "
            "not write; this export replaces the folder as a whole and would delete them: move them out of "
            "it, or export to another folder."
        )


def export_ctranslate2(
    model_dir: str | Path,
    output_dir: str | Path,
    *,
    quantization: str | None = None,
    max_positions: int = DEFAULT_MAX_POSITIONS,
) -> Path:
    """Write the CTranslate2 model of the model folder `model_dir` to `output_dir`, with its tokenizer and
    decoding settings beside it; the folder appears whole or not at all. An earlier export there is
    replaced, all its files (refused where it holds others, or the model folder); any other non-empty
    folder (the model folder itself, say) is refused."""
    from .evaluation import load_model_folder

    check_not_current_folder(output_dir)
    target = Path(output_dir)
    if target.exists() and (
        not target.is_dir() or (any(target.iterdir()) and not (target / SETTINGS_FILE).is_file())
    ):
        raise ValueError(
            f"{output_dir} exists and is not a CTranslate2 export of this package; writing there would mix "
            "the two. Name a new folder (or an earlier export to replace)."
        )

    if target.is_dir() and (target / SETTINGS_FILE).is_file():
        check_replaceable_export(target, model_dir)
    check_writable_place(target)  # under a file, or read-only: before the model is read and converted
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}.")
    if max_positions < 2:
        raise ValueError(f"max_positions must be at least 2, got {max_positions}.")
    # The table's size, from a local folder's configuration: refused before the weights are read. (Not
    # asked of the Hub: a mistyped folder name would wait out its retries before `load_model_folder`
    # says at once that there is no such folder; a folder without a readable configuration is named
    # there too, and a Hub model is checked once loaded.)
    try:
        width = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("d_model")
    except (OSError, ValueError, AttributeError):  # no such file, not JSON, not a JSON object
        width = None
    if isinstance(width, int) and width > 0:
        check_position_table(max_positions, width)
    # Two exports of one folder at once: the second removed the first's half-written folder as an
    # interrupted one's, and the first then published its remaining files alone (a tokenizer and settings,
    # no model). One at a time: a second is refused before it reads the model.
    try:
        lock = lock_folder(target)
    except BlockingIOError:
        raise ValueError(
            f"{output_dir} is being written by another export (it holds {hidden_sibling(target, 'lock')}): "
            "wait for it to end, or name another folder."
        ) from None
    with lock:
        model, tokenizer = load_model_folder(str(model_dir), "cpu")
        if model.config.model_type != "vanilla_transformer":  # read as one, it failed with an AttributeError
            raise ValueError(
                f"{model_dir} holds a {model.config.model_type!r} model, not this package's: this export "
                "reads this package's configuration and weights. CTranslate2's own converters "
                "(ct2-transformers-converter) export MarianMTModel and other transformers models."
            )
        model = model.float()
        check_position_table(max_positions, model.config.d_model)
        spec = ctranslate2_spec(model, tokenizer, max_positions)
        spec.validate()
        spec.optimize(quantization=quantization)
        generation = model.generation_config
        not_carried = uncarried_generation_settings(generation)
        if not_carried:
            logger.warning(
                f"The model's generation config sets {', '.join(not_carried)}, which the export does not "
                "carry (it keeps the beam size, the length penalty, n-gram blocking and the length limit): "
                "its translations may differ from generate()'s."
            )
        if fixed_new_tokens(generation) == 0:  # generate() refuses it; CTranslate2 only when translating
            name = "max_new_tokens" if generation.max_new_tokens is not None else "max_length"
            raise ValueError(
                f"{model_dir}'s generation config sets {name} {getattr(generation, name)}, which leaves no "
                "new token (max_length counts the decoder's start token): set a larger one, and export again."
            )
        offset = getattr(generation, "max_length_offset", None)
        settings = {
            "max_positions": max_positions,
            "quantization": quantization or "float32",
            # unset fields: transformers' defaults (greedy, length penalty 1)
            "num_beams": generation.num_beams or 1,
            "length_penalty": 1.0 if generation.length_penalty is None else generation.length_penalty,
            "max_length_offset": DEFAULT_MAX_LENGTH_OFFSET if offset is None else offset,  # 0 stays 0
            # a fixed limit of new tokens instead of the offset rule (its max_length, transformers' default)
            "max_new_tokens": fixed_new_tokens(generation),
            "no_repeat_ngram_size": generation.no_repeat_ngram_size or 0,
            # transformers' default is False; CTranslate2's beam search always stops as True does
            "early_stopping": "never"
            if generation.early_stopping == "never"
            else bool(generation.early_stopping),
            # CTranslate2 has transformers' form only: recorded so that translating with beams says so
            "length_penalty_form": getattr(generation, "length_penalty_form", None) or "power",
            "not_carried": not_carried,
            "source_model": str(model_dir),
        }
        for difference in beam_search_differences(
            settings["num_beams"],
            settings["early_stopping"],
            settings["no_repeat_ngram_size"],
            settings["length_penalty_form"],
        ):
            logger.warning(difference)
        output_dir = Path(output_dir)
        # An earlier export's files that this one lacks (another tokenizer's, two vocabularies where this has
        # one) would be read with it: replaced as a whole.
        with publish_folder(output_dir, keep_other_files=False) as staging:
            spec.save(str(staging))
            tokenizer.save_pretrained(staging)
            # what the next export of this folder may replace (`check_replaceable_export`)
            settings["files"] = sorted([entry.name for entry in staging.iterdir()] + [SETTINGS_FILE])
            (staging / SETTINGS_FILE).write_text(json.dumps(settings, indent=1))
        return output_dir


# Decoding settings of a generation config that change what `generate()` outputs but that the export
# does not carry (converted OPUS-MT models set several: `bad_words_ids` for the pad token,
# `forced_eos_token_id`, `renormalize_logits`), and the values that change nothing. (A fixed `max_length`
# or `max_new_tokens` is carried: `fixed_new_tokens`.)
UNCARRIED_GENERATION_FIELDS = (
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "min_length",
    "min_new_tokens",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "encoder_no_repeat_ngram_size",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "watermarking_config",
    "renormalize_logits",
    "do_sample",
    "num_return_sequences",
)
_NEUTRAL = {
    "min_length": 0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "renormalize_logits": False,
    "do_sample": False,
    "num_return_sequences": 1,
}


# transformers' limit where a generation config sets no length (and no `max_length_offset` rule applies):
# `max_length` 20, counted in new tokens for an encoder-decoder.
TRANSFORMERS_DEFAULT_NEW_TOKENS = 20


def fixed_new_tokens(generation: Any) -> int | None:
    """The new tokens `generate()` allows every sentence (the end token counted) under `generation`
    (the model's `GenerationConfig`), or None where each sentence gets its own source length +
    `max_length_offset`: that rule applies while neither `max_new_tokens` nor `max_length` is set and
    the offset is not None (a converted Marian model without a length has None: transformers' 20 tokens
    then). `max_length` counts the decoder's start token."""
    if generation.max_new_tokens is not None:
        return generation.max_new_tokens
    if generation.max_length is not None:
        return max(generation.max_length - 1, 0)
    if getattr(generation, "max_length_offset", DEFAULT_MAX_LENGTH_OFFSET) is None:
        return TRANSFORMERS_DEFAULT_NEW_TOKENS
    return None


def uncarried_generation_settings(generation: Any) -> list[str]:
    """Names of the fields of `generation` (a `GenerationConfig`) set to a value that changes decoding
    but that an export does not carry."""
    return [
        name
        for name in UNCARRIED_GENERATION_FIELDS
        if (value := getattr(generation, name, None)) is not None
        and value not in ([], {})
        and value != _NEUTRAL.get(name)
    ]


def beam_search_differences(
    num_beams: int, early_stopping: bool | str, no_repeat_ngram_size: int, length_penalty_form: str = "power"
) -> list[str]:
    """How CTranslate2's beam search would pick other outputs than `generate()` with these settings
    (none for greedy search or the paper's settings)."""
    if num_beams <= 1:
        return []
    differences = []
    if length_penalty_form == "gnmt":
        differences.append(
            "The model's beam search uses the paper's length penalty ((5 + |Y|) / 6)^alpha; CTranslate2 "
            "divides by |Y|^alpha, so it may pick other beams for some sentences."
        )
    if early_stopping is not True:
        differences.append(
            f"The generation config's early_stopping is {early_stopping!r}: generate()'s beam search then "
            "goes on while a longer hypothesis could still rank first, CTranslate2's stops when "
            f"{num_beams} are finished (early_stopping=True), so some translations differ."
        )
    if no_repeat_ngram_size:
        differences.append(
            f"With beam search, n-gram blocking (no_repeat_ngram_size {no_repeat_ngram_size}) ranks beams "
            "differently in the two engines (generate() leaves blocked tokens out after normalising the "
            "probabilities, CTranslate2 before), so some translations differ."
        )
    return differences


class CTranslate2Translator:
    """Translate with an exported folder the way `translation.translate` does with `generate()`:
    the folder's tokenizer, beam size and length penalty, each sentence stopped after its own source
    length + `max_length_offset` new tokens (counting the end token, as `generate` does), or after the
    fixed `max_new_tokens` of a generation config that sets a length."""

    def __init__(
        self, export_dir: str | Path, *, device: str = "cpu", compute_type: str = "default", **kwargs: Any
    ):
        from transformers import AutoTokenizer

        ctranslate2 = import_ctranslate2()
        export_dir = Path(export_dir)
        settings_file = export_dir / SETTINGS_FILE
        if not export_dir.is_dir():  # not "a folder without the settings file"
            raise FileNotFoundError(f"No CTranslate2 export at {export_dir} (no such folder).")
        if not settings_file.is_file():
            raise ValueError(
                f"{export_dir} is not a folder written by export_ctranslate2 (no {SETTINGS_FILE})."
            )
        check_has_tokenizer(export_dir)  # (AutoTokenizer's message was about sentencepiece)
        self.settings = json.loads(settings_file.read_text())
        self.warned: set[str] = set()  # each difference from generate() once
        self.tokenizer = AutoTokenizer.from_pretrained(export_dir)
        self.vocabulary = self.tokenizer.get_vocab()  # without the names of unused rows (`ctranslate2_spec`)
        # A device named with its number as torch names it ("cuda:1", translate.py's --device for either
        # engine): CTranslate2 takes the number apart, and refused the name ("unsupported device cuda:1").
        kind, numbered, number = device.partition(":")
        if numbered:
            if not number.isdigit() or "device_index" in kwargs:
                raise ValueError(
                    f"Device {device!r}: name a device and its number as 'cuda:1' (or give device_index, "
                    "not both)."
                )
            device, kwargs["device_index"] = kind, int(number)
        self.translator = ctranslate2.Translator(
            str(export_dir), device=device, compute_type=compute_type, **kwargs
        )

    def translate(
        self,
        sentences: Sequence[str],
        *,
        batch_size: int = 32,
        num_beams: int | None = None,
        length_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        line_numbers: Sequence[int] | None = None,
    ) -> list[str]:
        """Translations of `sentences`, in order (a blank sentence's is ""). Sentences of equal token length
        share batches, so that each keeps the paper's limit of its own length + 50 (CTranslate2 takes one
        limit per call). `line_numbers`, one per sentence, are the lines of a file they were read from
        (`translate_stream(..., numbered=True)`): a warning names those lines instead of
        `sentences[i]`."""
        sentences = checked_sentences(sentences, batch_size)
        if line_numbers is not None and len(line_numbers) != len(sentences):
            raise ValueError(
                f"{len(line_numbers)} line_numbers for {len(sentences)} sentences; give one per sentence."
            )
        check_beam_settings(num_beams, length_penalty, bounded=False)  # CTranslate2's power does not overflow
        if no_repeat_ngram_size is not None and not (
            is_integer(no_repeat_ngram_size) and no_repeat_ngram_size >= 0
        ):  # CTranslate2's own error is a TypeError listing its whole signature
            raise ValueError(
                f"no_repeat_ngram_size must be a non-negative integer (0: off), got {no_repeat_ngram_size!r}."
            )
        if not sentences:
            return []
        sentences = [one_line(sentence) for sentence in sentences]  # as `translate` reads them
        settings = self.settings
        sources = [
            self.tokenizer.convert_ids_to_tokens(ids) for ids in self.tokenizer(sentences)["input_ids"]
        ]
        for index, tokens in enumerate(sources):
            if len(tokens) > settings["max_positions"]:
                raise SentenceError(
                    index,
                    f"has {len(tokens)} tokens; the exported model's position table holds "
                    f"{settings['max_positions']} (export again with a larger --max_positions).",
                )
        options = {
            "beam_size": num_beams or settings["num_beams"],
            "length_penalty": settings["length_penalty"] if length_penalty is None else length_penalty,
            "no_repeat_ngram_size": settings["no_repeat_ngram_size"]
            if no_repeat_ngram_size is None
            else no_repeat_ngram_size,
            "max_input_length": 0,  # no truncation: checked against the position table above
            # generate() may end a translation at its first step; CTranslate2's default (1) forbids the
            # end token there and renormalises, which shifts every beam's score.
            "min_decoding_length": 0,
        }
        differences = beam_search_differences(
            options["beam_size"],
            settings.get("early_stopping", True),
            options["no_repeat_ngram_size"],
            settings.get("length_penalty_form", "power"),  # absent from earlier exports: not recorded
        )
        for difference in differences:
            if difference not in self.warned:
                self.warned.add(difference)
                logger.warning(difference)
        outputs = {i: "" for i, sentence in enumerate(sentences) if not sentence}  # as `translate`'s
        by_length: dict[int, list[int]] = {}
        for index, tokens in enumerate(sources):
            if index not in outputs:
                by_length.setdefault(len(tokens), []).append(index)
        cut: list[int] = []  # sentences whose translation the position table stopped short of the rule
        fixed = settings.get("max_new_tokens")  # absent from earlier exports: the offset rule
        rule = f"source length + {settings['max_length_offset']}" if fixed is None else f"{fixed}-token"
        for length, indices in by_length.items():
            allowed = length + settings["max_length_offset"] if fixed is None else fixed
            limit = min(allowed, settings["max_positions"])
            capped = limit < allowed
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                results = self.translator.translate_batch(
                    [sources[i] for i in chunk], max_decoding_length=limit, **options
                )
                for i, result in zip(chunk, results, strict=True):
                    tokens = result.hypotheses[0]  # without the end token: `limit` of them if stopped there
                    if capped and len(tokens) >= limit:
                        cut.append(i)
                    ids = [self.vocabulary[token] for token in tokens if token in self.vocabulary]
                    outputs[i] = one_line(self.tokenizer.decode(ids, skip_special_tokens=True))
        if cut:
            cut.sort()
            names = [f"sentences[{i}]" if line_numbers is None else f"line {line_numbers[i]}" for i in cut]
            named = some_of(names)
            logger.warning(
                f"The translations of {named} were cut at {settings['max_positions']} tokens, the exported "
                f"position table's size, before the {rule} limit that generate() keeps: export again with a "
                "larger --max_positions."
            )
        return [outputs[i] for i in range(len(sources))]


__all__ = [
    "CTranslate2Translator",
    "beam_search_differences",
    "check_exportable",
    "ctranslate2_spec",
    "export_ctranslate2",
]
