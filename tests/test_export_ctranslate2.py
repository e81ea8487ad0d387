"""The CTranslate2 export translates token for token like `generate()` (float32), and int8 stays close.

The reference is this package's own `generate()` with the paper's decoding (beam 4, length penalty 0.6,
each source's length + 50); CTranslate2 is an independent implementation of the same network and search.
"""

import json
import math
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers.activations import ACT2FN

from tests.conftest import TINY_TERMS, assert_same_up_to_rounding, tiny_config
from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.export_ctranslate2 import (
    SETTINGS_FILE,
    CTranslate2Translator,
    check_exportable,
    check_replaceable_export,
    export_ctranslate2,
    uncarried_generation_settings,
)
from vanilla_transformer.metrics import score_translations
from vanilla_transformer.tokenization import train_bpe_tokenizer
from vanilla_transformer.translation import SentenceError, translate

ctranslate2 = pytest.importorskip("ctranslate2")

VARIANTS = {
    "paper": {},
    # A large layer-norm epsilon: at the default 1e-5 an export that dropped it (CTranslate2's 1e-6)
    # gave the same tokens.
    "pre-LN, untied output, concatenated positions, logits bias, layer-norm epsilon 0.1, attention biases": {
        "attention_bias": True,
        "norm_first": True,
        "tie_word_embeddings": False,
        "position_encoding_layout": "concatenated",
        "add_final_logits_bias": True,
        "layer_norm_eps": 0.1,
    },
    # Separate embedding matrices over one vocabulary: each stack exports its own (they were refused as
    # "separate vocabularies").
    "separate embedding matrices": {"share_encoder_decoder_embeddings": False},
}


@pytest.fixture(scope="module")
def corpus():
    return load_default_corpus()


def trained_folder(path, corpus, steps: int = 40, **overrides):
    """A tiny model trained for `steps` updates on real pairs (a few dozen: peaked, non-trivial
    predictions)."""
    pairs = corpus["train"].select(range(256))
    tokenizer = train_bpe_tokenizer(list(pairs["en"]) + list(pairs["es"]), 400)
    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        **overrides,
    )
    model = VanillaTransformerForConditionalGeneration(config)
    if model.final_logits_bias is not None:
        with torch.no_grad():
            model.final_logits_bias.normal_(0, 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for step in range(steps):
        rows = range(32 * (step % 8), 32 * (step % 8 + 1))
        batch = tokenizer(
            [pairs["en"][i] for i in rows],
            text_target=[pairs["es"][i] for i in rows],
            padding=True,
            return_tensors="pt",
        )
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
        batch.pop("token_type_ids", None)
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.generation_config.length_penalty = 0.6  # the paper's, as the training script sets it
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def scored_pairs(tokenizer, corpus) -> tuple[list[list[str]], list[list[str]]]:
    """Four test sources (with their end token) and the first 12 tokens of their targets, as tokens."""
    pairs = corpus["test"].select(range(4))
    sources = [tokenizer.tokenize(s, add_special_tokens=True) for s in pairs["en"]]
    return sources, [tokenizer.tokenize(t)[:12] for t in pairs["es"]]


def teacher_forced_log_probs(model, tokenizer, sources, targets) -> torch.Tensor:
    """The model's log-probability of each target token and of the end token after them, as a forward with
    the targets given (each pair alone)."""
    rows = []
    for source, target in zip(sources, targets, strict=True):
        labels = [*tokenizer.convert_tokens_to_ids(target), tokenizer.eos_token_id]
        start = model.generation_config.decoder_start_token_id
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([tokenizer.convert_tokens_to_ids(source)]),
                decoder_input_ids=torch.tensor([[start, *labels[:-1]]]),
            ).logits[0]
        rows.append(logits.log_softmax(-1)[torch.arange(len(labels)), labels])
    return torch.cat(rows)


def assert_same_log_probs(model, tokenizer, export, corpus) -> torch.Tensor:
    """CTranslate2's scores of given targets (`score_batch`) equal the model's to float32 rounding: tokens
    alone would not show an error of 1e-3 in a log-probability. Returns the model's."""
    sources, targets = scored_pairs(tokenizer, corpus)
    engine = ctranslate2.Translator(str(export), intra_threads=2)
    got = torch.cat([torch.tensor(result.log_probs) for result in engine.score_batch(sources, targets)])
    expected = teacher_forced_log_probs(model, tokenizer, sources, targets)
    assert_same_up_to_rounding(got, expected, TINY_TERMS)
    return expected


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_export_generates_the_same_tokens(tmp_path, corpus, variant):
    model, tokenizer = trained_folder(tmp_path / "model", corpus, **VARIANTS[variant])
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=256)
    assert_same_log_probs(model, tokenizer, tmp_path / "ct2", corpus)
    engine = ctranslate2.Translator(str(tmp_path / "ct2"), intra_threads=2)
    settings = json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())
    length_penalty = settings["length_penalty"]
    assert length_penalty == model.generation_config.length_penalty == 0.6
    assert settings["not_carried"] == []  # a trained folder's decoding is carried whole
    sources = [s for s in corpus["test"]["en"][:40]]
    inputs = tokenizer(sources[:8], padding=True, return_tensors="pt")  # mixed lengths, padded
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 4
    tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(sources[:8])["input_ids"]]
    for beams in (1, 4):
        with torch.inference_mode():
            generated = model.generate(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], num_beams=beams
            )
        for row, source in enumerate(tokens):
            # One sentence at a time: CTranslate2 takes one length limit per call (the paper's: its
            # own length + 50; generate() counts the end token as one of them).
            result = engine.translate_batch(
                [source], beam_size=beams, length_penalty=length_penalty, max_decoding_length=len(source) + 50
            )[0]
            expected = [
                t
                for t in generated[row, 1:].tolist()
                if t not in (tokenizer.pad_token_id, tokenizer.eos_token_id)
            ]
            assert tokenizer.convert_tokens_to_ids(result.hypotheses[0]) == expected, (beams, row)
        # The translator applies the same rules to a whole list (grouped by source length).
        ours = translate(model, tokenizer, sources, num_beams=beams, batch_size=16)
        theirs = CTranslate2Translator(tmp_path / "ct2", intra_threads=2).translate(sources, num_beams=beams)
        assert theirs == ours
    assert sum(len(text.split()) for text in ours) > 40  # non-trivial outputs, not all empty


