"""Model behaviour against the paper's formulas and independent references (torch.nn.Transformer)."""

import math

import pytest
import torch
from torch import nn

from tests.conftest import (
    BOS,
    PAD,
    TINY_TERMS,
    assert_same_up_to_rounding,
    logged_messages,
    tiny_config,
    tiny_model,
)
from vanilla_transformer import (
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerModel,
)
from vanilla_transformer import modeling_vanilla_transformer as modeling
from vanilla_transformer.modeling_vanilla_transformer import (
    VanillaTransformerAttention,
    eager_attention_forward,
    label_smoothed_cross_entropy,
    shift_tokens_right,
    sinusoidal_position_encoding,
)

# Both linear-layer kernels: torch's, and oneDNN's for every product that may take it.
pytestmark = pytest.mark.usefixtures("each_linear_kernel")


def paper_position_encoding(pos: int, d_model: int, layout: str) -> list[float]:
    """Section 3.5 written out element by element, in Python floats."""
    sines = [math.sin(pos / 10000 ** (2 * i / d_model)) for i in range(d_model // 2)]
    cosines = [math.cos(pos / 10000 ** (2 * i / d_model)) for i in range(d_model // 2)]
    if layout == "concatenated":
        return sines + cosines
    return [value for pair in zip(sines, cosines, strict=True) for value in pair]


# Shapes and sizes ---------------------------------------------------------------------------------


def test_output_shapes(model, batch):
    out = model(**batch, output_attentions=True, output_hidden_states=True)
    assert out.logits.shape == (2, 7, 99)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.encoder_last_hidden_state.shape == (2, 9, 32)
    assert len(out.encoder_attentions) == 2 and out.encoder_attentions[0].shape == (2, 4, 9, 9)
    assert len(out.decoder_attentions) == 2 and out.decoder_attentions[0].shape == (2, 4, 7, 7)
    assert out.cross_attentions[0].shape == (2, 4, 7, 9)
    assert len(out.encoder_hidden_states) == 3 and len(out.decoder_hidden_states) == 3


@pytest.mark.parametrize("norm_first", [False, True])
def test_last_hidden_state_is_the_last_of_the_hidden_states(batch, norm_first):
    """As in transformers' models, pre-LN ones (MBart) included: `hidden_states[-1]` is the stack's
    output, after the final LayerNorm that pre-LN adds, not the last layer's output before it."""
    model = tiny_model(norm_first=norm_first)
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        decoder_input_ids = batch["labels"].clamp(min=PAD)
        out = model.model(**inputs, decoder_input_ids=decoder_input_ids, output_hidden_states=True)
    assert len(out.encoder_hidden_states) == len(out.decoder_hidden_states) == 3
    assert torch.equal(out.encoder_hidden_states[-1], out.encoder_last_hidden_state)
    assert torch.equal(out.decoder_hidden_states[-1], out.last_hidden_state)


@pytest.mark.parametrize("norm_first", [False, True])
def test_gradients_reach_every_reported_hidden_state_in_training(batch, norm_first):
    """`retain_grad()` on an output's hidden states gets their gradients in training mode, where a padded
    batch runs on packed tokens (Marian's post-LN reference: tests/test_marian_conversion.py). The
    encoder's last entry gets what the decoder and loss send back, computed here separately from the
    encoder output given as a leaf tensor."""
    model = tiny_model(norm_first=norm_first).train()  # dropout 0: one function in both modes
    out = model(**batch, output_hidden_states=True)
    states = [*out.encoder_hidden_states, *out.decoder_hidden_states]
    for state in states:
        state.retain_grad()
    out.loss.backward()
    assert all(state.grad is not None and state.grad.any() for state in states)
    leaf = out.encoder_last_hidden_state.detach().requires_grad_()
    model(**batch, encoder_outputs=(leaf,)).loss.backward()
    assert_same_up_to_rounding(out.encoder_hidden_states[-1].grad, leaf.grad, TINY_TERMS)


def test_return_dict_false_gives_tuples_as_transformers_models_do(model, batch):
    """`return_dict=False` (or `config.return_dict = False`) returns the output's `to_tuple()`, as
    MarianMTModel does, from the full model, the base model and the encoder; generation is unchanged."""

    def assert_same(plain, structured):
        assert isinstance(plain, tuple) and len(plain) == len(structured.to_tuple())
        for got, expected in zip(plain, structured.to_tuple(), strict=True):
            if isinstance(expected, torch.Tensor):
                assert torch.equal(got, expected)
            else:  # the cache
                assert type(got) is type(expected)

    source = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        assert_same(model(**batch, return_dict=False), model(**batch))
        targets = {"decoder_input_ids": batch["labels"].clamp(min=PAD)}
        assert_same(model.model(**source, **targets, return_dict=False), model.model(**source, **targets))
        encoder = model.get_encoder()
        assert_same(encoder(**source, return_dict=False), encoder(**source))
        expected = model.generate(**source, max_new_tokens=4)
        model.config.return_dict = False
        try:
            assert_same(model(**batch), model(**batch, return_dict=True))
            assert torch.equal(model.generate(**source, max_new_tokens=4), expected)
        finally:
            model.config.return_dict = True


def count_parameters(preset: str, **overrides) -> int:
    with torch.device("meta"):
        config = VanillaTransformerConfig.from_preset(preset, **overrides)
        model = VanillaTransformerForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())  # tied matrices are counted once


def test_parameter_counts_match_the_paper():
    base, big = count_parameters("base"), count_parameters("big")
    d, f, n, vocab = 512, 2048, 6, 37000
    # W^Q, W^K, W^V, W^O without biases (Section 3.2.2); the feed-forward's b_1 and b_2 (Equation 2)
    attention, ffn, norm = 4 * d * d, 2 * d * f + f + d, 2 * d
    expected = vocab * d + n * (attention + ffn + 2 * norm) + n * (2 * attention + ffn + 3 * norm)
    assert base == expected == 63_045_632
    with_biases = count_parameters("base", attention_bias=True)
    assert with_biases - base == 3 * n * 4 * d  # 4 biases of width d in each of 3 n attentions
    # Paper Table 3: 65M and 213M with a ~37k joint vocabulary.
    assert abs(base - 65e6) / 65e6 < 0.05
    assert abs(big - 213e6) / 213e6 < 0.03


@pytest.mark.parametrize("attention_bias", [False, True])
def test_multi_head_attention_costs_the_same_parameters_as_one_full_width_head(attention_bias):
    many = VanillaTransformerAttention(tiny_config(num_heads=8, attention_bias=attention_bias))
    one = VanillaTransformerAttention(tiny_config(num_heads=1, attention_bias=attention_bias))
    count = sum(p.numel() for p in many.parameters())
    assert count == sum(p.numel() for p in one.parameters()) == 4 * (32 * 32 + 32 * attention_bias)


# Positional encoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_position_encoding_is_the_paper_formula(layout):
    positions = torch.tensor([0, 1, 2, 17, 511, 4095, 100_000])
    encoding = sinusoidal_position_encoding(positions, 64, layout, dtype=torch.float64)
    expected = torch.tensor(
        [paper_position_encoding(int(p), 64, layout) for p in positions], dtype=torch.float64
    )
    torch.testing.assert_close(encoding, expected, atol=1e-9, rtol=0)
    if layout == "interleaved":
        assert encoding[5, 0] == pytest.approx(math.sin(4095)) and encoding[5, 1] == pytest.approx(
            math.cos(4095)
        )


def test_marian_layout_matches_transformers_marian_table():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(50, 32).create_weight()
    ours = sinusoidal_position_encoding(torch.arange(50), 32, "concatenated")
    torch.testing.assert_close(ours, table, atol=1e-6, rtol=0)


def test_model_runs_far_beyond_any_length_it_was_configured_or_trained_with():
    model = tiny_model()
    long_source = torch.randint(3, 99, (1, 3000))
    out = model(input_ids=long_source, decoder_input_ids=torch.randint(3, 99, (1, 2500)))
    assert out.logits.shape == (1, 2500, 99) and torch.isfinite(out.logits).all()


def test_decoder_positions_continue_from_the_cache(model):
    source = torch.randint(3, 99, (1, 5))
    target = torch.randint(3, 99, (1, 6))
    full = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
    first = model(input_ids=source, decoder_input_ids=target[:, :4], use_cache=True)
    second = model(
        input_ids=source,
        encoder_outputs=(first.encoder_last_hidden_state,),
        decoder_input_ids=target[:, 4:],
        cache=first.cache,
        use_cache=True,
    )
    assert_same_up_to_rounding(second.logits, full[:, 4:], TINY_TERMS)


def test_the_cache_under_its_former_name_is_used(model):
    """transformers' models (MarianMTModel) still take `past_key_values=` for `cache=`, with a
    deprecation warning; here it once went into `**kwargs` unread, and the step was decoded at position
    0 without the earlier tokens: other logits, no error."""
    source, target = torch.randint(3, 99, (1, 5)), torch.randint(3, 99, (1, 6))
    for module, read in ((model, lambda out: out.logits), (model.model, lambda out: out.last_hidden_state)):
        with torch.no_grad():
            full = read(module(input_ids=source, decoder_input_ids=target, use_cache=False))
            first = module(input_ids=source, decoder_input_ids=target[:, :4], use_cache=True)
            second = module(
                input_ids=source, decoder_input_ids=target[:, 4:], past_key_values=first.cache, use_cache=True
            )
        assert second.cache is first.cache and second.cache.get_seq_length() == 6
        assert_same_up_to_rounding(read(second), full[:, 4:], TINY_TERMS)


# Parity with torch.nn.Transformer layers ----------------------------------------------------------


def copy_attention(ours: VanillaTransformerAttention, theirs: nn.MultiheadAttention) -> None:
    """Our projections into torch's; without biases (the paper's), torch's are zeros."""
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.out_proj.weight.copy_(ours.out_proj.weight)
    if ours.q_proj.bias is None:
        theirs.in_proj_bias.zero_()
        theirs.out_proj.bias.zero_()
    else:
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.bias.copy_(ours.out_proj.bias)


def copy_layer(ours, theirs, cross: bool) -> None:
    copy_attention(ours.self_attn, theirs.self_attn)
    theirs.linear1.load_state_dict(ours.fc1.state_dict())
    theirs.linear2.load_state_dict(ours.fc2.state_dict())
    theirs.norm1.load_state_dict(ours.self_attn_layer_norm.state_dict())
    if cross:
        copy_attention(ours.encoder_attn, theirs.multihead_attn)
        theirs.norm2.load_state_dict(ours.encoder_attn_layer_norm.state_dict())
        theirs.norm3.load_state_dict(ours.final_layer_norm.state_dict())
    else:
        theirs.norm2.load_state_dict(ours.final_layer_norm.state_dict())


def torch_reference_stacks(config: VanillaTransformerConfig, model: VanillaTransformerModel):
    """nn.TransformerEncoder/Decoder with our weights copied in (final norm only for pre-LN)."""
    kwargs = {
        "d_model": config.d_model,
        "nhead": config.num_heads,
        "dim_feedforward": config.d_ff,
        "dropout": 0.0,
        "activation": "relu",
        "layer_norm_eps": config.layer_norm_eps,
        "batch_first": True,
        "norm_first": config.norm_first,
    }
    final_norm = (
        (lambda: nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)) if config.norm_first else None
    )
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(**kwargs),
        config.num_encoder_layers,
        norm=final_norm() if final_norm else None,
        enable_nested_tensor=False,
    )
    decoder = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(**kwargs),
        config.num_decoder_layers,
        norm=final_norm() if final_norm else None,
    )
    with torch.no_grad():
        for ours, theirs in zip(model.encoder.layers, encoder.layers, strict=True):
            copy_layer(ours, theirs, cross=False)
        for ours, theirs in zip(model.decoder.layers, decoder.layers, strict=True):
            copy_layer(ours, theirs, cross=True)
        if config.norm_first:
            encoder.norm.load_state_dict(model.encoder.layer_norm.state_dict())
            decoder.norm.load_state_dict(model.decoder.layer_norm.state_dict())
    return encoder.eval(), decoder.eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stacks_match_torch_nn_transformer(attn_implementation, norm_first, attention_bias, dtype, batch):
    """In float64 too: the eager attention's softmax was rounded to float32 in a float64 model (errors
    of about 2e-7 where SDPA's were 1e-15)."""
    # Pre-LN with a layer-norm epsilon other than torch's default (1e-5), so that a model which left
    # `config.layer_norm_eps` unread would differ from the reference.
    overrides = {"norm_first": True, "layer_norm_eps": 0.1} if norm_first else {}
    model = tiny_model(attn_implementation, attention_bias=attention_bias, **overrides)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("proj.bias"):  # biases as training leaves them, not the initial zeros
                parameter.normal_(0, 0.5)
    model.to(dtype)  # float32 values, which the reference's float32 parameters take exactly before its cast
    config, base = model.config, model.model
    encoder, decoder = (stack.to(dtype) for stack in torch_reference_stacks(config, base))
    source, source_mask = batch["input_ids"], batch["attention_mask"]
    target = shift_tokens_right(batch["labels"], PAD, BOS)
    scale = math.sqrt(config.d_model)

    with torch.no_grad():
        ours = base(input_ids=source, attention_mask=source_mask, decoder_input_ids=target, use_cache=False)
        src = base.shared(source) * scale + sinusoidal_position_encoding(torch.arange(9), 32, dtype=dtype)
        tgt = base.shared(target) * scale + sinusoidal_position_encoding(torch.arange(7), 32, dtype=dtype)
        padding = source_mask == 0
        memory = encoder(src, src_key_padding_mask=padding)
        causal = nn.Transformer.generate_square_subsequent_mask(7)
        out = decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=padding)

    keep = source_mask.bool()
    assert_same_up_to_rounding(ours.encoder_last_hidden_state[keep], memory[keep], TINY_TERMS)
    assert_same_up_to_rounding(ours.last_hidden_state, out, TINY_TERMS)


