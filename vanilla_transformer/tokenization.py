"""A joint source-target BPE vocabulary (paper Section 5.1: "shared source-target vocabulary").

Trained with the `tokenizers` library and wrapped as a transformers fast tokenizer, so that
`AutoTokenizer.from_pretrained(model_folder)` loads it next to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Order fixes the ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, the defaults of VanillaTransformerConfig.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Characters kept in the vocabulary even when the training text lacks them.
BASE_ALPHABET = list("0123456789.,;:!?¡¿'\"«»“”‘’()[]-–—/&%")
# The longest token (in characters, the word-start marker included) BPE training may merge. It bounds
# how much text a token covers, so that a text's length alone can show it is over a token limit
# (`length_check`). Far above what natural text gives: the embedded corpus's longest at 4,000 and
# 16,000 types are 14 and 16 characters.
MAX_TOKEN_CHARACTERS = 32
# `length_check` normalises and pre-tokenizes a long text this many characters at a time, stopping once
# it is surely over: a text whole cost about 64 bytes a character (a 50 MB line, over 3 GB). Each piece's
# count is lowered by LENGTH_CHECK_SLACK for what a cut can add with this package's normalizer and
# pre-tokenizer (a word-start marker, an accent composed across it), so that the pieces together never
# count more than the whole text. Only with those: another tokenizer's normalizer may delete a match of
# any length (a Replace of `<[^>]*>` with ""), which a cut through it leaves counted.
LENGTH_CHECK_CHUNK = 1 << 16
LENGTH_CHECK_SLACK = 4


def text_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Words with a word-start marker (Metaspace), split before and after punctuation."""
    return pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])