def test_decoding_settings_the_export_drops_are_named():
    """A converted OPUS-MT model's generation config forbids the pad token and forces the end token at
    its length limit; exported, neither holds, so the export names them (warning and settings file)."""
    from transformers import GenerationConfig

    opus_mt = GenerationConfig(
        bad_words_ids=[[58100]], max_length=512, forced_eos_token_id=0, renormalize_logits=True, num_beams=4
    )
    assert uncarried_generation_settings(opus_mt) == [
        "bad_words_ids",
        "forced_eos_token_id",
        "renormalize_logits",
    ]  # its max_length is carried (test_a_fixed_length_limit_is_carried)
    neutral = GenerationConfig(num_beams=4, length_penalty=0.6, min_length=0, repetition_penalty=1.0)
    assert uncarried_generation_settings(neutral) == []
    # Each of these changed a small trained model's greedy translations (all six sentences, or the one
    # repeating its source, for the encoder n-grams), and the export left them out without a word.
    others = GenerationConfig(
        encoder_no_repeat_ngram_size=1,
        sequence_bias={(5,): -10.0},
        exponential_decay_length_penalty=(2, 1.5),
        watermarking_config={"bias": 5.0},
    )
    assert uncarried_generation_settings(others) == [
        "encoder_no_repeat_ngram_size",
        "sequence_bias",
        "exponential_decay_length_penalty",
        "watermarking_config",
    ]
    off = GenerationConfig(encoder_no_repeat_ngram_size=0, sequence_bias={}, suppress_tokens=[])
    assert uncarried_generation_settings(off) == []