class NumberedDropout(nn.Module):
    """Dropout whose k-th call (counted in `calls`, shared) keeps the elements a generator seeded with k
    keeps, so that two computations calling it in the same order drop the same elements."""

    def __init__(self, p: float, calls: list[int]):
        super().__init__()
        self.p, self.calls = p, calls

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(len(self.calls))
        self.calls.append(inputs.numel())
        kept = torch.rand(inputs.numel(), generator=generator) >= self.p
        return inputs * kept.view(inputs.shape).to(inputs.dtype) / (1 - self.p)


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_sits_on_embeddings_and_sublayer_outputs_as_in_torch_nn_transformer(norm_first, monkeypatch):
    """Section 5.4: dropout on each sub-layer's output before the residual addition (and normalisation),
    and on the sums of embeddings and positions; nowhere else (attention and feed-forward hidden
    dropouts are 0). The reference is torch's layers, whose `dropout1/2/3` sit on the sub-layer outputs,
    given the same masks there and none on their feed-forward hidden layer."""
    p = 0.3
    model = tiny_model(dropout=p, norm_first=norm_first).train()
    ours_calls, reference_calls = [], []
    ours_dropout = NumberedDropout(p, ours_calls)

    def recorded(inputs: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
        if not training or rate == 0:
            return inputs
        assert rate == p
        return ours_dropout(inputs)

    monkeypatch.setattr(modeling, "dropout", recorded)
    config, base = model.config, model.model
    encoder, decoder = torch_reference_stacks(config, base)
    reference_dropout = NumberedDropout(p, reference_calls)
    for layer in [*encoder.layers, *decoder.layers]:
        layer.dropout = nn.Identity()  # the feed-forward hidden layer's
        for name in ("dropout1", "dropout2", "dropout3"):
            if hasattr(layer, name):
                setattr(layer, name, reference_dropout)
    encoder.train(), decoder.train()
    generator = torch.Generator().manual_seed(5)
    source, target = torch.randint(3, 99, (2, 9), generator=generator), torch.randint(3, 99, (2, 7))
    scale = math.sqrt(config.d_model)
    positions = sinusoidal_position_encoding(torch.arange(9), 32)

    with torch.no_grad():
        ours = base(input_ids=source, decoder_input_ids=target, use_cache=False)
        memory = encoder(reference_dropout(base.shared(source) * scale + positions))
        tgt = reference_dropout(base.shared(target) * scale + positions[:7])
        causal = nn.Transformer.generate_square_subsequent_mask(7)
        out = decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)

    # Embeddings, then 2 sub-layers in each encoder layer, embeddings, 3 in each decoder layer.
    assert len(reference_calls) == 2 + 2 * config.num_encoder_layers + 3 * config.num_decoder_layers
    assert ours_calls == reference_calls
    assert_same_up_to_rounding(ours.encoder_last_hidden_state, memory, TINY_TERMS)
    assert_same_up_to_rounding(ours.last_hidden_state, out, TINY_TERMS)


