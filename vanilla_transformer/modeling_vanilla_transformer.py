"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a transformers model.

It imports torch, transformers and two sibling files: the configuration, and
`kernels_vanilla_transformer.py`, the machinery beside the paper (kernels chosen by measurement, cheaper
dropout on CPU, packing of padded batches, the chunked loss, input checks, leaner generation steps, what
`save_pretrained` adds). All three are copied next to saved checkpoints, with
`pipeline_vanilla_transformer.py` (the translation pipeline), so that
`AutoModelForSeq2SeqLM.from_pretrained(..., trust_remote_code=True)` and `pipeline(...)` work without
this package.

Read top to bottom it follows the paper: positional encoding (3.5), scaled dot-product attention
(3.2.1), multi-head attention (3.2.2), encoder and decoder layers (3.1, 3.3), the stacks, the model
and the model with its pre-softmax projection (3.4).

Shape legend:
    B  batch size            S  source length        T  target length (this step)
    P  cached target length  H  attention heads      Dh head width d_k = d_model / H
    D  d_model               F  d_ff                 V  vocabulary size
"""

from __future__ import annotations

import ast
import copy
import logging
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    create_bidirectional_mask,
    create_causal_mask,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple
from transformers.utils import logging as hf_logging
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_vanilla_transformer import VanillaTransformerConfig, is_integer
from .kernels_vanilla_transformer import (
    EMPTY_BATCH,
    LeanGenerationSteps,
    Linear,
    PackedTokens,
    PositionTable,
    RemoteCodeFolder,
    TokenPacking,
    bare_linear,
    check_mask,
    check_token_ids,
    decoding_attention,
    dropout,
    global_module_hooks,
    joint_projection,
    kept_copies,
    layer_norm_of,
    linear_of,
    loss_dtype,
    loss_without_logits,
    merge_heads,
    new_generate_call,
    per_item,
    reads_are_free,
    split_heads,
    unlikelihood_candidates,
    unlikelihood_loss,
    unwrapped,
)

if TYPE_CHECKING:
    from typing import Unpack

# When neither `max_length` nor `max_new_tokens` is given, generation stops after the source length
# plus this many tokens (paper Section 6.1: "maximum output length to input length + 50").
DEFAULT_MAX_LENGTH_OFFSET = 50


def sinusoidal_position_encoding(
    positions: torch.Tensor, d_model: int, layout: str = "interleaved", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Sinusoidal positional encoding (Section 3.5), for positions of any shape (...) -> (..., d_model).

    PE(pos, 2i) = sin(pos / 10000^(2i/d_model)) and PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    Computed on the fly for any positions, so there is no maximum length and nothing to store in a
    checkpoint. `layout="concatenated"` puts all sines before all cosines (transformers' Marian).
    The angles are computed in float64 where the device allows it, so that large positions stay exact.
    """
    compute_dtype = torch.float32 if positions.device.type == "mps" else torch.float64
    two_i = torch.arange(0, d_model, 2, device=positions.device, dtype=compute_dtype)
    inv_freq = torch.pow(10000.0, -two_i / d_model)  # (D/2,)
    angles = positions.to(compute_dtype)[..., None] * inv_freq  # (..., D/2)
    if layout == "interleaved":
        encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., D)
    elif layout == "concatenated":
        encoding = torch.cat((angles.sin(), angles.cos()), dim=-1)  # (..., D)
    else:
        raise ValueError(f"Unknown position encoding layout {layout!r}.")
    return encoding.to(dtype)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (Section 3.2.1, Equation 1).

    `attention_mask` is additive (0 where allowed, a large negative number where masked), or boolean
    (True where allowed, as SDPA reads it: a 4-D mask given by hand reaches attention as it is).
    Returns the output as (B, T, H, Dh) and the attention probabilities as (B, H, T, S).
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, T, S)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    # At least float32 (half-precision scores would lose the small probabilities); float64 stays float64.
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, T, H, Dh)
    return output, weights


