"""Import OPUS-MT / Marian checkpoints (transformers' `MarianMTModel`) as this package's model.

Marian models are post-LN Transformers with sinusoidal positions, like the paper's, with a few
differences this conversion carries over: the positions' concatenated (sin half, cos half) layout,
the activation (OPUS-MT uses swish), a bias on the output logits, optionally separate source and
target vocabularies, and the pad token as decoder start. Logits and `generate()` outputs are identical.

One convention differs: `inputs_embeds` are the (unscaled) embedding lookup for both this model's
encoder and decoder, each scaling what it is given by sqrt(d_model), so that
`model(inputs_embeds=model.get_input_embeddings()(ids))` is `model(ids)`. MarianMTModel's decoder does
the same, but its encoder takes `inputs_embeds` as already scaled: code written for MarianMTModel that
passes encoder `inputs_embeds` must pass them unscaled here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .model_card import evaluation_metrics, write_model_card
from .modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration

logger = logging.getLogger(__name__)


def config_from_marian(marian: MarianConfig) -> VanillaTransformerConfig:
    """The configuration of the same network; raises ValueError for what the paper's model cannot express."""
    if marian.encoder_attention_heads != marian.decoder_attention_heads:
        raise ValueError(
            f"Encoder and decoder have {marian.encoder_attention_heads} and {marian.decoder_attention_heads} "
            "attention heads; this model uses one head count for both."
        )
    if marian.encoder_ffn_dim != marian.decoder_ffn_dim:
        raise ValueError(
            f"Encoder and decoder feed-forward widths differ ({marian.encoder_ffn_dim} and "
            f"{marian.decoder_ffn_dim}); this model uses one d_ff for both."
        )
    layerdrop = {name: getattr(marian, name, 0.0) for name in ("encoder_layerdrop", "decoder_layerdrop")}
    if any(layerdrop.values()):
        # Training only: the converted model computes what Marian's does, but trains every layer every step.
        logger.warning(
            f"Marian's {', '.join(f'{name} {value}' for name, value in layerdrop.items())} not carried over: "
            "this model has no layer drop. Translations are the same; fine-tuning trains every layer at "
            "every step."
        )
    shared = marian.share_encoder_decoder_embeddings
    config = VanillaTransformerConfig(
        vocab_size=marian.vocab_size,
        decoder_vocab_size=marian.vocab_size if shared else marian.decoder_vocab_size,
        share_encoder_decoder_embeddings=shared,
        d_model=marian.d_model,
        num_heads=marian.encoder_attention_heads,
        d_ff=marian.encoder_ffn_dim,
        num_encoder_layers=marian.encoder_layers,
        num_decoder_layers=marian.decoder_layers,
        dropout=marian.dropout,
        attention_dropout=marian.attention_dropout,
        activation_dropout=marian.activation_dropout,
        activation_function=marian.activation_function,
        layer_norm_eps=1e-5,  # torch's LayerNorm default, which Marian uses
        norm_first=False,
        scale_embedding=marian.scale_embedding,
        tie_word_embeddings=marian.tie_word_embeddings,
        position_encoding_layout="concatenated",
        attention_bias=True,
        add_final_logits_bias=True,
        label_smoothing=0.0,  # Marian's loss is plain cross entropy
        pad_token_id=marian.pad_token_id,
        bos_token_id=marian.bos_token_id,
        eos_token_id=marian.eos_token_id,
        decoder_start_token_id=marian.decoder_start_token_id,
        # What a call returns by default (`from_pretrained(..., output_attentions=True)` for attention
        # plots): the same outputs as Marian's.
        output_attentions=marian.output_attentions,
        output_hidden_states=marian.output_hidden_states,
        use_cache=marian.use_cache,
    )
    config._attn_implementation = marian._attn_implementation
    return config