# Properties --------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_decoder_is_causal(attn_implementation, batch):
    model = tiny_model(attn_implementation)
    source = batch["input_ids"][:1]
    target = torch.randint(3, 99, (1, 8))
    changed = target.clone()
    changed[:, 5:] = torch.randint(3, 99, (1, 3))
    with torch.no_grad():
        before = model(input_ids=source, decoder_input_ids=target).logits
        after = model(input_ids=source, decoder_input_ids=changed).logits
    assert_same_up_to_rounding(before[:, :5], after[:, :5], TINY_TERMS)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_does_not_change_outputs(attn_implementation, side):
    """A padded batch equals each pair alone. Sources padded on the left too (as tokenizers set up for
    decoder-only models pad): such a row once had its positions counted from the padding, so its
    encoding and translation changed."""
    model = tiny_model(attn_implementation)
    generator = torch.Generator().manual_seed(3)
    short_src, long_src = torch.randint(3, 99, (1, 4), generator=generator), torch.randint(3, 99, (1, 9))
    short_tgt, long_tgt = torch.randint(3, 99, (1, 3), generator=generator), torch.randint(3, 99, (1, 6))
    padding = [torch.full((1, 5), PAD), short_src] if side == "left" else [short_src, torch.full((1, 5), PAD)]
    source = torch.cat([torch.cat(padding, 1), long_src])
    source_mask = (source != PAD).long()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=source, attention_mask=source_mask).last_hidden_state
        short_encoded = model.get_encoder()(input_ids=short_src).last_hidden_state
    real = source_mask[0].bool()
    assert_same_up_to_rounding(encoded[0, real], short_encoded[0], TINY_TERMS)
    target = torch.cat([torch.cat([short_tgt, torch.full((1, 3), PAD)], 1), long_tgt])
    target_mask = torch.tensor([[1] * 3 + [0] * 3, [1] * 6])
    with torch.no_grad():
        batched = model(
            input_ids=source,
            attention_mask=source_mask,
            decoder_input_ids=target,
            decoder_attention_mask=target_mask,
        ).logits
        alone_short = model(input_ids=short_src, decoder_input_ids=short_tgt).logits
        alone_long = model(input_ids=long_src, decoder_input_ids=long_tgt).logits
    assert_same_up_to_rounding(batched[0, :3], alone_short[0], TINY_TERMS)
    assert_same_up_to_rounding(batched[1], alone_long[0], TINY_TERMS)


