"""Token-level unlikelihood training (`unlikelihood_weight`, Welleck et al., 2019): the loss and its
gradients against the paper's formula written out per token, on both loss paths, and the candidates."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY_TERMS, assert_same_up_to_rounding, gradient_scale, tiny_model
from tests.test_optimised_paths import loss_and_grads, ragged_batch
from vanilla_transformer.kernels_vanilla_transformer import (
    UNLIKELIHOOD_FLOOR,
    projected_label_smoothed_loss,
    unlikelihood_candidates,
)
from vanilla_transformer.modeling_vanilla_transformer import label_smoothed_cross_entropy


def test_candidates_are_the_distinct_earlier_tokens_other_than_the_label():
    labels = torch.tensor([[5, 6, 5, 7, 6, -100], [9, 9, 4, -100, 4, 8]])
    candidates = unlikelihood_candidates(labels)
    as_sets = [[set(row[row >= 0].tolist()) for row in sentence] for sentence in candidates]
    assert as_sets[0] == [set(), {5}, {6}, {5, 6}, {5, 7}, set()]
    # an ignored label is no candidate, and its own position has none
    assert as_sets[1] == [set(), set(), {9}, set(), {9}, {9, 4}]
    assert all((row[row >= 0].numel() == len(set(row[row >= 0].tolist()))) for s in candidates for row in s)


def per_token_formula(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float, weight: float, items: int
):
    """Label-smoothed cross entropy plus weight * sum_t sum_{c in prefix(t), c != y_t} -log(1 - p_t(c)),
    written out one target position at a time."""
    total = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=smoothing, reduction="sum"
    )
    probs = logits.softmax(-1)
    for row, sentence in enumerate(labels.tolist()):
        for position, label in enumerate(sentence):
            if label == -100:
                continue
            for token in {t for t in sentence[:position] if t != -100} - {label}:
                complement = torch.clamp(1 - probs[row, position, token], min=UNLIKELIHOOD_FLOOR)
                total = total - weight * torch.log(complement)
    return total / items


@pytest.mark.parametrize("return_logits", [False, True])
def test_loss_and_gradients_match_the_formula(return_logits):
    batch = ragged_batch()
    batch["labels"][0, :4] = torch.tensor([7, 8, 7, 7])  # repeats: shared and own-label candidates
    model = tiny_model("sdpa", unlikelihood_weight=0.7).double()
    got, got_grads = loss_and_grads(model, batch, return_logits=return_logits)

    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    expected = per_token_formula(logits.logits, batch["labels"], 0.1, 0.7, 11)
    expected.backward()
    expected_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert_same_up_to_rounding(got.loss, expected, TINY_TERMS)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert_same_up_to_rounding(
            got_grads[name], grad, TINY_TERMS, gradient_scale(expected_grads), msg=name
        )

    model.config.unlikelihood_weight = 0.0  # off: the paper's loss, less than with the term
    paper, _ = loss_and_grads(model, batch, return_logits=return_logits)
    plain = F.cross_entropy(
        logits.logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1, reduction="sum"
    )
    assert_same_up_to_rounding(paper.loss, plain.detach() / 11, TINY_TERMS)
    assert paper.loss < got.loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_loss_matches_full_logits_with_candidates(dtype):
    """Several chunks (vocabulary 40,000 -> 104 tokens per chunk), a bias, absent candidates (-1), and
    candidates likely enough to matter: each row's five most likely tokens, one of them (row 7's first)
    so likely that the floor holds (its term is constant: no gradient)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 8, dtype=dtype, generator=generator)
    weight = torch.randn(40_000, 8, dtype=dtype, generator=generator)
    bias = torch.randn(40_000, dtype=dtype, generator=generator)
    labels = torch.randint(0, 40_000, (300,), generator=generator)
    # Row 7 puts 1 - p = 2.3e-6 (below the floor) on token 123, whose logit is the bias elsewhere, low:
    # near p = 1 the term's gradient p / (1 - p) amplifies rounding, which the floor cuts off.
    direction = weight[123] / weight[123].norm()
    hidden -= (hidden @ direction)[:, None] * direction
    weight[123] *= 20
    hidden[7] = direction
    row = F.linear(hidden[7], weight, bias)
    bias[123] += 13 - row[123] + torch.cat([row[:123], row[124:]]).logsumexp(0)  # log-odds 13
    candidates = F.linear(hidden, weight, bias).topk(5, dim=1).indices
    candidates[::3, 2:] = -1
    assert candidates[7, 0] == 123
    hidden, weight, bias = (t.requires_grad_() for t in (hidden, weight, bias))

    fast = projected_label_smoothed_loss(hidden, weight, bias, labels, 0.1, 500, candidates, 0.5)
    fast_grads = torch.autograd.grad(2.5 * fast, (hidden, weight, bias))
    logits = F.linear(hidden, weight, bias)
    plain = label_smoothed_cross_entropy(logits, labels, 0.1, 500, candidates, 0.5)
    plain_grads = torch.autograd.grad(2.5 * plain, (hidden, weight, bias))
    assert fast.dtype == plain.dtype == dtype
    floored = -0.5 * math.log(UNLIKELIHOOD_FLOOR) / 500
    without = label_smoothed_cross_entropy(logits, labels, 0.1, 500)
    assert plain - without > floored  # the floored candidate and the others counted
    assert_same_up_to_rounding(fast, plain, 300 * 40_000)
    for got, expected in zip(fast_grads, plain_grads, strict=True):
        assert_same_up_to_rounding(got, expected, 40_000)
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        assert torch.equal(
            projected_label_smoothed_loss(hidden, weight, bias, labels, 0.1, 500, candidates, 0.5),
            fast.detach(),
        )


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
def test_bad_weight_is_refused(value):
    with pytest.raises(ValueError, match="`unlikelihood_weight` must be a non-negative finite number"):
        tiny_model(unlikelihood_weight=value)


def test_an_evaluation_loss_includes_the_term_as_the_card_says():
    """`Seq2SeqTrainer.evaluate` calls the model in eval mode without gradients: its `eval_loss` is the
    training objective, the term included (the card says so; train.py's validation loss leaves it out)."""
    batch = ragged_batch()
    batch["labels"][0, :4] = torch.tensor([7, 8, 7, 7])
    model = tiny_model("sdpa", unlikelihood_weight=0.7).double().eval()
    with torch.no_grad():
        out = model(**batch, return_logits=True)
    items = int((batch["labels"] != -100).sum())
    expected = per_token_formula(out.logits, batch["labels"], 0.1, 0.7, items)
    assert_same_up_to_rounding(out.loss, expected, TINY_TERMS)
