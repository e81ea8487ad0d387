"""Batched translation with `generate`: length-sorted batches, results in input order."""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .pipeline_vanilla_transformer import evaluation_mode, one_line


class LineError(ValueError):
    """A line of a text being translated (`translate_stream`) cannot be translated as given; the message
    starts with "line N", and `number` is N, counted from 1 with blank lines included."""

    def __init__(self, number: int, reason: str) -> None:
        super().__init__(f"line {number} {reason}")
        self.number = number


class SentenceError(ValueError):
    """One sentence of a list cannot be translated as given. `index` is its place in the list, so that
    a caller that read the sentences from a file (`translate_stream`) can name the line instead."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"sentences[{index}] {reason}")
        self.index = index
        self.reason = reason


def checked_sentences(sentences: Sequence[str], batch_size: int) -> list[str]:
    """`sentences` as a list, after the checks every translation engine makes at its boundary."""
    if isinstance(sentences, str):
        raise ValueError("`sentences` must be a sequence of strings, not a single string; wrap it in a list.")
    sentences = list(sentences)
    for index, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise SentenceError(index, f"is a {type(sentence).__name__}, not a str.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size}.")
    return sentences


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    *,
    batch_size: int = 32,
    **generate_kwargs: Any,
) -> list[str]:
    """Translate `sentences` with `model.generate`, `batch_size` sentences at a time.

    Each sentence is read as training data is (`one_line`: stripped, each run of whitespace a space).
    Sentences are sorted by token length (longest first) so that each batch carries little padding;
    the translations come back in the input order, decoded after the decoder's start token (a prompt,
    special or not, not part of the translation) and without special tokens, stripped and on one
    line each (a model trained on text with line breaks may write them: they become spaces, so that a
    line-by-line output keeps one line per input); a blank sentence translates to "". A batch that
    runs out of memory is reported as a `SentenceError` of its longest sentence, with its length.
    `generate_kwargs` go to `generate` (the model's generation config applies otherwise: beam 4 and
    source length + 50 for this package's models, each sentence its own source's length).
    The model runs in eval mode and under `torch.inference_mode()`; its train/eval state is restored.
    """
    sentences = checked_sentences(sentences, batch_size)
    if not sentences:
        return []

    # Each sentence as the training data's sources are (`one_line`; translate.py strips its lines too): a
    # sentence read with its line break ("Jesus wept.\n", from `readlines()`) or with spaces around it
    # was encoded with word-start tokens at its ends that no training source has, and translated
    # differently.
    sentences = [one_line(sentence) for sentence in sentences]
    # Encoded once, padded per batch by `pad`: a second call with padding switched on changed the fast
    # tokenizer's padding setting, which it keeps for every thread, so that another thread's batch at
    # times came back unpadded ("Unable to create tensor").
    encoded = tokenizer(sentences)["input_ids"]
    lengths = [len(ids) for ids in encoded]
    # A blank sentence is "" without going to the model, which given only the end token would write
    # whatever it learnt most often.
    translations = {i: "" for i, sentence in enumerate(sentences) if not sentence}
    order = [i for i in range(len(sentences)) if i not in translations]
    order.sort(key=lambda i: -lengths[i])  # stable: ties keep input order

    with evaluation_mode(model), torch.inference_mode():
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            inputs = tokenizer.pad({"input_ids": [encoded[i] for i in indices]}, return_tensors="pt")
            try:
                outputs = model.generate(**inputs.to(model.device), **generate_kwargs)
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
                # CPU allocation failures are RuntimeErrors that say so; others are not about the input.
                out_of_memory = isinstance(error, (torch.OutOfMemoryError, MemoryError))
                if not out_of_memory and "alloc" not in str(error):
                    raise
                longest = indices[0]  # the batches are sorted longest first
                reason = f"({lengths[longest]:,} tokens) needs more memory than there is to translate"
                if len(indices) > 1:  # the batch's size may be the cause as much as the sentence
                    reason += f" in a batch of {len(indices)} (a smaller batch size may fit)"
                raise SentenceError(longest, f"{reason}: {str(error).splitlines()[0]}") from None
            sequences = outputs if isinstance(outputs, torch.Tensor) else outputs.sequences
            if sequences.shape[0] != len(indices):
                raise ValueError(
                    f"generate returned {sequences.shape[0]} sequences for {len(indices)} sentences; "
                    "`translate` returns one translation per sentence (num_return_sequences=1)."
                )
            # After the decoder's start token, which begins what generate() returns: a start token that is
            # not a special token (a language tag, say) was decoded into each translation.
            rows = after_start_token(sequences.tolist(), decoder_start_id(model, generate_kwargs))
            decoded = tokenizer.batch_decode(rows, skip_special_tokens=True)
            for i, text in zip(indices, decoded, strict=True):
                translations[i] = one_line(text)
    return [translations[i] for i in range(len(sentences))]


def decoder_start_id(model: Any, generate_kwargs: dict[str, Any]) -> int | None:
    """The decoder start token `generate` begins its sequences with, given these options: the keyword,
    else a generation config passed, else the model's generation config, else its configuration."""
    if generate_kwargs.get("decoder_start_token_id") is not None:
        return generate_kwargs["decoder_start_token_id"]
    places = (
        generate_kwargs.get("generation_config"),
        *(getattr(model, n, None) for n in ("generation_config", "config")),
    )
    for settings in places:
        value = getattr(settings, "decoder_start_token_id", None)
        if value is not None:
            return value
    return None