class VanillaTransformerAttention(nn.Module):
    """Multi-head attention, MultiHead(Q, K, V) = Concat(head_1..head_h) W^O (Section 3.2.2).

    Used three ways (Section 3.2.3): encoder self-attention, masked decoder self-attention
    (`is_causal=True`) and encoder-decoder attention (`key_value_states` = encoder output).
    The four projections have no biases, as the paper's W^Q, W^K, W^V and W^O; `config.attention_bias`
    adds them (zero at initialisation), as fairseq's and Marian's have.
    """

    def __init__(
        self, config: VanillaTransformerConfig, is_causal: bool = False, layer_idx: int | None = None
    ):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = config.d_model // config.num_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        bias = config.attention_bias
        self.q_proj = Linear(config.d_model, config.d_model, bias=bias)
        self.k_proj = Linear(config.d_model, config.d_model, bias=bias)
        self.v_proj = Linear(config.d_model, config.d_model, bias=bias)
        self.out_proj = Linear(config.d_model, config.d_model, bias=bias)
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            projection.init_gain = config.qkv_init_gain  # read by `_init_weights`

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[PackedTokens],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states: (B, T, D); key_value_states: (B, S, D) for cross-attention. Returns (B, T, D)
        and the attention weights (B, H, T, S), None where the attention function computes none.

        (`kwargs` may say that the states are packed tokens, (N, D): see `PackedTokens`. Other keyword
        arguments, given to the model's `forward`, go to the attention function, as in transformers'
        models: a function registered with `AttentionInterface` may take arguments of its own.)
        """
        is_cross_attention = key_value_states is not None
        packing, encoder_packing = kwargs.pop("packing", None), kwargs.pop("encoder_packing", None)
        # A decoding step's self-attention: Q, K and V from one product with the three matrices stacked.
        # That stacked copy is checked against the weights once per decoding, whose start the decoder
        # cannot tell for a static cache where it does not read the cache's length (an accelerator):
        # there the products stay separate.
        joint = None
        if (
            cache is not None
            and not is_cross_attention
            and packing is None
            and (not cache.is_compileable or reads_are_free(hidden_states))
        ):
            joint = joint_projection(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        projected = self.q_proj(hidden_states) if joint is None else joint[0]
        query = split_heads(projected, self.head_dim, packing)  # (B, H, T, Dh)

        layer_cache, reuse = None, False
        if cache is not None:
            layer_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache
            # Cross-attention keys/values depend only on the encoder output: computed once, then reused.
            reuse = is_cross_attention and cache.is_updated.get(self.layer_idx, False)

        if reuse:
            key = layer_cache.layers[self.layer_idx].keys
            value = layer_cache.layers[self.layer_idx].values
        else:
            source = key_value_states if is_cross_attention else hidden_states
            source_packing = encoder_packing if is_cross_attention else packing
            keys, values = (self.k_proj(source), self.v_proj(source)) if joint is None else joint[1:]
            key = split_heads(keys, self.head_dim, source_packing)  # (B, H, S, Dh)
            value = split_heads(values, self.head_dim, source_packing)
            if layer_cache is not None:
                key, value = layer_cache.update(key, value, self.layer_idx)  # (B, H, P+T, Dh)
                if is_cross_attention:
                    cache.is_updated[self.layer_idx] = True

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        if attention_interface is sdpa_attention_forward:  # decoding steps: SDPA or matmul, measured
            attention_interface = decoding_attention
        output, weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.out_proj(merge_heads(output, packing)), weights  # (B, T, D)


class VanillaTransformerLayer(GradientCheckpointingLayer):
    """What encoder and decoder layers share: the residual connections and the feed-forward network.

    Section 5.4: each sub-layer output becomes LayerNorm(x + Dropout(Sublayer(x))) (post-LN). With
    `config.norm_first` the LayerNorm moves in front: x + Dropout(Sublayer(LayerNorm(x))) (pre-LN).
    """

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.norm_first = config.norm_first
        self.dropout = config.dropout
        self.activation_fn = ACT2FN[config.activation_function]
        self.activation_dropout = config.activation_dropout
        self.fc1 = Linear(config.d_model, config.d_ff)
        self.fc2 = Linear(config.d_ff, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def _sublayer_input(self, hidden_states: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        return norm(hidden_states) if self.norm_first else hidden_states

    def _sublayer_output(
        self, residual: torch.Tensor, output: torch.Tensor, norm: nn.LayerNorm
    ) -> torch.Tensor:
        hidden_states = residual + dropout(output, self.dropout, self.training)
        return hidden_states if self.norm_first else norm(hidden_states)

    def _feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """FFN(x) = max(0, x W1 + b1) W2 + b2 (Section 3.3), as a residual sub-layer."""
        residual = hidden_states
        # On (tokens, D) rows: a linear layer's output for (B, L, D) inputs is a view of a 2-D product,
        # and an in-place ReLU on a view makes autograd copy the (tokens x d_ff) gradient three times.
        rows = self._sublayer_input(hidden_states, self.final_layer_norm).reshape(-1, residual.shape[-1])
        hidden_states = self.fc1(rows)  # (tokens, F)
        if unwrapped(self.activation_fn, nn.ReLU):  # in place: saves a (tokens x d_ff) tensor
            hidden_states = F.relu(hidden_states, inplace=True)
        else:
            hidden_states = self.activation_fn(hidden_states)
        hidden_states = dropout(hidden_states, self.activation_dropout, self.training)  # (tokens, F)
        output = self.fc2(hidden_states).reshape(residual.shape)
        return self._sublayer_output(residual, output, self.final_layer_norm)


class VanillaTransformerEncoderLayer(VanillaTransformerLayer):
    """Encoder layer: multi-head self-attention, then the feed-forward network (Section 3.1)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.self_attn = VanillaTransformerAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[PackedTokens],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states: (B, S, D). Returns the new hidden states and the self-attention weights."""
        residual = hidden_states
        hidden_states, weights = self.self_attn(
            self._sublayer_input(hidden_states, self.self_attn_layer_norm),
            attention_mask=attention_mask,
            **kwargs,
        )
        hidden_states = self._sublayer_output(residual, hidden_states, self.self_attn_layer_norm)
        return self._feed_forward(hidden_states), weights


# A decoder layer's sub-layer modules, by name, as its `decoding_step` reads them.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
_LAYER_NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")


class VanillaTransformerDecoderLayer(VanillaTransformerLayer):
    """Decoder layer: masked self-attention, encoder-decoder attention, feed-forward (Section 3.1).

    The self-attention is causal, so the prediction for position i depends only on positions < i + 1.
    """

    def __init__(self, config: VanillaTransformerConfig, layer_idx: int):
        super().__init__(config)
        self.self_attn = VanillaTransformerAttention(config, is_causal=True, layer_idx=layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.encoder_attn = VanillaTransformerAttention(config, layer_idx=layer_idx)
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        # These run at every decoding step (Q, K, V too, as one product): see `Linear`.
        for layer in (self.self_attn.out_proj, self.encoder_attn.q_proj, self.encoder_attn.out_proj):
            layer.per_step = True
        self.fc1.per_step = self.fc2.per_step = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        use_cache: bool = False,
        **kwargs: Unpack[PackedTokens],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """hidden_states: (B, T, D); encoder_hidden_states: (B, S, D).

        Returns the new hidden states, the self-attention and the cross-attention weights.
        """
        residual = hidden_states
        hidden_states, self_weights = self.self_attn(
            self._sublayer_input(hidden_states, self.self_attn_layer_norm),
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = self._sublayer_output(residual, hidden_states, self.self_attn_layer_norm)

        residual = hidden_states
        hidden_states, cross_weights = self.encoder_attn(
            self._sublayer_input(hidden_states, self.encoder_attn_layer_norm),
            key_value_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = self._sublayer_output(residual, hidden_states, self.encoder_attn_layer_norm)
        return self._feed_forward(hidden_states), self_weights, cross_weights

    def decoding_step(
        self,
        hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None,
        cache: EncoderDecoderCache,
    ) -> torch.Tensor | None:
        """`forward` for a step of cached decoding once the cross-attention cache is filled, (B, 1, D) ->
        (B, 1, D), reading the sub-layers' weights instead of calling their modules and the attention's
        general `forward`: the same products, kernels and order, without 10 sub-layer module calls and
        their Python, which at batch 1 cost about as much as the tiny model's products. For the
        decoder's `decoding_step`, which checks the rest (SDPA attention, a dynamic cache, no global
        hooks). None (call `forward`) where a sub-layer's module must run: hooks, adapters, offloading,
        wrappers (`unwrapped`), or training mode. `encoder_attention_mask` is the cross-attention mask
        as `decoding_attention` takes it."""
        # Submodules are read from `_modules`: `nn.Module` attribute lookups would cost more than the checks.
        modules = self._modules
        self_attn, encoder_attn = modules["self_attn"], modules["encoder_attn"]
        if (
            self.training
            or self_attn.training
            or encoder_attn.training
            or not unwrapped(self_attn, VanillaTransformerAttention)
            or not unwrapped(encoder_attn, VanillaTransformerAttention)
        ):
            return None
        q_proj, k_proj, v_proj, out_proj = (self_attn._modules[name] for name in _PROJECTIONS)
        cross_q_proj, cross_out_proj = encoder_attn._modules["q_proj"], encoder_attn._modules["out_proj"]
        fc1, fc2 = modules["fc1"], modules["fc2"]
        self_norm, cross_norm, ffn_norm = (modules[name] for name in _LAYER_NORMS)
        if (
            not all(bare_linear(layer) for layer in (q_proj, k_proj, v_proj, out_proj, fc1, fc2))
            or not (bare_linear(cross_q_proj) and bare_linear(cross_out_proj))
            or not all(unwrapped(norm, nn.LayerNorm) for norm in (self_norm, cross_norm, ffn_norm))
        ):
            return None
        norm_first, head_dim = self.norm_first, self_attn.head_dim  # both attentions' head width

        def attend(attention: nn.Module, query, key, value, mask, projection: nn.Module) -> torch.Tensor:
            output = decoding_attention(attention, query, key, value, mask, scaling=attention.scaling)[0]
            return linear_of(projection, merge_heads(output))  # (B, 1, D)

        def sublayer_input(states: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
            return layer_norm_of(norm, states) if norm_first else states

        def sublayer_output(residual: torch.Tensor, output: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
            return residual + output if norm_first else layer_norm_of(norm, residual + output)

        # Masked self-attention: this step's query over the cached keys and values and its own.
        inputs = sublayer_input(hidden_states, self_norm)
        projected = joint_projection(inputs, (q_proj, k_proj, v_proj))
        if projected is None:
            projected = tuple(linear_of(layer, inputs) for layer in (q_proj, k_proj, v_proj))
        query, key, value = (split_heads(states, head_dim) for states in projected)  # (B, H, 1, Dh)
        key, value = cache.self_attention_cache.update(key, value, self_attn.layer_idx)
        output = attend(self_attn, query, key, value, None, out_proj)
        hidden_states = sublayer_output(hidden_states, output, self_norm)

        # Encoder-decoder attention over the cached projections of the encoder output.
        query = split_heads(linear_of(cross_q_proj, sublayer_input(hidden_states, cross_norm)), head_dim)
        cached = cache.cross_attention_cache.layers[encoder_attn.layer_idx]
        output = attend(
            encoder_attn, query, cached.keys, cached.values, encoder_attention_mask, cross_out_proj
        )
        hidden_states = sublayer_output(hidden_states, output, cross_norm)

        # Feed-forward network, as `_feed_forward` computes it.
        inner = linear_of(fc1, sublayer_input(hidden_states, ffn_norm))
        activation = self.activation_fn
        inner = F.relu(inner, inplace=True) if unwrapped(activation, nn.ReLU) else activation(inner)
        return sublayer_output(hidden_states, linear_of(fc2, inner), ffn_norm)


class VanillaTransformerPreTrainedModel(RemoteCodeFolder, PreTrainedModel):
    """Weight initialisation and loading glue shared by the models below.

    Initialisation follows fairseq: embeddings N(0, d_model^-0.5), so that embeddings scaled by
    sqrt(d_model) have unit variance; Xavier-uniform linear layers with zero biases, with the gain
    `config.qkv_init_gain` (2**-0.5) for attention's query, key and value projections.
    """

    config_class = VanillaTransformerConfig
    config: VanillaTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VanillaTransformerEncoderLayer", "VanillaTransformerDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _can_compile_fullgraph = False

    def __init__(self, config: VanillaTransformerConfig, *inputs: Any, **kwargs: Any) -> None:
        # The configuration checks its fields when built and loaded; a field set afterwards
        # (`config.num_heads = 5`, `config.update(...)`) is checked here, before it shapes a layer.
        config._check_values()
        super().__init__(config, *inputs, **kwargs)

    def mark_tied_weights_as_initialized(self, loading_info: Any) -> None:
        """transformers' marking of tied weights as initialised before loading's initialisation runs,
        which would leave a missing shared embedding on the meta device, unreported. The encoder and the
        decoder hold `shared`'s module itself, so marking their weights (tied targets) marked `shared.weight`
        too, and transformers then dropped it from the missing keys as one loaded through a shared module:
        a checkpoint without it (or with the matrix under `lm_head.weight` only) loaded silently with a
        meta tensor, or failed in a comparison of meta tensors. A tie source missing from the checkpoint and
        loaded through none of its names stays missing: initialised, or tied from the copy present, as
        MarianMTModel's is."""
        missing = set(loading_info.missing_keys)
        super().mark_tied_weights_as_initialized(loading_info)
        for source in set(self.all_tied_weights_keys.values()) & missing:
            weight = self.get_parameter(source)
            if weight.is_meta:  # not loaded under another of its names
                loading_info.missing_keys.add(source)
                weight._is_hf_initialized = False

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            init.xavier_uniform_(module.weight, gain=getattr(module, "init_gain", 1.0))
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif (
            isinstance(module, VanillaTransformerForConditionalGeneration)
            and module.final_logits_bias is not None
        ):
            init.zeros_(module.final_logits_bias)


def requested_outputs(
    config: VanillaTransformerConfig, output_attentions: bool | None, output_hidden_states: bool | None
) -> tuple[bool, bool]:
    """Whether to return attentions and hidden states: the arguments, else the configuration's fields.
    Attentions need an attention function that computes the weights: transformers' SDPA, flash and flex
    functions do not (a ValueError); the eager one does, and a user's own function returns what it may."""
    output_attentions = config.output_attentions if output_attentions is None else output_attentions
    output_hidden_states = (
        config.output_hidden_states if output_hidden_states is None else output_hidden_states
    )
    # (looked up only when asked: every forward runs this, and a name the interface lacks raises there)
    if output_attentions and any(
        ALL_ATTENTION_FUNCTIONS.get(config._attn_implementation) is weightless
        for weightless in (sdpa_attention_forward, flash_attention_forward, flex_attention_forward)
    ):
        raise ValueError(
            f"`output_attentions=True` needs the eager attention, but this model uses "
            f"{config._attn_implementation!r}: load it with `attn_implementation='eager'` "
            "or call `model.set_attn_implementation('eager')`."
        )
    return output_attentions, output_hidden_states


