"""Faster paths give the same numbers as the plain ones."""

import pytest
import torch

from tests.conftest import tiny_model


@pytest.mark.parametrize("overrides", [{}, {"add_final_logits_bias": True}, {"tie_word_embeddings": False}])
def test_loss_on_labelled_positions_only_matches_the_full_logits_path(batch, overrides):
    def run(return_logits: bool):
        model = tiny_model(**overrides).train()  # dropout 0 in the tiny test config
        if model.final_logits_bias is not None:
            with torch.no_grad():
                model.final_logits_bias.normal_()
        output = model(**batch, num_items_in_batch=torch.tensor(9), return_logits=return_logits)
        output.loss.backward()
        return output, {name: p.grad.clone() for name, p in model.named_parameters()}

    (full, full_grads), (kept, kept_grads) = run(True), run(False)
    assert kept.logits is None and full.logits.shape == (2, 7, 99)
    torch.testing.assert_close(kept.loss, full.loss, atol=1e-6, rtol=1e-6)
    assert full_grads.keys() == kept_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(kept_grads[name], full_grads[name], atol=1e-6, rtol=1e-5, msg=name)