def after_start_token(rows: list[list[int]], start: int | None) -> list[list[int]]:
    """Each row of token ids without its first where that is the decoder's start token `start`: the
    prompt `generate` begins with, not a translated word."""
    return [row[1:] if row and start is not None and row[0] == start else row for row in rows]


def translate_lines(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lines: Iterable[str],
    *,
    batch_size: int = 32,
    window: int | None = None,
    **generate_kwargs: Any,
) -> Iterator[str]:
    """Translate a stream of lines, `batch_size` at a time, yielding one output per input line.

    Blank lines stay blank (nothing is generated for them), so outputs align with inputs line by line.
    `window` lines are read before any is translated (default: 8 batches, sorted by length into fuller
    batches; 1 translates each line as it comes, as for a terminal).
    """

    def translate_many(texts: list[str]) -> list[str]:
        return translate(model, tokenizer, texts, batch_size=batch_size, **generate_kwargs)

    return translate_stream(translate_many, lines, window=window or batch_size * 8)


# What to do with text in another encoding than UTF-8, whose name only its writer knows.
CONVERT_HINT = (
    "convert it from the encoding it was written in, e.g. `iconv -f CP1252 -t UTF-8` for Windows' Western "
    "European text (others: GB18030, SHIFT_JIS, EUC-KR, CP1251, ISO-8859-2, ...)"
)

# A line is translated as one sentence; one longer than this is no sentence: input without line breaks
# (`--input /dev/zero`, a binary file) was read whole, and grew until the system stopped the process.
MAX_LINE_BYTES = 1 << 20


def wide_encoding(data: bytes, start: bool) -> str | None:
    """ "UTF-16" or "UTF-32" where `data` (the text's beginning, if `start`) is text in one of them rather
    than UTF-8, by its byte-order mark or by its NUL bytes: in UTF-16 text ASCII characters have a NUL
    byte beside each of them (three in UTF-32). For a block of a file: a quarter of its bytes NUL, which a
    stray NUL in UTF-8 text is not. None otherwise."""
    if start and (bom := _byte_order_mark(data)):
        return bom
    nul = data.count(b"\0")
    if data and nul * 4 >= len(data):
        return "UTF-32" if nul * 8 >= 5 * len(data) else "UTF-16"
    return None


def _byte_order_mark(data: bytes) -> str | None:
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):  # before UTF-16's: FF FE 00 00
        return "UTF-32"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "UTF-16"
    return None


# Bytes of a line, its line break left out, below which NUL bytes say nothing of its encoding.
WIDE_LINE_BYTES = 8


