"""scripts/convert_marian.py end to end, run once (not under each linear kernel, as the conversion's numeric
tests are); in this process, but for a full disk and the check of a written folder's scores by
evaluate_model.py in another process (which picks its own kernels)."""

import re
import subprocess
import sys
from pathlib import Path

from test_marian_conversion import marian_model

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.publishing import staging_paths

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "convert_marian.py")


def test_convert_script_says_when_a_folder_is_not_marian(tmp_path, monkeypatch, run_in_process):
    """It once answered a non-Marian folder with "Encoder and decoder have 2 and 16 attention heads"."""
    config = VanillaTransformerConfig(vocab_size=40, d_model=16, d_ff=32, num_heads=2)
    VanillaTransformerForConditionalGeneration(config).save_pretrained(tmp_path / "ours")
    result = run_in_process(
        "convert_marian.py", "--model", str(tmp_path / "ours"), "--output", str(tmp_path / "out")
    )
    assert result.returncode == 2
    assert "is not a Marian checkpoint: its config.json has model_type 'vanilla_transformer'" in result.stderr
    assert not (tmp_path / "out").exists()
    # A mistyped local path, not the Hub's rules for repo ids (it used to quote those).
    monkeypatch.chdir(tmp_path)
    result = run_in_process("convert_marian.py", "--model", "./nope", "--output", str(tmp_path / "out"))
    assert result.returncode == 2 and "No model folder at ./nope" in result.stderr, result.stderr
    # A file of a model folder was read as the config, then unpickled as the weights (a traceback that
    # advised weights_only=False); a folder without config.json said "its config.json has model_type None".
    marian_model().save_pretrained(tmp_path / "marian")
    (tmp_path / "empty").mkdir()
    for model, message in (
        ("marian/config.json", "--model marian/config.json is a file: give the model folder"),
        ("empty", "empty has no config.json: it is not a model folder"),
    ):
        result = run_in_process("convert_marian.py", "--model", model, "--output", str(tmp_path / "out"))
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_convert_script_writes_a_whole_folder_or_nothing(tmp_path, run_in_process):
    """It once wrote a folder without a tokenizer and exited 0, and mixed a new model into an existing
    folder's tokenizer and card."""
    marian_model().save_pretrained(tmp_path / "marian")  # no tokenizer files: it cannot be copied

    def convert(output: Path, *flags: str):
        return run_in_process(
            "convert_marian.py", "--model", str(tmp_path / "marian"), "--output", str(output), *flags
        )

    failed = convert(tmp_path / "out")
    assert (
        failed.returncode == 2
        and "has no tokenizer files" in failed.stderr
        and "--no-tokenizer" in failed.stderr
    )
    assert not (tmp_path / "out").exists()
    (tmp_path / "marian" / "source.spm").write_bytes(b"not a sentencepiece model")
    unreadable = convert(tmp_path / "out")
    assert unreadable.returncode == 2 and "could not be loaded" in unreadable.stderr
    assert "--no-tokenizer" in unreadable.stderr and not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "tokenizer.json").write_text("{}")
    taken = convert(tmp_path / "taken", "--no-tokenizer")
    assert taken.returncode == 2 and "is not an empty folder" in taken.stderr
    # An earlier run into the same folder, killed once its folder was complete but before the swap: its
    # files are not carried into this run's folder (its tokenizer beside this model once was).
    _, earlier_ready, _ = staging_paths(tmp_path / "out")
    earlier_ready.mkdir()
    (earlier_ready / "tokenizer.json").write_text("{}")
    alone = convert(tmp_path / "out", "--no-tokenizer")
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (
        tmp_path / "out" / "tokenizer.json"
    ).exists()


