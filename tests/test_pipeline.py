"""pipeline("translation") for this model on transformers 5, which removed its own translation pipeline."""

import copy
import json
import logging
import subprocess
import sys
import textwrap

import datasets
import numpy as np
import pytest
import torch
from conftest import logged_messages
from transformers import GenerationConfig, MarianConfig, MarianMTModel, pipeline
from transformers.pipelines.pt_utils import KeyDataset

from tests.conftest import tiny_model
from vanilla_transformer import TranslationPipeline
from vanilla_transformer.tokenization import SPECIAL_TOKENS, train_bpe_tokenizer
from vanilla_transformer.translation import translate

SENTENCES = ["In the beginning, God created the heavens and the earth.", "Jesus wept.", "And God said."]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small model with a real tokenizer, saved; returns folder, model and tokenizer."""
    tokenizer = train_bpe_tokenizer(
        SENTENCES * 10 + ["En el principio crió Dios.", "Y lloró Jesús."] * 10, 99
    )
    model = tiny_model(seed=38)
    folder = tmp_path_factory.mktemp("pipeline") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def test_saved_folder_declares_the_pipeline(saved):
    folder, _, _ = saved
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["custom_pipelines"]["translation"]["impl"]
        == "pipeline_vanilla_transformer.TranslationPipeline"
    )
    assert (folder / "pipeline_vanilla_transformer.py").is_file()


def test_wrapping_a_loaded_model_matches_generate(saved):
    _, model, tokenizer = saved
    translator = TranslationPipeline(model=model, tokenizer=tokenizer)
    single = translator(SENTENCES[0], num_beams=1, max_new_tokens=8)
    assert single == [
        {"translation_text": translate(model, tokenizer, SENTENCES[:1], num_beams=1, max_new_tokens=8)[0]}
    ]
    batched = translator(SENTENCES, batch_size=2, num_beams=3, max_new_tokens=6)
    expected = [translate(model, tokenizer, [s], num_beams=3, max_new_tokens=6)[0] for s in SENTENCES]
    assert batched == [{"translation_text": text} for text in expected]
    # Options given at construction hold for every call, unless a call changes them.
    fixed = TranslationPipeline(model=model, tokenizer=tokenizer, num_beams=1, max_new_tokens=3)
    assert fixed(SENTENCES[0]) == [
        {"translation_text": translate(model, tokenizer, SENTENCES[:1], num_beams=1, max_new_tokens=3)[0]}
    ]
    assert fixed(SENTENCES[0], max_new_tokens=8) == single
    # A call's whole generation config replaces them, as in transformers' pipelines (the construction's
    # max_new_tokens won over it, and generate warned of the two given together).
    from transformers import GenerationConfig

    whole = GenerationConfig(**{**model.generation_config.to_dict(), "num_beams": 1, "max_new_tokens": 8})
    with logged_messages("transformers") as messages:
        assert fixed(SENTENCES[0], generation_config=whole) == single
    assert not any("generation_config" in message for message in messages), messages
    with pytest.raises(ValueError, match="takes a string, a list or tuple of strings"):
        translator(42)
    with pytest.raises(ValueError, match=r"a string or a list of strings: inputs\[1\] is a int"):
        translator([SENTENCES[0], 42])
    with pytest.raises(ValueError, match="empty string"):
        translator("   ")
    with pytest.raises(ValueError, match="empty string"):  # a byte-order mark, a zero-width space: no text
        translator("\ufeff\u200b")
    # In a list: named, before any sentence is translated (it stopped a batch midway, unnamed).
    with pytest.raises(ValueError, match=r"empty string: inputs\[1\] \(and 1 more\) is blank"):
        translator([SENTENCES[0], " ", SENTENCES[1], "\u2060"], batch_size=2)
    assert translator([]) == []  # no sentences: no translations (an IndexError inside transformers once)


def test_a_sentence_is_read_as_the_training_data_reads_it(saved, keeping_spaces_at_the_ends):
    """Training sources are stripped, their line breaks made spaces: a sentence with its line break (a
    file's line) or spaces around it was encoded with word-start tokens that no training source has (by
    this package's tokenizers from before they stripped texts' ends, as here, and by others that keep
    spaces)."""
    _, model, tokenizer = saved
    tokenizer = keeping_spaces_at_the_ends(tokenizer)
    translator = TranslationPipeline(model=model, tokenizer=tokenizer)
    given = [SENTENCES[0] + "\n", "  " + SENTENCES[1] + " \r\n", SENTENCES[2].replace(" ", " \n ", 1)]
    for raw, text in zip(given, SENTENCES, strict=True):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        assert not torch.equal(tokenizer(raw, return_tensors="pt")["input_ids"], ids), raw
        assert torch.equal(translator.preprocess(raw)["input_ids"], ids), raw
    options = {"num_beams": 2, "max_new_tokens": 6, "return_tensors": True}
    expected = [translator(text, **options)[0]["translation_token_ids"] for text in SENTENCES]
    batched = translator(given, batch_size=3, **options)
    assert all(torch.equal(r["translation_token_ids"], e) for r, e in zip(batched, expected, strict=True))


def test_several_translations_per_sentence_stay_with_their_sentence(saved):
    """With batches of 2 and 2 sequences per sentence, the batch's 4 outputs were once handed out one
    per input: the second sentence got the first one's second beam, and the third sentence's were lost."""
    _, model, tokenizer = saved
    translator = TranslationPipeline(model=model, tokenizer=tokenizer)
    options = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 6}
    results = translator(SENTENCES, batch_size=2, **options)
    for sentence, result in zip(SENTENCES, results, strict=True):
        inputs = tokenizer([sentence], return_tensors="pt").to(model.device)  # the pipeline's device
        with torch.inference_mode():
            ids = model.eval().generate(**inputs, **options)
        expected = tokenizer.batch_decode(ids, skip_special_tokens=True)
        assert [r["translation_text"] for r in result] == [t.strip() for t in expected]


def test_a_model_in_training_mode_translates_without_dropout(saved):
    """transformers' pipelines leave the model's mode alone: one handed over from training generated
    with dropout on."""
    _, model, tokenizer = saved
    expected = TranslationPipeline(model=model, tokenizer=tokenizer)(SENTENCES, num_beams=2)
    # The same weights, with dropout (pipelines move a model to the GPU, where there is one).
    noisy = tiny_model(seed=38, dropout=0.5).to(model.device).train()
    noisy.model.encoder.eval()  # a frozen part, as a fine-tuning script may leave it
    assert all(torch.equal(a, b) for a, b in zip(noisy.parameters(), model.parameters(), strict=True))
    assert TranslationPipeline(model=noisy, tokenizer=tokenizer)(SENTENCES, num_beams=2) == expected
    assert noisy.training and noisy.model.decoder.training  # handed back as it came
    assert not noisy.model.encoder.training


def test_translations_in_threads_share_one_eval_mode(saved):
    """Each block recorded the model's mode and put it back: a thread that ended first restored training
    mode (dropout) under another's decoding, and the last left the model in eval mode. `translate` also
    switched the shared fast tokenizer's padding on for its batches, which another thread's call then
    found (unpadded batches, "Unable to create tensor"): it pads with `tokenizer.pad` now."""
    from concurrent.futures import ThreadPoolExecutor

    from vanilla_transformer.pipeline_vanilla_transformer import evaluation_mode

    _, model, tokenizer = saved
    noisy = tiny_model(seed=38, dropout=0.5).to(model.device).train()
    noisy.model.encoder.eval()
    first, second = evaluation_mode(noisy), evaluation_mode(noisy)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # blocks that end out of order, as threads' do
    assert not noisy.training and not noisy.model.decoder.training
    second.__exit__(None, None, None)
    assert noisy.training and noisy.model.decoder.training and not noisy.model.encoder.training

    expected = translate(model, tokenizer, SENTENCES, num_beams=2, max_new_tokens=6)
    assert tokenizer.backend_tokenizer.padding is None  # left as every thread's call expects it
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda _: translate(noisy, tokenizer, SENTENCES, num_beams=2, max_new_tokens=6), range(8)
            )
        )
    assert results == [expected] * 8
    assert noisy.training and noisy.model.decoder.training and not noisy.model.encoder.training


def test_pipeline_task_by_name_from_the_folder(saved):
    folder, model, tokenizer = saved
    # On the fixture model's device (a GPU, once a pipeline has put it there), so that outputs compare.
    translator = pipeline("translation", model=str(folder), trust_remote_code=True, device=model.device)
    expected = translate(model, tokenizer, SENTENCES, num_beams=2, max_new_tokens=5)
    assert translator(SENTENCES, num_beams=2, max_new_tokens=5) == [{"translation_text": t} for t in expected]
    # Without a task: the folder declares one pipeline, which transformers picks.
    untasked = pipeline(model=str(folder), trust_remote_code=True, device=model.device)
    assert untasked(SENTENCES, num_beams=2, max_new_tokens=5) == [{"translation_text": t} for t in expected]
    # With the package imported, its own classes, and no code run from the folder.
    native = pipeline(
        "translation", model=str(folder), pipeline_class=TranslationPipeline, device=model.device
    )
    assert type(native.model).__module__ == "vanilla_transformer.modeling_vanilla_transformer"
    assert native(SENTENCES, num_beams=2, max_new_tokens=5) == [{"translation_text": t} for t in expected]
    # A loaded model: transformers 5 refuses the removed task before it looks anything up (there is no
    # folder's custom_pipelines to read), so `TranslationPipeline(model=..., tokenizer=...)` is the way.
    with pytest.raises(KeyError, match="removed"):
        pipeline("translation", model=model, tokenizer=tokenizer)


def test_pipeline_without_the_package_installed(saved, tmp_path):
    folder, model, tokenizer = saved
    expected = translate(model, tokenizer, SENTENCES, num_beams=4, max_new_tokens=7)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["vanilla_transformer"] = None
        from transformers import pipeline
        device = {str(model.device)!r}  # the fixture model's, which computes the expected outputs
        translator = pipeline("translation", model={str(folder)!r}, trust_remote_code=True, device=device)
        assert type(translator).__module__.startswith("transformers_modules"), type(translator).__module__
        print(json.dumps([translator(SENTENCE, max_new_tokens=7) for SENTENCE in {SENTENCES!r}]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    assert outputs == [[{"translation_text": text}] for text in expected]  # default: beam 4


def test_streams_translate_lazily_and_name_an_item_that_cannot_be_translated(saved):
    """A dataset or a generator, the documented way to feed a pipeline, was refused: "takes a string or a
    list of strings"."""
    _, model, tokenizer = saved
    translator = TranslationPipeline(model=model, tokenizer=tokenizer, num_beams=1, max_new_tokens=5)
    expected = [translator(sentence) for sentence in SENTENCES]  # one `[{"translation_text": ...}]` each
    dataset = datasets.Dataset.from_dict({"en": SENTENCES})
    for stream in (KeyDataset(dataset, "en"), (sentence for sentence in SENTENCES), iter(SENTENCES)):
        results = translator(stream, batch_size=2)
        assert not isinstance(results, list)  # an iterator, translating as it is read
        assert list(results) == expected
    assert list(translator(iter([]))) == []

    # Each item is checked as it is reached: what comes before a bad one is translated; it is named.
    read = []

    def sentences():
        for sentence in [*SENTENCES, 42]:
            read.append(sentence)
            yield sentence

    results = translator(sentences())
    assert next(results) == expected[0]
    assert len(read) < len(SENTENCES)  # not read ahead
    assert [next(results), next(results)] == expected[1:]
    with pytest.raises(ValueError, match=r"translates strings: inputs\[3\] is a int"):
        next(results)
    blanks = KeyDataset(datasets.Dataset.from_dict({"en": [*SENTENCES[:2], "  ", SENTENCES[2]]}), "en")
    results = translator(blanks, batch_size=2)
    assert [next(results), next(results)] == expected[:2]
    with pytest.raises(ValueError, match=r"Cannot translate an empty string: inputs\[2\] is blank"):
        next(results)
    with pytest.raises(ValueError, match=r"got a Column\. Stream a dataset's column with KeyDataset"):
        translator(dataset["en"])