def text_normalizer(*, runs: bool = True) -> normalizers.Normalizer:
    """NFKC, each run of whitespace characters one space, the ends stripped (see `train_bpe_tokenizer`);
    with `runs=False`, each whitespace character a space, as tokenizers trained before 2026-12-07 read
    text (`length_check` knows both)."""
    spaces = Regex(r"\s+" if runs else r"\s")
    return normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(spaces, " "), normalizers.Strip()])


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, length: int | None = None
) -> PreTrainedTokenizerFast:
    """Learn one BPE vocabulary from source and target sentences together.

    Text is NFKC-normalised, every run of whitespace made one space (a tab between two words was a
    character of its own, `<unk>` where training text had none, and the next word lost its word-start
    marker: two words read and translated as one; a second space was a word-start token of its own,
    which no training sentence has, and two spaces after a full stop changed most translations of a
    model called with the tokenizer's own output) and the ends stripped (as the training data's
    sentences are: a line's line break, or spaces around a sentence, were word-start tokens that no
    training sentence has, and changed its translation), then split on spaces with a word-boundary marker
    (Metaspace) and before and after punctuation, so that decoding restores the original spacing.
    Every encoded sequence ends with `</s>`; the decoder starts from `<s>`. The special tokens'
    spellings in text ("<s>", "</s>" as HTML's strikethrough, say) are text, not those tokens
    (`split_special_tokens`, saved with the tokenizer): otherwise a sentence would end, or a token
    vanish from it, where one stands. A character that no training text has, nor `BASE_ALPHABET`, is
    `<unk>` (one per character; there is no byte fallback), which decoding with `skip_special_tokens`
    drops: a model reads it as an unknown token and never writes that character.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}."
        )
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = text_normalizer()
    tokenizer.pre_tokenizer = text_pre_tokenizer()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=BASE_ALPHABET,
        max_token_length=MAX_TOKEN_CHARACTERS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    eos_id = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        split_special_tokens=True,
    )


def characters_per_token(tokenizer: Any) -> tuple[int, Any, Any, frozenset[str] | None] | None:
    """The most characters one token of `tokenizer` covers, its normalizer and its pre-tokenizer (each
    None where it has none), and the characters sure to be encoded (None: all of them), where its
    vocabulary bounds that: a fast tokenizer whose model is BPE without `fuse_unk` (an unknown character
    is a token of its own, as is a character split into byte tokens). Without an unknown token (the
    `tokenizers` library's default for BPE) a character the vocabulary lacks is dropped, not encoded: only
    those the vocabulary has as tokens of their own count (all of a byte-level tokenizer's). None where
    nothing bounds it: a slow tokenizer, WordPiece (a word it cannot split is one unknown token however
    long), Unigram, BPE that fuses a run of unknown characters into one token, and a tokenizer with added
    tokens other than special ones (split off before pre-tokenization, one covers more of the
    pre-tokenized text than its own length: a byte-level "ж" is two characters; special tokens are text,
    as the pipeline encodes with `split_special_tokens=True`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return None
    model = backend.model
    if not isinstance(model, models.BPE) or model.fuse_unk:
        return None
    if not all(token.special for token in backend.get_added_tokens_decoder().values()):
        return None
    vocabulary = tokenizer.get_vocab()
    known = None
    if model.unk_token is None:
        prefix, suffix = model.continuing_subword_prefix or "", model.end_of_word_suffix or ""
        known = frozenset(
            token
            for token in vocabulary
            if len(token) == 1
            and all(form in vocabulary for form in (prefix + token, token + suffix, prefix + token + suffix))
        )
    return max(len(token) for token in vocabulary), backend.normalizer, backend.pre_tokenizer, known


def length_check(max_length: int, tokenizer: Any = None) -> Callable[[Sequence[str]], list[bool]] | None:
    """A function that says, for each of a list of texts, whether it surely encodes to more than
    `max_length` tokens, judged from its length without encoding it: a text of millions of characters
    (a corrupted line) takes gigabytes to encode, and minutes to train BPE on. With `tokenizer` (see
    `characters_per_token`, read once here; None where that gives no bound: nothing can be judged), or
    for any tokenizer `train_bpe_tokenizer` trains.

    Never True for a text that fits: a token covers at most the bound's characters of what the
    pre-tokenizer makes of the normalised text, so a text whose pieces have more than `max_length` times
    that many (of the characters sure to be encoded) is over the limit. Only a text longer than that as
    given is normalised and pre-tokenized to be judged; one that normalising lengthens (NFKC: a
    ligature, three letters) is caught only if it was that long already, and otherwise left to the
    length filter after encoding. With this package's normalizer and pre-tokenizer (any tokenizer
    `train_bpe_tokenizer` trains), a text longer than LENGTH_CHECK_CHUNK is judged a piece at a time, in
    bounded memory; with others, whole."""
    known = None
    if tokenizer is None:
        per_token, normalizer, pre_tokenizer = MAX_TOKEN_CHARACTERS, text_normalizer(), text_pre_tokenizer()
    else:
        bound = characters_per_token(tokenizer)
        if bound is None:
            return None
        per_token, normalizer, pre_tokenizer, known = bound
    limit = max_length * per_token
    in_pieces = tokenizer is None or (
        normalizer is not None
        and pre_tokenizer is not None
        and normalizer.__getstate__() in {text_normalizer(runs=r).__getstate__() for r in (True, False)}
        and pre_tokenizer.__getstate__() == text_pre_tokenizer().__getstate__()
    )

    def counted(text: str) -> int:  # characters sure to be encoded, after normalising and pre-tokenizing
        pieces = text if normalizer is None else normalizer.normalize_str(text)
        if pre_tokenizer is not None:
            pieces = "".join(piece for piece, _ in pre_tokenizer.pre_tokenize_str(pieces))
        dropped = 0 if known is None else sum(pieces.count(c) for c in set(pieces) - known)
        return len(pieces) - dropped

    def over(text: str) -> bool:
        if len(text) <= limit:
            return False
        chunk = LENGTH_CHECK_CHUNK
        if len(text) <= chunk or not in_pieces:
            return counted(text) > limit
        total = 0
        for start in range(0, len(text), chunk):
            total += counted(text[start : start + chunk]) - LENGTH_CHECK_SLACK
            if total > limit:
                return True
        return False

    return lambda texts: [over(text) for text in texts]


__all__ = [
    "MAX_TOKEN_CHARACTERS",
    "SPECIAL_TOKENS",
    "characters_per_token",
    "length_check",
    "train_bpe_tokenizer",
]