def leading_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B,) the padding positions before each row's first token of a (B, S) mask, or None where no row
    is padded on the left (read on the host only where that is free: on an accelerator the count is
    computed, never waited for)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    if reads_are_free(attention_mask) and bool(attention_mask[:, 0].all()):
        return None
    return (attention_mask.cumsum(-1) == 0).sum(-1)


def may_read(mask: torch.Tensor | None) -> bool:
    """Whether transformers' mask builders may read `mask` to skip it when nothing is masked (on CPU)."""
    return mask is None or reads_are_free(mask)


# transformers' own mask builders (`AttentionMaskInterface`): a model may skip one where it would give
# no mask, or one the attention does without.
TRANSFORMERS_MASK_BUILDERS = (sdpa_mask, eager_mask, flash_attention_mask, flex_attention_mask)


def masks_are_transformers(config: VanillaTransformerConfig) -> bool:
    """Whether the masks of the model's attention are built by one of transformers' own builders (or by
    none: a name without one gets no masks). Where a user registered a builder of their own under the
    name (`AttentionMaskInterface.register`, a local window say), every mask goes through it, as in
    transformers' models: no step skips one."""
    builder = ALL_MASK_ATTENTION_FUNCTIONS.get(config._attn_implementation)
    return builder is None or any(builder is own for own in TRANSFORMERS_MASK_BUILDERS)


def runs_transformers_sdpa(config: VanillaTransformerConfig) -> bool:
    """Whether the model's attention is transformers' SDPA function with transformers' SDPA mask builder:
    where this model's own masks and decoding steps compute what they would. A function or a builder
    registered by a user under the name gets the masks transformers' builders give."""
    name = config._attn_implementation
    return (
        ALL_ATTENTION_FUNCTIONS.get_interface(name, None) is sdpa_attention_forward
        and ALL_MASK_ATTENTION_FUNCTIONS.get(name) is sdpa_mask
    )


def padding_mask(
    config: VanillaTransformerConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    encoder_hidden_states: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The mask of padded keys (a (B, S) `attention_mask`) as the attention function takes it; None where
    nothing is padded. transformers' builder (`create_bidirectional_mask`) gives SDPA a (B, 1, T, S)
    mask, materialised; on the CPU this gives it (B, 1, 1, S), broadcast over the T queries, which torch's
    CPU flash kernel reads without expanding: one 4,000-token source batched with two short ones took
    230 MB more memory and 3x the time in SDPA with the full mask, and a 10,000-token one over 3 GB.
    Elsewhere (eager attention, which materialises its scores anyway; accelerators; a 4-D mask given
    by hand; export and tracing), transformers' builder."""
    if (
        runs_transformers_sdpa(config)
        and attention_mask is not None
        and attention_mask.dim() == 2
        and reads_are_free(attention_mask)
        and inputs_embeds.device.type == "cpu"
    ):
        return None if bool(attention_mask.all()) else attention_mask[:, None, None, :].to(torch.bool)
    return create_bidirectional_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        encoder_hidden_states=encoder_hidden_states,
        allow_is_bidirectional_skip=may_read(attention_mask),  # (it reads whether all are 1)
    )


