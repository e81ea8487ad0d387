"""Incremental decoding and generate() against hand-written decoding loops."""

import copy
import json
import re

import numpy as np
import pytest
import torch

from tests.conftest import BOS, EOS, TINY_TERMS, assert_same_up_to_rounding, count_returns, tiny_model

# Both linear-layer kernels: torch's, and oneDNN's for every product that may take it.
pytestmark = pytest.mark.usefixtures("each_linear_kernel")


@pytest.fixture
def source() -> torch.Tensor:
    return torch.randint(3, 99, (3, 8), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_cached_decoding_equals_uncached(attn_implementation, source):
    model = tiny_model(attn_implementation, layer_norm_eps=0.1)  # cached steps compute their own norms
    target = torch.randint(3, 99, (3, 10))
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
        encoder_outputs = model.get_encoder()(input_ids=source)
        cache, steps = None, []
        for t in range(target.shape[1]):
            out = model(
                encoder_outputs=encoder_outputs,
                decoder_input_ids=target[:, t : t + 1],
                cache=cache,
                use_cache=True,
            )
            cache = out.cache
            steps.append(out.logits)
    assert cache.get_seq_length() == 10
    assert_same_up_to_rounding(torch.cat(steps, 1), full, TINY_TERMS)


def test_cross_attention_keys_are_computed_once(source):
    model = tiny_model()
    calls = []
    model.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(lambda *args: calls.append(1))
    model.generate(source, num_beams=1, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert len(calls) == 1


def greedy_by_hand(model, source: torch.Tensor, steps: int) -> torch.Tensor:
    """Argmax decoding with full re-computation at every step: no cache, no generate()."""
    tokens = torch.full((source.shape[0], 1), BOS)
    finished = torch.zeros(source.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=source, decoder_input_ids=tokens, use_cache=False).logits[:, -1]
            next_token = logits.argmax(-1).masked_fill(finished, model.config.pad_token_id)
            tokens = torch.cat([tokens, next_token[:, None]], 1)
            finished |= next_token == EOS
            if finished.all():
                break
    return tokens


def test_greedy_generate_equals_hand_written_argmax_loop(source):
    model = tiny_model()
    generated = model.generate(source, num_beams=1, do_sample=False, max_new_tokens=12)
    torch.testing.assert_close(generated, greedy_by_hand(model, source, 12))


def test_greedy_stops_at_eos_and_pads_finished_rows(source):
    """Rows that end at different steps: each stops at its end token and is padded after it. (An
    earlier version zeroed the tied output matrix, hence every embedding: all rows ended together.)"""
    from tests.conftest import PAD

    model = tiny_model(seed=19, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 8  # the end token likelier, so that these rows end within 12
    generated = model.generate(source, num_beams=1, do_sample=False, max_new_tokens=12)
    torch.testing.assert_close(generated, greedy_by_hand(model, source, 12))
    ends = [int((row == EOS).nonzero()[0, 0]) for row in generated]  # every row has ended
    assert len(set(ends)) == len(ends), ends
    for row, end in zip(generated, ends, strict=True):
        assert (row[end + 1 :] == PAD).all()
    assert min(ends) < generated.shape[1] - 1  # so some row does carry padding


def teacher_forced_log_probs(model, source: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """log p(token_i | tokens_<i, source) of every generated token (B, T-1), from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=sequences[:, :-1], use_cache=False).logits
    return logits.log_softmax(-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)


def test_beam_search_sampling_and_multiple_returns(source):
    model = tiny_model()
    beams = model.generate(
        source,
        num_beams=4,
        num_return_sequences=3,
        max_new_tokens=7,
        length_penalty=1.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert beams.sequences.shape[0] == 9 and beams.sequences[:, 0].eq(BOS).all()
    scores = beams.sequences_scores.view(3, 3)
    assert (scores[:, :-1] >= scores[:, 1:]).all(), "returned beams are best first"
    assert len({tuple(row.tolist()) for row in beams.sequences[:3]}) == 3
    # Each returned score is its sequence's log-probability over its length, rescored independently
    # by a plain forward over the whole sequence (tokens after an EOS are padding, not scored).
    repeated = source.repeat_interleave(3, dim=0)
    log_probs = teacher_forced_log_probs(model, repeated, beams.sequences)
    ended = torch.cumsum(beams.sequences[:, 1:] == EOS, dim=1)
    scored = (ended == 0) | ((ended == 1) & (beams.sequences[:, 1:] == EOS))  # up to and with the EOS
    expected = (log_probs * scored).sum(-1) / scored.sum(-1)
    assert_same_up_to_rounding(beams.sequences_scores, expected, TINY_TERMS)

    # Sampling with top_k: every drawn token is among the 20 most likely at its step, and a seed
    # reproduces the draw.
    torch.manual_seed(0)
    first = model.generate(source, do_sample=True, num_beams=1, top_k=20, max_new_tokens=7)
    torch.manual_seed(0)
    second = model.generate(source, do_sample=True, num_beams=1, top_k=20, max_new_tokens=7)
    torch.testing.assert_close(first, second)
    assert first.shape == (3, 8)
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=first[:, :-1], use_cache=False).logits
    drawn = logits.gather(-1, first[:, 1:, None]).squeeze(-1)
    twentieth = logits.topk(20, dim=-1).values[..., -1]
    live = torch.cumsum(first[:, 1:] == EOS, dim=1) - (first[:, 1:] == EOS).long() == 0  # before EOS
    assert (drawn[live] >= twentieth[live]).all()


@pytest.mark.parametrize("form", ["power", "gnmt"])
def test_length_penalty_forms_rank_beams_by_their_formula(source, form):
    """The returned beam scores are each sequence's log-probability (rescored by a plain forward) over
    |Y|^0.6 (transformers' form) or the paper's ((5 + |Y|) / 6)^0.6, |Y| counting the end token; the
    form comes from the call or from the generation config."""
    model = tiny_model(seed=1, add_final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[0, EOS] = 1.3  # so that some beams end early, others run to the limit
    options = {"num_beams": 4, "num_return_sequences": 2, "max_new_tokens": 9, "length_penalty": 0.6}
    if form == "gnmt":
        model.generation_config.length_penalty_form = "gnmt"
    beams = model.generate(source, output_scores=True, return_dict_in_generate=True, **options)
    repeated = source.repeat_interleave(2, dim=0)
    log_probs = teacher_forced_log_probs(model, repeated, beams.sequences)
    ended = torch.cumsum(beams.sequences[:, 1:] == EOS, dim=1)
    scored = (ended == 0) | ((ended == 1) & (beams.sequences[:, 1:] == EOS))
    length = scored.sum(-1).double()
    assert len(set(length.tolist())) > 1, "sequences of several lengths"
    normalisers = {"power": length**0.6, "gnmt": ((5 + length) / 6) ** 0.6}
    total = (log_probs.double() * scored).sum(-1)
    expected = (total / normalisers[form]).float()
    other = (total / normalisers["gnmt" if form == "power" else "power"]).float()
    assert_same_up_to_rounding(beams.sequences_scores, expected, TINY_TERMS)
    assert not torch.allclose(beams.sequences_scores, other, rtol=1e-3)
    model.generation_config.length_penalty_form = "power"
    by_keyword = model.generate(
        source, output_scores=True, return_dict_in_generate=True, length_penalty_form=form, **options
    )
    torch.testing.assert_close(by_keyword.sequences_scores, beams.sequences_scores)
    with pytest.raises(ValueError, match="length_penalty_form must be one of"):
        model.generate(source, length_penalty_form="wu", **options)


def test_paper_length_penalty_form_takes_the_alpha_in_force(source, caplog):
    """ "gnmt" applies the alpha of the call, else of the generation config in use, else the model's (the
    paper's 0.6), else transformers' 1.0; greedy search, which has no length penalty, is left as it is
    (no warning)."""
    from transformers import GenerationConfig

    model = tiny_model(add_final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[0, EOS] = 1.0
    options = {"max_new_tokens": 9, "output_scores": True, "return_dict_in_generate": True}

    def scores(**kwargs: object) -> torch.Tensor:
        return model.generate(source, length_penalty_form="gnmt", **options, **kwargs).sequences_scores

    torch.testing.assert_close(scores(), scores(length_penalty=0.6))  # the model's default
    given = GenerationConfig(num_beams=4, early_stopping=True, length_penalty_form="gnmt", max_new_tokens=9)
    passed = model.generate(source, generation_config=given, output_scores=True, return_dict_in_generate=True)
    torch.testing.assert_close(passed.sequences_scores, scores(length_penalty=0.6))
    model.generation_config.length_penalty = None
    torch.testing.assert_close(scores(), scores(length_penalty=1.0))
    assert not torch.allclose(scores(length_penalty=1.0), scores(length_penalty=0.6))  # alpha matters here
    caplog.clear()
    with caplog.at_level("WARNING"):
        greedy = model.generate(source, num_beams=1, length_penalty_form="gnmt", max_new_tokens=9)
    assert torch.equal(greedy, model.generate(source, num_beams=1, max_new_tokens=9))
    assert "length_penalty" not in caplog.text


def test_default_generation_config_is_the_papers():
    config = tiny_model().generation_config
    assert config.num_beams == 4 and config.early_stopping is True and config.length_penalty == 0.6
    assert config.decoder_start_token_id == BOS and config.eos_token_id == EOS


def test_default_output_length_is_source_length_plus_50(source):
    model = tiny_model()
    # With EOS suppressed nothing stops early, so the length shows the limit.
    generated = model.generate(source, num_beams=1, suppress_tokens=[EOS])
    assert generated.shape[1] == 1 + source.shape[1] + 50
    capped = model.generate(source, num_beams=1, suppress_tokens=[EOS], max_new_tokens=5)
    assert capped.shape[1] == 6


@pytest.mark.parametrize("num_beams", [1, 3])
def test_each_sentence_gets_its_own_source_length_plus_offset(source, num_beams):
    """Section 6.1's limit (source length + 50) is per input: in a padded batch each row stops where it
    would alone (every row once got the padded length + 50). Offset 5 here, to keep the test short."""
    from tests.conftest import PAD

    model = tiny_model("sdpa")
    model.generation_config.max_length_offset = 5
    attention_mask = torch.ones_like(source)
    attention_mask[1, 5:] = attention_mask[2, 2:] = 0
    padded = source.masked_fill(attention_mask == 0, PAD)
    options = {"num_beams": num_beams, "suppress_tokens": [EOS]}  # nothing stops early
    batch = model.generate(padded, attention_mask=attention_mask, **options)
    assert batch.shape[1] == 1 + source.shape[1] + 5
    for row, length in enumerate(attention_mask.sum(-1).tolist()):
        alone = model.generate(source[row : row + 1, :length], **options)[0]
        assert alone.shape[0] == 1 + length + 5
        assert torch.equal(batch[row, : alone.shape[0]], alone), row
        # after the limit only padding (beam search filled it with the end token)
        assert (batch[row, alone.shape[0] :] == PAD).all(), row
    # Without the mask, as a direct call may leave it out: the padding is read from the token ids
    # (transformers infers it for decoder-only models alone; an encoder-decoder attended to the padding).
    assert torch.equal(model.generate(padded, **options), batch)
    # Only runs at the end (or start) of a row are padding: a padding id inside a row, where a model
    # whose padding token is also its start token has it, is text.
    inside = source.clone()
    inside[:, 3] = PAD
    assert torch.equal(
        model.generate(inside, **options),
        model.generate(inside, attention_mask=torch.ones_like(inside), **options),
    )
    # A padding id given as a keyword counts.
    other = source.masked_fill(attention_mask == 0, 7)
    masked = model.generate(other, attention_mask=attention_mask, pad_token_id=7, **options)
    assert torch.equal(model.generate(other, pad_token_id=7, **options), masked)


def test_end_tokens_given_as_a_tensor_read_the_padding_as_a_list_does(source):
    """`eos_token_id` as a tensor, which transformers' `generate` takes as it takes a list: the padding
    of a batch given without its mask is read from the token ids (a RuntimeError about a tensor's truth
    value came from comparing the padding id with the tensor), and not where an end token is the
    padding token."""
    from tests.conftest import PAD

    model = tiny_model()
    attention_mask = torch.ones_like(source)
    attention_mask[1, 5:] = attention_mask[2, 2:] = 0
    padded = source.masked_fill(attention_mask == 0, PAD)
    options = {"num_beams": 1, "max_new_tokens": 6}
    ends = [EOS, 7]
    masked = model.generate(padded, attention_mask=attention_mask, eos_token_id=ends, **options)
    assert torch.equal(model.generate(padded, eos_token_id=torch.tensor(ends), **options), masked)
    ends = [PAD, 7]  # the padding token is an end token: nothing is read as padding
    unmasked = model.generate(padded, attention_mask=torch.ones_like(padded), eos_token_id=ends, **options)
    assert torch.equal(model.generate(padded, eos_token_id=torch.tensor(ends), **options), unmasked)


def test_encoder_outputs_given_to_generate_are_left_as_they_were(source):
    """transformers expands `encoder_outputs` for beam search (or several sequences) in place: the
    caller's object then held num_beams copies of each row, and a second decoding from it returned
    num_beams times the rows (MarianMTModel still does)."""
    model = tiny_model("sdpa")
    encoder_outputs = model.get_encoder()(input_ids=source)
    states = encoder_outputs.last_hidden_state
    first = model.generate(encoder_outputs=encoder_outputs, num_beams=3, max_new_tokens=5)
    assert encoder_outputs.last_hidden_state is states
    again = model.generate(encoder_outputs=encoder_outputs, num_beams=3, max_new_tokens=5)
    assert torch.equal(again, first) and first.shape[0] == source.shape[0]
    several = model.generate(encoder_outputs=encoder_outputs, num_beams=3, num_return_sequences=2)
    assert several.shape[0] == 2 * source.shape[0] and encoder_outputs.last_hidden_state is states


def test_encoder_outputs_given_as_a_tuple_generate_as_a_model_output_does(source):
    """`forward` takes `encoder_outputs` as a tuple too; transformers expands only a ModelOutput for beam
    search or several sequences, and indexed the tuple by its keys ("TypeError: only integer tensors of a
    single element can be converted to an index"); greedy search took it."""
    model = tiny_model("sdpa")
    encoder_outputs = model.get_encoder()(input_ids=source)
    for options in ({"num_beams": 1}, {"num_beams": 3}, {"num_beams": 3, "num_return_sequences": 2}):
        expected = model.generate(encoder_outputs=encoder_outputs, max_new_tokens=5, **options)
        for given in (tuple(encoder_outputs.values()), [encoder_outputs.last_hidden_state]):
            assert torch.equal(model.generate(encoder_outputs=given, max_new_tokens=5, **options), expected)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_finished_rows_are_filled_with_padding_as_greedy_search_and_marian_fill_them(source, num_beams):
    """transformers' beam search fills a finished row with `pad_token_id or eos_token_id`: with this
    model's padding id, 0, with the end token, and with -1 where there is no end token. Greedy search
    (and MarianMTModel, whose padding id is not 0) fill it with padding, which is what counts a row's
    length. Rows end at an end token or at their own source-length limit; both are filled with padding,
    and what a row holds before that is its translation alone."""
    from tests.conftest import PAD

    model = tiny_model("sdpa", seed=2, tie_word_embeddings=False)
    model.generation_config.max_length_offset = 3
    attention_mask = torch.ones_like(source)
    attention_mask[1, 5:] = attention_mask[2, 2:] = 0
    padded = source.masked_fill(attention_mask == 0, PAD)
    for options in (
        {"forced_eos_token_id": EOS},  # each row ends with the end token at its limit
        {"eos_token_id": None},  # no end token: each row stops at its limit
    ):
        options["num_beams"] = num_beams
        batch = model.generate(padded, attention_mask=attention_mask, return_dict_in_generate=True, **options)
        for row, length in enumerate(attention_mask.sum(-1).tolist()):
            alone = model.generate(source[row : row + 1, :length], **options)[0]
            assert torch.equal(batch.sequences[row, : alone.shape[0]], alone), (options, row)
            assert (batch.sequences[row, alone.shape[0] :] == PAD).all(), (options, row)
    # An end token that a keyword switches off is text (here forced as the third token): nothing after
    # it is touched.
    from transformers import LogitsProcessor, LogitsProcessorList

    class EndTokenThird(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return scores.index_fill(1, torch.tensor([EOS]), 1e4) if input_ids.shape[1] == 3 else scores

    options = {"num_beams": num_beams, "eos_token_id": None, "suppress_tokens": [PAD]}
    text = model.generate(padded[:1], logits_processor=LogitsProcessorList([EndTokenThird()]), **options)
    assert text.shape[1] == 1 + source.shape[1] + 3 and text[0, 3] == EOS
    assert not (text[0, 1:] == PAD).any()


@pytest.mark.parametrize("num_beams", [1, 4])
def test_rows_a_stopping_criterion_ends_are_filled_with_padding(source, num_beams):
    """Beam search ends a hypothesis at an end token, at a sentence's own limit, or where a stopping
    criterion says so; transformers fills the rest with the end token (padding id 0) or -1. The rest
    is padding here, as in greedy search."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from tests.conftest import PAD

    class FirstSentenceStopsAfterThree(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[: input_ids.shape[0] // source.shape[0]] = input_ids.shape[1] - 1 >= 3  # batch-major
            return done

    model = tiny_model("sdpa")
    stop = StoppingCriteriaList([FirstSentenceStopsAfterThree()])
    for ends in ({}, {"eos_token_id": None}):
        if num_beams == 1 and ends:  # greedy search without an end token does not stop a row (as Marian's)
            continue
        options = {"num_beams": num_beams, "max_new_tokens": 8, "suppress_tokens": [EOS], **ends}
        output = model.generate(source, stopping_criteria=stop, **options)
        assert output.shape[1] == 1 + 8 and (output[0, 4:] == PAD).all(), (ends, output[0])
        assert not (output[1:, 1:] == PAD).any()  # the other sentences run to the length


def test_an_end_token_switched_off_in_the_generation_config_is_text(source):
    """With the model's generation config setting no end token (transformers then reads none from the
    model configuration either), an end token in the output is text: what follows it was once
    overwritten with padding."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class EndTokenThird(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return scores.index_fill(1, torch.tensor([EOS]), 1e4) if input_ids.shape[1] == 3 else scores

    model = tiny_model("sdpa")
    model.generation_config.eos_token_id = None
    for num_beams in (1, 4):
        output = model.generate(
            source[:1],
            num_beams=num_beams,
            max_new_tokens=8,
            logits_processor=LogitsProcessorList([EndTokenThird()]),
            suppress_tokens=[0],
        )
        assert output.shape[1] == 1 + 8 and output[0, 3] == EOS and not (output[0, 1:] == 0).any()


def test_a_start_token_per_row_with_a_prompt(source):
    """transformers takes `decoder_start_token_id` as one id per row; with a decoder prompt beside it,
    `generate` once failed reading the prompt's length ('bool' object has no attribute 'all')."""
    model = tiny_model("sdpa")
    start = model.config.decoder_start_token_id
    prompt = torch.tensor([[start, 7], [start, 8], [start, 9]])
    options = {"num_beams": 2, "max_new_tokens": 4, "decoder_input_ids": prompt}
    per_row = model.generate(source, decoder_start_token_id=[start] * 3, **options)
    assert torch.equal(per_row, model.generate(source, **options))


@pytest.mark.parametrize("num_beams", [1, 4])
def test_a_forced_end_token_comes_at_each_sentences_own_limit(source, num_beams):
    """`forced_eos_token_id` under the per-sentence limit: transformers forces the end token at the
    batch's limit (the longest sentence's), so the shorter rows of a padded batch, stopped at their
    own, ended without it, and under beam search with another translation than alone."""
    from tests.conftest import PAD

    model = tiny_model("sdpa", seed=2, tie_word_embeddings=False)
    model.generation_config.max_length_offset = 3
    attention_mask = torch.ones_like(source)
    attention_mask[1, 5:] = attention_mask[2, 2:] = 0
    padded = source.masked_fill(attention_mask == 0, PAD)
    options = {"num_beams": num_beams, "forced_eos_token_id": EOS}
    batch = model.generate(padded, attention_mask=attention_mask, **options)
    for row, length in enumerate(attention_mask.sum(-1).tolist()):
        alone = model.generate(source[row : row + 1, :length], **options)[0]
        assert alone[-1] == EOS and alone.shape[0] <= 1 + length + 3
        assert torch.equal(batch[row, : alone.shape[0]], alone), row
        assert (batch[row, alone.shape[0] :] == PAD).all(), row  # not the end token (beam search did)
    # Set in the generation config and switched off by the keyword, as transformers reads it.
    model.generation_config.forced_eos_token_id = EOS
    options["forced_eos_token_id"] = None
    batch = model.generate(padded, attention_mask=attention_mask, **options)
    for row, length in enumerate(attention_mask.sum(-1).tolist()):
        alone = model.generate(source[row : row + 1, :length], **options)[0]
        assert torch.equal(batch[row, : alone.shape[0]], alone), row
    # As an id that is not a Python int or list, which transformers' forcing takes (the per-sentence
    # forcing iterated over it: a TypeError in padded batches alone; a NumPy array was refused as
    # "outside the vocabulary").
    options["forced_eos_token_id"] = EOS
    batch = model.generate(padded, attention_mask=attention_mask, **options)
    for given in (torch.tensor(EOS), np.int64(EOS), torch.tensor([EOS]), np.array(EOS), np.array([EOS])):
        options["forced_eos_token_id"] = given
        assert torch.equal(model.generate(padded, attention_mask=attention_mask, **options), batch)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_sources_padded_on_the_left_translate_as_alone(source, num_beams):
    """A batch padded on the left (with its mask, or read from the token ids) translates each sentence
    as it would alone, to the same per-sentence limit."""
    from tests.conftest import PAD

    model = tiny_model("sdpa")
    model.generation_config.max_length_offset = 5
    lengths = [source.shape[1], 5, 2]
    padded = torch.full_like(source, PAD)
    for row, length in enumerate(lengths):
        padded[row, source.shape[1] - length :] = source[row, :length]
    options = {"num_beams": num_beams, "suppress_tokens": [EOS]}
    batch = model.generate(padded, attention_mask=(padded != PAD).long(), **options)
    assert torch.equal(model.generate(padded, **options), batch)
    for row, length in enumerate(lengths):
        alone = model.generate(source[row : row + 1, :length], **options)[0]
        assert torch.equal(batch[row, : alone.shape[0]], alone), row
        assert (batch[row, alone.shape[0] :] == PAD).all(), row  # not the end token (beam search did)


def test_the_length_rule_counts_the_start_token_put_before_a_prompt(source):
    """A decoder prompt that does not begin with the start token gets it put in front by `generate`;
    padded rows once stopped one token before their limit, which counted the prompt without it."""
    from tests.conftest import PAD

    model = tiny_model("sdpa")
    model.generation_config.max_length_offset = 5
    attention_mask = torch.ones_like(source)
    attention_mask[1, 5:] = 0
    padded = source.masked_fill(attention_mask == 0, PAD)
    prompt = torch.full((source.shape[0], 2), 7)  # no start token
    options = {"num_beams": 1, "suppress_tokens": [EOS], "decoder_input_ids": prompt}
    batch = model.generate(padded, attention_mask=attention_mask, **options)
    alone = model.generate(source[1:2, :5], decoder_input_ids=prompt[1:2], num_beams=1, suppress_tokens=[EOS])
    assert alone.shape[1] == 1 + 2 + 5 + 5  # start, prompt, source length + 5
    assert torch.equal(batch[1, : alone.shape[1]], alone[0]) and (batch[1, alone.shape[1] :] == PAD).all()


def test_a_fresh_generation_config_keeps_the_length_rule(source):
    """A user's `GenerationConfig()` has no `max_length_offset`: the model's own (50) applies, not
    transformers' 20-token default."""
    from transformers import GenerationConfig

    model = tiny_model()
    config = GenerationConfig(
        num_beams=1, suppress_tokens=[EOS], decoder_start_token_id=BOS, eos_token_id=EOS, pad_token_id=0
    )
    assert model.generate(source, generation_config=config).shape[1] == 1 + source.shape[1] + 50


def test_a_max_length_filled_from_transformers_defaults_does_not_end_the_length_rule(source, tmp_path):
    """`Seq2SeqTrainer.prediction_step` fills the model's generation config's unset fields with
    transformers' defaults, in place (`max_length` 20 among them): the rule still applies afterwards, and
    the saved folder has no length. A length set on purpose, even 20, is obeyed; a loaded model's config
    (a plain `GenerationConfig` from the folder) behaves the same."""
    from transformers import GenerationConfig

    from vanilla_transformer import VanillaTransformerForConditionalGeneration

    model = tiny_model()
    options = {"num_beams": 1, "suppress_tokens": [EOS]}  # nothing stops early
    full = 1 + source.shape[1] + 50
    config = model.generation_config
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)  # as Trainer does
    assert config.max_length == 20  # what Trainer reads to pad its predictions
    assert model.generate(source, **options).shape[1] == full
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    # A copy of it, passed in (a user editing Trainer's config after an evaluation), keeps the rule too.
    assert model.generate(source, generation_config=copy.deepcopy(config), **options).shape[1] == full
    model.save_pretrained(tmp_path)
    assert "max_length" not in json.loads((tmp_path / "generation_config.json").read_text())

    loaded = VanillaTransformerForConditionalGeneration.from_pretrained(tmp_path)
    loaded.generation_config.update(max_length=None)
    loaded.generation_config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    assert loaded.generate(source, **options).shape[1] == full
    loaded.generation_config.max_length = 20  # chosen: transformers' rule, 20 tokens in all
    assert loaded.generate(source, **options).shape[1] == 20
    loaded.generation_config.max_length = None
    loaded.generation_config.update(max_length=12)  # `update` without defaults_only chooses too
    assert loaded.generate(source, **options).shape[1] == 12


def test_generation_step_inputs_match_generation_mixins(source):
    """The model's lean `prepare_inputs_for_generation` gives the decoder what transformers' generic one
    gives (same tensors, same pass-through options), and generation is unchanged with either."""
    from transformers import DynamicCache, EncoderDecoderCache, GenerationMixin

    model = tiny_model("sdpa")
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    generated = torch.randint(3, 99, (3, 5))
    options = {"cache": cache, "attention_mask": torch.ones(3, 8, dtype=torch.long), "use_cache": True}
    options |= {"encoder_outputs": "encoder output", "output_attentions": False, "is_first_iteration": False}
    ours = model.prepare_inputs_for_generation(generated, next_sequence_length=1, **options)
    generic = GenerationMixin.prepare_inputs_for_generation(
        model, generated, next_sequence_length=1, **options
    )
    assert ours.keys() == generic.keys()
    for key, value in generic.items():
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] is value, key

    lean = model.generate(source, num_beams=2, max_new_tokens=7)
    model.prepare_inputs_for_generation = GenerationMixin.prepare_inputs_for_generation.__get__(model)
    assert torch.equal(lean, model.generate(source, num_beams=2, max_new_tokens=7))


def perturbed(model):
    """`model` with every parameter moved off its initial value (layer norms start as the identity and
    biases at zero, which would hide a norm or bias left out of a computation)."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize(
    "overrides",
    # A layer norm epsilon of its own: the default's, hard-coded in a step, would change nothing seen.
    [{"layer_norm_eps": 0.1}, {"norm_first": True, "layer_norm_eps": 0.1}, {"activation_function": "gelu"}],
    ids=["post-LN", "pre-LN", "gelu"],
)
def test_decoding_steps_without_module_calls_equal_the_module_path(source, overrides, monkeypatch):
    """Cached steps run the decoder's `decoding_step` and each layer's (no sub-layer module calls);
    with a hook registered for every module they take the module path instead. Same logits, same beams
    and tokens, with a padded source, trained-like parameters and one projection a plain `nn.Linear`."""
    from vanilla_transformer.modeling_vanilla_transformer import (
        VanillaTransformerDecoder,
        VanillaTransformerDecoderLayer,
    )

    model = perturbed(tiny_model("sdpa", **overrides))
    layer = model.model.decoder.layers[1]
    plain_linear = torch.nn.Linear(layer.fc2.in_features, layer.fc2.out_features)
    plain_linear.load_state_dict(layer.fc2.state_dict())
    layer.fc2 = plain_linear
    mask = torch.ones_like(source)
    mask[0, 5:] = 0
    decoder_steps = count_returns(monkeypatch, VanillaTransformerDecoder, "decoding_step")
    layer_steps = count_returns(monkeypatch, VanillaTransformerDecoderLayer, "decoding_step")
    options = {"attention_mask": mask, "num_beams": 3, "max_new_tokens": 9, "min_new_tokens": 9}
    options |= {"output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        lean = model.generate(source, **options)
        assert (len(decoder_steps), len(layer_steps)) == (8, 16)  # every step after the first, 2 layers
        decoder_steps.clear()
        layer_steps.clear()
        with torch.nn.modules.module.register_module_forward_hook(lambda *args: None):
            plain = model.generate(source, **options)
    assert not decoder_steps and not layer_steps
    assert torch.equal(lean.sequences, plain.sequences)
    lean_scores, plain_scores = torch.stack(lean.scores), torch.stack(plain.scores)
    finite = plain_scores.isfinite()  # min_new_tokens gives the end token -inf
    assert torch.equal(lean_scores.isfinite(), finite)
    assert_same_up_to_rounding(lean_scores[finite], plain_scores[finite], TINY_TERMS)


def test_a_hook_for_every_module_changes_what_the_same_hook_on_each_module_does(source):
    """A hook registered for every module (`register_module_forward_hook`: activation capture,
    ablation) is called by each module on every path: the stacked Q/K/V product of cached steps, the
    loss without (N, V) logits and the in-place ReLU took their modules' work without calling them, and
    such a hook changed nothing there. The same hook registered on each module itself (which every path
    honours) is the reference: the same logits, tokens and loss, and the same modules called."""
    model = perturbed(tiny_model("sdpa"))
    names = {module: name for name, module in model.named_modules()}
    changed = ("decoder.layers.0.self_attn.v_proj", "decoder.layers.1.activation_fn", "lm_head")
    called: list[str] = []

    def change(module, args, output):  # halves three modules' outputs
        name = names[module].removeprefix("model.")
        if name in changed:
            called.append(name)
            return output * 0.5

    target = torch.randint(3, 99, (source.shape[0], 6), generator=torch.Generator().manual_seed(3))
    options = {"num_beams": 3, "max_new_tokens": 7, "min_new_tokens": 7}

    def run() -> tuple:
        called.clear()
        with torch.no_grad():
            logits = model(input_ids=source, decoder_input_ids=target).logits  # use_cache: True
            tokens = model.generate(source, **options)
        model.train()  # dropout 0: the training loss, computed without logits where it can be
        loss = model(input_ids=source, labels=target).loss.detach()
        model.eval()
        return logits, tokens, loss, sorted(set(called))

    handles = [module.register_forward_hook(change) for module in model.modules()]
    reference = run()
    for handle in handles:
        handle.remove()
    assert reference[3] == sorted(changed)
    with torch.nn.modules.module.register_module_forward_hook(change):
        hooked = run()
    assert hooked[3] == sorted(changed)
    assert_same_up_to_rounding(hooked[0], reference[0], TINY_TERMS)
    assert torch.equal(hooked[1], reference[1])
    assert_same_up_to_rounding(hooked[2], reference[2], TINY_TERMS)
    unchanged = run()  # the hook gone: the fast paths again, and other results
    assert unchanged[3] == [] and not torch.allclose(unchanged[2], reference[2])


def test_a_cached_step_with_gradients_equals_the_full_forward(source, monkeypatch):
    """Called directly with gradients on, a cached step takes the layers' `decoding_step` with separate
    Q, K, V products (the stacked copy is for inference only); its logits equal the last position of an
    uncached forward pass and its gradients reach the sub-layers' weights."""
    from vanilla_transformer.modeling_vanilla_transformer import VanillaTransformerDecoderLayer

    model = perturbed(tiny_model("sdpa"))
    layer_steps = count_returns(monkeypatch, VanillaTransformerDecoderLayer, "decoding_step")
    target = torch.randint(3, 99, (source.shape[0], 4), generator=torch.Generator().manual_seed(2))
    encoder_outputs = model.get_encoder()(source)
    first = model(encoder_outputs=encoder_outputs, decoder_input_ids=target[:, :3], use_cache=True)
    step = model(
        encoder_outputs=encoder_outputs, decoder_input_ids=target[:, 3:], cache=first.cache, use_cache=True
    )
    assert len(layer_steps) == 2
    full = model(encoder_outputs=encoder_outputs, decoder_input_ids=target).logits[:, -1:]
    assert_same_up_to_rounding(step.logits, full.detach(), TINY_TERMS)
    step.logits.square().sum().backward()
    for layer in model.model.decoder.layers:
        for module in (layer.self_attn.v_proj, layer.encoder_attn.q_proj, layer.fc1, layer.final_layer_norm):
            assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0


def test_layer_steps_only_for_sdpa(source, monkeypatch):
    """A layer's `decoding_step` computes attention as SDPA does: with eager attention layers run
    `forward`, while the decoder still skips its own bookkeeping."""
    from vanilla_transformer.modeling_vanilla_transformer import (
        VanillaTransformerDecoder,
        VanillaTransformerDecoderLayer,
    )

    decoder_steps = count_returns(monkeypatch, VanillaTransformerDecoder, "decoding_step")
    layer_steps = count_returns(monkeypatch, VanillaTransformerDecoderLayer, "decoding_step")
    model = tiny_model("eager")
    with torch.no_grad():
        model.generate(source, num_beams=2, max_new_tokens=5, min_new_tokens=5)
    assert (len(decoder_steps), len(layer_steps)) == (4, 0)


def test_cached_steps_pass_on_the_encoder_outputs_given(source):
    """A forward passes on the hidden states of the `encoder_outputs` it is given. Cached steps of one
    token (the decoding-step path) returned the encoder's last states only: from the second step of a
    hand-written loop on, `encoder_hidden_states` was None and a `return_dict=False` tuple one shorter."""
    model = tiny_model("sdpa")
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=source, output_hidden_states=True)
        for given in (encoder_outputs, encoder_outputs.to_tuple()):
            tokens = torch.full((source.shape[0], 1), model.config.decoder_start_token_id)
            cache, lengths = None, []
            for _ in range(3):
                out = model(encoder_outputs=given, decoder_input_ids=tokens, cache=cache, use_cache=True)
                assert out.encoder_hidden_states is encoder_outputs.hidden_states
                lengths.append(len(out.to_tuple()))
                cache, tokens = out.cache, out.logits.argmax(-1)
            assert lengths == [4, 4, 4]


def test_hooks_on_decoder_modules_run_at_every_step(source):
    """A hook on a layer (whose module call `decoding_step` skips) sends every step through the modules;
    hooks on an attention, a linear layer or a layer norm (which a layer's `decoding_step` does not call),
    and accelerate's hooks (offloading, device placement), send that layer's steps through its
    `forward`. Each runs at every step."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_model("sdpa")
    calls = {"layer": 0, "attention": 0}
    layer = model.model.decoder.layers[1]
    layer.register_forward_hook(lambda *args: calls.__setitem__("layer", calls["layer"] + 1))
    layer.encoder_attn.register_forward_pre_hook(
        lambda *args: calls.__setitem__("attention", calls["attention"] + 1)
    )
    model.generate(source, num_beams=1, max_new_tokens=6, min_new_tokens=6)
    assert calls == {"layer": 6, "attention": 6}

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls["accelerate"] += 1
            return args, kwargs

    model = tiny_model("sdpa")
    first, second = model.model.decoder.layers
    hooked = {"fc2": first.fc2, "norm": second.final_layer_norm, "query": second.encoder_attn.q_proj}
    calls = dict.fromkeys([*hooked, "accelerate"], 0)
    for name, module in hooked.items():
        module.register_forward_hook(lambda *args, name=name: calls.__setitem__(name, calls[name] + 1))
    add_hook_to_module(first.self_attn_layer_norm, Counting())
    model.generate(source, num_beams=1, max_new_tokens=6, min_new_tokens=6)
    # Layer norm and feed-forward run at every position of the first step (one call) and then once a step;
    # the encoder-decoder attention's query projection likewise.
    assert calls == {"fc2": 6, "norm": 6, "query": 6, "accelerate": 6}


def test_wrapped_sublayers_run_their_forward_at_every_step(source):
    """An adapter that replaces a linear layer (a subclass, as PEFT's LoRA layers are) is called at every
    step, and so is a wrapper around an attention (`torch.compile`'s, which holds the attention under
    another name); generation equals decoding without a cache."""
    from vanilla_transformer.kernels_vanilla_transformer import Linear

    class Shifted(Linear):
        calls = 0

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            Shifted.calls += 1
            return super().forward(inputs) + 0.5

    class Wrapper(torch.nn.Module):
        calls = 0

        def __init__(self, wrapped: torch.nn.Module):
            super().__init__()
            self.wrapped = wrapped

        def forward(self, *args, **kwargs):
            Wrapper.calls += 1
            return self.wrapped(*args, **kwargs)

    model = tiny_model("sdpa")
    first, second = model.model.decoder.layers
    adapted = Shifted(first.fc1.in_features, first.fc1.out_features)
    adapted.load_state_dict(first.fc1.state_dict())
    first.fc1 = adapted
    second.self_attn = Wrapper(second.self_attn)
    tokens = model.generate(source, num_beams=1, max_new_tokens=6, min_new_tokens=6, use_cache=True)
    assert (Shifted.calls, Wrapper.calls) == (6, 6)
    uncached = model.generate(source, num_beams=1, max_new_tokens=6, min_new_tokens=6, use_cache=False)
    assert torch.equal(tokens, uncached)


def test_static_cache_generates_the_same_tokens(source):
    model = tiny_model("sdpa")
    dynamic = model.generate(source, num_beams=1, max_new_tokens=7)
    assert torch.equal(
        model.generate(source, num_beams=1, max_new_tokens=7, cache_implementation="static"), dynamic
    )


def test_static_cache_decoding_compiles_as_one_graph(source):
    """transformers' static-cache path compiles the decoding step; `fullgraph=True` fails on any graph
    break (the "eager" backend skips code generation, so this checks tracing only, in seconds)."""
    from transformers import CompileConfig

    model = tiny_model("sdpa")
    config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    options = {"num_beams": 1, "max_new_tokens": 5}
    compiled = model.generate(source, **options, cache_implementation="static", compile_config=config)
    assert torch.equal(compiled, model.generate(source, **options))
    torch._dynamo.reset()


@pytest.mark.parametrize("attention_bias", [False, True])
def test_generate_follows_weights_written_through_data(attention_bias):
    """Decoding keeps copies of weights (stacked Q/K/V, other kernels' layouts) while the weights keep
    their version counter, which writes through `.data` do not bump: PEFT merging an adapter
    (`weight.data += delta`), or weights averaged in with `p.data.copy_`. Such a write after a first
    `generate()` once left the next one decoding with the old weights. With attention biases, their
    stacked copy too (the default network has none since 089d024)."""
    model = tiny_model("sdpa", seed=0, attention_bias=attention_bias)
    other = tiny_model("sdpa", seed=1, attention_bias=attention_bias)
    if attention_bias:
        with torch.no_grad():
            for name, parameter in other.named_parameters():
                if name.endswith("proj.bias"):  # not the initial zeros of both models
                    parameter.normal_(0, 0.5)
    source = torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    options = {"max_new_tokens": 8, "num_beams": 1, "do_sample": False}
    before = model.generate(source, **options)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.data.copy_(theirs)
    after = model.generate(source, **options)
    assert torch.equal(after, other.generate(source, **options)) and not torch.equal(after, before)


@pytest.mark.parametrize("written", ["weight", "bias"])
def test_a_decoding_reads_each_kept_copys_sources_once(written, monkeypatch):
    """Once per decoding the stacked Q/K/V copies are checked against their sources' values: one read
    of each source. The biases' stack listed the three matrices as sources too, so a model with
    attention biases (every converted Marian model) read each self-attention matrix twice per
    `generate()` call, about 1.2 ms of a base model's 0.16-s greedy call. Each stack still follows a
    write through `.data` to its own sources, and only to them."""
    from vanilla_transformer import kernels_vanilla_transformer as kernels

    previous = kernels.set_linear_kernel("torch")  # stacks only: no other kernel's copies checked
    try:
        model = tiny_model("sdpa", seed=0, attention_bias=True)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("proj.bias"):
                    parameter.normal_(0, 0.5)
        source = torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(0))
        options = {"max_new_tokens": 6, "num_beams": 1, "do_sample": False}
        model.generate(source, **options)  # makes the stacks
        reads = []
        original = kernels.value_checksum
        monkeypatch.setattr(kernels, "value_checksum", lambda t: reads.extend(map(id, t)) or original(t))
        before = model.generate(source, **options)
        stacked = [
            id(getattr(getattr(layer.self_attn, name), kind))
            for layer in model.model.decoder.layers
            for name in ("q_proj", "k_proj", "v_proj")
            for kind in ("weight", "bias")
        ]
        assert sorted(reads) == sorted(stacked)  # every stacked source once, nothing twice

        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for layer in model.model.decoder.layers:
                edited = getattr(layer.self_attn.v_proj, written).data  # written: no version bump
                edited.copy_(torch.randn(edited.shape, generator=generator))
        after = model.generate(source, **options)
        expected = copy.deepcopy(model).generate(source, **options)  # new tensors: stacks made afresh
        assert torch.equal(after, expected) and not torch.equal(after, before)
    finally:
        kernels.set_linear_kernel(previous)


@pytest.mark.parametrize("write", ["fused AdamW", "data"])
def test_evaluation_loss_follows_weights_changed_without_a_version_bump(batch, write):
    """An evaluation loss (eval mode, labels, no gradients: `Seq2SeqTrainer.evaluate`) runs the
    decoder's products on kept weight copies. A fused optimiser step (transformers' default optimiser)
    and `.data` writes leave the version counter as it was, and the copies were checked against the
    values only when a decoding started: from the second evaluation on, the loss was computed with the
    weights of the first. Reference: the same forward with gradients on, all on torch's kernel."""
    model, other = tiny_model("sdpa", seed=0), tiny_model("sdpa", seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        with torch.no_grad():
            loss = model(**batch).loss
        assert_same_up_to_rounding(loss, model(**batch).loss.detach(), 2 * 32)
        if write == "data":
            with torch.no_grad():
                for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
                    mine.data.copy_(mine + theirs)
        else:
            model.train()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()


def test_only_decodings_with_a_cache_read_kept_copies(batch, monkeypatch):
    """Kept copies are checked against the weights' values (one more read of every decoder matrix) once
    per decoding. Forwards without a cache (an evaluation loss) checked them at every call, a quarter to
    a third of a one-sentence forward's time; they now compute on the matrices themselves. So does the
    output layer called outside a decoding (a hook on it sends the loss through it; user code applies
    it to decoder states), which once kept computing with a copy that nothing checked any more."""
    from vanilla_transformer import kernels_vanilla_transformer as kernels

    checked = []
    original = kernels.value_checksum
    monkeypatch.setattr(kernels, "value_checksum", lambda sources: checked.append(1) or original(sources))
    previous = kernels.set_linear_kernel("mkl")  # packed copies for every decoding-step product
    try:
        if kernels.linear_kernel().mkl is None:
            pytest.skip("this torch build has no MKL packed product")
        model = tiny_model("sdpa")
        kept = len(kernels.linear_kernel().packed)
        source, target = batch["input_ids"], batch["labels"].clamp(min=0)
        with torch.no_grad():
            loss = model(**batch).loss
            logits = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
        assert checked == [] and len(kernels.linear_kernel().packed) == kept
        assert_same_up_to_rounding(loss, model(**batch).loss.detach(), 2 * 32)
        model.generate(source, max_new_tokens=3, num_beams=1, do_sample=False)
        assert checked and len(kernels.linear_kernel().packed) > kept  # the decoding keeps and checks
        with torch.no_grad():
            again = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
        assert torch.equal(again, logits)

        # The output layer outside a decoding, after a write that leaves the version counter alone.
        model.lm_head.register_forward_hook(lambda module, inputs, output: None)  # the loss goes through it
        with torch.no_grad():
            states = model.model(input_ids=source, decoder_input_ids=target, use_cache=False)[0]
            model.get_output_embeddings()(states), model(**batch, return_logits=False)  # as before a write
            model.lm_head.weight.data.mul_(3)
            direct = model.get_output_embeddings()(states)
            hooked = model(**batch, return_logits=False).loss
            kernels.set_linear_kernel("torch")
            torch.testing.assert_close(direct, model.get_output_embeddings()(states))
            torch.testing.assert_close(hooked, model(**batch, return_logits=False).loss)
    finally:
        kernels.set_linear_kernel(previous)


def test_a_forward_without_a_cache_compiles_whole_where_reads_are_not_free(batch, monkeypatch):
    """On an accelerator (emulated: no host reads of tensor values) a forward without a cache compiled
    as one graph; switching kept copies off there once broke it (torch.compile cannot trace the context
    variable), so `fullgraph=True` failed for training and evaluation losses."""
    from vanilla_transformer import kernels_vanilla_transformer as kernels
    from vanilla_transformer import modeling_vanilla_transformer as modeling

    monkeypatch.setattr(kernels, "reads_are_free", lambda tensor: False)
    monkeypatch.setattr(modeling, "reads_are_free", lambda tensor: False)
    monkeypatch.setattr(modeling, "may_read", lambda mask: mask is None)
    model = tiny_model("sdpa").eval()
    source, target = batch["input_ids"], batch["labels"].clamp(min=0)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            loss = torch.compile(lambda: model(**batch).loss, fullgraph=True, backend="eager")()
            logits = torch.compile(
                lambda: model(input_ids=source, decoder_input_ids=target, use_cache=False).logits,
                fullgraph=True,
                backend="eager",
            )()
            torch.testing.assert_close(loss, model(**batch).loss)
            torch.testing.assert_close(
                logits, model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
            )
    finally:
        torch._dynamo.reset()


def assert_reused_static_cache_follows_weights_written_through_data(source: torch.Tensor) -> None:
    """A hand-written loop decodes with a static cache, which is reset, the weights rewritten through
    `.data` (no version counter change), and decodes again: as a model built with the new weights."""
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    model, other = tiny_model("sdpa", seed=0), tiny_model("sdpa", seed=1)
    cache = EncoderDecoderCache(
        StaticCache(config=model.config, max_cache_len=16), StaticCache(config=model.config, max_cache_len=16)
    )
    start = torch.full((source.shape[0], 1), model.config.decoder_start_token_id)

    def decode(decoder):
        cache.reset()
        with torch.no_grad():
            encoder_outputs, tokens, steps = decoder.get_encoder()(input_ids=source), start, []
            for _ in range(5):
                logits = decoder(
                    encoder_outputs=encoder_outputs, decoder_input_ids=tokens, cache=cache
                ).logits
                tokens, steps = logits[:, -1:].argmax(-1), [*steps, logits[:, -1]]
        return torch.stack(steps, 1)

    decode(model)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.data.copy_(theirs)
    assert_same_up_to_rounding(decode(model), decode(other), TINY_TERMS)


def test_a_reused_static_cache_follows_weights_written_through_data(source):
    """A static cache reused after its `reset()` (its usual use) reports its length as a tensor, so no
    check of the kept copies started the second decoding: after a `.data` write it decoded with the
    old weights."""
    assert_reused_static_cache_follows_weights_written_through_data(source)


def test_a_reused_static_cache_follows_weights_written_through_data_on_an_accelerator(source, monkeypatch):
    """On an accelerator (emulated: no host reads of tensor values, torch's kernels) the decoder cannot
    tell a reused static cache's first step, so no check of the kept copies starts the decoding; the
    stacked Q/K/V copy was used all the same, and after a `.data` write (or a fused optimiser step) a
    hand-written loop decoded with the old weights. There the products stay separate."""
    from vanilla_transformer import kernels_vanilla_transformer as kernels
    from vanilla_transformer import modeling_vanilla_transformer as modeling

    monkeypatch.setattr(modeling, "reads_are_free", lambda tensor: False)
    previous = kernels.set_linear_kernel("torch")  # on an accelerator only torch's kernels run
    try:
        assert_reused_static_cache_follows_weights_written_through_data(source)
    finally:
        kernels.set_linear_kernel(previous)


def cached_logits(model, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A hand-written decoding loop: one cached forward per target token, as users write beside
    `generate()`."""
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=source)
        cache, steps = None, []
        for t in range(target.shape[1]):
            out = model(encoder_outputs=encoder_outputs, decoder_input_ids=target[:, t : t + 1], cache=cache)
            cache, steps = out.cache, [*steps, out.logits]
    return torch.cat(steps, 1)


def test_a_hand_written_decoding_loop_follows_weights_written_through_data(source):
    """The kept copies were checked against the weights' values in `generate()` only: after a `.data`
    write, a decoding loop of the user's own kept decoding with the old weights. Forwards without a
    cache, one of them at the decoding's row count (whose copies it kept), follow the write too."""
    model, other = tiny_model("sdpa", seed=0), tiny_model("sdpa", seed=1)
    target = torch.randint(3, 99, (3, 6), generator=torch.Generator().manual_seed(1))
    before = cached_logits(model, source, target)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.data.copy_(theirs)
        expected = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
        # A forward without a cache follows the write too, also one with a decoding step's row count
        # (3 target tokens: the class whose copies the decoding above kept).
        for length in (1, target.shape[1]):
            assert_same_up_to_rounding(
                model(input_ids=source, decoder_input_ids=target[:, :length], use_cache=False).logits,
                other(input_ids=source, decoder_input_ids=target[:, :length], use_cache=False).logits,
                TINY_TERMS,
            )
    after = cached_logits(model, source, target)
    assert not torch.allclose(after, before)
    assert_same_up_to_rounding(after, expected, TINY_TERMS)


def test_generate_follows_square_matrices_transposed_through_data(source):
    """The kept copies' check, u^T W v, used the same vector on both sides of a square matrix, so a
    matrix transposed in place through `.data` (a checkpoint's (in, out) layout put right; every
    attention projection is square) kept its checksum: the next `generate()` decoded with the old
    stacked Q/K/V and other kernels' layouts. Reference: a fresh model loaded with the new weights."""
    model = tiny_model("sdpa", seed=0)
    options = {"max_new_tokens": 8, "num_beams": 2, "output_scores": True, "return_dict_in_generate": True}
    model.generate(source, **options)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2 and parameter.shape[0] == parameter.shape[1]:
                parameter.data.copy_(parameter.data.t().clone())
    after = model.generate(source, **options)
    fresh = tiny_model("sdpa", seed=1)
    fresh.load_state_dict(model.state_dict())
    expected = fresh.generate(source, **options)
    assert torch.equal(after.sequences, expected.sequences)
    assert_same_up_to_rounding(torch.stack(after.scores), torch.stack(expected.scores), TINY_TERMS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_checksums_of_narrow_types_see_real_edits(dtype):
    """u^T W v rounded to bfloat16's 8 bits missed a 5% change of every element about once in 50."""
    from vanilla_transformer.kernels_vanilla_transformer import value_checksum

    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        weight = (torch.randn(64, 64, generator=generator) * 0.125).to(dtype)
        edited = weight + (torch.randn(64, 64, generator=generator) * 0.125 * 0.05).to(dtype)
        assert not torch.equal(edited, weight)
        assert value_checksum((edited,)) != value_checksum((weight,))


def test_a_given_generation_config_keeps_the_models_length(source):
    """transformers fills a given config's unset fields from the model's: a length set there applies,
    where the source length + 50 rule used to replace it."""
    from transformers import GenerationConfig

    model = tiny_model()
    options = {"generation_config": GenerationConfig(num_beams=1, suppress_tokens=[EOS])}
    model.generation_config.max_new_tokens = 5
    assert model.generate(source, **options).shape[1] == 1 + 5
    model.generation_config.max_new_tokens, model.generation_config.max_length = None, 8
    assert model.generate(source, **options).shape[1] == 8


def test_the_length_rule_applies_to_inputs_embeds_and_takes_the_offset_as_a_keyword(source):
    """`inputs_embeds` once got transformers' 20-token default, and a `max_length_offset` keyword was
    dropped unread."""
    model = tiny_model()
    options = {"num_beams": 1, "suppress_tokens": [EOS]}
    embeds = model.get_input_embeddings()(source)
    assert model.generate(inputs_embeds=embeds, **options).shape[1] == 1 + source.shape[1] + 50
    three = model.generate(source, max_length_offset=3, **options)
    assert three.shape[1] == 1 + source.shape[1] + 3
    # A NumPy integer is an integer (it was refused as "must be a non-negative integer").
    assert torch.equal(model.generate(source, max_length_offset=np.int64(3), **options), three)
    for wrong in (-1, np.int64(-1), 2.5, True):
        with pytest.raises(ValueError, match="max_length_offset must be a non-negative integer"):
            model.generate(source, max_length_offset=wrong, **options)


def test_arguments_generate_cannot_use_are_named(source):
    """A 1-D `input_ids` once met an IndexError, `num_beams=0` a ZeroDivisionError in transformers'
    beam search, and `length_penalty=nan` returned cut-off translations without a word."""
    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, length\).*add a batch dimension"):
        model.generate(source[0])
    with pytest.raises(ValueError, match="num_beams must be a positive integer, got 0"):
        model.generate(source, num_beams=0)
    # transformers checks neither: beam search gave 6 rows for 2 sentences at -1 and failed in a reduction
    # ("max(): Expected reduction dim") at 0; sampling gave one sequence per sentence at 0.
    for count, options in ((-1, {}), (0, {}), (0, {"num_beams": 1, "do_sample": True}), (1.5, {})):
        with pytest.raises(ValueError, match=f"num_return_sequences must be a positive integer, got {count}"):
            model.generate(source, num_return_sequences=count, max_new_tokens=3, **options)
    model.generation_config.num_return_sequences = 0  # a saved configuration's value as well
    with pytest.raises(ValueError, match="num_return_sequences must be a positive integer, got 0"):
        model.generate(source, max_new_tokens=3)
    model.generation_config.num_return_sequences = 1
    # A length that is no integer (a hand-edited generation_config.json's 30.0) was a TypeError from torch
    for name, value in (("max_new_tokens", 3.0), ("max_length", 30.0), ("min_new_tokens", -1)):
        with pytest.raises(ValueError, match=f"{name} must be a non-negative integer, got {value}"):
            model.generate(source, **{name: value})
    model.generation_config.max_length = 30.0
    with pytest.raises(ValueError, match=r"max_length must be a non-negative integer, got 30\.0"):
        model.generate(source)
    model.generation_config.max_length = None
    # An id outside the vocabulary failed with an IndexError of the forcing processor's ("index 500 is out
    # of bounds for dimension 1 with size 99"), naming no setting.
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        for value in (99, -1, [2, 500]):
            with pytest.raises(
                ValueError, match=rf"{name} {re.escape(repr(value))} is outside the vocabulary"
            ):
                model.generate(source, num_beams=1, max_new_tokens=3, **{name: value})
    model.generation_config.forced_eos_token_id = 500  # a saved configuration's value as well
    with pytest.raises(ValueError, match="forced_eos_token_id 500 is outside the vocabulary"):
        model.generate(source, num_beams=1)
    model.generation_config.forced_eos_token_id = None
    for alpha in (float("nan"), float("-inf"), 10**400):  # (an int past float's range: OverflowError)
        with pytest.raises(ValueError, match="length_penalty must be a finite number"):
            model.generate(source, num_beams=2, length_penalty=alpha)
    # 300: an 11-token output's length to that power overflowed (OverflowError from inside transformers)
    for alpha in (300.0, -50.5):
        with pytest.raises(ValueError, match="length_penalty must be from -50 to 50 for beam search"):
            model.generate(source, num_beams=2, length_penalty=alpha)
    for alpha in (50.0, -50.0):  # the bound itself
        assert model.generate(source[:1], num_beams=2, max_new_tokens=3, length_penalty=alpha).shape[0] == 1
    # greedy search reads no length penalty: a folder saved with a large one still decodes greedily
    assert model.generate(source[:1], num_beams=1, max_new_tokens=3, length_penalty=300.0).shape[0] == 1
    model.generation_config.length_penalty = float("nan")  # a saved configuration's value as well
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        model.generate(source, num_beams=2)
    model.generation_config.length_penalty = 0.6
    assert model.generate(source[:1], num_beams=2, max_new_tokens=3).shape[0] == 1
    # numpy and one-element tensor numbers are numbers: valid ones pass, a NaN among them does not.
    assert model.generate(source[:1], num_beams=np.int64(2), max_new_tokens=3).shape[0] == 1
    for alpha in (np.float32("nan"), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match="length_penalty must be a finite number"):
            model.generate(source, num_beams=2, length_penalty=alpha)


def test_a_decoder_only_cache_given_is_made_an_encoder_decoder_one():
    """`generate(cache=DynamicCache())`, as a language model takes it, failed inside the attention with
    an AttributeError (MarianMTModel fails too, with a size mismatch): it holds the self-attention's
    keys and values, and the cross-attention gets a cache of its own. Another kind is refused, naming
    the kind this model takes."""
    from transformers import DynamicCache, StaticCache

    model = tiny_model().eval()
    source = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for beams in (1, 3):
            expected = model.generate(source, num_beams=beams, max_new_tokens=6)
            given = model.generate(source, cache=DynamicCache(), num_beams=beams, max_new_tokens=6)
            assert torch.equal(given, expected)
        start = torch.full((2, 1), model.config.decoder_start_token_id)
        output = model(source, decoder_input_ids=start, cache=DynamicCache(), use_cache=True)
        torch.testing.assert_close(output.logits, model(source, decoder_input_ids=start).logits)
        static = StaticCache(model.config, max_cache_len=8)
        with pytest.raises(TypeError, match=r"cache is an EncoderDecoderCache .* got a StaticCache"):
            model(source, decoder_input_ids=start, cache=static, use_cache=True)


def test_the_source_length_limit_stops_at_exactly_the_limit():
    """Section 6.1's limit (source length + 50) as a stopping criterion: a row is done once it has exactly
    its limit of new tokens, not one later (a `>` for `>=` let beam search rank hypotheses one token past
    the limit, and no end-to-end test saw it: padding hid the extra token). Beam rows are batch-major."""
    from vanilla_transformer.modeling_vanilla_transformer import SourceLengthLimit

    criterion = SourceLengthLimit(torch.tensor([3, 5]), prompt_length=1)
    assert criterion(torch.ones(2, 1 + 2, dtype=torch.long), None).tolist() == [False, False]
    assert criterion(torch.ones(2, 1 + 3, dtype=torch.long), None).tolist() == [True, False]
    assert criterion(torch.ones(2, 1 + 5, dtype=torch.long), None).tolist() == [True, True]
    assert criterion(torch.ones(4, 1 + 3, dtype=torch.long), None).tolist() == [True, True, False, False]
