"""A "translation" pipeline for sequence-to-sequence models (transformers 5 removed its own).

Self-contained (imports only torch and transformers): saved next to the model, with `custom_pipelines`
in config.json, so that `pipeline("translation", model=FOLDER_OR_REPO, trust_remote_code=True)` works
where this package is not installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset
from transformers import AutoModelForSeq2SeqLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

_ACCEPTED = (
    "a string, a list or tuple of strings, or strings to stream: a generator or other iterator, or a "
    'torch Dataset such as KeyDataset(dataset, "en")'
)


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


def _checked_text(text: Any, index: int) -> str:
    """`text`, the `index`-th input of a stream, if it can be translated."""
    if not isinstance(text, str):
        raise ValueError(
            f"The translation pipeline translates strings: inputs[{index}] is a {type(text).__name__}."
        )
    if not text.strip():
        raise ValueError(f"Cannot translate an empty string: inputs[{index}] is blank.")
    return text


def _checked_stream(texts: Iterable[Any]) -> Iterator[str]:
    """The items of `texts`, each checked as it is reached (a stream is not read ahead)."""
    for index, text in enumerate(texts):
        yield _checked_text(text, index)


class _CheckedDataset(Dataset):
    """A sized torch Dataset of strings whose items are checked as the pipeline reads them."""

    def __init__(self, texts: Dataset) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> str:
        return _checked_text(self.texts[index], index)


class TranslationPipeline(Pipeline):
    """Translate a string, a list of strings or a stream of strings with `model.generate`.

    Returns `[{"translation_text": ...}]` per input, as transformers' translation pipeline did before
    version 5: a list of inputs gives a list of results, a stream (a generator or other iterator, a torch
    Dataset such as `KeyDataset`) an iterator that translates as it is read. Generation options
    (`num_beams`, `max_new_tokens`, `length_penalty`, ...) pass through, either at construction or per
    call; the model's generation config applies otherwise.
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

    def __call__(self, inputs: str | list[str] | tuple[str, ...] | Iterable[str], **kwargs: Any) -> Any:
        """A sentence gives `[{"translation_text": ...}]`; a list or tuple gives one such dict per
        sentence (a list of them with `num_return_sequences` > 1), after every sentence has been checked;
        a stream gives an iterator of `[{"translation_text": ...}]`, one per sentence, each sentence checked
        when it is reached: the iterator stops with an error at the first that cannot be translated,
        named by its position."""
        if isinstance(inputs, str):
            return super().__call__(inputs, **kwargs)
        if isinstance(inputs, (list, tuple)):
            return self._translate_list(list(inputs), **kwargs)
        # Lazily, as transformers streams a torch Dataset or a generator (an iterator here, for `next` as for
        # `for`): a sized Dataset is read by index, so that a DataLoader's workers can share it.
        if (
            isinstance(inputs, Dataset)
            and isinstance(inputs, Sized)
            and not isinstance(inputs, IterableDataset)
        ):
            return iter(super().__call__(_CheckedDataset(inputs), **kwargs))
        if isinstance(inputs, (Dataset, Iterator)):
            return iter(super().__call__(_checked_stream(inputs), **kwargs))
        raise ValueError(
            f"The translation pipeline takes {_ACCEPTED}; got a {type(inputs).__name__}."
            + (
                " Stream a dataset's column with KeyDataset, or pass list(...)."
                if isinstance(inputs, Sized)
                else ""
            )
        )

    def _translate_list(self, inputs: list[Any], **kwargs: Any) -> list:
        wrong = next((index for index, text in enumerate(inputs) if not isinstance(text, str)), None)
        if wrong is not None:
            raise ValueError(
                f"The translation pipeline takes a string or a list of strings: inputs[{wrong}] is a "
                f"{type(inputs[wrong]).__name__}."
            )
        if not inputs:  # no sentences, no translations (transformers' batching fails on an empty list)
            return []
        blank = [index for index, text in enumerate(inputs) if not text.strip()]
        if blank:  # named before any is translated (one would otherwise stop the batch midway)
            raise ValueError(
                f"Cannot translate an empty string: inputs[{blank[0]}]"
                + (f" (and {len(blank) - 1} more)" if len(blank) > 1 else "")
                + " is blank."
            )
        results = super().__call__(inputs, **kwargs)
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