def test_truncation_cuts_sources_at_the_tokenizers_maximum(saved, caplog):
    """`truncation=True` reached `generate`, which refused it as an unused model argument."""
    _, model, tokenizer = saved
    source = SENTENCES[0]
    short = copy.deepcopy(tokenizer)
    short.model_max_length = 4
    cut = short(source, truncation=True, return_tensors="pt").to(model.device)
    assert cut["input_ids"].shape == (1, 4) and len(tokenizer(source)["input_ids"]) > 4
    assert cut["input_ids"][0, -1] == short.eos_token_id  # the end token is kept
    with torch.inference_mode():
        ids = model.eval().generate(
            input_ids=cut["input_ids"], attention_mask=cut["attention_mask"], num_beams=1, max_new_tokens=6
        )
    expected = [{"translation_text": short.decode(ids[0], skip_special_tokens=True).strip()}]
    translator = TranslationPipeline(model=model, tokenizer=short, num_beams=1, max_new_tokens=6)
    assert translator(source, truncation=True) == expected
    assert translator([source], truncation="longest_first") == expected
    assert (
        TranslationPipeline(model=model, tokenizer=short, truncation=True, max_new_tokens=6)(
            source, num_beams=1
        )
        == expected
    )
    uncut = translate(model, tokenizer, [source], num_beams=1, max_new_tokens=6)
    assert translator(source) == [{"translation_text": uncut[0]}]

    # No maximum (this package's tokenizers; the model has none): nothing is cut, and that is said once.
    plain = TranslationPipeline(model=model, tokenizer=tokenizer, num_beams=1, max_new_tokens=6)
    with caplog.at_level(logging.WARNING, logger="vanilla_transformer.pipeline_vanilla_transformer"):
        assert plain(source, truncation=True) == plain(source, truncation=True) == plain(source)
    said = [record.getMessage() for record in caplog.records if "cuts nothing" in record.getMessage()]
    assert len(said) == 1 and "tokenizer.model_max_length" in said[0]
    with pytest.raises(ValueError, match="truncation must be True, False or one of"):
        plain(source, truncation="sometimes")