class VanillaTransformerStack(nn.Module):
    """What encoder and decoder share: token embeddings x sqrt(d_model) + sinusoidal positions (Sections
    3.4, 3.5), dropout, N layers, and with pre-LN a final LayerNorm."""

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding, layers: list[nn.Module]):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.position_table = PositionTable(
            config.d_model, config.position_encoding_layout, sinusoidal_position_encoding
        )
        self.dropout = config.dropout
        self.layers = nn.ModuleList(layers)
        self.layer_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None
        )

    @staticmethod
    def _reported(
        hidden_states: torch.Tensor, packing: TokenPacking | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's output as `hidden_states` reports it, (B, L, D), and the states the next layer takes.

        Packed tokens (N, D) go on packed again from the report (the same values): the reported tensors
        stay in the computation, so that gradients reach them (`retain_grad()` on an output's hidden
        states), as in transformers' models, where the next layer takes the very tensor reported.
        """
        if packing is None:
            return hidden_states, hidden_states
        reported = packing.unpack(hidden_states)
        return reported, packing.pack(reported)

    def _stack_output(
        self,
        hidden_states: torch.Tensor,
        all_hidden_states: tuple[torch.Tensor, ...] | None,
        packing: TokenPacking | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The stack's output (B, L, D), after the final LayerNorm with pre-LN, and the hidden states,
        whose last entry is that very tensor, as in transformers' models (pre-LN ones included)."""
        if self.layer_norm is None and all_hidden_states is not None:
            return all_hidden_states[-1], all_hidden_states
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        output = hidden_states if packing is None else packing.unpack(hidden_states)
        if all_hidden_states is not None:
            all_hidden_states = (*all_hidden_states[:-1], output)
        return output, all_hidden_states


class VanillaTransformerEncoder(VanillaTransformerStack):
    """The encoder: embeddings x sqrt(d_model) + positions, dropout, then N encoder layers (Section 3.1)."""

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding):
        layers = [VanillaTransformerEncoderLayer(config) for _ in range(config.num_encoder_layers)]
        super().__init__(config, embed_tokens, layers)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput:
        """input_ids: (B, S) token ids; attention_mask: (B, S), 1 for tokens and 0 for padding.

        `inputs_embeds` (B, S, D) replaces the (unscaled) token embedding lookup, as
        `get_input_embeddings()(input_ids)` gives it; it is scaled here as the lookup is (MarianMTModel's
        encoder takes it already scaled instead; its decoder, like this one, does not).
        Returns `last_hidden_state` (B, S, D) and, on request (the arguments, else the configuration's
        fields), per-layer hidden states and attentions. Other keyword arguments go to the attention
        function.
        """
        output_attentions, output_hidden_states = requested_outputs(
            self.config, output_attentions, output_hidden_states
        )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds` to the encoder.")
        if inputs_embeds is None:
            check_token_ids("input_ids", input_ids, self.config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, length = inputs_embeds.shape[:2]
        check_mask("attention_mask", attention_mask, batch_size, length)
        if batch_size == 0:
            raise ValueError(EMPTY_BATCH)
        if length == 0:
            raise ValueError(
                "The source sequence is empty: every input needs at least one token (e.g. </s>)."
            )

        positions = self.position_table(0, length, inputs_embeds.device, inputs_embeds.dtype)  # (S, D)
        shift = leading_padding(attention_mask)
        if shift is not None:  # a row padded on the left starts at position 0 where its tokens start
            index = (torch.arange(length, device=shift.device) - shift[:, None]).clamp_(min=0)  # (B, S)
            positions = positions[index]  # (B, S, D)
        hidden_states = inputs_embeds * self.embed_scale + positions
        # Padding is never attended to, so only real tokens go through the layers (zeros come back).
        packing = TokenPacking.from_mask(attention_mask)
        if packing is not None:
            hidden_states = packing.pack(hidden_states)  # (N, D)
        hidden_states = dropout(hidden_states, self.dropout, self.training)
        mask = padding_mask(self.config, inputs_embeds, attention_mask)

        all_hidden_states = None
        if output_hidden_states:
            reported, hidden_states = self._reported(hidden_states, packing)
            all_hidden_states = (reported,)
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            hidden_states, weights = layer(hidden_states, mask, packing=packing, **kwargs)
            if output_hidden_states:
                reported, hidden_states = self._reported(hidden_states, packing)
                all_hidden_states += (reported,)
            if output_attentions:
                all_attentions += (weights,)
        output, all_hidden_states = self._stack_output(hidden_states, all_hidden_states, packing)

        return BaseModelOutput(
            last_hidden_state=output,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )


def encoder_decoder_cache(cache: Any, config: VanillaTransformerConfig) -> EncoderDecoderCache:
    """The cache a decoder-only model takes (`generate(cache=DynamicCache())`, as for a language model)
    made an encoder-decoder one: it holds the self-attention's keys and values, and a new one the
    cross-attention's (computed from the encoder output at the first step). It failed deep inside the
    attention. Any other kind is refused, naming the kind this model takes."""
    if type(cache) is DynamicCache:
        return EncoderDecoderCache(cache, DynamicCache(config=config))
    raise TypeError(
        f"This encoder-decoder model's cache is an EncoderDecoderCache (self-attention and cross-attention "
        f"caches), e.g. EncoderDecoderCache(DynamicCache(), DynamicCache()); got a {type(cache).__name__}."
    )


class VanillaTransformerDecoder(VanillaTransformerStack):
    """The decoder: shifted target embeddings + positions, then N decoder layers (Section 3.1).

    Positions continue from the cache length during incremental decoding.
    """

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding):
        layers = [
            VanillaTransformerDecoderLayer(config, layer_idx=i) for i in range(config.num_decoder_layers)
        ]
        super().__init__(config, embed_tokens, layers)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        target_lengths: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """input_ids: (B, T) target ids (shifted right); attention_mask: (B, P + T) with 0 on padding.

        encoder_hidden_states: (B, S, D); encoder_attention_mask: (B, S). Returns `last_hidden_state`
        (B, T, D) and the updated `cache` when `use_cache`. `use_cache`, `output_attentions` and
        `output_hidden_states` left None take the configuration's fields, as in transformers' decoders.
        target_lengths: (B,) optional, without a cache: only the first `target_lengths[b]` positions of
        row b are needed. Attention is causal, so the positions after them cannot change them and are
        skipped (they come back as zeros). The loss uses it to skip trailing target padding. Other
        keyword arguments go to the attention function.
        """
        output_attentions, output_hidden_states = requested_outputs(
            self.config, output_attentions, output_hidden_states
        )
        if use_cache is None:  # the configuration's, but `target_lengths` asks for a forward without one
            use_cache = self.config.use_cache and target_lengths is None
        elif use_cache and target_lengths is not None:
            raise ValueError("`target_lengths` skips positions a cache would need: pass `use_cache=False`.")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `decoder_input_ids` and `decoder_inputs_embeds`.")
        if encoder_hidden_states is None:
            raise ValueError("The decoder needs `encoder_hidden_states` (the encoder output) to attend to.")
        if cache is not None and not isinstance(cache, EncoderDecoderCache):
            cache = encoder_decoder_cache(cache, self.config)
        # An int, or a tensor for static (compilable) caches; checks that would read it are skipped
        # inside torch.compile, where they would break the graph.
        past_length = cache.get_seq_length() if cache is not None else 0
        checking = not torch.compiler.is_compiling()
        if inputs_embeds is None:
            # Later steps of cached decoding feed back the model's own tokens: checked once.
            if checking and past_length == 0:
                check_token_ids("decoder_input_ids", input_ids, self.config.decoder_vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, length = inputs_embeds.shape[:2]
        if batch_size == 0:
            raise ValueError(EMPTY_BATCH)
        if (
            use_cache
            and self.training
            and torch.is_grad_enabled()
            and any(layer.gradient_checkpointing for layer in self.layers)  # not all: `every_n_layers`
        ):
            # Checkpointed layers drop the cache (their backward replay would write it twice): the empty
            # cache returned would restart a later decoding at position 0, or, where only some layers
            # are checkpointed (`every_n_layers`), leave those layers without the earlier positions.
            # None, as transformers' models.
            hf_logging.get_logger(__name__).warning_once(
                "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
            )
            use_cache = False
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        # A decoding starts (in `generate` or a loop of the user's own, a static cache reused after its
        # `reset()` too): the weight copies kept for other kernels are checked against the weights'
        # current values once in it. Fused optimisers (transformers' default) and writes through `.data`
        # change values without the version counter that a copy is otherwise kept by. Only decodings
        # with a cache use such copies (`kept_copies`, below), and only on the CPU, where reading the
        # length is free.
        if checking and cache is not None:
            if isinstance(past_length, int):
                starting = past_length == 0
            else:  # a static cache's length, a tensor
                starting = reads_are_free(past_length) and int(past_length) == 0
            if starting:
                new_generate_call()
        if checking:
            # Attention would broadcast a batch of 1 against the other's rows: one source (or target)
            # silently paired with every row of the other, where the batches were meant to match.
            if encoder_hidden_states.shape[0] != batch_size:
                raise ValueError(
                    f"The decoder inputs hold {batch_size} sequences but the encoder output (`input_ids`, "
                    f"`inputs_embeds` or `encoder_outputs`) {encoder_hidden_states.shape[0]}: one target "
                    "per source is needed."
                )
            check_mask("decoder_attention_mask", attention_mask, batch_size, past_length + length)
            check_mask("attention_mask", encoder_attention_mask, batch_size, encoder_hidden_states.shape[1])

        capacity = cache.get_max_length() if isinstance(past_length, torch.Tensor) else None
        position_encoding = self.position_table(
            past_length, length, inputs_embeds.device, inputs_embeds.dtype, capacity
        )  # (T, D)
        hidden_states = inputs_embeds * self.embed_scale + position_encoding
        packing = encoder_packing = None
        if cache is None:  # one full forward (teacher forcing): per-token work on the needed tokens only
            if target_lengths is not None:
                needed = torch.arange(length, device=hidden_states.device) < target_lengths[:, None].to(
                    hidden_states.device
                )
                packing = TokenPacking.from_mask(needed)
            encoder_packing = TokenPacking.from_mask(encoder_attention_mask)
        if packing is not None:
            hidden_states = packing.pack(hidden_states)  # (N, D)
        encoder_states = encoder_hidden_states
        if encoder_packing is not None:
            encoder_states = encoder_packing.pack(encoder_hidden_states)  # (N_S, D)
        hidden_states = dropout(hidden_states, self.dropout, self.training)

        if (
            length == 1
            and attention_mask is None
            and cache is not None
            and not cache.is_compileable
            and masks_are_transformers(self.config)
        ):
            self_mask = None  # one new token may attend to every cached position: nothing to mask
        else:
            self_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache.self_attention_cache if cache is not None else None,
                allow_is_causal_skip=may_read(attention_mask),
            )
        cross_mask = self._cross_mask(inputs_embeds, encoder_hidden_states, encoder_attention_mask)

        all_hidden_states = None
        if output_hidden_states:
            reported, hidden_states = self._reported(hidden_states, packing)
            all_hidden_states = (reported,)
        all_self_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions else None
        with kept_copies(cache is not None):
            for layer in self.layers:
                hidden_states, self_weights, cross_weights = layer(
                    hidden_states,
                    self_mask,
                    encoder_states,
                    encoder_attention_mask=cross_mask,
                    cache=cache,
                    use_cache=use_cache,
                    packing=packing,
                    encoder_packing=encoder_packing,
                    **kwargs,
                )
                if output_hidden_states:
                    reported, hidden_states = self._reported(hidden_states, packing)
                    all_hidden_states += (reported,)
                if output_attentions:
                    all_self_attentions += (self_weights,)
                    all_cross_attentions += (cross_weights,)
        output, all_hidden_states = self._stack_output(hidden_states, all_hidden_states, packing)

        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=output,
            cache=cache if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_self_attentions,
            cross_attentions=all_cross_attentions,
        )

    def _cross_mask(
        self, inputs_embeds: torch.Tensor, encoder_hidden_states: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The encoder-decoder attention mask as the attention function takes it (None: no padding)."""
        return padding_mask(self.config, inputs_embeds, mask, encoder_hidden_states)

    def decoding_step(
        self,
        input_ids: torch.LongTensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None,
        cache: EncoderDecoderCache,
    ) -> torch.Tensor | None:
        """`forward` for one step of cached decoding, (B, 1) new token ids -> (B, 1, D) hidden states.

        The same computation without what `forward` does besides it at every step (input checks, mask
        and packing decisions, output objects) and without the layers' module calls: each layer runs its
        `decoding_step` (no sub-layer module calls either) or, where that does not apply, its `forward`.
        At batch 1 a step's matrices are small enough that this Python overhead is a large part of its time.
        None where it does not apply, and then `forward` is what to call: in training, for compilable
        (static) caches, at the first step (it fills the cross-attention cache), or where a layer is
        wrapped (hooks, offloading, subclasses), whose module call must run.
        """
        layers = self.layers
        if (
            self.training
            or type(cache) is not EncoderDecoderCache
            or cache.is_compileable
            or not all(cache.is_updated.get(index, False) for index in range(len(layers)))
            or global_module_hooks()
            or not all(unwrapped(layer, VanillaTransformerDecoderLayer) for layer in layers)
            or not masks_are_transformers(self.config)  # a user's builder gets its masks built
        ):
            return None
        inputs_embeds = self.embed_tokens(input_ids)  # (B, 1, D)
        hidden_states = inputs_embeds * self.embed_scale + self.position_table(
            cache.get_seq_length(), 1, inputs_embeds.device, inputs_embeds.dtype
        )
        cross_mask = self._cross_mask(inputs_embeds, encoder_hidden_states, encoder_attention_mask)
        # A layer's `decoding_step` computes attention as the SDPA implementation's `forward` does.
        sdpa = runs_transformers_sdpa(self.config)
        for layer in layers:
            stepped = layer.decoding_step(hidden_states, cross_mask, cache) if sdpa else None
            if stepped is None:
                stepped = layer.forward(
                    hidden_states, None, encoder_hidden_states, cross_mask, cache=cache, use_cache=True
                )[0]
            hidden_states = stepped
        return hidden_states if self.layer_norm is None else self.layer_norm(hidden_states)


def check_resized_vocabulary(
    config: VanillaTransformerConfig, new_num_tokens: int | None, pad_to_multiple_of: int | None
) -> int | None:
    """Refuse, before anything changes, what `resize_token_embeddings` cannot do right: a model with two
    embedding matrices (transformers would resize the encoder's alone), or a size that leaves a special
    token's id outside the vocabulary (the configuration's own checks, the decoder's too). Returns
    `pad_to_multiple_of` as a Python int (transformers refuses a NumPy one)."""
    if not config.share_encoder_decoder_embeddings:
        raise ValueError(
            "Resizing needs one embedding matrix shared by encoder and decoder "
            "(share_encoder_decoder_embeddings=True): this model has one of each (separate vocabularies, "
            "or one vocabulary in two matrices, as some converted Marian models)."
        )
    if pad_to_multiple_of is not None and not (is_integer(pad_to_multiple_of) and pad_to_multiple_of > 0):
        raise ValueError(  # (the size it gave was blamed on vocab_size)
            f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}."
        )
    if pad_to_multiple_of is not None:
        pad_to_multiple_of = int(pad_to_multiple_of)
    if new_num_tokens is None:
        return pad_to_multiple_of
    resized = copy.copy(config)
    size = new_num_tokens
    if pad_to_multiple_of:
        size = math.ceil(new_num_tokens / pad_to_multiple_of) * pad_to_multiple_of
    resized.vocab_size = size
    if config.share_encoder_decoder_embeddings:
        resized.decoder_vocab_size = resized.vocab_size
    resized._check_values()
    return pad_to_multiple_of


class VanillaTransformerModel(VanillaTransformerPreTrainedModel):
    """Encoder and decoder sharing one embedding matrix (Section 3.4), without the output projection.

    With `config.share_encoder_decoder_embeddings=False` (Marian checkpoints with two vocabularies, or
    with one vocabulary and two matrices) the encoder and the decoder each have their own embedding
    matrix and there is no `shared`.
    """

    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        if config.share_encoder_decoder_embeddings:
            self.shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
            source_embedding = target_embedding = self.shared
        else:
            self.shared = None
            self._tied_weights_keys = {}
            source_embedding = nn.Embedding(
                config.vocab_size, config.d_model, padding_idx=config.pad_token_id
            )
            target_embedding = nn.Embedding(
                config.decoder_vocab_size, config.d_model, padding_idx=config.pad_token_id
            )
        self.encoder = VanillaTransformerEncoder(config, source_embedding)
        self.decoder = VanillaTransformerDecoder(config, target_embedding)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Source and target embeddings are one matrix whatever `tie_word_embeddings` says about the
        # output projection, so this tie holds unconditionally.
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if not self.config.share_encoder_decoder_embeddings:
            raise ValueError(
                "This model has separate source and target vocabularies; set each embedding itself."
            )
        self.shared = value
        self.encoder.embed_tokens = value
        self.decoder.embed_tokens = value

    def resize_token_embeddings(
        self,
        new_num_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        mean_resizing: bool = True,
    ) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings` of the shared matrix, with `decoder_vocab_size`
        following `vocab_size`: left as it was, the decoder refused the new ids and the saved folder
        failed to load. A size that would leave a special token's id outside the vocabulary, or a model
        with two embedding matrices, is refused before anything changes."""
        pad_to_multiple_of = check_resized_vocabulary(self.config, new_num_tokens, pad_to_multiple_of)
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.config.decoder_vocab_size = self.config.vocab_size  # one shared matrix, one size
        return embeddings

    def get_encoder(self, modality: str | None = None) -> VanillaTransformerEncoder:
        return self.encoder

    @can_return_tuple
    # transformers' models take the cache's former name until 5.40 (with a warning): without this it
    # would be swallowed by `**kwargs`, and decoding would silently restart from an empty cache.
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        target_lengths: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Seq2SeqModelOutput:
        """input_ids: (B, S); decoder_input_ids: (B, T).

        Returns the decoder states (B, T, D) and the encoder states (B, S, D). `target_lengths` (B,):
        see `VanillaTransformerDecoder.forward`. Other keyword arguments go to the attention function
        (one registered with transformers' `AttentionInterface` may take arguments of its own).
        """
        output_attentions, output_hidden_states = requested_outputs(
            self.config, output_attentions, output_hidden_states
        )  # (`use_cache` None: the decoder's default)

        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                return_dict=True,
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                **kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)

        decoder_outputs = self.decoder(
            return_dict=True,
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            target_lengths=target_lengths,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            cache=decoder_outputs.cache,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from labels (B, T): prepend the start token, drop the last token, -100 -> pad."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


def label_smoothed_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    smoothing: float,
    num_items_in_batch: int | torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    unlikelihood: float = 0.0,
) -> torch.Tensor:
    """Cross entropy against (1 - eps) one-hot + eps / V uniform targets, over labels != -100 (Section 5.4).

    logits: (N, V); labels: (N,). Averaged over the non-ignored tokens, or summed and divided by
    `num_items_in_batch` (the token count of the whole accumulated batch) when it is given, so that
    gradient accumulation gives the same gradient as one large batch. With a positive `unlikelihood`
    weight, plus that times the token-level unlikelihood term of `candidates` (N, K)
    (`unlikelihood_candidates`; not in the paper).
    """
    loss = F.cross_entropy(
        logits.to(loss_dtype(logits.dtype)),
        labels,
        ignore_index=-100,
        label_smoothing=smoothing,
        reduction="sum",
    )
    if unlikelihood and candidates is not None:
        loss = loss + unlikelihood * unlikelihood_loss(logits, candidates)
    return per_item(loss, labels, num_items_in_batch)


class SourceLengthGenerationConfig(GenerationConfig):
    """The model's generation config: a `GenerationConfig` that tells a `max_length` filled in from
    transformers' defaults apart from one that was chosen.

    `Seq2SeqTrainer.prediction_step` fills the model's generation config's unset fields with transformers'
    defaults after each batch's `generate`, in place (`update(**defaults, defaults_only=True)`),
    `max_length` 20 among them. Taken as chosen, that length would switch off the paper's per-sentence
    limit (source length + `max_length_offset`, which applies while no length is set) from the next
    batch on, in every later `generate` and in the saved folder. Filled that way it is remembered as
    not chosen: the model's `generate` unsets it again (`unset_default_max_length`), and saving writes no
    length. Setting `max_length` in any other way (an attribute, `update` without `defaults_only`)
    chooses it.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "max_length":
            self.__dict__.pop(_MAX_LENGTH_FROM_DEFAULTS, None)
        super().__setattr__(name, value)

    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any) -> dict:
        was_unset = defaults_only and self.max_length is None
        unused = super().update(defaults_only, allow_custom_entries, **kwargs)
        if was_unset and self.max_length is not None:
            self.__dict__[_MAX_LENGTH_FROM_DEFAULTS] = True
        return unused

    def unset_default_max_length(self) -> None:
        """Unset `max_length` if transformers' defaults filled it in."""
        if self.__dict__.get(_MAX_LENGTH_FROM_DEFAULTS):
            self.max_length = None

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        if output.pop(_MAX_LENGTH_FROM_DEFAULTS, False):
            output["max_length"] = None
        return output

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        """transformers' checks, except that greedy search (`num_beams` 1) leaves the model's beam
        settings (the paper's `length_penalty` 0.6 and `early_stopping`) dormant rather than wrong: a
        configuration switched to greedy search saves (transformers refused it, so `save_pretrained`
        and Trainer's checkpoints failed after training), and the settings apply again with beams."""
        if self.num_beams is None or self.num_beams == 1:
            given = set(self.__dict__) if user_set_attributes is None else set(user_set_attributes)
            user_set_attributes = given - {"early_stopping", "length_penalty"}
        super().validate(strict=strict, user_set_attributes=user_set_attributes)