def _one_matrix(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two weights are one matrix (the same memory), not two that hold equal values."""
    return a is b or (
        a.shape == b.shape
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def _check_sinusoidal_positions(marian_model: MarianMTModel) -> None:
    """A ValueError where a position table of `marian_model` is not Marian's sinusoid: transformers 5
    loads the tables trainable, and one trained in place (a fine-tune of the loaded model, converted in
    memory) would be replaced by the sinusoid this model computes, its outputs changed without a word."""
    for side in ("encoder", "decoder"):
        table = getattr(marian_model.model, side).embed_positions
        sinusoid = table.create_weight().to(table.weight.device, torch.float32)
        tolerance = 2 * torch.finfo(table.weight.dtype).eps  # the values lie in [-1, 1]
        # The sinusoid as it is, or rounded by a model loaded or kept in half precision and cast back.
        gap = min(
            (table.weight.detach().float() - sinusoid.to(dtype).float()).abs().max().item()
            for dtype in (torch.float32, torch.float16, torch.bfloat16)
        )
        if gap > tolerance:
            raise ValueError(
                f"The Marian model's {side} position table is not sinusoidal (it differs from the sinusoid "
                f"by up to {gap:.3g}: trained?). This model computes sinusoidal positions and would not "
                "compute what it does. Marian's save_pretrained leaves the table out too: a saved and "
                "reloaded copy of it would also differ."
            )


def convert_from_marian(marian_model: MarianMTModel) -> VanillaTransformerForConditionalGeneration:
    """A `VanillaTransformerForConditionalGeneration` with the same weights (copies: training one model
    leaves the other as it was) and generation config.

    Module names already match (both follow BART's); the sinusoidal tables Marian stores are dropped
    because this model computes positions. Embedding sharing and output tying follow the weights.
    The generation config is Marian's, so that `generate()` gives the same tokens, including its length
    limits: where Marian's sets none, transformers' 20-token default, not this model's source length +
    50 rule (`max_length_offset` None).
    """
    if not isinstance(marian_model, MarianMTModel):
        raise ValueError(f"Expected a MarianMTModel, got {type(marian_model).__name__}.")
    config = config_from_marian(marian_model.config)
    _check_sinusoidal_positions(marian_model)
    # Which matrices are one and the same is read off the model, not the flags (a MarianMTModel created
    # with tie_word_embeddings=False has three independent embedding matrices), by memory, not values:
    # untied copies of one trained matrix (an old checkpoint storing all three) train apart.
    source = marian_model.model.encoder.embed_tokens.weight
    target = marian_model.model.decoder.embed_tokens.weight
    config.share_encoder_decoder_embeddings = _one_matrix(source, target)
    config.decoder_vocab_size = target.shape[0]
    config.tie_word_embeddings = _one_matrix(marian_model.lm_head.weight, target)

    state = {
        k: v.detach().clone()
        for k, v in marian_model.state_dict().items()
        if "embed_positions" not in k and not k.endswith(("shared.weight", "embed_tokens.weight"))
    }
    if config.share_encoder_decoder_embeddings:
        state["model.shared.weight"] = source.detach().clone()
    else:
        state["model.encoder.embed_tokens.weight"] = source.detach().clone()
        state["model.decoder.embed_tokens.weight"] = target.detach().clone()
    with torch.device("meta"):
        model = VanillaTransformerForConditionalGeneration(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    untied = set(result.missing_keys) - set(model.all_tied_weights_keys)
    if untied or result.unexpected_keys:
        raise ValueError(
            f"Marian weights do not map onto the model: missing {untied}, extra {result.unexpected_keys}"
        )
    model.tie_weights()
    # `load_state_dict` keeps the new model's `requires_grad` (True): what the Marian model had frozen
    # (an encoder or embeddings, as fine-tuning scripts freeze them) would train here. A matrix frozen
    # under any of Marian's names for it stays frozen ("model.shared.weight" is also listed under the
    # encoder's name, the matrix Marian's forward reads).
    marian_parameters = dict(marian_model.named_parameters(remove_duplicate=False))
    for name, parameter in model.named_parameters(remove_duplicate=False):
        source = marian_parameters.get(name) if name != "model.shared.weight" else None
        if source is not None and not source.requires_grad:
            parameter.requires_grad_(False)
    marian_generation = marian_model.generation_config
    generation = marian_generation.to_dict()
    if not generation.get("return_dict_in_generate"):
        # Copied from Marian's configuration into its generation config (`from_pretrained(...,
        # output_attentions=True)`), where transformers refuses to save them without
        # return_dict_in_generate: the converted model's configuration carries them.
        for name in ("output_attentions", "output_hidden_states", "output_scores", "output_logits"):
            generation.pop(name, None)
    model.generation_config = GenerationConfig.from_dict(generation)
    # Marian's may say it was derived from the model's configuration, which makes `from_pretrained`
    # derive a new one from this model's and drop what the conversion carried (max_length_offset).
    model.generation_config._from_model_config = False
    if marian_generation.max_length is None and marian_generation.max_new_tokens is None:
        model.generation_config.max_length_offset = None
    model.to(marian_model.dtype)
    modes = {name: module.training for name, module in marian_model.named_modules()}  # BART's names
    for name, module in model.named_modules():
        module.training = modes.get(name, marian_model.training)
    return model


def write_converted_card(
    folder: str | Path,
    *,
    model_name: str,
    converted_from: str,
    scores: Mapping[str, Any],
    test_file: str | Path,
    source_lang: str,
    target_lang: str,
    license: str | None,
    license_name: str | None = None,
    license_link: str | None = None,
) -> Path:
    """The model card of a converted model folder (`folder/README.md`): the model whose weights it holds
    (`converted_from`, a folder or a Hub id, linked as `base_model` if it is not a folder here) and its
    `scores` on `test_file`, an `evaluate_model` result decoded with the folder's generation config.
    No training is described: the card of `converted_from` describes it."""
    folder = Path(folder)
    local = Path(converted_from).exists()
    return write_model_card(
        folder,
        model_name=model_name,
        config=VanillaTransformerConfig.from_pretrained(folder),
        metrics=evaluation_metrics(scores, GenerationConfig.from_pretrained(folder), Path(test_file).name),
        training={
            "converted_from": Path(converted_from).resolve().name if local else converted_from,
            "converted_from_hub": not local,
        },
        dataset={},
        source_lang=source_lang,
        target_lang=target_lang,
        license=license,
        license_name=license_name,
        license_link=license_link,
        examples=list(scores["sources"][:3]),
    )


__all__ = ["config_from_marian", "convert_from_marian", "write_converted_card"]