def test_what_cannot_be_exported_is_refused_with_the_reason(tmp_path, corpus):
    with pytest.raises(ValueError, match="separate source and target vocabularies"):
        check_exportable(tiny_config(share_encoder_decoder_embeddings=False, decoder_vocab_size=50))
    # Separate matrices of one size: one vocabulary, unless the tokenizer has two (MarianTokenizer's
    # `separate_vocabs`) or is not there to tell.
    unshared = tiny_config(share_encoder_decoder_embeddings=False)
    check_exportable(unshared, SimpleNamespace(separate_vocabs=False))
    for tokenizer in (None, SimpleNamespace(separate_vocabs=True)):
        with pytest.raises(ValueError, match="separate source and target vocabularies"):
            check_exportable(unshared, tokenizer)
    with pytest.raises(ValueError, match="activation 'mish'"):
        check_exportable(tiny_config(activation_function="mish"))
    trained_folder(tmp_path / "model", corpus)
    with pytest.raises(ValueError, match="quantization must be one of"):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2", quantization="int3")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"a-file/ct2 cannot be written: .* is a file"):  # before loading
        export_ctranslate2(tmp_path / "nowhere", tmp_path / "a-file" / "ct2")
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=8)
    assert json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())["max_positions"] == 8
    # No start token at all (a bos_token_id alone left unset is a MarianConfig's, and exports: the decoder
    # start token serves): what to set, where.
    saved = {
        name: (tmp_path / "model" / name).read_text() for name in ("config.json", "generation_config.json")
    }
    unset = {"bos_token_id": None, "decoder_start_token_id": None}
    for name, text in saved.items():
        (tmp_path / "model" / name).write_text(json.dumps(json.loads(text) | unset))
    with pytest.raises(
        ValueError,
        match=r"decoder_start_token_id is None \(config.json\); .* set `decoder_start_token_id` in",
    ):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2-unset")
    # A length that leaves no new token: generate() refuses it; the export's translator failed in
    # CTranslate2 at the first call ("The maximum decoding length must be > 0").
    (tmp_path / "model" / "generation_config.json").write_text(
        json.dumps(json.loads(saved["generation_config.json"]) | {"max_length": 1})
    )
    with pytest.raises(ValueError, match=r"max_length 1, which leaves no new token"):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2-no-tokens")
    for name, text in saved.items():
        (tmp_path / "model" / name).write_text(text)
    too_long = r"sentences\[1\] has \d+ tokens; .* position table holds 8"
    with pytest.raises(SentenceError, match=too_long) as error:
        CTranslate2Translator(tmp_path / "ct2").translate(
            ["short", "a sentence that is much longer than eight tokens surely"]
        )
    assert error.value.index == 1
    assert CTranslate2Translator(tmp_path / "ct2").translate([]) == []
    # Line breaks a model writes become spaces, as with the transformers engine: one line per input.
    translator = CTranslate2Translator(tmp_path / "ct2")
    translator.tokenizer.decode = lambda ids, **_: "uno\ndos\n"
    assert translator.translate(["short", "short too"]) == ["uno dos", "uno dos"]
    assert translator.translate(["", "short", " "]) == ["", "uno dos", ""]  # blank: "", as `translate`
    with pytest.raises(ValueError, match=r"sentences\[0\] is a int"):
        CTranslate2Translator(tmp_path / "ct2").translate([3])
    with pytest.raises(ValueError, match="not a folder written by export_ctranslate2"):
        CTranslate2Translator(tmp_path / "model")
    # No folder at all (a mistyped path; an export killed between its two renames) is said as such.
    with pytest.raises(FileNotFoundError, match=r"No CTranslate2 export at .*missing \(no such folder\)"):
        CTranslate2Translator(tmp_path / "missing")
    # An export copied without its tokenizer: transformers' message advised installing sentencepiece.
    shutil.copytree(tmp_path / "ct2", tmp_path / "untokenized")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "untokenized" / name).unlink()
    with pytest.raises(FileNotFoundError, match=r"untokenized has no tokenizer \(none of tokenizer\.json"):
        CTranslate2Translator(tmp_path / "untokenized")
    # A device with its number as torch names it (translate.py's --device, for either engine): CTranslate2
    # refused "cuda:1" as an unsupported device; it takes the number as device_index.
    numbered = CTranslate2Translator(tmp_path / "ct2", device="cpu:0")
    assert (numbered.translator.device, numbered.translator.device_index) == ("cpu", [0])
    assert numbered.translate(["short"]) == CTranslate2Translator(tmp_path / "ct2").translate(["short"])
    with pytest.raises(ValueError, match="Invalid CPU device index: 1"):  # CTranslate2's, on the number
        CTranslate2Translator(tmp_path / "ct2", device="cpu:1")
    with pytest.raises(ValueError, match=r"Device 'cuda:x': name a device and its number as 'cuda:1'"):
        CTranslate2Translator(tmp_path / "ct2", device="cuda:x")
    # Exporting into the model folder once replaced its config.json with CTranslate2's.
    config = (tmp_path / "model" / "config.json").read_text()
    with pytest.raises(ValueError, match="is not a CTranslate2 export of this package"):
        export_ctranslate2(tmp_path / "model", tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == config
    with pytest.raises(ValueError, match=r"'' \(an empty name\) is the current folder"):  # renamed it away
        export_ctranslate2(tmp_path / "model", "")
    # An earlier export is replaced, all its files: one of another model (a converted OPUS-MT's
    # sentencepiece tokenizer, two vocabularies) left files the next export does not write, read with it.
    exported = sorted(p.name for p in (tmp_path / "ct2").iterdir())
    settings = json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())
    for stale in ("source.spm", "source_vocabulary.json", "target_vocabulary.json"):
        (tmp_path / "ct2" / stale).write_text("from an earlier export")
        settings["files"].append(stale)  # which that export wrote, as it records
    (tmp_path / "ct2" / SETTINGS_FILE).write_text(json.dumps(settings))
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=16)
    assert json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())["max_positions"] == 16
    assert sorted(p.name for p in (tmp_path / "ct2").iterdir()) == exported
    with pytest.raises(ValueError, match=r"position table of 119\.2 GiB"):  # refused before it is built
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=10**9)
    # ... and before the weights are read: unreadable ones are not reached.
    unread = tmp_path / "unread"
    shutil.copytree(tmp_path / "model", unread)
    (unread / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError, match=r"position table of 119\.2 GiB"):
        export_ctranslate2(unread, tmp_path / "ct2", max_positions=10**9)
    # That early look reads a folder's file only: a mistyped folder name, which transformers would ask
    # the Hub for (waiting out its retries offline), is refused at once by the loading.
    from unittest import mock

    from transformers import PretrainedConfig

    asked = mock.Mock(side_effect=AssertionError("the Hub was asked"))
    with (
        mock.patch.object(PretrainedConfig, "get_config_dict", asked),
        pytest.raises(OSError, match="No model folder at"),
    ):
        export_ctranslate2(tmp_path / "mode", tmp_path / "ct2-typo", max_positions=10**9)
    asked.assert_not_called()
    # An end token given as a list (the configuration allows it): one is exported, several are refused.
    # generate() reads the generation config's (config.json's is what it was made from).
    listed = tmp_path / "listed"
    shutil.copytree(tmp_path / "model", listed)
    generation = json.loads((listed / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    (listed / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [eos]}))
    export_ctranslate2(listed, tmp_path / "listed-ct2", max_positions=16)
    assert CTranslate2Translator(tmp_path / "listed-ct2").translate(["short"]) == (
        CTranslate2Translator(tmp_path / "ct2").translate(["short"])
    )
    (listed / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [eos, 3]}))
    with pytest.raises(
        ValueError, match=r"eos_token_id is \[2, 3\] \(generation_config.json\); a CTranslate2 export needs"
    ):
        export_ctranslate2(listed, tmp_path / "listed-ct2", max_positions=16)
    # An id outside the vocabulary: named, not an IndexError (or, negative, another token silently).
    (listed / "generation_config.json").write_text(json.dumps(generation | {"decoder_start_token_id": -1}))
    with pytest.raises(
        ValueError, match=r"decoder_start_token_id is -1 \(generation_config.json\); .* of the"
    ):
        export_ctranslate2(listed, tmp_path / "listed-ct2", max_positions=16)