def test_eager_and_sdpa_agree(batch):
    eager, sdpa = tiny_model("eager"), tiny_model("sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert_same_up_to_rounding(eager(**batch).logits, sdpa(**batch).logits, TINY_TERMS)


def test_a_4d_boolean_mask_masks_as_its_2d_mask_does_under_both_attentions(batch):
    """A prepared 4-D mask goes to attention as it is (transformers' mask builders return it): a boolean
    one, True where attention is allowed as SDPA reads it, was added to the eager attention's scores
    (+1 for each allowed key, +0 for padding), so the eager model attended to the padding."""
    mask = batch["attention_mask"]
    for implementation in ("eager", "sdpa"):
        model = tiny_model(implementation)
        with torch.no_grad():
            expected = model(**batch).logits
            got = model(**{**batch, "attention_mask": mask[:, None, None, :].bool()}).logits
        assert_same_up_to_rounding(got, expected, TINY_TERMS, msg=implementation)


def windowed(builder, causal_only: bool = False):
    """`builder` (a transformers mask builder) letting each token see only its neighbours, never skipped;
    with `causal_only`, in causal masks only (the decoder's self-attention)."""
    from transformers.masking_utils import and_masks, causal_mask_function

    def neighbours(batch_index, head_index, query_index, key_index):
        return (query_index - key_index).abs() <= 1

    def build(*args, mask_function, **kwargs):
        kwargs |= {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
        if causal_only and mask_function is not causal_mask_function:
            return builder(*args, mask_function=mask_function, **kwargs)
        return builder(*args, mask_function=and_masks(mask_function, neighbours), **kwargs)

    return build


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_mask_builder_a_user_registers_builds_every_mask(batch, implementation, monkeypatch):
    """A mask builder registered under the attention's name (`AttentionMaskInterface.register`, here a
    window of neighbours) builds every mask, as in transformers' models: the encoder's and the
    cross-attention's with a 2-D `attention_mask` given (skipped on the CPU under SDPA: an all-ones mask
    and none gave logits 1.03 apart) and the decoder's at each cached step (skipped for one new token:
    greedy decoding ignored the window)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    model = tiny_model(implementation)
    source, target = batch["input_ids"][:1], batch["labels"][:1, :-1]
    transformers_builder = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    with torch.no_grad():
        plain = model(input_ids=source, decoder_input_ids=target).logits
        builder = windowed(transformers_builder)
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, implementation, builder)
        unmasked = model(input_ids=source, decoder_input_ids=target).logits
        masked = model(
            input_ids=source, attention_mask=torch.ones_like(source), decoder_input_ids=target
        ).logits
        assert (unmasked - plain).abs().max() > 0.1  # the window applies
        assert_same_up_to_rounding(masked, unmasked, TINY_TERMS)

        # Greedy decoding with the cache scores each step as the whole prefix run through the model
        # without one does (every mask built whole). The window in the decoder's self-attention only: a
        # cross-attention mask built at a cached step knows no query offset (in transformers' models too).
        builder = windowed(transformers_builder, causal_only=True)
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, implementation, builder)
        generated = model.generate(
            source,
            max_new_tokens=8,
            min_new_tokens=8,
            num_beams=1,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for step, logits in enumerate(generated.logits):
            prefix = generated.sequences[:, : step + 1]
            expected = model(input_ids=source, decoder_input_ids=prefix, use_cache=False).logits[:, -1]
            assert_same_up_to_rounding(logits, expected, TINY_TERMS, msg=f"step {step}")


def registered_and_scaled(monkeypatch, function, mask_builder, implementation: str, divisor: float):
    """A tiny model whose attention is `function`, registered (under its name) with `mask_builder`, and
    the same model under transformers' `implementation` with every attention's scale divided by
    `divisor`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, function.__name__, function)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, function.__name__, mask_builder)
    model, reference = tiny_model(function.__name__), tiny_model(implementation)
    for module in reference.modules():
        if isinstance(module, VanillaTransformerAttention):
            module.scaling /= divisor
    return model, reference


