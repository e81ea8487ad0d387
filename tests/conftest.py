"""Shared fixtures: a tiny configuration (vocab 99, d_model 32, 2+2 layers, 4 heads) and inputs."""

import pytest
import torch

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

PAD, BOS, EOS = 0, 1, 2


def tiny_config(**overrides) -> VanillaTransformerConfig:
    values = {
        "vocab_size": 99,
        "d_model": 32,
        "num_heads": 4,
        "d_ff": 64,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "dropout": 0.0,
    }
    return VanillaTransformerConfig(**{**values, **overrides})


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = attn_implementation
    return VanillaTransformerForConditionalGeneration(config).eval()


@pytest.fixture
def config() -> VanillaTransformerConfig:
    return tiny_config()


@pytest.fixture
def model() -> VanillaTransformerForConditionalGeneration:
    return tiny_model()


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    """Two source and target sequences; the second of each is padded."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 6:], attention_mask[1, 6:] = PAD, 0
    labels = torch.randint(3, 99, (2, 7), generator=generator)
    labels[:, -1] = EOS
    labels[1, 4] = EOS
    labels[1, 5:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
