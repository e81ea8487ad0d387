"""A "translation" pipeline for sequence-to-sequence models (transformers 5 removed its own).

Self-contained (imports only torch and transformers): saved next to the model, with `custom_pipelines`
in config.json, so that `pipeline("translation", model=FOLDER_OR_REPO, trust_remote_code=True)` works
where this package is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AutoModelForSeq2SeqLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY


@contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode (no dropout) for the block; then each module's own mode is put back, so a
    frozen submodule left in eval mode by a fine-tuning script stays so."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield model
    finally:
        for module, mode in modes.items():
            module.training = mode


class TranslationPipeline(Pipeline):
    """Translate a string or a list of strings with `model.generate`.

    Returns `[{"translation_text": ...}]` per input, as transformers' translation pipeline did before
    version 5. Generation options (`num_beams`, `max_new_tokens`, `length_penalty`, ...) pass through,
    either at construction or per call; the model's generation config applies otherwise.
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(
        self, clean_up_tokenization_spaces: bool | None = None, **generate_kwargs: Any
    ) -> tuple[dict, dict, dict]:
        postprocess_params = {}
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        # `Pipeline` replaces the construction's forward parameters with a call's: merge the options so
        # that those given at construction stay unless the call changes them.
        given = getattr(self, "_forward_params", {}).get("generate_kwargs", {})
        return {}, {"generate_kwargs": {**given, **generate_kwargs}}, postprocess_params

    def __call__(self, inputs: str | list[str], **kwargs: Any) -> list:
        """A sentence gives `[{"translation_text": ...}]`; a list gives one such dict per sentence."""
        if isinstance(inputs, str):
            return super().__call__(inputs, **kwargs)
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(text, str) for text in inputs):
            raise ValueError("The translation pipeline takes a string or a list of strings.")
        if not inputs:  # no sentences, no translations (transformers' batching fails on an empty list)
            return []
        blank = [index for index, text in enumerate(inputs) if not text.strip()]
        if blank:  # named before any is translated (one would otherwise stop the batch midway)
            raise ValueError(
                f"Cannot translate an empty string: inputs[{blank[0]}]"
                + (f" (and {len(blank) - 1} more)" if len(blank) > 1 else "")
                + " is blank."
            )
        results = super().__call__(list(inputs), **kwargs)
        # One translation per sentence: a flat list, as the pipeline of transformers 4 returned.
        return [result[0] for result in results] if all(len(r) == 1 for r in results) else results

    def preprocess(self, text: str) -> dict[str, torch.Tensor]:
        if not text.strip():
            raise ValueError("Cannot translate an empty string.")
        return self.tokenizer(text, return_tensors="pt")

    def _forward(
        self, model_inputs: dict[str, torch.Tensor], generate_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        model_inputs.pop("token_type_ids", None)
        sentences = model_inputs["input_ids"].shape[0]
        with evaluation_mode(self.model):  # a model handed over from training would translate with dropout
            output_ids = self.model.generate(**model_inputs, **generate_kwargs)
        # (sentences, sequences per sentence, length): the pipeline splits a batch's outputs by their
        # first dimension, one entry per input sentence, also with `num_return_sequences` > 1.
        return {"output_ids": output_ids.reshape(sentences, -1, output_ids.shape[-1])}

    def postprocess(
        self, model_outputs: dict[str, Any], clean_up_tokenization_spaces: bool = False
    ) -> list[dict[str, str]]:
        (sequences,) = model_outputs["output_ids"]  # one input sentence's
        return [
            {
                "translation_text": self.tokenizer.decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
                ).strip()
            }
            for ids in sequences
        ]


PIPELINE_REGISTRY.register_pipeline(
    "translation", pipeline_class=TranslationPipeline, pt_model=AutoModelForSeq2SeqLM
)

__all__ = ["TranslationPipeline", "evaluation_mode"]
