"""A joint source-target BPE vocabulary (paper Section 5.1: "shared source-target vocabulary").

Trained with the `tokenizers` library and wrapped as a transformers fast tokenizer, so that
`AutoTokenizer.from_pretrained(model_folder)` loads it next to the model.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Order fixes the ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, the defaults of VanillaTransformerConfig.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Characters kept in the vocabulary even when the training text lacks them.
BASE_ALPHABET = list("0123456789.,;:!?¡¿'\"«»“”‘’()[]-–—/&%")


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, length: int | None = None
) -> PreTrainedTokenizerFast:
    """Learn one BPE vocabulary from source and target sentences together.

    Text is NFKC-normalised, every whitespace character made a space (a tab between two words was a
    character of its own, `<unk>` where training text had none, and the next word lost its word-start
    marker: two words read and translated as one) and the ends stripped (as the training data's
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
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()]
    )
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=BASE_ALPHABET,
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


__all__ = ["SPECIAL_TOKENS", "train_bpe_tokenizer"]
