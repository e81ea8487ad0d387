"""End to end: a tiny model learns to copy random token sequences (training and decoding together)."""

import torch
from transformers import get_inverse_sqrt_schedule

from tests.conftest import EOS, tiny_config
from vanilla_transformer import VanillaTransformerForConditionalGeneration

VOCAB, LENGTH = 20, 8


def random_sequences(count: int, seed: int) -> torch.Tensor:
    tokens = torch.randint(3, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(seed))
    return torch.cat([tokens, torch.full((count, 1), EOS)], 1)  # (count, LENGTH + 1)


def test_tiny_model_learns_to_copy():
    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB, d_model=64, num_heads=4, d_ff=256, dropout=0.0)
    model = VanillaTransformerForConditionalGeneration(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    schedule = get_inverse_sqrt_schedule(optimizer, num_warmup_steps=100)
    model.train()
    for step in range(600):
        batch = random_sequences(64, seed=step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()

    model.eval()
    held_out = random_sequences(500, seed=10_000)  # training used seeds 0..599
    generated = model.generate(held_out, num_beams=1, do_sample=False, max_new_tokens=LENGTH + 1)
    exact_match = (generated[:, 1:] == held_out).all(-1).float().mean().item()
    assert exact_match >= 0.99, f"copied {exact_match:.1%} of held-out sequences exactly"
    beam = model.generate(held_out[:50], num_beams=4, max_new_tokens=LENGTH + 1)
    assert (beam[:, 1:] == held_out[:50]).all(-1).float().mean().item() >= 0.98