def test_translating_with_ctranslate2_not_installed_says_how_to_install_it(
    tmp_path, corpus, run_in_process, monkeypatch
):
    """`translate.py --engine ctranslate2` imported the module itself first: without the extra it said
    only "No module named 'ctranslate2'"."""
    trained_folder(tmp_path / "model", corpus)
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed
    result = run_in_process("translate.py", "--model", str(tmp_path / "ct2"), "--engine", "ctranslate2")
    assert result.returncode == 2
    assert 'need the `ctranslate2` package: pip install "ctranslate2>=4.5"' in result.stderr, result.stderr


def test_scripts_export_and_translate_a_file(tmp_path, corpus, run_in_process):
    trained_folder(tmp_path / "model", corpus)
    exported = run_in_process("export_ctranslate2.py", str(tmp_path / "model"), str(tmp_path / "ct2"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    (tmp_path / "en.txt").write_text("In the beginning.\n\nAnd God said.\n")
    engine = ["--engine", "ctranslate2"]
    files = ["--input", str(tmp_path / "en.txt"), "--output", str(tmp_path / "es.txt")]
    translated = run_in_process("translate.py", "--model", str(tmp_path / "ct2"), *engine, *files)
    assert translated.returncode == 0, translated.stderr[-2000:]
    lines = (tmp_path / "es.txt").read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one line per input line, blank kept
    expected = CTranslate2Translator(tmp_path / "ct2").translate(["In the beginning.", "And God said."])
    assert [lines[0], lines[2]] == expected
    # Sentences given with a line break or spaces around them are read as `translate` reads them (as
    # training data is): the engine once got word-start tokens at their ends that no source had.
    translator, received = CTranslate2Translator(tmp_path / "ct2"), []
    engine_of = translator.translator

    class Recording:
        def translate_batch(self, sources, **options):
            received.extend(sources)
            return engine_of.translate_batch(sources, **options)

    translator.translator = Recording()
    assert translator.translate(["In the beginning.\n", "  And God said. \r\n"]) == expected
    tokens = [
        translator.tokenizer.tokenize(text, add_special_tokens=True)
        for text in ["In the beginning.", "And God said."]
    ]
    assert sorted(received) == sorted(tokens)
    # Without --engine ctranslate2 the export was read as a transformers folder ("Unrecognized model").
    plain = run_in_process(
        "translate.py", "--model", str(tmp_path / "ct2"), "--input", str(tmp_path / "en.txt")
    )
    assert plain.returncode == 2 and "is a CTranslate2 export" in plain.stderr and "--engine" in plain.stderr
    # A line longer than the export's position table is named by its number in the file.
    export_ctranslate2(tmp_path / "model", tmp_path / "short", max_positions=8)
    (tmp_path / "long.txt").write_text("And God said.\n\n" + "and the earth " * 10 + "\n")
    long_input = ["--input", str(tmp_path / "long.txt")]
    long = run_in_process("translate.py", "--model", str(tmp_path / "short"), *engine, *long_input)
    assert long.returncode == 1 and f"error: {tmp_path / 'long.txt'}: line 3 has" in long.stderr
    assert "holds 8" in long.stderr


@pytest.mark.slow
def test_int8_export_scores_within_half_a_bleu_point_of_float32(tmp_path):
    """The main job's recipe shortened to 600 updates (300 warm-up to lr_scale 0.3; about 2 minutes), then
    the whole embedded test split in float32 and int8."""
    command = [sys.executable, "scripts/train.py", "--output_dir", str(tmp_path / "model")]
    command += ["--report_to", "none", "--max_steps", "600", "--warmup_steps", "300", "--lr_scale", "0.3"]
    command += ["--max_train_minutes", "0", "--test_samples", "8"]
    subprocess.run(command, check=True, capture_output=True)
    test = load_default_corpus()["test"]
    scores = {}
    for quantization in ("float32", "int8"):
        export_ctranslate2(tmp_path / "model", tmp_path / quantization, quantization=quantization)
        hypotheses = CTranslate2Translator(tmp_path / quantization).translate(list(test["en"]))
        scores[quantization] = score_translations(hypotheses, list(test["es"]))["bleu"]
    # A model that translates somewhat, so that the comparison means something (an untrained model
    # scores near 0; after these 600 updates 1.9 on one machine, above 2 on another).
    assert scores["float32"] > 1.0, scores
    assert abs(scores["int8"] - scores["float32"]) <= 0.5, scores


def test_empty_translations_length_offset_0_and_beam_differences(tmp_path, corpus, caplog):
    """CTranslate2's default forbids the end token at the first step (and renormalises, shifting beam
    scores): a translation that `generate()` ends at once came out as a run of tokens. An offset of 0
    became 50. Settings whose beam search CTranslate2 does not reproduce are named."""
    model, tokenizer = trained_folder(tmp_path / "model", corpus, add_final_logits_bias=True)
    sources = list(corpus["test"]["en"][:6])
    model.generation_config.max_length_offset = 0
    low, high = 0.0, 20.0  # end-token biases with none and with all translations empty
    for _ in range(30):  # bisected to one where some sentences end at once and others do not
        with torch.no_grad():
            model.final_logits_bias[0, tokenizer.eos_token_id] = (low + high) / 2
        expected = translate(model, tokenizer, sources)
        if "" in expected and any(expected):
            break
        low, high = (low, (low + high) / 2) if "" in expected else ((low + high) / 2, high)
    assert "" in expected and any(expected), expected
    model.save_pretrained(tmp_path / "model")
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2")
    assert json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())["max_length_offset"] == 0
    assert CTranslate2Translator(tmp_path / "ct2").translate(sources) == expected
    for bad, message in (
        ({"num_beams": 0}, "num_beams must be a positive integer"),
        ({"length_penalty": math.nan}, "length_penalty must be a finite number"),
        # CTranslate2 refused these with a TypeError listing its whole signature
        ({"no_repeat_ngram_size": 2.5}, r"no_repeat_ngram_size must be a non-negative integer .* got 2\.5"),
        ({"no_repeat_ngram_size": -1}, r"no_repeat_ngram_size must be a non-negative integer .* got -1"),
    ):
        with pytest.raises(ValueError, match=message):  # once taken silently, as generate() now refuses them
            CTranslate2Translator(tmp_path / "ct2").translate(sources[:1], **bad)
    # CTranslate2's length power does not overflow: a penalty generate()'s beam search refuses is taken
    assert (
        len(CTranslate2Translator(tmp_path / "ct2").translate(sources[:1], num_beams=2, length_penalty=300.0))
        == 1
    )

    model.generation_config.early_stopping, model.generation_config.no_repeat_ngram_size = False, 3
    model.save_pretrained(tmp_path / "model")
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2")
    assert "early_stopping is False" in caplog.text and "no_repeat_ngram_size 3" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        CTranslate2Translator(tmp_path / "ct2").translate(sources[:2], num_beams=1)
    assert caplog.text == ""  # greedy search: the engines agree


def test_translations_cut_by_a_small_position_table_are_named(tmp_path, corpus, caplog):
    """An export with a small --max_positions stops translations at that many tokens, short of the
    source length + 50 that generate() keeps, and said nothing: the output looked like a translation."""
    model, _ = trained_folder(tmp_path / "model", corpus, steps=0, add_final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] = -1e4  # never ends: every limit is reached
    model.save_pretrained(tmp_path / "model")
    sources = ["short", "a sentence", "three words here"]
    export_ctranslate2(tmp_path / "model", tmp_path / "small", max_positions=12)
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        cut = CTranslate2Translator(tmp_path / "small").translate(sources)
    assert "sentences[0], sentences[1], sentences[2] were cut at 12 tokens" in caplog.text
    assert "larger --max_positions" in caplog.text
    caplog.clear()
    export_ctranslate2(tmp_path / "model", tmp_path / "large", max_positions=128)
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        whole = CTranslate2Translator(tmp_path / "large").translate(sources)
    assert "were cut" not in caplog.text  # stopped by the source length + 50 rule, as generate() stops
    assert all(len(a) < len(b) for a, b in zip(cut, whole, strict=True))


def test_translate_script_names_the_lines_whose_translations_were_cut(
    tmp_path, corpus, caplog, run_in_process
):
    """translate.py named the cut translations `sentences[i]`, places among one window's non-blank lines:
    for a file, other lines than the cut ones (blank lines and earlier windows uncounted)."""
    model, _ = trained_folder(tmp_path / "model", corpus, steps=0, add_final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] = -1e4  # never ends: every limit is reached
    model.save_pretrained(tmp_path / "model")
    export_ctranslate2(tmp_path / "model", tmp_path / "small", max_positions=12)
    (tmp_path / "en.txt").write_text("short\n\na sentence\n" + "\n" * 7 + "three words here\n")
    options = ["--engine", "ctranslate2", "--input", str(tmp_path / "en.txt"), "--batch_size", "1"]
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        result = run_in_process("translate.py", "--model", str(tmp_path / "small"), *options)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("\n") == 11
    # Windows of 8 lines (batch size 1): lines 1 and 3 in the first, line 11 in the second.
    assert "The translations of line 1, line 3 were cut at 12 tokens" in caplog.text
    assert "The translations of line 11 were cut at 12 tokens" in caplog.text
    assert "sentences[" not in caplog.text
    with pytest.raises(ValueError, match=r"^1 line_numbers for 2 sentences"):
        CTranslate2Translator(tmp_path / "small").translate(["short", "long"], line_numbers=[1])


@pytest.mark.parametrize(
    "length", [{"max_length_offset": None}, {"max_length": 9}, {"max_new_tokens": 7}], ids=str
)
def test_a_fixed_length_limit_is_carried(tmp_path, corpus, length):
    """A generation config with a length of its own (OPUS-MT's max_length, a max_new_tokens), or a
    converted Marian model's max_length_offset None (transformers' 20 tokens), stops generate() there;
    the export applied the source length + 50 rule instead, silently for the offset None."""
    model, tokenizer = trained_folder(tmp_path / "model", corpus, steps=0, add_final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] = -1e4  # never ends: every limit is reached
    model.generation_config.update(**length)
    model.save_pretrained(tmp_path / "model")
    sources = ["short", "a sentence of a few more words than the others"]
    expected = translate(model, tokenizer, sources, num_beams=1)
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=128)
    assert CTranslate2Translator(tmp_path / "ct2").translate(sources, num_beams=1) == expected