def test_convert_script_explains_a_full_disk(tmp_path):
    """A full disk while the converted weights were written gave safetensors' traceback."""
    marian_model().save_pretrained(tmp_path / "marian")
    full_disk = str(Path(__file__).resolve().parent / "full_disk.py")
    command = [sys.executable, full_disk, SCRIPT, "--model", str(tmp_path / "marian"), "--no-tokenizer"]
    result = subprocess.run(
        [*command, "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"error: Writing {tmp_path / 'out'} failed (" in result.stderr
    assert "(os error 28)): " in result.stderr and "MiB free in" in result.stderr
    assert "Nothing was written: free some space and run again." in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marian"]  # no folder, no staging folder


def test_convert_script_refuses_a_checkpoint_without_the_encoder(tmp_path, run_in_process):
    """A saved MarianForCausalLM has model_type "marian" and no encoder: transformers filled the missing
    weights with random ones, only warning, and the script wrote the model."""
    from transformers import MarianForCausalLM

    config = marian_model().config
    config.is_decoder, config.is_encoder_decoder = True, False
    MarianForCausalLM(config).save_pretrained(tmp_path / "causal")
    flags = ["--model", str(tmp_path / "causal"), "--output", str(tmp_path / "out"), "--no-tokenizer"]
    result = run_in_process("convert_marian.py", *flags)
    assert result.returncode == 2 and "lacks" in result.stderr and "model.encoder." in result.stderr
    assert "not a complete translation model" in result.stderr and not (tmp_path / "out").exists()


def test_convert_script_scores_the_model_and_writes_a_card_push_accepts(tmp_path, run_in_process):
    """A converted folder had no card, so push_to_hub.py refused it. With --test_file the script scores
    the converted model and writes one; its scores are what scripts/evaluate_model.py measures on the
    written folder."""
    import json

    from vanilla_transformer.corpus import load_default_corpus
    from vanilla_transformer.hub import check_model_folder
    from vanilla_transformer.tokenization import train_bpe_tokenizer

    test = load_default_corpus()["test"].select(range(6))
    tokenizer = train_bpe_tokenizer(list(test["en"]) + list(test["es"]), 120)
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    marian = marian_model(
        vocab_size=len(tokenizer),
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
        **special,
    )
    marian.save_pretrained(tmp_path / "opus-mt-en-es")
    tokenizer.save_pretrained(tmp_path / "opus-mt-en-es")
    (tmp_path / "opus-mt-en-es" / "README.md").write_text("---\nlicense: cc-by-4.0\n---\n# OPUS-MT\n")
    # References the model can score on: half of them are the MarianMTModel's own translations (a random
    # model's are no Spanish), so the scores are not 0 and tell decodings apart.
    from vanilla_transformer.evaluation import evaluate_model

    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("en\tes\n" + "".join(f"{s}\t{t}\n" for s, t in zip(test["en"], test["es"], strict=True)))
    marian_outputs = evaluate_model(
        tmp_path / "opus-mt-en-es",
        data_options={"test_file": pairs, "source_lang": "en", "target_lang": "es"},
    )["hypotheses"]
    targets = [*marian_outputs[:3], *test["es"][3:]]
    pairs.write_text("en\tes\n" + "".join(f"{s}\t{t}\n" for s, t in zip(test["en"], targets, strict=True)))

    convert = [
        "convert_marian.py",
        "--model",
        str(tmp_path / "opus-mt-en-es"),
        "--output",
        str(tmp_path / "out"),
    ]
    # Refused before any work, and nothing written.
    en_es = ["--source_lang", "en", "--target_lang", "es"]
    for flags, said in (
        (["--test_file", str(pairs), "--source_lang", "en"], "needs --source_lang and --target_lang"),
        (["--test_file", str(pairs), "--source_lang", "en", "--target_lang", "de"], "'de'"),
        (["--test_file", str(pairs), *en_es, "--no-tokenizer"], "cannot go with --no-tokenizer"),
        (["--test_file", str(pairs), "--source_lang", "english", "--target_lang", "es"], "not a language"),
    ):
        refused = run_in_process(*convert, *flags)
        assert refused.returncode == 2 and said in refused.stderr, (flags, refused.stderr[-1500:])
        assert not (tmp_path / "out").exists()

    scored = run_in_process(*convert, "--test_file", str(pairs), *en_es)
    assert scored.returncode == 0, scored.stderr[-2000:]
    card = check_model_folder(tmp_path / "out")  # what push_to_hub.py checks
    text = (tmp_path / "out" / "README.md").read_text()
    assert "holding the weights of\n`opus-mt-en-es`, a MarianMTModel" in text and "Not trained here" in text
    assert "Fine-tuned" not in text and "recipe of the paper" not in text and "Optimiser" not in text
    assert card.data.license == "cc-by-4.0" and card.data.language == ["en", "es"]
    assert card.data.base_model is None  # a local folder, not a Hub model to link
    results = {r.metric_type: r for r in card.data.eval_results}
    assert results["bleu"].dataset_name == "pairs.tsv" and results["bleu"].dataset_split == "test"
    assert "(6 sentence pairs) of pairs.tsv" in text
    # Marian's generation config sets no length: transformers' default cut the scored translations, at the
    # length MarianMTModel's generate() stops at when it never ends a sentence (20 tokens after the
    # decoder's start token; the card once said 20 with the start token included).
    stated = re.search(r"at most (\d+) output tokens \(transformers' default", " ".join(text.split()))
    assert stated, text
    never_ending = marian.generate(**tokenizer(test["en"][:1], return_tensors="pt"), min_new_tokens=10**4)
    assert never_ending.shape[1] == 1 + int(stated[1])
    # The same scores as the evaluation script gives the written folder, in another process.
    evaluate = str(Path(SCRIPT).parent / "evaluate_model.py")
    assert results["chrf"].metric_value > 10  # (the random model writes one word: BLEU, on 4-grams, is 0)
    command = [sys.executable, evaluate, "--model", str(tmp_path / "out"), "--test_file", str(pairs), *en_es]
    checked = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert checked.returncode == 0, checked.stderr[-2000:]
    line = next(line for line in checked.stdout.splitlines() if line.startswith("BLEU"))
    assert f"{results['bleu'].metric_value:.2f}" == line.split()[1]
    chrf = next(line for line in checked.stdout.splitlines() if line.startswith("chrF"))
    assert f"{results['chrf'].metric_value:.2f}" == chrf.split()[1]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "vanilla_transformer"


def test_convert_script_refuses_weights_that_do_not_fit_the_config(tmp_path, run_in_process):
    """A checkpoint whose config.json does not describe its weights (another d_model here) ended in a
    traceback after transformers' load report."""
    import json

    marian_model().save_pretrained(tmp_path / "marian")
    config_file = tmp_path / "marian" / "config.json"
    config = json.loads(config_file.read_text())
    config["d_model"] = 48
    config_file.write_text(json.dumps(config))
    flags = ["--model", str(tmp_path / "marian"), "--output", str(tmp_path / "out"), "--no-tokenizer"]
    result = run_in_process("convert_marian.py", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "do not have the shapes its config.json gives" in result.stderr
    assert "(32,) in the checkpoint, (48,) from the config" in result.stderr
    assert not (tmp_path / "out").exists()