def test_keyword_arguments_of_a_registered_attention_function_reach_it(batch, monkeypatch):
    """transformers passes a model call's other keyword arguments to the attention function (a function
    registered with `AttentionInterface` may take its own): they were dropped without a word, in a forward,
    with labels and in a cached decoding step. Here a temperature dividing the scores, against the same
    model with every attention's scale divided by it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    temperatures = []

    def tempered(module, query, key, value, attention_mask, temperature=1.0, **kwargs):
        temperatures.append(temperature)
        kwargs["scaling"] /= temperature
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    model, reference = registered_and_scaled(monkeypatch, tempered, sdpa_mask, "sdpa", 5.0)
    with torch.no_grad():
        got = model(**batch, temperature=5.0)
        expected = reference(**batch)
        assert temperatures == [5.0] * 6  # 2 encoder layers, 2 decoder layers with two attentions each
        assert_same_up_to_rounding(got.logits, expected.logits, TINY_TERMS)
        assert_same_up_to_rounding(got.loss, expected.loss, TINY_TERMS)

        # A cached step: the step after the first two target tokens.
        source, mask, target = batch["input_ids"], batch["attention_mask"], batch["labels"][:, :3].clone()
        first = model(
            input_ids=source,
            attention_mask=mask,
            decoder_input_ids=target[:, :2],
            use_cache=True,
            temperature=5.0,
        )
        temperatures.clear()
        step = model(
            encoder_outputs=(first.encoder_last_hidden_state,),
            attention_mask=mask,
            decoder_input_ids=target[:, 2:],
            cache=first.cache,
            use_cache=True,
            temperature=5.0,
        )
        assert temperatures == [5.0] * 4
        whole = reference(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits[:, -1:]
        assert_same_up_to_rounding(step.logits, whole, TINY_TERMS)


def test_output_attentions_needs_eager(batch):
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        tiny_model("sdpa")(**batch, output_attentions=True)
    # Not asked for, the attention function is not looked up (every forward checks): a configuration
    # without an implementation made transformers warn, and a name it lacks raised.
    config = tiny_config()
    for name in (None, "not registered"):
        config._attn_implementation = name
        with logged_messages("transformers") as messages:
            assert modeling.requested_outputs(config, False, True) == (False, True)
        assert messages == []


def test_output_attentions_returns_the_weights_a_registered_function_returns(batch, monkeypatch):
    """A function registered with `AttentionInterface` that returns its weights (here the eager attention
    at half the scale) gives them with `output_attentions=True`, as in transformers' models: every
    implementation but "eager" was refused, saying that the others compute no weights."""
    from transformers.masking_utils import eager_mask

    def halved(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return eager_attention_forward(module, query, key, value, attention_mask, scaling / 2, dropout)

    model, reference = registered_and_scaled(monkeypatch, halved, eager_mask, "eager", 2.0)
    with torch.no_grad():
        got, expected = (m(**batch, output_attentions=True) for m in (model, reference))
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        assert len(got[name]) == 2, name
        for weights, reference_weights in zip(got[name], expected[name], strict=True):
            assert_same_up_to_rounding(weights, reference_weights, TINY_TERMS, msg=name)


@pytest.mark.parametrize("tracer", ["export", "jit"])
def test_export_and_jit_trace_give_the_eager_logits(batch, tracer):
    """`torch.export.export` and `torch.jit.trace` capture the forward, as they do MarianMTModel's: on
    another padding pattern than the traced one (rows padded on the left) the captured graph gives the
    eager logits, and the eager model is unchanged afterwards (no traced tensors kept in it)."""
    model = tiny_model()
    model.config.use_cache = False  # a cache object is no traced output
    inputs = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["attention_mask"])}
    inputs["decoder_input_ids"] = shift_tokens_right(batch["labels"].clamp(min=PAD), PAD, BOS)
    if tracer == "export":
        traced = torch.export.export(model, (), inputs, strict=False).module()
    else:
        traced = torch.jit.trace(model, tuple(inputs.values()), strict=False)
    left = {
        **inputs,
        "input_ids": inputs["input_ids"].clone(),
        "attention_mask": inputs["attention_mask"].clone(),
    }
    left["input_ids"][1, :3], left["attention_mask"][1, :3] = PAD, 0
    with torch.no_grad():
        expected = model(**left).logits
        got = traced(**left) if tracer == "export" else traced(*left.values())
    assert type(expected) is torch.Tensor  # not a fake tensor left behind by the trace
    assert_same_up_to_rounding(got["logits"], expected, TINY_TERMS)


def test_attention_scaling_gives_unit_variance_scores():
    torch.manual_seed(0)
    d_k, n = 64, 256
    query, key = torch.randn(1, 1, n, d_k), torch.randn(1, 1, n, d_k)
    value = torch.zeros(1, 1, n, d_k)
    _, weights = eager_attention_forward(nn.Module(), query, key, value, None, scaling=d_k**-0.5)
    # log-softmax recovers the scores up to a per-row constant.
    scores = weights.log()
    scores = scores - scores.mean(-1, keepdim=True)
    assert scores.var().item() == pytest.approx(1.0, rel=0.1)
    torch.testing.assert_close(weights, torch.softmax(query @ key.transpose(-1, -2) / 8.0, -1))


@pytest.mark.parametrize("qkv_init_gain", [None, 1.0])
def test_initialisation_follows_fairseq(qkv_init_gain):
    """Embeddings N(0, d_model^-0.5); Xavier-uniform linear layers, U(-b, b) with b = gain *
    sqrt(6 / (fan_in + fan_out)), standard deviation b / sqrt(3); gain 2**-0.5 by default for the
    attention's query, key and value projections (self- and cross-attention), 1 for the others."""
    torch.manual_seed(0)
    overrides = {} if qkv_init_gain is None else {"qkv_init_gain": qkv_init_gain}
    config = VanillaTransformerConfig.from_preset("tiny", attention_bias=False, **overrides)
    model = VanillaTransformerForConditionalGeneration(config)
    embedding = model.model.shared.weight
    assert embedding[PAD].abs().max() == 0
    assert embedding[3:].std().item() == pytest.approx(config.d_model**-0.5, rel=0.02)

    def check_xavier(weight, gain):
        bound = gain * math.sqrt(6 / sum(weight.shape))
        assert weight.abs().max() <= bound
        assert weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)

    check_xavier(model.model.encoder.layers[0].fc1.weight, 1.0)  # (d_ff, d_model)
    qkv_gain = 2**-0.5 if qkv_init_gain is None else qkv_init_gain
    for attention in (model.model.encoder.layers[0].self_attn, model.model.decoder.layers[1].encoder_attn):
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            check_xavier(projection.weight, qkv_gain)
        check_xavier(attention.out_proj.weight, 1.0)
    assert model.model.decoder.layers[1].encoder_attn.q_proj.bias is None  # the paper's W^Q
    assert model.model.encoder.layers[0].fc1.bias.abs().max() == 0
    torch.manual_seed(0)
    biased = VanillaTransformerForConditionalGeneration(
        VanillaTransformerConfig.from_preset("tiny", **overrides)
    )
    assert biased.model.decoder.layers[1].encoder_attn.q_proj.bias.abs().max() == 0