_MAX_LENGTH_FROM_DEFAULTS = "_max_length_from_defaults"


class _DormantBeamSettingsFilter(logging.Filter):
    """Drops transformers' warning that a greedy generation config's `early_stopping` and
    `length_penalty` "are not valid and may be ignored": it validates the folder's generation config as
    a plain `GenerationConfig` before the model's `SourceLengthGenerationConfig` takes it over, for which
    they are dormant beam settings (see its `validate`). A warning naming any other flag passes."""

    PREFIX = "The following generation flags are not valid and may be ignored: "

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        try:
            flags = ast.literal_eval(message[len(self.PREFIX) :].split("]")[0] + "]")
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(flags, list) and set(flags) <= {"early_stopping", "length_penalty"})


class VanillaTransformerForConditionalGeneration(
    VanillaTransformerPreTrainedModel, LeanGenerationSteps, GenerationMixin
):
    """The full Transformer: encoder-decoder plus the pre-softmax linear projection tied to the embeddings.

    Section 3.4: "we share the same weight matrix between the two embedding layers and the pre-softmax
    linear transformation". Training loss is label-smoothed cross entropy (Section 5.4).
    """

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    accepts_loss_kwargs = True

    @property
    def generation_config(self) -> GenerationConfig | None:
        return self.__dict__.get("_generation_config")

    @generation_config.setter
    def generation_config(self, value: GenerationConfig | None) -> None:
        # transformers assigns plain `GenerationConfig`s (`from_pretrained` loads one from the folder);
        # the model's own must keep the paper's length rule through transformers' default filling.
        if type(value) is GenerationConfig:
            value.__class__ = SourceLengthGenerationConfig
        self.__dict__["_generation_config"] = value

    def adjust_generation_fn(self, *args: Any, **kwargs: Any) -> None:
        """transformers' loading of the folder's generation config (in `from_pretrained`), without its
        warning about a greedy config's dormant beam settings (`_DormantBeamSettingsFilter`)."""
        quiet, logger = _DormantBeamSettingsFilter(), logging.getLogger(GenerationConfig.__module__)
        logger.addFilter(quiet)
        try:
            super().adjust_generation_fn(*args, **kwargs)
        finally:
            logger.removeFilter(quiet)

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.model = VanillaTransformerModel(config)
        if not config.share_encoder_decoder_embeddings:
            self._tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
        self.lm_head = Linear(config.d_model, config.decoder_vocab_size, bias=False, per_step=True)
        # Not in the paper; Marian checkpoints carry one (see `convert_from_marian`). A buffer, as in
        # MarianMTModel: saved and loaded, never trained, so that fine-tuning a converted model trains
        # what fine-tuning the original does.
        bias = torch.zeros(1, config.decoder_vocab_size) if config.add_final_logits_bias else None
        self.register_buffer("final_logits_bias", bias)
        self.post_init()
        # Paper Section 6.1: beam size 4, length penalty alpha 0.6 (in transformers' |Y|^alpha form; the
        # paper's is `length_penalty_form="gnmt"`), stop when all beams are finished.
        self.generation_config = SourceLengthGenerationConfig(
            num_beams=4,
            length_penalty=0.6,
            early_stopping=True,
            max_length_offset=DEFAULT_MAX_LENGTH_OFFSET,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            decoder_start_token_id=config.decoder_start_token_id,
        )

    def get_encoder(self, modality: str | None = None) -> VanillaTransformerEncoder:
        return self.model.encoder

    def get_decoder(self) -> VanillaTransformerDecoder:
        return self.model.decoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @can_return_tuple
    # (as `VanillaTransformerModel.forward`: the cache's former name, not swallowed by `**kwargs`)
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_logits: bool | None = None,
        **kwargs: Any,
    ) -> Seq2SeqLMOutput:
        """Logits over the vocabulary for each target position, and the loss when `labels` are given.

        Args:
            input_ids: (B, S) source token ids. attention_mask: (B, S), 1 = token, 0 = padding.
            decoder_input_ids: (B, T) target ids shifted right; built from `labels` when omitted.
            decoder_attention_mask: (B, P + T), 0 on target padding (causality is always applied).
            labels: (B, T) target ids, -100 where no loss is wanted (padding). Where no logits are
                returned (`return_logits`), the positions after a row's last label are not computed
                (causal attention: no loss term depends on them); returned logits are those of a
                forward without labels.
            num_items_in_batch: number of non-ignored target tokens in the whole (accumulated) batch;
                the loss is then sum / num_items_in_batch instead of a per-batch mean.
            return_logits: with `labels`, False skips the (B, T, V) logits (`logits` is None): the
                output projection and the loss run only on positions whose label is not -100, in
                chunks, without the logits in memory. The loss and gradients are the same. By
                default (None) logits are skipped in training mode when `labels` are given (what
                `Trainer` runs: it reads only the loss then) and returned otherwise. As with every
                transformers output, absent fields leave `to_tuple()`, so read outputs by name.
            kwargs: go to the attention function, as in transformers' models (one registered with
                `AttentionInterface` may take arguments of its own).
        Returns:
            `Seq2SeqLMOutput` with `logits` (B, T, V) (None where skipped), `loss`, `cache` and
            optional attentions.
        """
        if (
            cache is not None
            and use_cache
            and not kwargs  # the step computes attention itself
            and labels is None
            and decoder_attention_mask is None
            and decoder_inputs_embeds is None
        ):
            step = self._decoding_step(
                decoder_input_ids,
                encoder_outputs,
                attention_mask,
                cache,
                output_attentions,
                output_hidden_states,
            )
            if step is not None:
                return step
        if return_logits is None:
            return_logits = labels is None or not self.training
        target_lengths = None
        if labels is not None:
            check_token_ids("labels", labels, self.config.decoder_vocab_size, allow_ignore=True)
            labels = labels.long()  # int32 labels index as int64 ones, but the loss takes int64 alone
            given = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
            if given is not None and tuple(given.shape[:2]) != tuple(labels.shape):
                name = "decoder_input_ids" if decoder_input_ids is not None else "decoder_inputs_embeds"
                raise ValueError(  # one label per decoder position; torch's message named neither
                    f"`labels` has shape {tuple(labels.shape)} but `{name}` {tuple(given.shape[:2])} "
                    "(batch, length): each decoder position needs the label of the token it predicts."
                )
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
            if not return_logits:
                # Positions after a row's last label (its padding) affect no loss term: when no logits
                # are returned, skip their compute. (Returned logits are those of a forward without labels.)
                positions = torch.arange(1, labels.shape[1] + 1, device=labels.device)
                target_lengths = torch.where(labels != -100, positions, 0).amax(dim=1)
        elif decoder_input_ids is None and decoder_inputs_embeds is None:
            # Trainer with `label_smoothing_factor` (or `compute_loss_func`) takes `labels` out of the
            # batch before calling the model: the decoder inputs must then come with the batch. The
            # decoder's own message named two arguments the user never passed.
            raise ValueError(
                "No decoder inputs: pass `labels` (the decoder inputs are then the labels shifted right), "
                "`decoder_input_ids` or `decoder_inputs_embeds`. Trainer with `label_smoothing_factor` "
                "(or `compute_loss_func`) calls the model without `labels`: build `decoder_input_ids` "
                "in the collator, `DataCollatorForSeq2Seq(tokenizer, model=model)`."
            )
        elif self.training and num_items_in_batch is not None and self.config.unlikelihood_weight:
            # Trainer's loss keyword without labels: its label smoother (or `compute_loss_func`) computes
            # the loss from the logits, so the unlikelihood term the model was trained with is dropped.
            hf_logging.get_logger(__name__).warning_once(
                f"The loss is computed outside the model (Trainer's `label_smoothing_factor` or "
                f"`compute_loss_func`), without its unlikelihood term (`config.unlikelihood_weight` = "
                f"{self.config.unlikelihood_weight}). To keep it, leave `label_smoothing_factor` at 0 "
                f"and set `config.label_smoothing` instead; set `config.unlikelihood_weight = 0` to "
                f"train without it."
            )

        outputs = self.model(
            return_dict=True,
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            target_lengths=target_lengths,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state  # (B, T, D)
        loss = logits = None
        if labels is not None and not return_logits:  # the loss alone, see `loss_without_logits`
            loss = loss_without_logits(
                self, hidden_states, labels, num_items_in_batch, label_smoothed_cross_entropy
            )
        else:
            with kept_copies(outputs.cache is not None):
                logits = self.project(hidden_states)  # (B, T, V)
            if labels is not None:
                labels = labels.to(logits.device)
                unlikelihood = self.config.unlikelihood_weight
                candidates = unlikelihood_candidates(labels).flatten(0, 1) if unlikelihood else None
                loss = label_smoothed_cross_entropy(
                    logits.flatten(0, 1),
                    labels.flatten(),
                    self.config.label_smoothing,
                    num_items_in_batch,
                    candidates,
                    unlikelihood,
                )

        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )

    def _decoding_step(
        self,
        decoder_input_ids: torch.LongTensor | None,
        encoder_outputs: BaseModelOutput | tuple | None,
        attention_mask: torch.Tensor | None,
        cache: EncoderDecoderCache,
        output_attentions: bool | None,
        output_hidden_states: bool | None,
    ) -> Seq2SeqLMOutput | None:
        """`forward` for a step of cached decoding (what `generate` calls after its first step): one new
        token per row, the encoder output given, no outputs asked for but the logits and the cache. The
        decoder runs `VanillaTransformerDecoder.decoding_step`; None where that or this does not apply."""
        config = self.config
        if (
            encoder_outputs is None
            or decoder_input_ids is None
            or decoder_input_ids.shape[1] != 1
            or (config.output_attentions if output_attentions is None else output_attentions)
            or (config.output_hidden_states if output_hidden_states is None else output_hidden_states)
            or not unwrapped(self.model, VanillaTransformerModel)
            or not unwrapped(self.model.decoder, VanillaTransformerDecoder)
        ):
            return None
        if not isinstance(encoder_outputs, BaseModelOutput):  # as `VanillaTransformerModel.forward` reads it
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        encoder_hidden_states = encoder_outputs.last_hidden_state
        with kept_copies():
            hidden_states = self.model.decoder.decoding_step(
                decoder_input_ids, encoder_hidden_states, attention_mask, cache
            )
            if hidden_states is None:
                return None
            logits = self.project(hidden_states)
        # The encoder's outputs given are passed on, as `forward` passes them on.
        return Seq2SeqLMOutput(
            logits=logits,
            cache=cache,
            encoder_last_hidden_state=encoder_hidden_states,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The pre-softmax linear transformation (Section 3.4): (..., D) -> (..., V) logits."""
        logits = self.lm_head(hidden_states)
        return logits if self.final_logits_bias is None else logits + self.final_logits_bias[0]

    def resize_token_embeddings(
        self,
        new_num_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        mean_resizing: bool = True,
    ) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings`, for the paper's single shared vocabulary. A size
        that would leave a special token's id outside the vocabulary is refused before anything changes
        (such a model would generate with warnings, save, and then fail to load). A final logits bias
        (converted OPUS-MT models) is cut or extended with zeros, as MarianMTModel's is."""
        pad_to_multiple_of = check_resized_vocabulary(self.config, new_num_tokens, pad_to_multiple_of)
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.config.decoder_vocab_size = self.config.vocab_size  # one shared matrix, one size
        if self.final_logits_bias is not None and self.final_logits_bias.shape[1] != self.config.vocab_size:
            old = self.final_logits_bias
            resized = old.new_zeros(1, self.config.vocab_size)
            kept = min(old.shape[1], resized.shape[1])
            resized[:, :kept] = old[:, :kept]
            self.final_logits_bias = resized  # a registered buffer: replaced, still saved
        if type(self.lm_head) is nn.Linear:  # an untied output layer, which transformers rebuilds plain
            rebuilt = self.lm_head
            self.lm_head = Linear.over(rebuilt, per_step=True)  # (and which decodes on our kernels)
            # transformers marks the rebuilt layer initialised: a later `post_init()` re-drew the wrapper
            # (every row, the old ones too), where MarianMTModel's stays as resized.
            if getattr(rebuilt, "_is_hf_initialized", False):
                self.lm_head._is_hf_initialized = True
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Teacher-forcing decoder inputs for `DataCollatorForSeq2Seq`: labels shifted right."""
        for name in ("pad_token_id", "decoder_start_token_id"):  # None failed inside torch
            if getattr(self.config, name) is None:
                raise ValueError(
                    f"`config.{name}` is None: decoder inputs are made from `labels` by shifting them "
                    "right, which needs it. Set it, or pass `decoder_input_ids`."
                )
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        """`GenerationMixin.generate` with the paper's output-length rule (Section 6.1), and its length
        penalty on request.

        When neither `max_length` nor `max_new_tokens` is set (in the call, the generation config given
        or the model's, whose fields fill the given one's unset ones), each sentence gets at most its
        own source length (its attention-mask count; `input_ids`, `inputs_embeds` or `encoder_outputs`)
        + `max_length_offset` new tokens, instead of transformers' silent 20-token default. The offset
        comes from the `max_length_offset` keyword, else the generation config in use, else the model's
        (50), so a fresh `GenerationConfig` keeps the rule. In a padded batch each sentence stops at its
        own limit (`SourceLengthLimit`) and gets a `forced_eos_token_id` as its last token there
        (`SourceLengthForcedEOS`). One estimate of transformers' beam search stays batch-wide: with
        `early_stopping="never"` and a positive length penalty it judges whether a sentence's running
        beams could still win by the longest sentence's limit, so there a shorter sentence may end
        with another translation than it gets alone.

        `length_penalty_form` (a keyword or a generation-config field, default "power"): "power" ranks
        finished beams as transformers does, by log P(Y) / |Y|^length_penalty; "gnmt" by the paper's
        log P(Y) / ((5 + |Y|) / 6)^length_penalty (`GNMTLengthPenalty`).

        A padded batch of token ids given without `attention_mask` is masked where it holds the padding
        token (`_padding_mask`), so that no row attends to padding or gets another row's length limit.

        A row that ended before the longest is filled with the padding token after its end
        (`pad_finished`), under beam search too, where transformers fills it with the end token when the
        padding id is 0, as here.
        """
        # Kept weight copies are checked against the weights' values once per call. (The decoder also
        # starts a check at its first cached forward, but cannot tell a static cache's first step.)
        new_generate_call()
        if isinstance(self.generation_config, SourceLengthGenerationConfig):
            self.generation_config.unset_default_max_length()
        if isinstance(generation_config, SourceLengthGenerationConfig):  # a copy of the model's
            generation_config = copy.copy(generation_config)
            generation_config.unset_default_max_length()
        config = generation_config if generation_config is not None else self.generation_config
        check_generate_arguments(inputs if inputs is not None else kwargs.get("input_ids"), config, kwargs)
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            check_forced_token(name, self._setting(name, config, kwargs), self.config.decoder_vocab_size)
        if isinstance(kwargs.get("encoder_outputs"), (tuple, list)):  # as `forward` takes them
            # transformers reads the batch size from a ModelOutput's `last_hidden_state` and expands it
            # by its keys for beams or sequences; a tuple it read as a batch of 1, and indexed by keys.
            kwargs["encoder_outputs"] = BaseModelOutput(*kwargs["encoder_outputs"])
        elif isinstance(kwargs.get("encoder_outputs"), dict):  # a ModelOutput is a dict
            # transformers expands it for beams or sequences in place: the caller's object, reused for
            # another decoding, would then hold num_beams copies of each row (and give that many rows).
            kwargs["encoder_outputs"] = copy.copy(kwargs["encoder_outputs"])
        form = kwargs.pop("length_penalty_form", None)
        if form is None:
            form = getattr(config, "length_penalty_form", None)
        if form is None:
            form = getattr(self.generation_config, "length_penalty_form", None) or "power"
        if form not in LENGTH_PENALTY_FORMS:
            raise ValueError(f"length_penalty_form must be one of {LENGTH_PENALTY_FORMS}, got {form!r}.")
        beams = kwargs.get("num_beams") or config.num_beams or self.generation_config.num_beams or 1
        if form == "gnmt" and beams > 1:  # greedy search has no length penalty to change
            given = (kwargs.get("length_penalty"), config.length_penalty)
            given += (self.generation_config.length_penalty,)
            alpha = next((value for value in given if value is not None), 1.0)  # transformers' default: 1.0
            kwargs["length_penalty"] = GNMTLengthPenalty(alpha)
        # transformers fills a given config's unset fields from the model's: a length there counts too.
        unset = all(
            kwargs.get(k) is None and getattr(c, k, None) is None
            for k in ("max_length", "max_new_tokens")
            for c in (config, self.generation_config)
        )
        offset = kwargs.pop("max_length_offset", None)
        if offset is None:
            offset = getattr(config, "max_length_offset", None)
        if offset is None:
            offset = getattr(self.generation_config, "max_length_offset", DEFAULT_MAX_LENGTH_OFFSET)
        if offset is not None:
            if not is_integer(offset) or offset < 0:  # a NumPy integer is one too
                raise ValueError(f"max_length_offset must be a non-negative integer or None, got {offset!r}.")
            offset = int(offset)
        source = inputs if inputs is not None else kwargs.get("input_ids")
        if kwargs.get("attention_mask") is None and kwargs.get("encoder_outputs") is None:
            mask = self._padding_mask(source, config, kwargs)
            if mask is not None:
                kwargs["attention_mask"] = mask
        if source is None:
            source = kwargs.get("inputs_embeds")  # (B, S, D): the length is the same dimension
        if source is None and kwargs.get("encoder_outputs") is not None:
            source = kwargs["encoder_outputs"][0]
        limits, prompt_length = None, 1  # each sentence's own limit of new tokens, where they differ
        if unset and offset is not None and source is not None:
            longest = source.shape[1] + offset  # the longest row's limit
            if generation_config is None:
                kwargs["max_new_tokens"] = longest
            else:  # a config given with generation keywords beside it is deprecated in transformers
                generation_config = copy.copy(generation_config)
                generation_config.max_new_tokens = longest
            mask = kwargs.get("attention_mask")
            if mask is not None and mask.dim() == 2 and bool((mask.sum(-1) < mask.shape[1]).any()):
                limits, prompt_length = mask.sum(-1) + offset, self._prompt_length(config, kwargs)
                criteria = kwargs.get("stopping_criteria")
                limit = SourceLengthLimit(limits, prompt_length)
                kwargs["stopping_criteria"] = StoppingCriteriaList([*(criteria or []), limit])
                forced_eos = self._setting("forced_eos_token_id", config, kwargs)
                if forced_eos is not None:  # transformers forces it at the longest sentence's limit only
                    processors = kwargs.get("logits_processor")
                    forcing = SourceLengthForcedEOS(limits, prompt_length, forced_eos)
                    kwargs["logits_processor"] = LogitsProcessorList([*(processors or []), forcing])
        # Beam search fills rows that ended early with the end token (see `pad_finished`); where each
        # hypothesis ended is in its `beam_indices`, which come with a dictionary output.
        pad = self._setting("pad_token_id", config, kwargs)
        dictionary = self._setting("return_dict_in_generate", config, kwargs)
        needs_dictionary = beams > 1 and pad is not None and not dictionary
        if needs_dictionary:
            if generation_config is None:
                kwargs["return_dict_in_generate"] = True
            else:  # not as a keyword beside a config, which transformers deprecates
                generation_config = copy.copy(generation_config)
                generation_config.return_dict_in_generate = True
        output = super().generate(inputs, generation_config=generation_config, **kwargs)
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        if pad is not None and isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
            beam_indices = getattr(output, "beam_indices", None)
            pad_finished(sequences, pad, beam_indices, limits, prompt_length)
        return sequences if needs_dictionary else output

    def _padding_mask(
        self, input_ids: torch.Tensor | None, config: GenerationConfig, kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """The attention mask of a padded batch of token ids given without one: transformers infers it
        for decoder-only models alone, and an encoder-decoder would attend to the padding and give the
        short rows the longest row's length limit. Padding is a run of the padding token at the end of a
        row (or at its start, padded on the left); one inside a row is text. None where nothing is
        padded, or where the padding token is also an end token (it cannot be told from the text)."""
        if input_ids is None or input_ids.dim() != 2 or input_ids.is_floating_point():
            return None
        pad, eos = (
            self._setting("pad_token_id", config, kwargs),
            self._setting("eos_token_id", config, kwargs),
        )
        if pad is None or pad in token_id_list(eos):
            return None
        is_pad = input_ids.eq(pad)
        trailing = is_pad.flip(-1).cumprod(-1).flip(-1).bool()
        leading = is_pad.cumprod(-1).bool()
        mask = ~(trailing | leading)
        return mask.long() if not bool(mask.all()) else None

    def _setting(self, name: str, config: GenerationConfig, kwargs: dict[str, Any]) -> Any:
        """A generation setting as transformers' `generate` resolves it: the keyword (a keyword None
        unsets it), else the generation config in use, else the model's; None where none sets it (the
        model configuration's fields are not read: transformers no longer does)."""
        if name in kwargs:
            return kwargs[name]
        value = getattr(config, name, None)
        return value if value is not None else getattr(self.generation_config, name, None)

    def _prompt_length(self, config: GenerationConfig, kwargs: dict[str, Any]) -> int:
        """The decoder input `generate` starts from: the start token, or the prompt given, which it
        prefixes with the start token unless a row begins with it (as transformers does)."""
        prompt = kwargs.get("decoder_input_ids")
        if prompt is None:
            return 1
        start = self._setting("decoder_start_token_id", config, kwargs)
        if start is None:  # transformers starts from the start-of-sequence token then
            start = self._setting("bos_token_id", config, kwargs)
        if start is None:
            return prompt.shape[1]
        starts = torch.as_tensor(start, device=prompt.device).flatten()  # one id, or one per row
        return prompt.shape[1] + int(bool((prompt[:, 0] != starts).all()))


