"""OPUS-MT / Marian import: identical logits and generate() output, on randomly initialised MarianMTModels."""

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel

from tests.conftest import TINY_TERMS, assert_same_up_to_rounding
from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.conversion import config_from_marian, convert_from_marian

# Both linear-layer kernels: torch's, and oneDNN's for every product that may take it.
pytestmark = pytest.mark.usefixtures("each_linear_kernel")

VARIANTS = {
    # The OPUS-MT layout: shared vocabulary, swish, scaled embeddings, tied output projection.
    "opus-mt": {"activation_function": "swish"},
    "separate-vocabularies": {
        "share_encoder_decoder_embeddings": False,
        "decoder_vocab_size": 71,
        "pad_token_id": 70,
        "decoder_start_token_id": 70,
        "activation_function": "relu",
        "encoder_layers": 3,
        "decoder_layers": 1,
        "scale_embedding": False,
    },
    "untied-gelu": {
        "activation_function": "gelu",
        "tie_word_embeddings": False,
        "d_model": 48,
        "encoder_ffn_dim": 40,
        "decoder_ffn_dim": 40,
        "encoder_attention_heads": 6,
        "decoder_attention_heads": 6,
    },
}


def marian_model(**overrides) -> MarianMTModel:
    values = {
        "vocab_size": 99,
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "max_position_embeddings": 256,
        "scale_embedding": True,
        "pad_token_id": 98,
        "decoder_start_token_id": 98,
        "eos_token_id": 0,
        "forced_eos_token_id": 0,
    }
    torch.manual_seed(0)
    config = MarianConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    model = MarianMTModel(config).eval()
    with torch.no_grad():  # Marian's biases start at zero; make them matter
        model.final_logits_bias.normal_(0, 0.5)
        for name, parameter in model.named_parameters():
            if name.endswith("proj.bias"):  # the attention's, which the paper's network has not
                parameter.normal_(0, 0.5)
    return model