def wide_line(line: bytes, first: bool) -> str | None:
    """ "UTF-16" or "UTF-32" where one line of input (`first`: the input's first) is in one of them rather
    than UTF-8: by a byte-order mark, or by ASCII text's pattern there, a NUL at every position but every
    second (fourth) one, over at least WIDE_LINE_BYTES. A short line's stray NUL byte is UTF-8 text. Text
    in other scripts has no such pattern in UTF-16: without a byte-order mark it is not recognised (where
    its bytes are not UTF-8 either, the line is refused as such). None otherwise."""
    if first and (bom := _byte_order_mark(line)):
        return bom
    body = line.rstrip(b"\r\n")
    if len(body) < WIDE_LINE_BYTES or b"\0" not in body:
        return None
    for name, width in (("UTF-32", 4), ("UTF-16", 2)):  # UTF-32's pattern is UTF-16's too
        for kept in range(width):
            others = [body[offset::width] for offset in range(width) if offset != kept]
            if all(part.count(0) == len(part) for part in others):
                return name
    return None


def decoded_lines(stream: IO[bytes]) -> Iterator[str]:
    """The input's lines as text, decoded one by one so that an error names its line; a byte-order mark
    that starts the input (as Windows editors save UTF-8) is not part of its first line. A line is read
    at most MAX_LINE_BYTES (and its line break) at a time: a longer one is an error that names it."""
    limit = MAX_LINE_BYTES + 2  # "\r\n" included
    for number in itertools.count(1):
        try:  # a network share gone, a terminal hung up: the input's failure, not the output's
            line = stream.readline(limit)
        except OSError as error:
            raise LineError(number, f"could not be read: {error}") from error
        if not line:
            return
        ending = 2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0
        if len(line) - ending > MAX_LINE_BYTES:
            raise LineError(
                number,
                f"is longer than {MAX_LINE_BYTES:,} bytes: each line is translated as one sentence (is the "
                "input text with line breaks?).",
            )
        wide = wide_line(line, first=number == 1)
        if wide is not None:  # NUL bytes are UTF-8 too: its ASCII text would be translated as garbage
            raise LineError(
                number,
                f"is not UTF-8 text but {wide}, by its byte-order mark or NUL bytes; convert the input, "
                f"e.g. `iconv -f {wide} -t UTF-8`.",
            )
        try:
            yield line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise LineError(number, f"is not UTF-8 text ({error.reason}); {CONVERT_HINT}.") from None


def translate_stream(
    translate_many: Callable[..., list[str]],
    lines: Iterable[str],
    *,
    window: int = 256,
    numbered: bool = False,
) -> Iterator[str]:
    """Yield one translation per line of `lines`, translating `window` lines at a time with
    `translate_many` (any engine: `translate` above, or a CTranslate2 export's). Blank lines stay blank;
    a larger window lets the engine sort more lines into fuller batches. With `numbered`, the engine is
    called as `translate_many(texts, numbers)`, with the line number (from 1) of each text too, for its
    messages (the CTranslate2 translator's `line_numbers`).

    A line that cannot be read (`lines` raises) or translated (a `SentenceError`, raised as a `LineError`
    naming it) stops the stream after the translations of every line before it, so that an output
    written as it comes ends just before the line named."""
    chunk: list[str] = []
    done = 0  # lines translated before `chunk`

    def flush(chunk: list[str]) -> Iterator[str]:
        failed = None  # the first line that cannot be translated: the lines before it are, then it is named
        while True:  # each try on fewer lines: it ends
            numbers = [done + position + 1 for position, line in enumerate(chunk) if line]
            texts = [line for line in chunk if line]
            try:
                translated = iter(translate_many(texts, numbers) if numbered else translate_many(texts))
                break
            except SentenceError as error:  # name the line, not the place among the window's non-blank lines
                if not 0 <= error.index < len(numbers):
                    raise
                failed = LineError(numbers[error.index], error.reason)
                chunk = chunk[: failed.number - done - 1]
        for line in chunk:
            yield next(translated) if line else ""
        if failed is not None:
            raise failed

    iterator = iter(lines)
    while True:
        try:
            raw = next(iterator)
        except StopIteration:
            break
        except Exception:  # a line that cannot be read (not UTF-8): the lines read before it first
            yield from flush(chunk)
            raise
        chunk.append(one_line(raw))
        if len(chunk) == window:
            yield from flush(chunk)
            done += len(chunk)
            chunk = []
    yield from flush(chunk)


__all__ = [
    "MAX_LINE_BYTES",
    "LineError",
    "SentenceError",
    "after_start_token",
    "checked_sentences",
    "decoded_lines",
    "decoder_start_id",
    "one_line",
    "translate",
    "translate_lines",
    "translate_stream",
]