LENGTH_PENALTY_FORMS = ("power", "gnmt")


def pad_finished(
    sequences: torch.Tensor,
    pad: int,
    beam_indices: torch.Tensor | None = None,
    limits: torch.Tensor | None = None,
    start: int = 1,
) -> None:
    """Write the padding token, in place, where each row of `generate`'s output had ended: where its
    `beam_indices` (beam search's, (rows, generated tokens)) are -1, and from its own limit of new
    tokens on (`limits`, per sentence, as `SourceLengthLimit`'s, counted from position `start`, the
    prompt's length).

    transformers' beam search fills the positions after a hypothesis that ended early (at an end token,
    a stopping criterion, a sentence's own limit) with `pad_token_id or eos_token_id`: with this model's
    padding id, 0, with the end token, and with -1 where there is no end token. Its greedy search, and
    MarianMTModel's beam search (padding id 58100), fill them with padding; greedy search without an
    end token goes on after a sentence's own limit."""
    if beam_indices is not None:
        generated = sequences[:, sequences.shape[1] - beam_indices.shape[1] :]
        generated.masked_fill_(beam_indices.to(sequences.device) < 0, pad)
    if limits is not None:
        generated = sequences[:, start:]
        positions = torch.arange(generated.shape[1], device=sequences.device)
        generated.masked_fill_(positions >= per_row(limits, generated)[:, None], pad)


