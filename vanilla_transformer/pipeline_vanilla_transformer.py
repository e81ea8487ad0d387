"""A "translation" pipeline for sequence-to-sequence models (transformers 5 removed its own).

Self-contained (imports only torch and transformers): saved next to the model, with `custom_pipelines`
in config.json, so that `pipeline("translation", model=FOLDER_OR_REPO, trust_remote_code=True)` works
where this package is not installed.

Nothing is registered in transformers' `PIPELINE_REGISTRY`: transformers 5 raises its "task removed"
KeyError for "translation" before it consults the registry, so an entry there made no call work (each
folder's copy of this module, once loaded, only warned that it overwrote the entry). What transformers
reads instead is the `custom_pipelines` of a folder's or repo's config.json, which the model's
`save_pretrained` and this pipeline's `save_pretrained` write.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset
from transformers import Pipeline
from transformers.dynamic_module_utils import custom_object_save
from transformers.tokenization_utils_base import LARGE_INTEGER, TruncationStrategy

logger = logging.getLogger(__name__)

_ACCEPTED = (
    "a string, a list or tuple of strings, or strings to stream: a generator or other iterator, or a "
    'torch Dataset such as KeyDataset(dataset, "en")'
)


# Models inside `evaluation_mode` (by id; each kept alive by its block): blocks open on it, and the modes
# its modules had before the first.
_EVALUATING: dict[int, tuple[int, dict[torch.nn.Module, bool]]] = {}
_EVALUATING_LOCK = threading.Lock()


@contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode (no dropout) for the block; then each module's own mode is put back, so a
    frozen submodule left in eval mode by a fine-tuning script stays so. Blocks on one model in several
    threads (or nested) share one eval mode, put back when the last ends. (Each block once recorded and
    put back its own: a thread restored training mode, dropout included, under another's decoding, and
    the model stayed in eval mode after the last.)"""
    with _EVALUATING_LOCK:
        blocks, modes = _EVALUATING.get(id(model), (0, {}))
        if blocks == 0:
            modes = {module: module.training for module in model.modules()}
            model.eval()
        _EVALUATING[id(model)] = (blocks + 1, modes)
    try:
        yield model
    finally:
        with _EVALUATING_LOCK:
            blocks, modes = _EVALUATING.pop(id(model))
            if blocks > 1:
                _EVALUATING[id(model)] = (blocks - 1, modes)
            else:
                for module, mode in modes.items():
                    module.training = mode


# Characters that show nothing and are not whitespace to `str.split`: a byte-order mark (which starts
# every file a Windows editor saved, and so lines of files joined with `cat`), a zero-width space, a word
# joiner. Each is an unknown token that took the next word's word-start marker: "\ufeffJesus wept."
# translated otherwise, and a line of one of them alone was translated into made-up text.
INVISIBLE = "\ufeff\u200b\u2060"


def one_line(text: str) -> str:
    """`text` stripped, with every run of whitespace (line breaks that `str.splitlines` knows included)
    made one space and the invisible characters beside them (`INVISIBLE`) dropped: how this package
    reads every sentence, training data included. A second space encodes as a word-start token of its
    own, which no training sentence has: two spaces after a full stop changed most translations of a
    trained model."""
    return " ".join(word for word in (part.strip(INVISIBLE) for part in text.split()) if word)


def _checked_text(text: Any, index: int) -> str:
    """`text`, the `index`-th input of a stream, if it can be translated."""
    if not isinstance(text, str):
        raise ValueError(
            f"The translation pipeline translates strings: inputs[{index}] is a {type(text).__name__}."
        )
    if not one_line(text):
        raise ValueError(f"Cannot translate an empty string: inputs[{index}] is blank.")
    return text


def _checked_stream(texts: Iterable[Any]) -> Iterator[str]:
    """The items of `texts`, each checked as it is reached (a stream is not read ahead)."""
    for index, text in enumerate(texts):
        yield _checked_text(text, index)


def _sequence_lengths(output_ids: torch.Tensor, end_ids: list[int], pad_id: int | None) -> torch.Tensor:
    """Each generated sequence's length: up to and including its first end token after the start token;
    for one without an end token (stopped by a stop string, or at the length limit), up to its last token
    that is not padding. `generate` pads a sequence that ended before the batch's longest, so that the
    ids of a sentence would otherwise depend on the sentences batched with it."""
    lengths = torch.full(output_ids.shape[:1], output_ids.shape[-1], device=output_ids.device)
    if output_ids.shape[-1] < 2:
        return lengths
    generated = output_ids[:, 1:]  # after the start token, which may be the padding token
    if pad_id is not None:
        positions = torch.arange(1, output_ids.shape[-1], device=output_ids.device)
        lengths = 1 + (generated.ne(pad_id) * positions).amax(-1)  # 1 where all is padding
    if not end_ids:
        return lengths
    ends = torch.isin(generated, torch.tensor(end_ids, dtype=output_ids.dtype, device=output_ids.device))
    return torch.where(ends.any(-1), ends.int().argmax(-1) + 2, lengths)