def test_a_model_without_a_bos_token_id_exports(tmp_path, corpus):
    """A converted Marian model has no bos_token_id (MarianConfig's default), which neither generate()
    nor CTranslate2 needs beside the decoder start token: the export refused it, asking for one."""
    model, tokenizer = trained_folder(tmp_path / "model", corpus, steps=0)
    model.config.bos_token_id = model.generation_config.bos_token_id = None
    model.generation_config.max_new_tokens = 6
    model.save_pretrained(tmp_path / "model")
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2")
    sources = ["In the beginning", "Jesus wept."]
    expected = translate(model, tokenizer, sources, num_beams=1)
    assert CTranslate2Translator(tmp_path / "ct2").translate(sources, num_beams=1) == expected


def test_the_token_ids_generate_reads_are_exported(tmp_path, corpus):
    """generate() reads the start and end tokens from the generation config (generation_config.json);
    the export read config.json's: a model whose generation config starts from another token (the
    padding token, as Marian's do) or stops at several translated alike in both engines, silently not."""
    model, tokenizer = trained_folder(tmp_path / "model", corpus)
    model.generation_config.num_beams = 1
    sources = list(corpus["test"]["en"][:8])
    before = translate(model, tokenizer, sources)
    model.generation_config.decoder_start_token_id = tokenizer.pad_token_id
    assert model.config.decoder_start_token_id == tokenizer.bos_token_id  # config.json keeps its own
    expected = translate(model, tokenizer, sources)
    assert expected != before  # the start token matters to this model
    model.save_pretrained(tmp_path / "model")
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=128)
    assert CTranslate2Translator(tmp_path / "ct2").translate(sources) == expected
    # Stopping at either of two tokens: CTranslate2's export has one end token, so it is refused.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.unk_token_id]
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"eos_token_id is \[2, 3\] \(generation_config.json\)"):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=128)