def test_token_ids_returned_as_transformers_4_did(saved):
    """`return_tensors=True` (and `return_text`) reached `generate`, which refused them."""
    _, model, tokenizer = saved
    translator = TranslationPipeline(model=model, tokenizer=tokenizer, num_beams=1, max_new_tokens=8)
    alone = [translator(sentence, return_tensors=True)[0]["translation_token_ids"] for sentence in SENTENCES]
    assert all(isinstance(ids, torch.Tensor) for ids in alone)
    with torch.inference_mode():
        first = model.eval().generate(
            **tokenizer([SENTENCES[0]], return_tensors="pt", return_token_type_ids=False).to(model.device),
            num_beams=1,
            max_new_tokens=8,
        )
    assert alone[0].tolist() == first[0].tolist()

    # An end token that stops some translations sooner than others: in a batch, those that end first
    # are padded by `generate`; the ids returned stop at their end token, as they do translated alone.
    def up_to(ids, end):
        found = (ids[1:] == end).nonzero()
        return ids[: found[0].item() + 2] if len(found) else ids

    ends = [
        t
        for t in sorted({t for ids in alone for t in ids[1:].tolist()})
        if len({len(up_to(ids, t)) for ids in alone}) > 1
    ]
    assert ends, "no token ends the translations at different lengths"
    options = {"eos_token_id": [tokenizer.eos_token_id, ends[0]], "batch_size": 3}
    batched = translator(SENTENCES, return_tensors=True, **options)
    assert [set(result) for result in batched] == [{"translation_token_ids"}] * len(SENTENCES)
    assert [r["translation_token_ids"].tolist() for r in batched] == [
        up_to(ids, ends[0]).tolist() for ids in alone
    ]

    both = translator(SENTENCES, return_tensors=True, return_text=True, **options)
    assert [r["translation_token_ids"].tolist() for r in both] == [
        r["translation_token_ids"].tolist() for r in batched
    ]
    assert [r["translation_text"] for r in both] == [
        tokenizer.decode(r["translation_token_ids"], skip_special_tokens=True).strip() for r in both
    ]
    assert [r["translation_text"] for r in both] == [
        r["translation_text"] for r in translator(SENTENCES, **options)
    ]
    fixed = TranslationPipeline(model=model, tokenizer=tokenizer, return_tensors=True, max_new_tokens=8)
    assert set(fixed(SENTENCES[0], num_beams=1, return_text=True)[0]) == {
        "translation_text",
        "translation_token_ids",
    }
    with pytest.raises(ValueError, match="leaves nothing to return"):
        translator(SENTENCES[0], return_text=False)
    assert translator(SENTENCES[0], clean_up_tokenization_spaces=False) == translator(SENTENCES[0])