def inputs(config: MarianConfig) -> dict[str, torch.Tensor]:
    """Three source sentences ending in </s> (id 0), the last one padded, and decoder inputs."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(1, 60, (3, 11), generator=generator)
    source[:, -1] = 0
    mask = torch.ones_like(source)
    source[2, 7:], mask[2, 7:] = config.pad_token_id, 0
    source[2, 6] = 0
    target = torch.randint(1, 60, (3, 6), generator=generator)
    return {"input_ids": source, "attention_mask": mask, "decoder_input_ids": target}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_converted_model_has_identical_logits_and_generations(variant, tmp_path):
    marian = marian_model(**VARIANTS[variant])
    ours = convert_from_marian(marian)
    assert isinstance(ours, VanillaTransformerForConditionalGeneration)
    assert ours.config.position_encoding_layout == "concatenated"
    # Marian's layer norms' epsilon: a wrong one moves these logits by less than rounding (every layer
    # norm's input has a variance near 1 here), so it is compared module by module (BART's names).
    marian_norms = {n: m.eps for n, m in marian.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    our_norms = {n: m.eps for n, m in ours.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    assert our_norms == marian_norms and marian_norms
    batch = inputs(marian.config)
    with torch.no_grad():
        expected = marian(**batch).logits
        # At most 4 layers and widths under 99 in every variant: the tiny model's sums bound them.
        assert_same_up_to_rounding(ours(**batch).logits, expected, TINY_TERMS)

    generate = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "max_new_tokens": 12,
    }
    for options in ({"num_beams": 1, "do_sample": False}, {"num_beams": 4}):
        torch.testing.assert_close(
            ours.generate(**generate, **options), marian.generate(**generate, **options)
        )
    # Without a length: Marian's generation config sets none here, so transformers' 20 tokens, in both.
    default = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "num_beams": 1}
    default["forced_eos_token_id"] = None
    default_tokens = marian.generate(**default, suppress_tokens=[0])  # no end token: the limit ends it
    torch.testing.assert_close(ours.generate(**default, suppress_tokens=[0]), default_tokens)
    # The weights are the converted model's own: training it leaves the Marian model as it was.
    with torch.no_grad():
        ours.lm_head.weight.add_(1.0)
        ours.model.encoder.layers[0].fc1.weight.add_(1.0)
        assert_same_up_to_rounding(marian(**batch).logits, expected, TINY_TERMS)
        ours.lm_head.weight.sub_(1.0)
        ours.model.encoder.layers[0].fc1.weight.sub_(1.0)

    # The converted model saves and loads like any other.
    ours.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_same_up_to_rounding(loaded(**batch).logits, expected, TINY_TERMS)
    tied = marian.config.tie_word_embeddings
    assert (loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight) == tied
    torch.testing.assert_close(loaded.generate(**default, suppress_tokens=[0]), default_tokens)


def test_separate_vocabularies_keep_their_sizes():
    ours = convert_from_marian(marian_model(**VARIANTS["separate-vocabularies"]))
    assert ours.model.shared is None
    assert ours.model.encoder.embed_tokens.weight.shape == (99, 32)
    assert ours.model.decoder.embed_tokens.weight.shape == (71, 32)
    assert ours.lm_head.weight.shape == (71, 32) and ours.final_logits_bias.shape == (1, 71)
    with pytest.raises(ValueError, match="`decoder_input_ids` holds ids"):
        ours(input_ids=torch.tensor([[5, 0]]), decoder_input_ids=torch.tensor([[80]]))


def test_unsupported_marian_configurations_are_refused():
    with pytest.raises(ValueError, match="attention heads"):
        config_from_marian(MarianConfig(encoder_attention_heads=4, decoder_attention_heads=8, d_model=32))
    with pytest.raises(ValueError, match="feed-forward widths differ"):
        config_from_marian(
            MarianConfig(
                encoder_ffn_dim=64,
                decoder_ffn_dim=32,
                d_model=32,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
            )
        )
    with pytest.raises(ValueError, match="Expected a MarianMTModel"):
        convert_from_marian(torch.nn.Linear(2, 2))


def test_marians_layer_drop_is_named_as_not_carried_over(caplog):
    """Marian's layer drop (skipping whole layers in training) has no counterpart here: converted, a model
    with it translates the same but fine-tunes otherwise, which the conversion says; without it, nothing."""
    with caplog.at_level("WARNING", logger="vanilla_transformer.conversion"):
        ours = convert_from_marian(marian_model())
        assert not caplog.records
        marian = marian_model(decoder_layerdrop=0.3).eval()
        ours = convert_from_marian(marian)
    assert "decoder_layerdrop 0.3 not carried over" in caplog.text and "encoder_layerdrop 0.0" in caplog.text
    batch = inputs(marian.config)
    with torch.no_grad():
        assert_same_up_to_rounding(ours.eval()(**batch).logits, marian(**batch).logits, TINY_TERMS)


def test_each_module_keeps_its_training_mode():
    marian = marian_model().train()
    marian.model.encoder.eval()  # frozen, as a fine-tuning script may leave it
    ours = convert_from_marian(marian)
    assert ours.training and ours.model.decoder.training and not ours.model.encoder.training


def test_fine_tuning_a_converted_model_trains_what_fine_tuning_marian_trains():
    """MarianMTModel's final logits bias is a buffer: fine-tuning leaves it as converted. Here it was a
    parameter, so the same optimiser steps trained the bias too and gave another model. Reference: three
    SGD steps on the same batch for both (dropout off), each on the model's own loss (Marian's is plain
    cross entropy: the converted model must not smooth it), then the logits."""
    marian = marian_model()
    ours = convert_from_marian(marian)
    assert "final_logits_bias" not in dict(ours.named_parameters())
    assert "final_logits_bias" in ours.state_dict()  # saved and loaded with the weights
    batch = inputs(marian.config)
    labels = torch.randint(1, 60, (3, 6), generator=torch.Generator().manual_seed(2))
    losses = {}
    for model in (marian, ours):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model.eval()  # no dropout: both compute the same function
        for step in range(3):
            loss = model(**batch, labels=labels).loss
            if step == 0:  # the same loss on the same weights: the cross entropy of the logits
                logits = model(**batch).logits.detach()
                expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
                assert_same_up_to_rounding(loss.detach(), expected, TINY_TERMS)
                losses[model is ours] = loss.detach()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_same_up_to_rounding(losses[True], losses[False], TINY_TERMS)
    with torch.no_grad():
        assert_same_up_to_rounding(ours(**batch).logits, marian(**batch).logits, 4 * TINY_TERMS)


def test_untied_matrices_holding_equal_values_train_apart_as_in_marian():
    """Sharing and tying were read off the matrices' values: an untied Marian model whose three embedding
    matrices held equal values (untied copies of one trained matrix, as old checkpoints store them)
    converted to one matrix, and three SGD steps later the logits were 0.12 apart."""
    marian = marian_model(tie_word_embeddings=False, init_std=0.2)
    embeddings = marian.model.encoder.embed_tokens.weight
    with torch.no_grad():
        for weight in (
            marian.model.decoder.embed_tokens.weight,
            marian.lm_head.weight,
            marian.model.shared.weight,
        ):
            weight.copy_(embeddings)
    ours = convert_from_marian(marian)
    assert not ours.config.tie_word_embeddings and not ours.config.share_encoder_decoder_embeddings
    batch = inputs(marian.config)
    labels = batch.pop("decoder_input_ids")
    for model in (marian, ours):
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        for _ in range(3):
            model(**batch, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        logits = [model(**batch, decoder_input_ids=labels).logits for model in (ours, marian)]
    assert_same_up_to_rounding(*logits, 4 * TINY_TERMS)


def test_a_trained_position_table_is_refused():
    """transformers 5 loads Marian's position tables trainable: one trained in place (a fine-tune of the
    loaded model, converted in memory) was replaced by the sinusoid without a word (logits 0.027 apart).
    A table in bfloat16, rounded, is still the sinusoid."""
    marian = marian_model()
    assert convert_from_marian(marian.to(torch.bfloat16)).dtype == torch.bfloat16
    for half in (torch.bfloat16, torch.float16):  # loaded in half precision and cast back: still rounded
        assert convert_from_marian(marian_model().to(half).float()).dtype == torch.float32
    marian = marian_model()
    with torch.no_grad():
        marian.model.decoder.embed_positions.weight[3:5] += 1e-3
    with pytest.raises(ValueError, match=r"decoder position table is not sinusoidal .* up to 0.001"):
        convert_from_marian(marian)


def test_what_a_call_returns_by_default_is_carried_over(tmp_path):
    """A Marian model set to return attentions or hidden states (`from_pretrained(...,
    output_attentions=True)`, for attention plots) or no cache converted to one returning neither, and a
    cache; and, loaded so, one that could not be saved (its generation config, copied from Marian's, asked
    for attentions without return_dict_in_generate, which transformers refuses to save)."""
    for flags in ({"output_attentions": True}, {"output_hidden_states": True}, {"use_cache": False}):
        marian_model().save_pretrained(tmp_path / "marian")
        marian = MarianMTModel.from_pretrained(tmp_path / "marian", **flags).eval()
        ours = convert_from_marian(marian)
        ours.save_pretrained(tmp_path / "ours")
        # SDPA computes no weights (this model says so; transformers' picked eager for Marian here).
        ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
        batch = inputs(marian.config)
        with torch.no_grad():
            expected, got = marian(**batch), ours(**batch)
        assert set(got.keys()) == set(expected.keys()), flags
        for name in expected:
            if name.endswith(("attentions", "hidden_states")):  # the unpadded sentences' (rows 0 and 1)
                for mine, theirs in zip(got[name], expected[name], strict=True):
                    assert_same_up_to_rounding(mine[:2], theirs[:2], 4 * TINY_TERMS)


def test_frozen_parameters_stay_frozen():
    """Parameters frozen in the Marian model (`requires_grad_(False)`, how a fine-tuning script freezes an
    encoder or the embeddings) came back trainable: fine-tuning the converted model then changed them, and
    trained another model than fine-tuning Marian does."""
    for overrides in ({}, VARIANTS["separate-vocabularies"], VARIANTS["untied-gelu"]):
        marian = marian_model(**overrides)
        marian.model.encoder.requires_grad_(False)  # the source embeddings too
        marian.model.decoder.layers[0].fc1.requires_grad_(False)
        ours = convert_from_marian(marian)
        expected = {name: p.requires_grad for name, p in marian.named_parameters(remove_duplicate=False)}
        for name, parameter in ours.named_parameters(remove_duplicate=False):
            if name != "model.shared.weight":  # Marian's encoder embeddings (the same matrix)
                assert parameter.requires_grad == expected[name], (overrides, name)
        assert not ours.model.encoder.embed_tokens.weight.requires_grad
        assert any(p.requires_grad for p in ours.parameters())


def test_gradients_reach_the_hidden_states_in_training_as_in_marian():
    """`retain_grad()` on the hidden states an output reports, then `backward()` (transformers'
    `test_retain_grad_hidden_states_attentions`; gradient saliency): in training mode a padded batch
    runs on packed tokens, and the reported (padded) states were copies beside the computation, which
    got no gradient. Compared with MarianMTModel's, entry by entry, with the loss Trainer computes (no
    logits) and with logits."""
    marian = marian_model(activation_function="relu", dropout=0.0).train()  # no dropout: one function
    ours = convert_from_marian(marian).train()
    batch = inputs(marian.config)
    labels = batch.pop("decoder_input_ids")
    labels[1, 4:] = -100  # trailing target padding: positions the loss path skips

    def gradients(model, **options):
        model.zero_grad()
        out = model(**batch, labels=labels, output_hidden_states=True, **options)
        states = [*out.encoder_hidden_states, *out.decoder_hidden_states]
        for state in states:
            state.retain_grad()
        out.loss.backward()
        assert all(state.grad is not None for state in states)
        return out.loss, [state.grad for state in states]

    expected_loss, expected = gradients(marian)
    scale = max(float(g.abs().max()) for g in expected)
    for options in ({}, {"return_logits": True}):
        loss, got = gradients(ours, **options)
        assert_same_up_to_rounding(loss, expected_loss, TINY_TERMS)
        assert len(got) == len(expected) == 6
        for index, (ours_grad, marian_grad) in enumerate(zip(got, expected, strict=True)):
            assert_same_up_to_rounding(ours_grad, marian_grad, TINY_TERMS, scale, msg=f"{options} {index}")


def test_encoder_and_decoder_called_alone_answer_as_marians_do():
    """`get_encoder()` and `get_decoder()` called alone (feature extraction, a decoding loop of one's
    own) take `output_hidden_states`, `output_attentions` and `use_cache` from the configuration where
    not given, and `return_dict=False`, as MarianMTModel's do: the encoder ignored the configuration's
    flags, and the decoder refused `return_dict` and returned no cache by default."""
    marian = marian_model(activation_function="relu")
    ours = convert_from_marian(marian)
    batch = inputs(marian.config)
    for model in (marian, ours):
        model.config.output_hidden_states = model.config.output_attentions = True
    with torch.no_grad():
        outputs = {}
        for name, model in (("marian", marian), ("ours", ours)):
            encoder = model.get_encoder()(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            )
            decoder = model.get_decoder()(
                input_ids=batch["decoder_input_ids"],
                encoder_hidden_states=encoder.last_hidden_state,
                encoder_attention_mask=batch["attention_mask"],
                return_dict=False,
            )
            outputs[name] = (encoder, decoder)
    (marian_encoder, marian_decoder), (our_encoder, our_decoder) = outputs["marian"], outputs["ours"]
    assert len(our_encoder.hidden_states) == len(our_encoder.attentions) + 1 == 3
    # Padding positions: Marian computes them, this model leaves them out (nothing attends to them).
    kept = batch["attention_mask"].bool()
    for got, expected in zip(our_encoder.hidden_states, marian_encoder.hidden_states, strict=True):
        assert_same_up_to_rounding(got[kept], expected[kept], TINY_TERMS)
    for got, expected in zip(our_encoder.attentions, marian_encoder.attentions, strict=True):
        # (B, H, S, S) -> the rows of real queries, (N, H, S)
        assert_same_up_to_rounding(got.transpose(1, 2)[kept], expected.transpose(1, 2)[kept], TINY_TERMS)
    assert isinstance(our_decoder, tuple) and len(our_decoder) == len(marian_decoder) == 5
    assert_same_up_to_rounding(our_decoder[0], marian_decoder[0], TINY_TERMS)
    assert our_decoder[1].get_seq_length() == marian_decoder[1].get_seq_length() == 6  # the cache
    for got_group, expected_group in zip(our_decoder[2:], marian_decoder[2:], strict=True):
        for got, expected in zip(got_group, expected_group, strict=True):
            assert_same_up_to_rounding(got, expected, TINY_TERMS)


def test_inputs_embeds_are_the_lookup_unscaled_on_both_sides_where_marians_encoder_takes_them_scaled():
    """`model(inputs_embeds=model.get_input_embeddings()(ids))` is `model(ids)` in encoder and decoder
    (each scales what it is given by sqrt(d_model), as it scales its lookup). MarianMTModel's decoder does
    the same, but its encoder takes `inputs_embeds` as already scaled: with equal weights the two models
    agree on `inputs_embeds` once the encoder's are scaled for MarianMTModel (a user porting Marian code
    that passes them gets other logits without it; the conversion's docstring says so)."""
    marian = marian_model(activation_function="relu")
    with torch.no_grad():  # embeddings as large as the positions, so that their scale shows in the logits
        marian.get_input_embeddings().weight.normal_(0, 1)
    ours = convert_from_marian(marian)
    batch = inputs(marian.config)
    scale = marian.config.d_model**0.5
    with torch.no_grad():
        expected = marian(**batch).logits
        embeds = ours.get_input_embeddings()(batch["input_ids"])
        decoder_embeds = ours.get_input_embeddings()(batch["decoder_input_ids"])
        given = {"attention_mask": batch["attention_mask"], "decoder_inputs_embeds": decoder_embeds}
        assert_same_up_to_rounding(ours(inputs_embeds=embeds, **given).logits, expected, TINY_TERMS)
        assert_same_up_to_rounding(marian(inputs_embeds=embeds * scale, **given).logits, expected, TINY_TERMS)
        # Unscaled, MarianMTModel's encoder reads another input (the difference this test documents).
        assert not torch.allclose(marian(inputs_embeds=embeds, **given).logits, expected, atol=0.1)