class _CheckedDataset(Dataset):
    """A sized torch Dataset of strings whose items are checked as the pipeline reads them."""

    def __init__(self, texts: Dataset) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> str:
        return _checked_text(self.texts[index], index)


# transformers' `StopStringCriteria.clean_tokenizer_vocab` reads tokens after it
STOP_STRING_PREFIX = "abcdef"


def check_stop_strings(tokenizer: Any, strings: list[str]) -> None:
    """Raise a ValueError that says why where transformers' `StopStringCriteria` cannot read `tokenizer`'s
    vocabulary for `strings`. Except in byte-level vocabularies it decodes each token after the text
    STOP_STRING_PREFIX, and failed with "substring not found" deep inside `generate` for a tokenizer that
    cannot write those letters (one learned on other scripts)."""
    from transformers import StopStringCriteria

    try:
        StopStringCriteria(tokenizer, strings)  # transformers caches what it reads: `generate` reuses it
    except ValueError as error:
        ids = tokenizer(STOP_STRING_PREFIX, add_special_tokens=False)["input_ids"]
        written = tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(ids))
        reason = (
            f"they read the vocabulary after the text {STOP_STRING_PREFIX!r}, which this tokenizer writes "
            f"as {written!r}"
            if STOP_STRING_PREFIX not in written
            else f"they cannot read its vocabulary ({(str(error).splitlines() or [''])[0]})"
        )
        raise ValueError(
            f"stop_sequence cannot be matched with this tokenizer: transformers' stop strings need a "
            f"vocabulary they can read, and {reason}. Stop at the end token instead, or cut the "
            "translations at the string afterwards."
        ) from None