# Loss ----------------------------------------------------------------------------------------------


def test_label_smoothed_loss_is_the_formula(model, batch):
    out = model(**batch)
    labels = batch["labels"]
    log_probs = out.logits.log_softmax(-1)
    keep = labels != -100
    nll = -log_probs[keep].gather(-1, labels[keep][:, None]).squeeze(-1)
    uniform = -log_probs[keep].mean(-1)
    expected = (0.9 * nll + 0.1 * uniform).mean()
    torch.testing.assert_close(out.loss, expected)


def test_labels_alone_give_shifted_decoder_inputs(model, batch):
    labels = batch["labels"]
    shifted = model.prepare_decoder_input_ids_from_labels(labels)
    assert (
        shifted[0, 0] == BOS
        and (shifted[:, 1:][labels[:, :-1] != -100] == labels[:, :-1][labels[:, :-1] != -100]).all()
    )
    assert (shifted[1, 6:] == PAD).all()
    with torch.no_grad():
        implicit = model(**batch).logits
        explicit = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=shifted
        ).logits
    # With labels, the padding after each row's last label is skipped: compare where labels are.
    torch.testing.assert_close(implicit[labels != -100], explicit[labels != -100])


@pytest.mark.parametrize("name", ["pad_token_id", "decoder_start_token_id"])
def test_labels_alone_without_the_ids_to_shift_them_raise_naming_the_field(batch, name):
    # Generation runs without either; the shift of labels failed inside torch (new_full, a None store).
    model = tiny_model(**{name: None})
    with pytest.raises(ValueError, match=f"`config.{name}` is None"):
        model(**batch)


def test_num_items_in_batch_makes_accumulated_loss_equal_the_full_batch_loss(model, batch):
    full = model(**batch).loss
    total = (batch["labels"] != -100).sum()
    halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    accumulated = sum(model(**half, num_items_in_batch=total).loss for half in halves)
    torch.testing.assert_close(accumulated, full)
    mean_of_means = sum(model(**half).loss for half in halves) / 2
    assert not torch.allclose(mean_of_means, full)


def test_loss_of_fully_ignored_labels_is_zero_not_nan():
    loss = label_smoothed_cross_entropy(torch.randn(3, 10, requires_grad=True), torch.full((3,), -100), 0.1)
    assert loss.item() == 0.0
    loss.backward()


def test_loss_ignores_padding_labels():
    logits = torch.randn(4, 10)
    labels = torch.tensor([1, -100, 3, -100])
    torch.testing.assert_close(
        label_smoothed_cross_entropy(logits, labels, 0.0),
        nn.functional.cross_entropy(logits[[0, 2]], labels[[0, 2]]),
    )


# Misuse gives clear errors -----------------------------------------------------------------------


