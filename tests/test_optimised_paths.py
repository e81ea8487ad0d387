"""Faster paths give the same numbers as the plain ones (logits, loss, gradients, generated tokens).

The optimised training path skips padding in every per-token operation (`TokenPacking`), computes the
output projection and loss in chunks without the (N, V) logits (`projected_label_smoothed_loss`), and
draws dropout masks faster on CPU; beam search skips reordering the cross-attention cache. The plain
references: the same model with packing switched off and logits materialised, each sentence run on its
own without padding, `F.cross_entropy` on full logits, `F.dropout`'s definition, and transformers'
default cache reordering.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import (
    EOS,
    PAD,
    TINY_TERMS,
    assert_same_up_to_rounding,
    gradient_scale,
    tiny_model,
)
from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer import kernels_vanilla_transformer as kernels
from vanilla_transformer import modeling_vanilla_transformer as modeling
from vanilla_transformer.kernels_vanilla_transformer import (
    PositionTable,
    TokenPacking,
    dropout,
    projected_label_smoothed_loss,
)
from vanilla_transformer.modeling_vanilla_transformer import (
    label_smoothed_cross_entropy,
    sinusoidal_position_encoding,
)


def ragged_batch() -> dict[str, torch.Tensor]:
    """Padded sources and targets, with an ignored label in the middle of a row (it stays computed)."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 99, (3, 8), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, length in ((1, 5), (2, 2)):
        input_ids[row, length:], attention_mask[row, length:] = PAD, 0
    labels = torch.randint(3, 99, (3, 6), generator=generator)
    labels[0, -1] = EOS
    labels[1, 3], labels[1, 4:] = EOS, -100
    labels[2, 1] = -100  # ignored, but positions 2-3 still need it
    labels[2, 3], labels[2, 4:] = EOS, -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model, batch, **kwargs):
    output = model(**batch, num_items_in_batch=torch.tensor(11), **kwargs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return output, grads


CONFIGS = [
    ("eager", {}),
    ("sdpa", {}),
    ("sdpa", {"norm_first": True}),
    ("eager", {"add_final_logits_bias": True}),
    ("sdpa", {"tie_word_embeddings": False}),
]


@pytest.mark.parametrize(("attention", "overrides"), CONFIGS)
def test_optimised_training_path_matches_the_plain_one(monkeypatch, attention, overrides):
    batch = ragged_batch()
    model = tiny_model(attention, **overrides)  # eval(): dropout off, gradients still computed
    if model.final_logits_bias is not None:
        with torch.no_grad():
            model.final_logits_bias.normal_()
    fast, fast_grads = loss_and_grads(model, batch, return_logits=False)
    fast_logits = model(**batch).logits.detach()

    monkeypatch.setattr(TokenPacking, "from_mask", classmethod(lambda cls, keep: None))
    plain, plain_grads = loss_and_grads(model, batch)  # full (B, T, V) logits, F.cross_entropy
    assert fast.logits is None and plain.logits.shape == (3, 6, 99)
    labelled = batch["labels"] != -100
    assert_same_up_to_rounding(fast_logits[labelled], plain.logits[labelled].detach(), TINY_TERMS)
    assert_same_up_to_rounding(fast.loss, plain.loss, TINY_TERMS)
    assert fast_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        assert_same_up_to_rounding(
            fast_grads[name], plain_grads[name], TINY_TERMS, gradient_scale(plain_grads), msg=name
        )


def test_padded_batch_matches_each_sentence_run_alone(each_linear_kernel):
    """Independent of the packing code: padding must not change any real position."""
    batch, model = ragged_batch(), tiny_model("sdpa")
    with torch.no_grad():
        output = model(**batch)
        for row in range(3):
            length = int(batch["attention_mask"][row].sum())
            target = batch["labels"][row : row + 1]
            alone = model(input_ids=batch["input_ids"][row : row + 1, :length], labels=target)
            assert_same_up_to_rounding(
                output.encoder_last_hidden_state[row, :length], alone.encoder_last_hidden_state[0], TINY_TERMS
            )
            labelled = target[0] != -100
            assert_same_up_to_rounding(output.logits[row][labelled], alone.logits[0][labelled], TINY_TERMS)
        assert (output.encoder_last_hidden_state[2, 2:] == 0).all()  # skipped padding comes back as zeros


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generated_tokens_are_unchanged(monkeypatch, num_beams, each_linear_kernel):
    batch, model = ragged_batch(), tiny_model("sdpa")
    options = {"num_beams": num_beams, "max_new_tokens": 8}
    options |= {"output_scores": True, "return_dict_in_generate": True}
    source = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    fast = model.generate(**source, **options)

    # transformers' own reordering of both caches, and every position computed
    monkeypatch.setattr(
        VanillaTransformerForConditionalGeneration,
        "_reorder_cache",
        lambda self, cache, beam_idx: (cache.reorder_cache(beam_idx), cache)[1],
    )
    monkeypatch.setattr(TokenPacking, "from_mask", classmethod(lambda cls, keep: None))
    plain = model.generate(**source, **options)
    assert torch.equal(fast.sequences, plain.sequences)
    if num_beams > 1:
        torch.testing.assert_close(fast.sequences_scores, plain.sequences_scores)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_projected_loss_matches_cross_entropy_on_full_logits(dtype):
    """Several chunks (vocabulary 40,000 -> 104 tokens per chunk), with a bias; float64 stays float64."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 8, dtype=dtype, generator=generator, requires_grad=True)
    weight = torch.randn(40_000, 8, dtype=dtype, generator=generator, requires_grad=True)
    bias = torch.randn(40_000, dtype=dtype, generator=generator, requires_grad=True)
    labels = torch.randint(0, 40_000, (300,), generator=generator)

    fast = projected_label_smoothed_loss(hidden, weight, bias, labels, 0.1, num_items_in_batch=500)
    fast_grads = torch.autograd.grad(2.5 * fast, (hidden, weight, bias))
    plain = label_smoothed_cross_entropy(F.linear(hidden, weight, bias), labels, 0.1, num_items_in_batch=500)
    plain_grads = torch.autograd.grad(2.5 * plain, (hidden, weight, bias))
    assert fast.dtype == plain.dtype == dtype
    assert_same_up_to_rounding(fast, plain, 300 * 40_000)  # a sum over every token and logit
    for got, expected in zip(fast_grads, plain_grads, strict=True):
        assert_same_up_to_rounding(got, expected, 40_000)  # sums over the vocabulary or the tokens
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        assert torch.equal(
            projected_label_smoothed_loss(hidden, weight, bias, labels, 0.1, 500), fast.detach()
        )


def test_cpu_dropout_is_dropout():
    torch.manual_seed(0)
    inputs = torch.ones(1_000_000, requires_grad=True)
    outputs = dropout(inputs, 0.1, training=True)
    kept = outputs != 0
    # kept with probability 0.9: 5 standard deviations of a binomial proportion
    assert abs(kept.float().mean().item() - 0.9) < 5 * (0.9 * 0.1 / 1e6) ** 0.5
    assert torch.allclose(outputs[kept], torch.tensor(1 / 0.9))
    (grad,) = torch.autograd.grad(outputs, inputs, torch.full_like(outputs, 2.0))
    assert torch.equal(grad, 2.0 * outputs.detach())  # backward uses the same mask and scale
    torch.manual_seed(5)
    first = dropout(torch.ones(1000), 0.3, training=True)
    torch.manual_seed(5)
    assert torch.equal(first, dropout(torch.ones(1000), 0.3, training=True))  # seeded like torch's
    x = torch.randn(4, 5)
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0, training=True) is x
    assert (dropout(x, 1.0, training=True) == 0).all()
    assert (dropout(torch.ones(1000), 1 - 1e-10, training=True) == 0).all()  # p rounding to 1 in 32 bits


def test_left_padding_and_holes_match_the_plain_path(monkeypatch):
    batch = ragged_batch()
    batch["attention_mask"][0] = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])  # left padding and a hole
    model = tiny_model("sdpa")
    fast, fast_grads = loss_and_grads(model, batch, return_logits=False)
    monkeypatch.setattr(TokenPacking, "from_mask", classmethod(lambda cls, keep: None))
    plain, plain_grads = loss_and_grads(model, batch)
    assert_same_up_to_rounding(fast.loss, plain.loss, TINY_TERMS)
    for name in plain_grads:
        assert_same_up_to_rounding(
            fast_grads[name], plain_grads[name], TINY_TERMS, gradient_scale(plain_grads), msg=name
        )


@pytest.mark.parametrize("return_logits", [False, True])
def test_all_labels_ignored_gives_zero_loss_and_zero_gradients(return_logits):
    batch = ragged_batch()
    batch["labels"][:] = -100
    model = tiny_model("sdpa")
    output = model(**batch, return_logits=return_logits)
    output.loss.backward()
    assert output.loss.item() == 0.0
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    assert gradients and not any(g.any() for g in gradients)


def test_hooked_output_projection_runs_its_forward():
    """Hooks, adapters, offloading on lm_head need its forward: the loss then goes through `project`."""
    batch, model = ragged_batch(), tiny_model("sdpa")
    plain = model(**batch, return_logits=False).loss
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    hooked = model(**batch, return_logits=False).loss
    assert calls == [(int((batch["labels"] != -100).sum()), 99)]
    torch.testing.assert_close(hooked, plain)


def test_projected_loss_in_bfloat16_has_no_gradient_bias():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 16, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(50, 16, generator=generator).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (256,), generator=generator)
    fast = torch.autograd.grad(projected_label_smoothed_loss(hidden, weight, None, labels, 0.1, 11), hidden)[
        0
    ]
    plain = torch.autograd.grad(
        label_smoothed_cross_entropy(F.linear(hidden, weight).float(), labels, 0.1, 11), hidden
    )[0]
    assert fast.dtype == torch.bfloat16
    ratio = (fast.float() * plain.float()).sum() / (plain.float() ** 2).sum()
    # rounding 1 / 11 to bfloat16 first would scale every gradient by 1 - 1e-3
    assert abs(ratio.item() - 1) < 4e-4


def test_position_table_equals_the_encoding_computed_on_the_fly():
    table = PositionTable(32, "interleaved", sinusoidal_position_encoding)
    for start, length in ((0, 10), (9, 1), (100, 5), (3, 200)):  # grows past 64 and 128 rows
        expected = sinusoidal_position_encoding(torch.arange(start, start + length), 32)
        assert torch.equal(table(start, length, torch.device("cpu"), torch.float32), expected)
    assert table.table.shape[0] == 256
    assert table(0, 4, torch.device("cpu"), torch.float64).dtype == torch.float64


def test_training_mode_with_dropout_is_seeded_and_differentiable():
    batch = ragged_batch()
    model = tiny_model("sdpa", dropout=0.3).train()

    def loss(seed):
        torch.manual_seed(seed)
        value = model(**batch, return_logits=False).loss
        value.backward()
        return value.detach()

    first, again, other = loss(1), loss(1), loss(2)
    assert torch.isfinite(first) and torch.equal(first, again) and not torch.equal(first, other)
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    assert any(g.any() for g in gradients) and all(torch.isfinite(g).all() for g in gradients)


def autograd_nodes(output: torch.Tensor) -> set[str]:
    """Names of the backward functions in `output`'s graph."""
    seen, pending = set(), [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is not None and node not in seen:
            seen.add(node)
            pending.extend(parent for parent, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_training_graph_has_no_in_place_operation_on_a_view(padded, norm_first):
    """An in-place operation on a view (the feed-forward network's ReLU on a linear layer's output for
    (B, L, D) inputs) makes autograd copy the whole base tensor's gradient in backward (`CopySlices`),
    three (tokens x d_ff) copies per layer. Unpadded batches (no packing: (B, L, D) states) are the case
    that had them; packed (N, D) states guard against the same in the packing path."""
    batch = ragged_batch()
    if not padded:
        batch = {key: value[:1] for key, value in batch.items()}  # one full-length row: nothing to pack
    model = tiny_model("sdpa", dropout=0.1, norm_first=norm_first).train()
    nodes = autograd_nodes(model(**batch, return_logits=False).loss)
    assert "AddmmBackward0" in nodes and "ReluBackward0" in nodes
    assert not nodes & {"CopySlices", "AsStridedBackward0"}


def test_training_mode_with_labels_skips_the_logits_and_keeps_loss_and_gradients():
    """What `Trainer` runs, model(input_ids, attention_mask, labels).loss in training mode, takes the
    fast path; logits are returned on request and always in eval mode."""
    batch = ragged_batch()
    model = tiny_model("sdpa").train()  # dropout 0: training and eval modes compute the same function
    trainer, trainer_grads = loss_and_grads(model, batch)
    assert trainer.logits is None
    requested, requested_grads = loss_and_grads(model, batch, return_logits=True)
    assert requested.logits.shape == (3, 6, 99)
    expected = label_smoothed_cross_entropy(
        requested.logits.flatten(0, 1), batch["labels"].flatten(), 0.1, torch.tensor(11)
    )
    assert_same_up_to_rounding(trainer.loss, expected, TINY_TERMS)
    for name in requested_grads:
        assert_same_up_to_rounding(
            trainer_grads[name], requested_grads[name], TINY_TERMS, gradient_scale(requested_grads), msg=name
        )
    assert model.eval()(**batch).logits.shape == (3, 6, 99)


def test_bfloat16_autocast_training_path_matches_the_plain_one(monkeypatch):
    """`--mixed_precision bf16` on CPU runs the model under autocast: the fast path (packing, chunked
    loss, custom autograd functions) must give the plain path's loss and gradients to bfloat16 rounding."""
    batch = ragged_batch()
    model = tiny_model("sdpa").train()
    full_precision, _ = loss_and_grads(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, fast_grads = loss_and_grads(model, batch, return_logits=False)
        monkeypatch.setattr(TokenPacking, "from_mask", classmethod(lambda cls, keep: None))
        plain, plain_grads = loss_and_grads(model, batch, return_logits=True)
    assert plain.logits.dtype == torch.bfloat16  # autocast is on
    assert fast.loss.dtype == plain.loss.dtype == torch.float32  # the loss itself is summed in float32
    assert fast.loss != full_precision.loss
    # Autocast rounds each product's inputs and output to bfloat16 and accumulates in float32, so
    # the paths differ by a few bfloat16 units, not by units grown with the terms summed. (bfloat16
    # against float32 arithmetic moves these gradients by ~10% of their scale.)
    tolerance = 4 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(fast.loss, plain.loss, rtol=tolerance, atol=0)
    scale = gradient_scale(plain_grads)
    assert fast_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        assert fast_grads[name].dtype == torch.float32
        torch.testing.assert_close(
            fast_grads[name], plain_grads[name], rtol=tolerance, atol=tolerance * scale, msg=name
        )


def test_bfloat16_autocast_training_loss_adds_the_final_logits_bias_unrounded():
    """Under autocast the logits are the bfloat16 product plus the float32 final logits bias (a converted
    Marian model's), as `project` and MarianMTModel compute them. The chunked training loss once passed
    the bias into the autocast product, which rounded it to bfloat16: the training loss and gradients of
    such a model under `--mixed_precision bf16` were those of other logits than its evaluation's."""
    batch = ragged_batch()
    model = tiny_model("sdpa", add_final_logits_bias=True).train()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 8.0)  # OPUS-MT biases reach such sizes; far from bfloat16 values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, fast_grads = loss_and_grads(model, batch, return_logits=False)
        plain, plain_grads = loss_and_grads(model, batch, return_logits=True)
    assert plain.logits.dtype == torch.float32  # bfloat16 product + float32 bias
    expected = F.cross_entropy(
        plain.logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1, reduction="sum"
    ) / torch.tensor(11)
    torch.testing.assert_close(fast.loss, expected, rtol=1e-5, atol=0)
    tolerance = 4 * torch.finfo(torch.bfloat16).eps  # backward products in bfloat16 (see above)
    scale = gradient_scale(plain_grads)
    for name in plain_grads:
        torch.testing.assert_close(
            fast_grads[name], plain_grads[name], rtol=tolerance, atol=tolerance * scale, msg=name
        )


def test_eval_outputs_do_not_depend_on_labels():
    """transformers' convention, which `generate`, evaluation and `Trainer.predict` rely on: in eval mode
    the logits and encoder states are the same with and without `labels` (positions after a row's last
    label once came back as bias-only logits)."""
    batch = ragged_batch()
    model = tiny_model("sdpa").eval()
    with torch.no_grad():
        with_labels = model(**batch)
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
        without = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=decoder_input_ids,
        )
    # Equal up to rounding, not bit for bit: with labels the padded target positions are not computed,
    # and products of other row counts may be blocked, hence rounded, differently (they were with
    # torch's AVX2 kernels, `ATEN_CPU_CAPABILITY=avx2`).
    assert_same_up_to_rounding(with_labels.logits, without.logits, TINY_TERMS)
    assert_same_up_to_rounding(
        with_labels.encoder_last_hidden_state, without.encoder_last_hidden_state, TINY_TERMS
    )


class RecordedOps(TorchDispatchMode):
    """Every aten op that runs, and whether any indexes with a boolean mask (a data-dependent shape)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        indices = args[1] if func.overloadpacket is torch.ops.aten.index else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            self.names.add("index with a boolean mask")
        return func(*args, **(kwargs or {}))


# Ops that read a value on the host or whose output shape depends on values: on an accelerator each
# waits for the device to finish.
HOST_READS = {
    "_local_scalar_dense",
    "is_nonzero",
    "item",
    "nonzero",
    "masked_select",
    "index with a boolean mask",
}


@pytest.mark.parametrize("on_accelerator", [False, True])
def test_training_forward_reads_no_values_on_the_host_on_an_accelerator(monkeypatch, on_accelerator):
    """CUDA emulated on CPU: where `reads_are_free` says no (as for accelerator tensors), a training
    forward and backward with labels (what `Trainer` runs) and an evaluation forward run no op that
    reads a value on the host, with the loss of the path that does; on CPU the shortcuts do read."""
    batch, model = ragged_batch(), tiny_model("sdpa").train()
    reference = model(**batch).loss
    if on_accelerator:
        for module in (kernels, modeling):
            monkeypatch.setattr(module, "reads_are_free", lambda tensor: False)
        # Kernel measurement (a CPU-only path, which reads its timings' results) stays out of it too.
        monkeypatch.setattr(kernels.linear_kernel(), "mode", "torch")
    with RecordedOps() as recorded:
        loss = model(**batch).loss
        loss.backward()
        with torch.no_grad():
            model.eval()(**batch)  # what evaluation sees
    assert bool(recorded.names & HOST_READS) != on_accelerator, recorded.names & HOST_READS
    assert_same_up_to_rounding(loss, reference, TINY_TERMS)
