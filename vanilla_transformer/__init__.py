"""vanilla_transformer: the Transformer of "Attention Is All You Need" as a native transformers model.

Importing the package registers the model with transformers' Auto classes, so that
`AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM` resolve `model_type="vanilla_transformer"`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_vanilla_transformer import PRESETS, VanillaTransformerConfig
from .modeling_vanilla_transformer import (
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerModel,
    VanillaTransformerPreTrainedModel,
)
from .pipeline_vanilla_transformer import TranslationPipeline

__version__ = "0.1.0"

AutoConfig.register(VanillaTransformerConfig.model_type, VanillaTransformerConfig, exist_ok=True)
AutoModel.register(VanillaTransformerConfig, VanillaTransformerModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(
    VanillaTransformerConfig, VanillaTransformerForConditionalGeneration, exist_ok=True
)

# `save_pretrained` writes `auto_map` into config.json and copies the configuration and modeling files,
# so that a saved folder loads with `trust_remote_code=True` where this package is not installed.
VanillaTransformerConfig.register_for_auto_class()
VanillaTransformerModel.register_for_auto_class("AutoModel")
VanillaTransformerForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")

__all__ = [
    "PRESETS",
    "TranslationPipeline",
    "VanillaTransformerConfig",
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerModel",
    "VanillaTransformerPreTrainedModel",
]