def test_out_of_vocabulary_ids_raise(model, batch):
    bad = batch["input_ids"].clone()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match=r"`input_ids` holds ids from .* outside \[0, 99\)"):
        model(input_ids=bad, labels=batch["labels"])
    bad_labels = batch["labels"].clone()
    bad_labels[0, 0] = -5
    with pytest.raises(ValueError, match=r"`labels`.*-100"):
        model(input_ids=batch["input_ids"], labels=bad_labels)
    with pytest.raises(ValueError, match="integer token ids"):
        model(input_ids=batch["input_ids"].float(), labels=batch["labels"])
    # Integer types the embedding does not index with ("Expected tensor for argument #1 'indices' to have
    # one of the following scalar types: Long, Int", naming no argument) are refused by name.
    for dtype in (torch.int16, torch.int8, torch.uint8):
        with pytest.raises(ValueError, match=rf"`input_ids` must hold int64 or int32 token ids, got {dtype}"):
            model(input_ids=batch["input_ids"].to(dtype), labels=batch["labels"])
        with pytest.raises(ValueError, match=rf"`decoder_input_ids` must hold int64 or int32 .* {dtype}"):
            model.generate(
                batch["input_ids"], decoder_input_ids=torch.ones(2, 1, dtype=dtype), max_new_tokens=2
            )
        with pytest.raises(ValueError, match=rf"`labels` must hold int64 or int32 token ids, got {dtype}"):
            model(input_ids=batch["input_ids"], labels=batch["labels"].to(dtype))


def test_int32_token_ids_give_what_int64_ones_give(model, batch):
    """int32 ids (numpy's default integer on Windows before numpy 2) index the embedding as int64 ones;
    as labels they failed in the loss ("expected target dtype to be Long or Byte, but got Int")."""
    expected = model(**batch)
    as_int32 = {name: tensor.to(torch.int32) for name, tensor in batch.items()}
    got = model(**as_int32)
    torch.testing.assert_close(got.loss, expected.loss)
    torch.testing.assert_close(got.logits, expected.logits)
    model.train()
    torch.testing.assert_close(model(**as_int32).loss, model(**batch).loss)  # the loss without logits