def test_a_start_token_that_is_not_special_is_not_part_of_the_translation(tmp_path, corpus):
    """Every sequence generate() returns begins with the decoder's start token, the prompt, not a
    translated word; CTranslate2 leaves it out. One that is no special token (a language tag, a word)
    was decoded into each translation of `translate()`, the pipeline and the fine-tuning scores."""
    import numpy as np
    from transformers import EvalPrediction

    from vanilla_transformer import TranslationPipeline
    from vanilla_transformer.finetuning import BleuMetric

    model, tokenizer = trained_folder(tmp_path / "model", corpus)
    model.generation_config.num_beams, model.generation_config.max_new_tokens = 1, 12
    word = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" Dios")[0])
    assert word not in tokenizer.all_special_ids
    model.generation_config.decoder_start_token_id = word
    model.save_pretrained(tmp_path / "model")
    sources = list(corpus["test"]["en"][:6])
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=128)
    expected = CTranslate2Translator(tmp_path / "ct2").translate(sources)
    assert translate(model, tokenizer, sources) == expected
    pipe = TranslationPipeline(model=model, tokenizer=tokenizer)
    assert [record["translation_text"] for record in pipe(sources)] == expected
    generated = model.generate(**tokenizer(sources, padding=True, return_tensors="pt"))
    assert (generated[:, 0] == word).all()
    metric = BleuMetric(tokenizer, decoder_start_token_id=word)
    scores = metric(
        EvalPrediction(
            predictions=generated.numpy(),
            label_ids=np.asarray(tokenizer(expected, padding=True)["input_ids"]),
        )
    )
    assert metric.scores["bleu"] == pytest.approx(score_translations(expected, expected)["bleu"])
    # gen_len counts what was generated, as for MarianMTModel (whose start token is the pad token)
    pad, end = tokenizer.pad_token_id, tokenizer.eos_token_id
    rows = np.array([[word, 7, 8, end, pad, pad], [word, 7, 8, 9, 10, end]])
    assert metric(EvalPrediction(predictions=rows, label_ids=rows))["gen_len"] == 4.0  # (3 + 5) / 2
    assert scores["gen_len"] == pytest.approx(float((generated[:, 1:] != pad).sum(dim=1).float().mean()))


def test_a_vocabulary_padded_past_the_tokenizer_exports(tmp_path, corpus):
    """`resize_token_embeddings(..., pad_to_multiple_of=N)` leaves rows no token names: the export was
    refused ("The tokenizer has 401 tokens but the model's vocabulary is 448"). They get names no token
    has, and an output of such a row is dropped, as generate()'s decoding drops its id."""
    model, tokenizer = trained_folder(tmp_path / "model", corpus, steps=0, add_final_logits_bias=True)
    tokenizer.add_tokens(["<domain>"])
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    assert model.config.vocab_size == 448 > len(tokenizer) == 401
    model.generation_config.num_beams, model.generation_config.max_new_tokens = 1, 10
    sources = list(corpus["test"]["en"][:6])
    for unused_wins in (False, True):
        if unused_wins:  # an unused row outscores every token at every step
            with torch.no_grad():
                model.final_logits_bias[0, 420] = model.final_logits_bias.max() + 3
            assert (
                model.generate(**tokenizer(sources, padding=True, return_tensors="pt"))[:, 1:] == 420
            ).all()
        model.save_pretrained(tmp_path / "model")
        tokenizer.save_pretrained(tmp_path / "model")
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=64)
        expected = translate(model, tokenizer, sources)
        assert CTranslate2Translator(tmp_path / "ct2").translate(sources) == expected
        assert all(expected) != unused_wins  # translations, or none
    vocabulary = json.loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text())
    assert vocabulary[:401] == tokenizer.convert_ids_to_tokens(list(range(401)))
    assert vocabulary[401:] == [f"<unused_row_{row}>" for row in range(401, 448)]
    # More tokens than rows: refused, with the way to make them fit.
    tokenizer.add_tokens([f"<more_{i}>" for i in range(60)])
    tokenizer.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"has 461 tokens but the model's vocabulary is 448: resize"):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=64)