def test_resizing_a_converted_model_extends_its_logits_bias_as_marian_does(tmp_path):
    """Adding tokens to a converted OPUS-MT model before fine-tuning was refused for its final logits
    bias; it now grows (zeros for the new ids) as MarianMTModel's does: equal new rows, equal logits."""
    marian = marian_model(activation_function="relu")
    ours = convert_from_marian(marian)
    batch = inputs(marian.config)
    for model in (marian, ours):
        model.resize_token_embeddings(112, mean_resizing=False)
    with torch.no_grad():
        ours.get_input_embeddings().weight.copy_(marian.get_input_embeddings().weight)
        # a new id in every sentence, so that the new rows are read as well as scored
        batch["input_ids"][:, 0], batch["decoder_input_ids"][:, 1] = 105, 110
        expected = marian(**batch).logits
        assert expected.shape[-1] == ours.final_logits_bias.shape[1] == ours.config.decoder_vocab_size == 112
        assert torch.equal(ours.final_logits_bias, marian.final_logits_bias)
        assert_same_up_to_rounding(ours(**batch).logits, expected, TINY_TERMS)
    ours.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_same_up_to_rounding(loaded(**batch).logits, expected, TINY_TERMS)
    generate = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    torch.testing.assert_close(
        loaded.generate(**generate, num_beams=4, max_new_tokens=8),
        marian.generate(**generate, num_beams=4, max_new_tokens=8),
    )

    separate = convert_from_marian(marian_model(**VARIANTS["separate-vocabularies"]))
    with pytest.raises(ValueError, match="Resizing needs one embedding matrix shared by encoder and decoder"):
        separate.resize_token_embeddings(112)
    # Cut (to a multiple of 8, 104) as MarianMTModel cuts its bias (asked for 104 itself: given
    # pad_to_multiple_of, its bias keeps the size asked for, 101, against 104 logits); asked for nothing,
    # nothing is replaced.
    bias = ours.final_logits_bias
    assert ours.resize_token_embeddings() is ours.get_input_embeddings() and ours.final_logits_bias is bias
    ours.resize_token_embeddings(101, pad_to_multiple_of=8)
    marian.resize_token_embeddings(104)
    assert ours.final_logits_bias.shape == (1, 104) and torch.equal(ours.final_logits_bias, bias[:, :104])
    torch.testing.assert_close(ours.final_logits_bias, marian.final_logits_bias)
    with torch.no_grad():
        batch["input_ids"][:, 0], batch["decoder_input_ids"][:, 1] = 100, 103
        assert_same_up_to_rounding(ours(**batch).logits, marian(**batch).logits, TINY_TERMS)