def generated_alone(model, tokenizer, sentence: str, **options) -> list[int]:
    """A sentence's ids as `generate` gives them alone: no batch, no padding after its end token."""
    inputs = tokenizer([sentence], return_tensors="pt", return_token_type_ids=False).to(model.device)
    with torch.inference_mode():
        return model.generate(**inputs, **options)[0].tolist()


def uneven_end_token(generated: list[list[int]]) -> int:
    """A token that, as an end token, stops these generated ids at different lengths (a batch then pads
    the shorter ones)."""
    return next(
        t
        for t in sorted({t for ids in generated for t in ids[1:]})
        if len({ids.index(t) if t in ids[1:] else len(ids) for ids in generated}) > 1
    )


def test_a_generation_config_given_ends_token_ids_where_generate_ends_them(saved):
    """`generate` fills a given generation config's unset fields (the end and padding tokens of a
    `GenerationConfig(num_beams=2, ...)`) from the model's; the pipeline read them from the given config
    alone, so it knew no end token and returned a batch's ids with the padding after it."""
    _, model, tokenizer = saved
    model = copy.deepcopy(model)
    options = {"num_beams": 1, "max_new_tokens": 8}
    # A second end token that stops the translations at different lengths, in the model's config.
    end = uneven_end_token([generated_alone(model, tokenizer, s, **options) for s in SENTENCES])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end]
    given = GenerationConfig(**options)  # no end or padding token of its own
    expected = [generated_alone(model, tokenizer, s, generation_config=given) for s in SENTENCES]
    assert len({len(ids) for ids in expected}) > 1  # some are padded in a batch
    translator = TranslationPipeline(model=model, tokenizer=tokenizer)
    batched = translator(SENTENCES, generation_config=given, batch_size=3, return_tensors=True)
    assert [result["translation_token_ids"].tolist() for result in batched] == expected