def test_mismatched_masks_and_empty_inputs_raise(model, batch):
    with pytest.raises(ValueError, match="`attention_mask` has shape"):
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"][:, :5],
            labels=batch["labels"],
        )
    with pytest.raises(ValueError, match="`decoder_attention_mask` has shape"):
        model(**batch, decoder_attention_mask=torch.ones(2, 3))
    # A mask without its batch dimension (or with one too many) failed with an IndexError inside
    # transformers' mask builder where it held a 0, and was taken whole, whatever its length, where not.
    sequence_mask = batch["attention_mask"][1]  # (9,), padded
    with pytest.raises(
        ValueError, match=r"`attention_mask` must be \(batch, length\).*\(9,\).*`mask\[None\]`"
    ):
        model(input_ids=batch["input_ids"], attention_mask=sequence_mask, labels=batch["labels"])
    with pytest.raises(ValueError, match=r"`attention_mask` must be \(batch, length\).*\(18,\)"):
        model(input_ids=batch["input_ids"], attention_mask=torch.ones(18), labels=batch["labels"])
    with pytest.raises(ValueError, match=r"`attention_mask` must be \(batch, length\).*\(2, 1, 9\)\.$"):
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"][:, None],
            labels=batch["labels"],
        )
    with pytest.raises(ValueError, match=r"`attention_mask` must be \(batch, length\).*\(9,\)"):
        model.generate(batch["input_ids"], attention_mask=sequence_mask, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` must be \(batch, length\).*\(7,\)"):
        model(**batch, decoder_attention_mask=torch.ones(7))
    with pytest.raises(ValueError, match="source sequence is empty"):
        model(input_ids=torch.empty(2, 0, dtype=torch.long), labels=batch["labels"])
    # A 0-row batch once ended in a reshape RuntimeError deep inside the attention.
    with pytest.raises(ValueError, match="The batch is empty"):
        model(input_ids=torch.empty(0, 4, dtype=torch.long), labels=torch.empty(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="The batch is empty"):
        model.generate(torch.empty(0, 4, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="The batch is empty"):
        model(
            encoder_outputs=(torch.empty(0, 4, model.config.d_model),),
            decoder_input_ids=torch.empty(0, 1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="exactly one of `input_ids`"):
        model(labels=batch["labels"])
    # Torch's messages for these named neither tensor: "size of tensor a (9) must match ... (32)" for
    # one unbatched sequence, "Expected input batch_size (10) to match target batch_size (6)" for labels
    # one position short of the decoder inputs.
    one_sequence = r"`input_ids` must be a \(batch, length\) tensor, got shape \(9,\): .*\(`ids\[None\]`\)"
    with pytest.raises(ValueError, match=one_sequence):
        model(input_ids=batch["input_ids"][0], labels=batch["labels"])
    with pytest.raises(
        ValueError, match=r"`labels` must be a \(batch, length\) tensor, got shape \(2, 7, 1\)\.$"
    ):
        model(input_ids=batch["input_ids"], labels=batch["labels"][..., None])
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    short = r"`labels` has shape \(2, 6\) but `decoder_input_ids` \(2, 7\)"
    with pytest.raises(ValueError, match=short):
        model(
            input_ids=batch["input_ids"], decoder_input_ids=decoder_input_ids, labels=batch["labels"][:, 1:]
        )
    embeds = model.get_decoder().embed_tokens(decoder_input_ids)
    with pytest.raises(ValueError, match=r"but `decoder_inputs_embeds` \(2, 7\)"):
        model(input_ids=batch["input_ids"], decoder_inputs_embeds=embeds, labels=batch["labels"][:, 1:])


def test_source_and_target_batches_of_different_sizes_raise(model, batch):
    """A batch of 1 on either side once broadcast against the other's rows in attention and returned
    logits for every pairing, where MarianMTModel fails; with a padding mask it was that mask that was
    reported, as the wrong shape."""
    source, target = batch["input_ids"], batch["labels"].clamp(min=PAD)
    encoder_outputs = model.get_encoder()(input_ids=source[:1])
    for call in (
        lambda: model(input_ids=source, decoder_input_ids=target[:1]),
        lambda: model(input_ids=source[:1], decoder_input_ids=target),
        lambda: model(encoder_outputs=encoder_outputs, decoder_input_ids=target),
        lambda: model(input_ids=source, attention_mask=batch["attention_mask"], labels=batch["labels"][:1]),
        lambda: model.model(input_ids=source, decoder_input_ids=target[:1]),
    ):
        with pytest.raises(ValueError, match=r"decoder inputs hold \d sequences but the encoder output"):
            call()


def test_attention_dropout_drops_attention_weights(batch):
    """`attention_dropout` (off in the paper's recipe) acts on the attention probabilities, and only there:
    in training mode each returned weight of a first layer (whose input is the same in both modes, the
    other dropouts off) is 0 or its eval-mode value over 1 - p; a model without it is deterministic."""
    p = 0.5
    model = tiny_model("eager", attention_dropout=p)
    with torch.no_grad():
        expected = model(**batch, output_attentions=True)
        torch.manual_seed(0)
        dropped = model.train()(**batch, output_attentions=True)
    real_targets = (batch["labels"] != -100)[:, None, :, None]  # queries at padding differ in training
    for name, rows in (("encoder_attentions", True), ("decoder_attentions", real_targets)):
        rows = torch.as_tensor(rows).expand_as(getattr(dropped, name)[0])
        got, reference = getattr(dropped, name)[0][rows], getattr(expected, name)[0][rows]
        kept = got != 0
        assert torch.equal(got[~kept], torch.zeros_like(got[~kept]))
        assert_same_up_to_rounding(got[kept], reference[kept] / (1 - p), 2)
        # dropped with probability p among the weights that are not 0 anyway: 5 standard deviations
        candidates = reference != 0
        share = (~kept & candidates).sum() / candidates.sum()
        assert abs(share.item() - p) < 5 * (p * (1 - p) / candidates.sum().item()) ** 0.5, (name, share)
    for implementation in ("eager", "sdpa"):
        without = tiny_model(implementation).train()
        with torch.no_grad():
            assert torch.equal(without(**batch).loss, without(**batch).loss)
        with_dropout = tiny_model(implementation, attention_dropout=p).train()
        with torch.no_grad():
            assert not torch.equal(with_dropout(**batch).loss, with_dropout(**batch).loss)


def test_target_lengths_get_a_forward_without_a_cache_by_default():
    """The decoder's `use_cache` follows the configuration (True) when not given; `target_lengths`,
    which skips the positions after each row's length (zeros there), then built a cache instead and
    computed them. Now it has the forward it needs by default, and a cache asked for with it is refused."""
    model = tiny_model().eval()
    source = torch.randint(4, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    target = torch.randint(4, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([5, 2])
    encoded = model.get_encoder()(input_ids=source).last_hidden_state
    decoder = model.get_decoder()
    full = decoder(input_ids=target, encoder_hidden_states=encoded, use_cache=False).last_hidden_state
    alone = decoder(input_ids=target, encoder_hidden_states=encoded, target_lengths=lengths)
    whole = model.model(input_ids=source, decoder_input_ids=target, target_lengths=lengths)
    for out in (alone, whole):
        states = out.last_hidden_state
        assert out.cache is None
        assert torch.equal(states[1, 2:], torch.zeros_like(states[1, 2:]))
        assert_same_up_to_rounding(states[0], full[0], TINY_TERMS)
        assert_same_up_to_rounding(states[1, :2], full[1, :2], TINY_TERMS)
    with pytest.raises(ValueError, match="target_lengths"):
        decoder(input_ids=target, encoder_hidden_states=encoded, target_lengths=lengths, use_cache=True)


def test_sdpa_on_the_cpu_gets_the_padding_mask_broadcast_over_the_queries():
    """transformers' mask builder gives SDPA a (B, 1, T, S) mask, materialised: one long source batched
    with short ones took memory in its length squared (a 10,000-token line with two short ones: over
    3 GB). On the CPU SDPA gets (B, 1, 1, S), the same mask broadcast over the queries; elsewhere (eager
    attention) the builder's own; and the outputs are those of the builder's mask."""
    from transformers.masking_utils import create_bidirectional_mask

    model = tiny_model("sdpa")
    config = model.config
    source = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
    keep = source != PAD
    embeds = torch.zeros(2, 5, config.d_model)
    decoder_embeds = torch.zeros(2, 3, config.d_model)
    built = create_bidirectional_mask(config=config, inputs_embeds=embeds, attention_mask=keep.long())
    mask = modeling.padding_mask(config, embeds, keep.long())
    assert mask.shape == (2, 1, 1, 5) and mask.dtype == torch.bool
    assert torch.equal(mask.expand_as(built), built)
    cross = modeling.padding_mask(config, decoder_embeds, keep.long(), torch.zeros(2, 5, config.d_model))
    assert cross.shape == (2, 1, 1, 5) and torch.equal(cross[:, :, 0], mask[:, :, 0])
    assert modeling.padding_mask(config, embeds, torch.ones(2, 5, dtype=torch.long)) is None
    target = torch.tensor([[BOS, 11, 12], [BOS, 13, PAD]])
    with torch.no_grad():
        broadcast = model(input_ids=source, attention_mask=keep.long(), decoder_input_ids=target).logits
        model.set_attn_implementation("eager")
        assert modeling.padding_mask(config, embeds, keep.long()).shape == built.shape  # the builder's
        eager = model(input_ids=source, attention_mask=keep.long(), decoder_input_ids=target).logits
    assert_same_up_to_rounding(broadcast, eager, TINY_TERMS)