def test_translating_with_beams_names_the_papers_length_penalty_form(tmp_path, corpus, caplog):
    """A model whose generation config asks for the paper's length penalty form ranks beams by
    ((5 + |Y|) / 6)^alpha, CTranslate2 by |Y|^alpha: only the export said so (whatever the beam size),
    and translating the export with beams, where the outputs differ, said nothing."""
    model, _ = trained_folder(tmp_path / "model", corpus, steps=0)
    model.generation_config.num_beams, model.generation_config.length_penalty_form = 1, "gnmt"
    model.save_pretrained(tmp_path / "model")
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2")
    translator = CTranslate2Translator(tmp_path / "ct2")
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        translator.translate(["Jesus wept."])
    assert caplog.text == ""  # greedy search has no length penalty
    with caplog.at_level("WARNING", logger="vanilla_transformer.export_ctranslate2"):
        translator.translate(["Jesus wept."], num_beams=4)
    assert "paper's length penalty ((5 + |Y|) / 6)^alpha" in caplog.text


def test_a_model_of_another_kind_is_refused_with_what_exports_it(tmp_path):
    """A MarianMTModel folder (finetune.py writes them) loads as a seq2seq model, and the export then failed
    with an AttributeError on the first field of this package's configuration it read."""
    from transformers import MarianConfig, MarianMTModel

    tokenizer = train_bpe_tokenizer(["a small text", "un texto pequeño"] * 8, 40)
    config = MarianConfig(
        vocab_size=len(tokenizer),
        d_model=8,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
    )
    MarianMTModel(config).save_pretrained(tmp_path / "marian")
    tokenizer.save_pretrained(tmp_path / "marian")
    with pytest.raises(
        ValueError, match=r"holds a 'marian' model, not this package's.*ct2-transformers-converter"
    ):
        export_ctranslate2(tmp_path / "marian", tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


def test_a_second_export_of_a_folder_being_written_is_refused(tmp_path, corpus):
    """Two exports of one folder at once (another terminal, a script run twice): the second removed the
    first's half-written folder as an interrupted run's, and the first then published what it wrote after
    that alone, a tokenizer and settings without the model, and both said they had succeeded."""
    from transformers import PreTrainedTokenizerBase

    trained_folder(tmp_path / "model", corpus, steps=0)
    save, second = PreTrainedTokenizerBase.save_pretrained, []

    def racing(self, *args, **kwargs):  # the second starts while the first writes its folder
        if not second:
            second.append("started")
            with pytest.raises(ValueError, match=r"ct2 is being written by another export .*\.ct2\.lock"):
                export_ctranslate2(tmp_path / "model", tmp_path / "ct2", quantization="int8")
            second.append("refused")
        return save(self, *args, **kwargs)

    with mock.patch.object(PreTrainedTokenizerBase, "save_pretrained", racing):
        export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=64)
    assert second == ["started", "refused"]
    written = {p.name for p in (tmp_path / "ct2").iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer.json", SETTINGS_FILE} <= written
    assert json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())["quantization"] == "float32"
    assert CTranslate2Translator(tmp_path / "ct2").translate(["Jesus wept."])  # loads and translates
    # Once it is done, the folder is an earlier export to replace, as before.
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", quantization="int8", max_positions=64)
    assert json.loads((tmp_path / "ct2" / SETTINGS_FILE).read_text())["quantization"] == "int8"


def test_replacing_an_earlier_export_loses_nothing_it_did_not_write(tmp_path, corpus):
    """An export replaces an earlier one as a whole: a model folder kept inside the export (exported
    from there again) and a user's notes beside the engine were deleted without a word."""
    trained_folder(tmp_path / "model", corpus, steps=0)
    export = tmp_path / "ct2"
    export_ctranslate2(tmp_path / "model", export, max_positions=64)
    written = json.loads((export / SETTINGS_FILE).read_text())["files"]
    assert sorted(p.name for p in export.iterdir()) == written

    shutil.copytree(tmp_path / "model", export / "hf_model")
    with pytest.raises(ValueError, match=r"hf_model lies inside .*ct2, an earlier export"):
        export_ctranslate2(export / "hf_model", export, max_positions=64)
    assert (export / "hf_model" / "config.json").is_file()
    with pytest.raises(ValueError, match=r"also holds hf_model, which the export did not write"):
        export_ctranslate2(tmp_path / "model", export, max_positions=64)
    shutil.rmtree(export / "hf_model")
    (export / "NOTES.md").write_text("my notes")
    with pytest.raises(ValueError, match=r"also holds NOTES\.md, which"):
        export_ctranslate2(tmp_path / "model", export, max_positions=64)
    assert (export / "NOTES.md").read_text() == "my notes"

    # An export written before the files were listed: the files an export writes are its own.
    settings = json.loads((export / SETTINGS_FILE).read_text())
    del settings["files"]
    (export / SETTINGS_FILE).write_text(json.dumps(settings))
    (export / "kept").mkdir()
    with pytest.raises(ValueError, match=r"also holds NOTES\.md, kept, which"):
        export_ctranslate2(tmp_path / "model", export, max_positions=64)
    (export / "kept").rmdir()
    (export / "NOTES.md").unlink()
    # A Hub id is no folder inside the export, whatever the current folder holds.
    check_replaceable_export(export, export / "my-model")
    # What a file manager leaves there goes with the export.
    (export / ".DS_Store").write_bytes(b"\0")
    export_ctranslate2(tmp_path / "model", export, quantization="int8", max_positions=64)
    assert not (export / ".DS_Store").exists()
    assert json.loads((export / SETTINGS_FILE).read_text())["quantization"] == "int8"