def test_an_end_token_given_as_a_numpy_integer_ends_token_ids_as_an_int_does(saved):
    """`generate` takes an `eos_token_id` that is a NumPy integer (or a 0-d array) as it takes an int;
    the pipeline, reading the end tokens to cut each sentence's ids, raised "'numpy.int64' object is not
    iterable" after generating. Reference: each sentence generated alone with the int."""
    _, model, tokenizer = saved
    options = {"num_beams": 1, "max_new_tokens": 8}
    end = uneven_end_token([generated_alone(model, tokenizer, s, **options) for s in SENTENCES])
    expected = [generated_alone(model, tokenizer, s, eos_token_id=end, **options) for s in SENTENCES]
    assert len({len(ids) for ids in expected}) > 1
    translator = TranslationPipeline(model=model, tokenizer=tokenizer)
    for given in (np.int64(end), np.array(end), np.array([end]), torch.tensor(end)):
        batched = translator(SENTENCES, eos_token_id=given, batch_size=3, return_tensors=True, **options)
        assert [result["translation_token_ids"].tolist() for result in batched] == expected, given


def test_generate_returning_a_dictionary_translates_as_without(saved):
    """`return_dict_in_generate=True` (with `output_scores=True`, as one asks for scores) ended the
    pipeline with "AttributeError: 'GenerateEncoderDecoderOutput' object has no attribute 'shape'"."""
    _, model, tokenizer = saved
    translator = TranslationPipeline(model=model, tokenizer=tokenizer, max_new_tokens=6)
    for beams in (1, 2):
        expected = translator(SENTENCES, num_beams=beams, batch_size=2)
        options = {"return_dict_in_generate": True, "output_scores": True}
        assert translator(SENTENCES, num_beams=beams, batch_size=2, **options) == expected