def check_generate_arguments(input_ids: Any, config: GenerationConfig, kwargs: dict[str, Any]) -> None:
    """What `generate` would otherwise meet as an IndexError, a ZeroDivisionError, a count of outputs
    other than asked for or cut-off output: token ids without a batch dimension, a beam count below 1, a
    count of sequences per input below 1 (beam search gave 3 per input at -1, sampling 1 at 0), a length
    penalty that is not finite (NaN ranks every finished beam alike), a length that is no integer (a
    TypeError from inside torch). Raises ValueError naming the argument."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be (batch, length) token ids, got shape {tuple(input_ids.shape)}"
            + (": add a batch dimension (`ids[None]`)." if input_ids.dim() == 1 else ".")
        )
    sequences = kwargs.get("num_return_sequences", config.num_return_sequences)
    if sequences is not None and (not is_integer(sequences) or sequences < 1):
        raise ValueError(f"num_return_sequences must be a positive integer, got {sequences!r}.")
    for name in ("max_length", "max_new_tokens", "min_length", "min_new_tokens"):
        # a float (`30.0` in a hand-edited generation_config.json) reached torch.full as a size
        length = kwargs.get(name, getattr(config, name, None))
        if length is not None and (not is_integer(length) or length < 0):
            raise ValueError(f"{name} must be a non-negative integer, got {length!r}.")
    check_beam_settings(
        kwargs.get("num_beams", config.num_beams), kwargs.get("length_penalty", config.length_penalty)
    )


def token_id_list(value: Any) -> list[int]:
    """Token ids in any form `generate()` takes them (an int, a list, a NumPy or torch scalar or array)
    as a list; None as []."""
    return [] if value is None else torch.as_tensor(value).flatten().tolist()


def check_forced_token(name: str, value: Any, vocab_size: int) -> None:
    """A forced token (`forced_bos_token_id`, `forced_eos_token_id`: an id or a list of ids) inside the
    vocabulary, where set: the forcing processors index the scores with it (an IndexError naming no
    setting otherwise). Raises ValueError naming the setting."""
    if value is None:
        return
    # a tensor, a NumPy array or integer: flattened, as the forcing processors read them
    ids = value.flatten().tolist() if hasattr(value, "flatten") else value
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    if not all(is_integer(i) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"{name} {value!r} is outside the vocabulary [0, {vocab_size}).")


def check_beam_settings(num_beams: Any, length_penalty: Any, *, bounded: bool = True) -> None:
    """A beam count that is a positive integer and a length penalty that is a finite number, where
    given (None: the defaults; numpy scalars and one-element tensors count as numbers), and for beam
    search (`bounded`: transformers') within `MAX_LENGTH_PENALTY`; other objects (`GNMTLengthPenalty`
    is a number too) are left to their users. Raises ValueError naming the argument."""
    if isinstance(num_beams, torch.Tensor) and num_beams.numel() == 1:
        num_beams = num_beams.item()
    if num_beams is not None and (not is_integer(num_beams) or num_beams < 1):
        raise ValueError(f"num_beams must be a positive integer, got {num_beams!r}.")
    if isinstance(length_penalty, torch.Tensor) and length_penalty.numel() == 1:
        length_penalty = length_penalty.item()
    problem = length_penalty_problem(length_penalty, beam_search=bounded and (num_beams or 1) > 1)
    if problem:
        raise ValueError(f"length_penalty {problem}.")


# transformers' beam search divides by |Y|^length_penalty (or this model's ((5 + |Y|) / 6)^length_penalty)
# as a Python float: at 300 an 11-token output's power overflowed (an OverflowError from inside it). Up to
# this bound the power stays finite for outputs of up to a million tokens; the paper's is 0.6.
MAX_LENGTH_PENALTY = 50.0


def length_penalty_problem(length_penalty: Any, beam_search: bool = True) -> str | None:
    """What is wrong with a length penalty that is a number (numpy scalars count): not finite, or, for
    transformers' beam search, over `MAX_LENGTH_PENALTY` in magnitude; None where nothing is (or it is
    no number: left to its users)."""
    if not isinstance(length_penalty, numbers.Real):
        return None
    try:
        value = float(length_penalty)
    except OverflowError:  # an int past float's range
        value = math.inf
    if not math.isfinite(value):
        return f"must be a finite number, got {length_penalty!r}"
    if beam_search and abs(value) > MAX_LENGTH_PENALTY:
        return (
            f"must be from -{MAX_LENGTH_PENALTY:g} to {MAX_LENGTH_PENALTY:g} for beam search (a length to a "
            f"larger power overflows; the paper's is 0.6), got {length_penalty!r}"
        )
    return None


class GNMTLengthPenalty(float):
    """The paper's length penalty (Section 6.1, from Wu et al. 2016's GNMT): beam search ranks finished
    hypotheses by log P(Y) / lp(Y) with lp(Y) = ((5 + |Y|) / 6)^alpha, |Y| counting the end token.

    transformers' beam search divides by |Y|^length_penalty instead, computed as `length **
    length_penalty` with a Python int `length`: with a `length_penalty` of this type (whose value is
    alpha) that power is lp(Y). tests/test_generation.py checks the scores beam search returns against
    the formula, so a transformers that computed the power otherwise would fail there, not silently."""

    def __rpow__(self, length: int) -> float:
        return ((5 + length) / 6) ** float(self)

    def __repr__(self) -> str:
        return f"GNMTLengthPenalty({float(self)})"


class SourceLengthLimit(StoppingCriteria):
    """Stops each sentence after its own limit of new tokens (its source length + 50 in the paper).

    `limits`: (B,) per source sentence. Beam search asks about (B x beams) hypotheses, batch-major."""

    def __init__(self, limits: torch.Tensor, prompt_length: int):
        self.limits = limits
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_length) >= per_row(self.limits, input_ids)


def per_row(limits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B,) per-sentence `limits` for the rows of `input_ids`: B x beams (or x sequences), batch-major."""
    limits = limits.to(input_ids.device)
    if input_ids.shape[0] != limits.shape[0]:
        limits = limits.repeat_interleave(input_ids.shape[0] // limits.shape[0])
    return limits


class SourceLengthForcedEOS(LogitsProcessor):
    """`forced_eos_token_id` at each sentence's own last token under `SourceLengthLimit`: transformers
    forces it at the batch's length limit, which the shorter sentences of a padded batch never reach
    (they ended without it, unlike the same sentence generated alone). Rows as `SourceLengthLimit`'s."""

    def __init__(self, limits: torch.Tensor, prompt_length: int, eos_token_id: Any):
        self.limits = limits
        self.prompt_length = prompt_length
        self.eos_token_id = token_id_list(eos_token_id)
        self.last_steps = {int(limit) - 1 for limit in limits.tolist()}  # read once, on the host

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_length
        if generated not in self.last_steps:  # no sentence's last token: nothing to force
            return scores
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.eos_token_id] = 0
        return torch.where((per_row(self.limits, input_ids) - 1 == generated)[:, None], forced, scores)


__all__ = [
    "GNMTLengthPenalty",
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerModel",
    "VanillaTransformerPreTrainedModel",
    "label_smoothed_cross_entropy",
    "sinusoidal_position_encoding",
]