# Each activation the export maps onto one of CTranslate2's, and the one it is nearest (another
# approximation of the same function): a mapping to the wrong one moves the log-probabilities.
NEAREST_ACTIVATIONS = {
    "gelu_python": "gelu_pytorch_tanh",
    "gelu_fast": "gelu",
    "gelu_accurate": "gelu",
    "quick_gelu": "gelu",
    "tanh": "sigmoid",
    "sigmoid": "tanh",
}


@pytest.mark.parametrize("activation", sorted(NEAREST_ACTIVATIONS))
def test_every_activation_ctranslate2_computes_is_exported(tmp_path, corpus, activation):
    """transformers' other names for the GELU and its tanh approximation, its sigmoid approximation
    (quick_gelu), tanh and sigmoid were refused as activations CTranslate2 does not have (its own
    converter exports MarianMTModels with gelu_fast, gelu_python and quick_gelu). Reference: the
    model's own log-probabilities of given targets against CTranslate2's (a trained model: an untrained
    one's hardly tell the GELU approximations apart), closer than the same weights' with the nearest
    other activation."""
    model, tokenizer = trained_folder(tmp_path / "model", corpus, activation_function=activation)
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2", max_positions=64)
    expected = assert_same_log_probs(model, tokenizer, tmp_path / "ct2", corpus)
    for layer in [*model.model.encoder.layers, *model.model.decoder.layers]:
        layer.activation_fn = ACT2FN[NEAREST_ACTIVATIONS[activation]]
    other = teacher_forced_log_probs(model, tokenizer, *scored_pairs(tokenizer, corpus))
    with pytest.raises(AssertionError):  # the comparison tells the two apart
        assert_same_up_to_rounding(other, expected, TINY_TERMS)


def test_torch_dynamic_quantization_leaves_this_model_in_float32_as_the_readme_says():
    """README: `quantize_dynamic(model, {nn.Linear})` swaps exactly-`nn.Linear` layers only, so it
    changes none of this model's (a subclass); the CTranslate2 export is the int8 route. If torch
    starts swapping subclasses, the README's caveat (and the kernels' forward) needs a look."""
    import warnings

    from torch import nn

    from vanilla_transformer.kernels_vanilla_transformer import Linear

    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    source = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=source, decoder_input_ids=source).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    linears = [m for m in quantized.modules() if isinstance(m, nn.Linear) or "Linear" in type(m).__name__]
    assert linears and all(type(m) is Linear for m in linears)
    assert torch.equal(quantized(input_ids=source, decoder_input_ids=source).logits, before)


def test_a_full_disk_is_explained_by_the_export_and_translate_scripts(
    tmp_path, corpus, run_in_process, monkeypatch
):
    """export_ctranslate2.py on a full disk printed its usage and "[Errno 28] No space left on device"
    (naming no folder), and translate.py's --output failure did not name --output. The earlier export
    and output file stay as they were."""
    import contextlib
    import errno
    import io

    import vanilla_transformer.cli
    import vanilla_transformer.export_ctranslate2 as export_module

    trained_folder(tmp_path / "model", corpus)
    export = ["export_ctranslate2.py", str(tmp_path / "model"), str(tmp_path / "ct2")]
    assert run_in_process(*export).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "ct2").iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(export_module, "publish_folder", full_disk)
        result = run_in_process(*export)
    assert result.returncode == 1 and "usage:" not in result.stderr
    assert re.search(
        rf"error: writing {re.escape(str(tmp_path / 'ct2'))} failed \(\[Errno 28\] No space left on "
        r"device\): [\d.,]+ MiB free there\. An earlier export there is intact",
        result.stderr,
    ), result.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "ct2").iterdir()} == before
    (tmp_path / "en.txt").write_text("In the beginning.\n")
    (tmp_path / "es.txt").write_text("kept\n")
    files = ["--input", str(tmp_path / "en.txt"), "--output", str(tmp_path / "es.txt")]

    @contextlib.contextmanager
    def filling_up(path, *args, **kwargs):  # the disk fills while the translations are written
        yield io.StringIO()
        full_disk()

    monkeypatch.setattr(vanilla_transformer.cli, "replaced_when_complete", filling_up)
    result = run_in_process("translate.py", "--model", str(tmp_path / "model"), *files)
    assert result.returncode == 1
    assert f"error: writing --output {tmp_path / 'es.txt'} failed: [Errno 28] No space left" in result.stderr
    assert (tmp_path / "es.txt").read_text() == "kept\n"