def test_stop_sequences_and_return_type_as_transformers_pipelines_take_them(saved):
    """`stop_sequence` and transformers 4's `return_type` reached `generate`, which called them unused
    model arguments."""
    _, model, _ = saved
    # transformers' stop strings need a vocabulary that spells "abcdef" (it decodes each token after it).
    texts = SENTENCES * 10 + ["En el principio crió Dios.", "Y lloró Jesús.", "a b c d e f"] * 10
    tokenizer = train_bpe_tokenizer(texts, model.config.vocab_size)
    translator = TranslationPipeline(model=model, tokenizer=tokenizer, num_beams=1, max_new_tokens=8)
    alone = [translator(s, return_tensors=True)[0]["translation_token_ids"].tolist() for s in SENTENCES]
    pieces = [tokenizer.decode([token]) for token in alone[1]]
    stop = next(piece for piece in pieces[2:-1] if piece.strip() and piece != pieces[1])  # a later word
    end = pieces.index(stop) + 1
    assert all(stop not in tokenizer.decode(ids) for ids in (alone[0], alone[2])), "pick another sentence"
    for stop_sequence in (stop, [stop, "never generated"]):
        batched = translator(SENTENCES, stop_sequence=stop_sequence, batch_size=3, return_tensors=True)
        ids = [result["translation_token_ids"].tolist() for result in batched]
        # The row stopped there, without the padding the batch gives it; the others as they were.
        assert ids == [alone[0], alone[1][:end], alone[2]]
    text = translator(SENTENCES[1], stop_sequence=stop)[0]["translation_text"]
    assert text == tokenizer.decode(alone[1][:end], skip_special_tokens=True).strip() and text.endswith(stop)
    with pytest.raises(ValueError, match="stop_sequence must be a non-empty string"):
        translator(SENTENCES[1], stop_sequence="")
    # A vocabulary of another script: "ValueError: substring not found" from inside transformers.
    cyrillic = ["Вначале сотворил Бог небо и землю.", "Иисус прослезился.", "И сказал Бог."] * 10
    other = TranslationPipeline(model=model, tokenizer=train_bpe_tokenizer(cyrillic, 99), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"stop_sequence cannot be matched with this tokenizer: .*'<unk>"):
        other(cyrillic[0], stop_sequence="Бог")
    with pytest.raises(ValueError, match="stop_sequence cannot be matched"):  # as generate's keyword too
        other(cyrillic[0], stop_strings=["Бог"])
    assert other(cyrillic[0])[0]["translation_text"] is not None
    # A byte-level vocabulary is read byte by byte, without the letters: it matches.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        cyrillic, trainers.BpeTrainer(vocab_size=99, special_tokens=list(SPECIAL_TOKENS))
    )
    bytewise = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    assert "abcdef" not in bytewise.decode(bytewise("abcdef")["input_ids"])
    assert isinstance(
        TranslationPipeline(model=model, tokenizer=bytewise, max_new_tokens=4)(
            cyrillic[0], stop_sequence="Бог"
        )[0]["translation_text"],
        str,
    )

    from transformers.pipelines.text_generation import ReturnType

    only_ids = translator(SENTENCES[1], return_type=ReturnType.TENSORS)[0]
    assert (
        set(only_ids) == {"translation_token_ids"} and only_ids["translation_token_ids"].tolist() == alone[1]
    )
    for kind in (ReturnType.NEW_TEXT, "TEXT"):
        assert translator(SENTENCES[1], return_type=kind) == translator(SENTENCES[1])
    with pytest.raises(ValueError, match=r"ReturnType\.TENSORS \(the token ids\) or ReturnType\.NEW_TEXT "):
        translator(SENTENCES[1], return_type=ReturnType.FULL_TEXT)
    with pytest.raises(ValueError, match="Give return_type, or return_tensors and return_text, not both"):
        translator(SENTENCES[1], return_type=ReturnType.TENSORS, return_text=True)
    # Given at construction, a call's return_tensors=False gives the text again (an error named a
    # return_text=False the caller never gave).
    ids_only = TranslationPipeline(
        model=model, tokenizer=tokenizer, num_beams=1, max_new_tokens=8, return_type="TENSORS"
    )
    assert ids_only(SENTENCES[1], return_tensors=False) == translator(SENTENCES[1])