class TranslationPipeline(Pipeline):
    """Translate a string, a list of strings or a stream of strings with `model.generate`.

    Returns `[{"translation_text": ...}]` per input, as transformers' translation pipeline did before
    version 5: a list of inputs gives a list of results, a stream (a generator or other iterator, a torch
    Dataset such as `KeyDataset`) an iterator that translates as it is read. Generation options
    (`num_beams`, `max_new_tokens`, `length_penalty`, ...) pass through, either at construction or per
    call; the model's generation config applies otherwise. The other options of that pipeline:

    - `truncation`: cut each source to the tokenizer's `model_max_length` tokens (its end token kept).
      The model has sinusoidal positions and no maximum length of its own, so with a tokenizer that sets
      none (this package's) nothing is cut; set `tokenizer.model_max_length` to choose a limit.
    - `return_tensors`: the generated token ids, under `translation_token_ids` (up to and including the
      end token, without the padding of a batch); the text is then left out unless `return_text=True`.
    - `return_type`: transformers 4's spelling of the two above: `ReturnType.TENSORS` (the token ids
      alone) or `ReturnType.NEW_TEXT` (the text alone), of transformers' text-generation pipeline, or
      the name "TENSORS" or "TEXT" (transformers 4's translation pipeline had an enum of its own).
    - `clean_up_tokenization_spaces`: passed to the tokenizer's `decode` (default False).
    - `stop_sequence`: a string, or a list of strings, that ends a translation once generated (it is kept
      in the text); `generate`'s `stop_strings`, given the pipeline's tokenizer. The end token still ends
      it too (transformers 4 replaced the end token by the stop sequence's first token). transformers
      reads the vocabulary for it, but for byte-level ones, after the text "abcdef": a tokenizer that
      cannot write those letters is refused with that reason (`check_stop_strings`).
    - `src_lang`, `tgt_lang`: refused; the model translates one language pair and takes no language code.
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(
        self,
        truncation: bool | str | TruncationStrategy | None = None,
        return_tensors: bool | None = None,
        return_text: bool | None = None,
        return_type: Any = None,
        clean_up_tokenization_spaces: bool | None = None,
        stop_sequence: str | list[str] | None = None,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        **generate_kwargs: Any,
    ) -> tuple[dict, dict, dict]:
        for name, code in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
            if code is None:
                continue
            if hasattr(self.tokenizer, "_build_translation_inputs"):  # a multilingual tokenizer's
                raise ValueError(
                    f"{name}={code!r}: this pipeline takes no language codes; for a multilingual model set "
                    "the tokenizer's src_lang and give the target language's token as forced_bos_token_id."
                )
            raise ValueError(
                f"{name}={code!r}: this model translates the one language pair it was trained on and "
                "takes no language codes (src_lang and tgt_lang were for multilingual models); remove it."
            )
        preprocess_params = {}
        if truncation is not None:
            if not isinstance(truncation, bool):
                try:
                    truncation = TruncationStrategy(truncation)
                except ValueError:
                    choices = ", ".join(repr(strategy.value) for strategy in TruncationStrategy)
                    raise ValueError(
                        f"truncation must be True, False or one of {choices}; got {truncation!r}."
                    ) from None
            preprocess_params["truncation"] = truncation
            maximum = self.tokenizer.model_max_length if self.tokenizer is not None else None
            cuts = truncation not in (False, TruncationStrategy.DO_NOT_TRUNCATE)
            if (
                cuts
                and (maximum is None or maximum > LARGE_INTEGER)
                and not getattr(self, "_said_uncut", False)
            ):
                self._said_uncut = True  # once per pipeline, not at every call of a loop
                logger.warning(
                    "truncation cuts nothing: the tokenizer sets no model_max_length, and this model has no "
                    "maximum length (sinusoidal positions). Set tokenizer.model_max_length to cut sources "
                    "at that many tokens."
                )
        if return_type is not None:
            kind = getattr(return_type, "name", return_type)
            if kind not in ("TENSORS", "TEXT", "NEW_TEXT"):
                raise ValueError(
                    "return_type must be ReturnType.TENSORS (the token ids) or ReturnType.NEW_TEXT (the "
                    f"text), or the name 'TENSORS' or 'TEXT'; got {return_type!r}."
                )
            if return_tensors is not None or return_text is not None:
                raise ValueError("Give return_type, or return_tensors and return_text, not both.")
            # (the text follows from it: a later call's return_tensors=False gives the text again)
            return_tensors = kind == "TENSORS"
        if stop_sequence is not None:
            strings = [stop_sequence] if isinstance(stop_sequence, str) else stop_sequence
            if not isinstance(strings, (list, tuple)) or not all(isinstance(t, str) and t for t in strings):
                raise ValueError(
                    f"stop_sequence must be a non-empty string or a list of them; got {stop_sequence!r}."
                )
            generate_kwargs["stop_strings"] = list(strings)
        if generate_kwargs.get("stop_strings") is not None and "tokenizer" not in generate_kwargs:
            generate_kwargs["tokenizer"] = self.tokenizer  # `generate` matches the strings with it
        if generate_kwargs.get("stop_strings") and generate_kwargs["tokenizer"] is not None:
            check_stop_strings(generate_kwargs["tokenizer"], generate_kwargs["stop_strings"])
        postprocess_params = {}
        if return_tensors is not None:
            postprocess_params["return_tensors"] = bool(return_tensors)
        if return_text is not None:
            postprocess_params["return_text"] = bool(return_text)
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        # What this call returns, with the construction's options (none yet while constructing).
        returned = {**getattr(self, "_postprocess_params", {}), **postprocess_params}
        if returned.get("return_text") is False and not returned.get("return_tensors"):
            raise ValueError("return_text=False without return_tensors=True leaves nothing to return.")
        # `Pipeline` merges a call's pre- and postprocessing options over the construction's itself, but
        # replaces the construction's forward options with a call's: merge them here, so that those given
        # at construction stay unless the call changes them; a call's whole `generation_config` replaces
        # them, as in transformers' pipelines.
        given = getattr(self, "_forward_params", {}).get("generate_kwargs", {})
        if "generation_config" in generate_kwargs:
            given = {}
        return preprocess_params, {"generate_kwargs": {**given, **generate_kwargs}}, postprocess_params

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
        blank = [index for index, text in enumerate(inputs) if not one_line(text)]
        if blank:  # named before any is translated (one would otherwise stop the batch midway)
            raise ValueError(
                f"Cannot translate an empty string: inputs[{blank[0]}]"
                + (f" (and {len(blank) - 1} more)" if len(blank) > 1 else "")
                + " is blank."
            )
        results = super().__call__(inputs, **kwargs)
        # One translation per sentence: a flat list, as the pipeline of transformers 4 returned.
        return [result[0] for result in results] if all(len(r) == 1 for r in results) else results

    def preprocess(
        self, text: str, truncation: bool | str | TruncationStrategy = False
    ) -> dict[str, torch.Tensor]:
        if not one_line(text):
            raise ValueError("Cannot translate an empty string.")
        # As training data is read (`one_line`). A sentence with its line break (a file's line) or spaces
        # around it was encoded with word-start tokens at its ends that no training source has, and
        # translated otherwise.
        text = one_line(text)
        return self.tokenizer(text, return_tensors="pt", truncation=truncation)

    def _setting(self, name: str, generate_kwargs: dict[str, Any]) -> Any:
        """A generation setting as `generate` takes it with these options: the keyword (a keyword None
        unsets it), else the generation config given, else the model's (`generate` fills a given
        config's unset fields from the model's: a `GenerationConfig(num_beams=2)` keeps its end token)."""
        if name in generate_kwargs:
            return generate_kwargs[name]
        value = getattr(generate_kwargs.get("generation_config"), name, None)
        return value if value is not None else getattr(self.model.generation_config, name, None)

    def _end_token_ids(self, generate_kwargs: dict[str, Any]) -> list[int]:
        """The end-of-sequence tokens `generate` stops at with these options."""
        ids = self._setting("eos_token_id", generate_kwargs)
        # an id or ids in any form `generate` takes (int, list, NumPy integer or array, tensor)
        return [] if ids is None else torch.as_tensor(ids).flatten().tolist()

    def _forward(
        self, model_inputs: dict[str, torch.Tensor], generate_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        model_inputs.pop("token_type_ids", None)
        sentences = model_inputs["input_ids"].shape[0]
        with evaluation_mode(self.model):  # a model handed over from training would translate with dropout
            output_ids = self.model.generate(**model_inputs, **generate_kwargs)
        if not isinstance(output_ids, torch.Tensor):  # `return_dict_in_generate=True`: the ids are in it
            output_ids = output_ids.sequences
        pad_id = self._setting("pad_token_id", generate_kwargs)
        lengths = _sequence_lengths(output_ids, self._end_token_ids(generate_kwargs), pad_id)
        # Which rows begin with the decoder's start token: the prompt, not part of the translation.
        start = self._setting("decoder_start_token_id", generate_kwargs)
        if start is None:
            start = getattr(self.model.config, "decoder_start_token_id", None)
        prompted = output_ids[:, 0] == start if isinstance(start, int) else torch.zeros_like(lengths).bool()
        # (sentences, sequences per sentence, ...): the pipeline splits a batch's outputs by their first
        # dimension, one entry per input sentence, also with `num_return_sequences` > 1.
        return {
            "output_ids": output_ids.reshape(sentences, -1, output_ids.shape[-1]),
            "lengths": lengths.reshape(sentences, -1),
            "prompted": prompted.reshape(sentences, -1),
        }

    def postprocess(
        self,
        model_outputs: dict[str, Any],
        return_tensors: bool = False,
        return_text: bool | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> list[dict[str, Any]]:
        if return_text is None:  # the text, unless only the token ids are asked for
            return_text = not return_tensors
        (sequences,) = model_outputs["output_ids"]  # one input sentence's
        (lengths,) = model_outputs["lengths"]
        (prompted,) = model_outputs["prompted"]
        records = []
        for ids, length, after in zip(sequences, lengths.tolist(), prompted.tolist(), strict=True):
            ids = ids[:length]
            record: dict[str, Any] = {}
            if return_text:
                text = self.tokenizer.decode(  # after the decoder's start token
                    ids[int(after) :],
                    skip_special_tokens=True,
                    clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                )
                record["translation_text"] = text.strip()
            if return_tensors:
                record["translation_token_ids"] = ids
            records.append(record)
        return records

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Model and tokenizer, with this pipeline's code and its entry in config.json's
        `custom_pipelines`: `pipeline("translation", model=save_directory, trust_remote_code=True)` then
        works without this package, whatever the sequence-to-sequence model (a MarianMTModel too).
        The model's configuration in memory is left as it was."""
        if os.path.isfile(save_directory):
            raise ValueError(f"{save_directory} is a file; save_pretrained writes a folder.")
        os.makedirs(save_directory, exist_ok=True)
        config = self.model.config
        had_entries = "custom_pipelines" in config.__dict__
        entries = getattr(config, "custom_pipelines", None)
        config.custom_pipelines = {
            **(entries or {}),
            "translation": {
                "impl": f"{type(self).__module__.rsplit('.', 1)[-1]}.{type(self).__name__}",
                "pt": ["AutoModelForSeq2SeqLM"],
                "type": "text",
            },
        }
        try:
            custom_object_save(self, save_directory)
            super().save_pretrained(save_directory, **kwargs)
        finally:
            if had_entries:
                config.custom_pipelines = entries
            else:
                del config.custom_pipelines


__all__ = ["TranslationPipeline", "evaluation_mode", "one_line"]