def test_language_codes_are_refused_clearly(saved):
    """They reached `generate`, which called them unused model arguments, perhaps typos."""
    _, model, tokenizer = saved
    translator = TranslationPipeline(model=model, tokenizer=tokenizer)
    for option in ({"src_lang": "en"}, {"tgt_lang": "es"}):
        with pytest.raises(ValueError, match="takes no language codes"):
            translator(SENTENCES[0], **option)
        with pytest.raises(ValueError, match="takes no language codes"):
            TranslationPipeline(model=model, tokenizer=tokenizer, **option)
    # A multilingual tokenizer (NLLB's, M2M100's, mBART's) takes them: the message said that the model
    # translates one language pair.
    import copy

    multilingual = copy.deepcopy(tokenizer)
    multilingual._build_translation_inputs = lambda *args, **kwargs: None
    with pytest.raises(ValueError, match="for a multilingual model set the tokenizer's src_lang and give"):
        TranslationPipeline(model=model, tokenizer=multilingual)(SENTENCES[0], src_lang="eng_Latn")


def test_loading_a_folder_with_the_package_imported_overwrites_nothing(saved, tmp_path):
    """Importing the package registered "translation" with transformers, a task transformers 5 refuses
    before consulting its registry; each folder's copy of the pipeline registered it again when loaded,
    with a warning that the pipeline was being overwritten."""
    _, model, tokenizer = saved
    # A folder name of its own: transformers runs a folder's code once a process for a name and content.
    folder = tmp_path / f"model_{tmp_path.name}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with logged_messages("transformers") as messages:
        translator = pipeline("translation", model=str(folder), trust_remote_code=True, device=model.device)
    assert not [message for message in messages if "already registered" in message], messages
    expected = translate(model, tokenizer, SENTENCES[:1], num_beams=1, max_new_tokens=5)
    assert translator(SENTENCES[0], num_beams=1, max_new_tokens=5) == [{"translation_text": expected[0]}]


def test_the_pipeline_saves_a_folder_that_translates_with_any_seq2seq_model(saved, tmp_path):
    """`TranslationPipeline(...).save_pretrained` declares itself and copies its code, also for a model
    whose own `save_pretrained` does not (a MarianMTModel)."""
    _, _, tokenizer = saved
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=99,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    marian = MarianMTModel(config).eval()
    translator = TranslationPipeline(model=marian, tokenizer=tokenizer, num_beams=1, max_new_tokens=5)
    expected = translator(SENTENCES)
    translator.save_pretrained(tmp_path / "marian")
    assert "custom_pipelines" not in marian.config.to_dict()  # the model in memory is left as it was
    saved_config = json.loads((tmp_path / "marian" / "config.json").read_text())
    assert (
        saved_config["custom_pipelines"]["translation"]["impl"]
        == "pipeline_vanilla_transformer.TranslationPipeline"
    )
    loaded = pipeline(
        "translation", model=str(tmp_path / "marian"), trust_remote_code=True, device=marian.device
    )
    assert type(loaded).__module__.startswith("transformers_modules")  # the folder's copy
    assert type(loaded.model) is MarianMTModel
    assert loaded(SENTENCES, num_beams=1, max_new_tokens=5) == expected
