"""Fine-tuning with transformers' Seq2SeqTrainer, the path transformers users already know."""

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
from conftest import logged_messages
from safetensors import SafetensorError
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel

from tests.test_unlikelihood import per_token_formula
from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.cli import InputError
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.finetuning import FinetuneConfig, bleu_metric_fn, build_trainer, finetune
from vanilla_transformer.hub import check_model_folder
from vanilla_transformer.parallel_data import DataError
from vanilla_transformer.tokenization import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> tuple[Path, Path]:
    """A small untrained model folder with its tokenizer, and a TSV of 300 real sentence pairs."""
    folder = tmp_path_factory.mktemp("finetune")
    rows = load_default_corpus()["train"].select(range(300))
    data = folder / "pairs.tsv"
    data.write_text("en\tes\n" + "".join(f"{r['en']}\t{r['es']}\n" for r in rows), encoding="utf-8")
    tokenizer = train_bpe_tokenizer(list(rows["en"]) + list(rows["es"]), vocab_size=400)
    torch.manual_seed(0)
    config = VanillaTransformerConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), d_model=64, d_ff=128, num_encoder_layers=2, num_decoder_layers=2
    )
    model_dir = folder / "model"
    VanillaTransformerForConditionalGeneration(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, data


def small_config(model: Path, train_file: Path, output_dir: Path, **overrides) -> FinetuneConfig:
    """The fine-tuning settings these tests share (40 validation pairs held out), with `overrides`."""
    return FinetuneConfig(
        model=str(model),
        train_file=str(train_file),
        output_dir=str(output_dir),
        **{"validation_size": 40, **overrides},
    )


def test_finetuning_lowers_the_loss_and_reports_bleu(start, tmp_path):
    start_dir, data = start
    model_dir = tmp_path / "base-en-es"  # the start model, with a card stating its licence
    shutil.copytree(start_dir, model_dir)
    (model_dir / "README.md").write_text("---\nlicense: cc-by-4.0\n---\n\n# base\n", encoding="utf-8")
    config = small_config(
        model_dir,
        data,
        tmp_path / "tuned",
        max_steps=30,
        learning_rate=2e-3,
        warmup_steps=5,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        eval_steps=30,
        num_beams=2,
        max_eval_samples=12,
    )
    metrics = finetune(config)
    assert metrics["after_loss"] < metrics["before_loss"] - 0.5, metrics
    assert 0 <= metrics["after_bleu"] <= 100 and 0 <= metrics["after_chrf"] <= 100
    assert (tmp_path / "tuned" / "model.safetensors").is_file()
    # The folder has its card, with the scores measured after fine-tuning: it can be published.
    card = check_model_folder(tmp_path / "tuned")
    results = {result.metric_type: result for result in card.data.eval_results}
    assert results["bleu"].metric_value == round(metrics["after_bleu"], 2)
    assert results["chrf"].metric_value == round(metrics["after_chrf"], 2)
    assert results["bleu"].dataset_split == "validation" and results["bleu"].metric_config.startswith(
        "nrefs:1"
    )
    assert card.data.base_model is None  # a local folder, not a Hub model the metadata could link
    assert card.data.license == "cc-by-4.0"  # the start model's
    text = " ".join(card.text.split())
    assert "fine-tuned from `base-en-es` on pairs.tsv" in text and "trained from scratch" not in text
    assert "linear warm-up to 0.002 over 5 steps" in text and "ε_ls = 0.1" in text
    assert "clipped to norm 1.0 (Trainer's default; the paper does not clip)" in text
    assert "| training steps | 30 |" in text
    assert "32 sentence pairs per update" in text  # 16 per device x 2 accumulated
    assert "On the validation split (its first 12 of 40 sentence pairs) of pairs.tsv" in text
    assert "validation loss" not in text  # Trainer's loss is not the validation loss train.py reports
    # Scored with 2 beams; the folder's generation config keeps the start model's 4, and the card says so.
    assert "beam search with 2 beams" in text and "Far less training" not in text
    assert (
        "beam search with 4 beams and length penalty 0.6, where the scores above were decoded with 2 beams"
        in text
    )
    assert json.loads((tmp_path / "tuned" / "generation_config.json").read_text())["num_beams"] == 4


def test_a_validation_file_is_named_as_the_scored_data(start, tmp_path):
    model_dir, data = start
    dev = tmp_path / "dev.tsv"
    dev.write_text("\n".join(data.read_text(encoding="utf-8").splitlines()[:9]) + "\n", encoding="utf-8")
    config = small_config(model_dir, data, tmp_path / "tuned", validation_file=str(dev), max_steps=2)
    config.eval_steps, config.num_beams = 2, 4
    finetune(config)
    card = check_model_folder(tmp_path / "tuned")
    assert {result.dataset_name for result in card.data.eval_results} == {"dev.tsv"}
    assert card.data.license is None  # the start model states none
    text = " ".join(card.text.split())
    assert "fine-tuned from `model` on pairs.tsv" in text
    assert "On the validation split (8 sentence pairs) of dev.tsv" in text
    assert "`generation_config.json`: as described above;" in text  # scored with its own 4 beams
    assert "over 20 steps (the run stopped after 2, still warming up)" in text


def test_evaluation_is_not_capped_at_20_tokens(start, tmp_path):
    model_dir, data = start
    config = small_config(
        model_dir,
        data,
        tmp_path / "out",
        max_steps=1,
        num_beams=2,
        max_eval_samples=4,
        per_device_eval_batch_size=2,
    )
    trainer = build_trainer(config)
    trainer.model.generation_config.suppress_tokens = [trainer.processing_class.eos_token_id]
    eval_set = trainer.eval_dataset
    output = trainer.predict(eval_set)
    longest_source = max(len(ids) for ids in eval_set["input_ids"])
    # Decoding runs to source length + 50 (the paper's limit), far past transformers' default of 20, in
    # both batches: after the first, transformers' prediction_step fills the model's max_length with 20,
    # which the model's generation config remembers as a default, not a choice.
    assert output.predictions.shape[1] == 1 + longest_source + 50 > 20
    assert trainer.model.generation_config.to_dict()["max_length"] is None
    second = eval_set.select([2, 3])
    assert trainer.predict(second).predictions.shape[1] == 1 + max(map(len, second["input_ids"])) + 50


@pytest.fixture(scope="module")
def marian_start(start, tmp_path_factory) -> Path:
    """A MarianMTModel folder of the same small shape, with the same tokenizer."""
    from transformers import AutoTokenizer, MarianConfig, MarianMTModel

    tokenizer = AutoTokenizer.from_pretrained(start[0])
    config = MarianConfig(
        vocab_size=len(tokenizer),
        d_model=64,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("marian") / "model"
    MarianMTModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["ours", "marian"])
def test_the_saved_folder_is_the_fine_tuned_model(start, marian_start, tmp_path, kind):
    """transformers 5 loads a MarianMTModel's sinusoidal position tables as trainable parameters, which
    `save_pretrained` leaves out: Trainer trained them and the written folder lost them, so the scores
    printed after fine-tuning were another model's. Every weight of the reloaded folder is now the
    trained model's, and what it leaves out was not trained."""
    model_dir, data = start
    model = model_dir if kind == "ours" else marian_start
    config = small_config(model, data, tmp_path / "out", max_steps=3, learning_rate=3e-3, warmup_steps=1)
    trainer = build_trainer(config)
    before = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    trainer.train()
    trainer.save_model(tmp_path / "saved")
    trained = trainer.model.state_dict()
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "saved", trust_remote_code=True).state_dict()
    assert set(reloaded) == set(trained)
    for name, tensor in reloaded.items():
        assert torch.equal(tensor, trained[name].cpu()), name
    assert any(not torch.equal(before[name], trained[name]) for name in trained)  # it did train
    if kind == "marian":
        positions = [name for name in trained if "embed_positions" in name]
        assert positions and all(torch.equal(before[name], trained[name]) for name in positions)


def test_the_launchers_mixed_precision_is_refused_or_stated(start, tmp_path, monkeypatch):
    """Trainer takes the launcher's mixed precision (`accelerate launch --mixed_precision`, a config
    file): bf16 trained under autocast while the card said nothing of it, fp16 on the CPU trained in
    float32 and recorded fp16."""
    model_dir, data = start
    options = {"max_steps": 1, "eval_steps": 1, "max_eval_samples": 2, "num_beams": 1}
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(InputError, match=r"fp16 \(accelerate launch's\) does not run on the CPU"):
        finetune(small_config(model_dir, data, tmp_path / "fp16", **options))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    finetune(small_config(model_dir, data, tmp_path / "bf16", **options))
    row = "| precision | bf16 mixed precision: products under bfloat16 autocast"
    assert row in (tmp_path / "bf16" / "README.md").read_text(encoding="utf-8")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    finetune(small_config(model_dir, data, tmp_path / "no", **options))
    assert "| precision |" not in (tmp_path / "no" / "README.md").read_text(encoding="utf-8")


def test_a_model_whose_tokenizer_pads_on_the_left_is_fine_tuned_on_right_padded_targets(start, tmp_path):
    """transformers' collator pads the labels on the tokenizer's side: a model folder whose tokenizer
    pads on the left was fine-tuned from decoder inputs `<s> <pad> ... y1 ...`, a context no translation
    is decoded from. The training batches are padded on the right, the tokenizer left as it is."""
    from transformers import AutoTokenizer

    model_dir, data = start
    folder = tmp_path / "left"
    shutil.copytree(model_dir, folder)
    AutoTokenizer.from_pretrained(model_dir, padding_side="left").save_pretrained(folder)
    trainer = build_trainer(small_config(folder, data, tmp_path / "out", max_steps=1))
    assert trainer.processing_class.padding_side == "left"
    rows = sorted(range(len(trainer.train_dataset)), key=lambda i: len(trainer.train_dataset[i]["labels"]))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in (rows[0], rows[-1])])
    tokenizer = trainer.processing_class
    labelled = batch["labels"] != -100
    assert labelled[0, 0] and not labelled[0, -1]  # the short target first, its padding after it
    assert (batch["decoder_input_ids"][:, 0] == tokenizer.bos_token_id).all()
    assert (batch["decoder_input_ids"][:, 1] != tokenizer.pad_token_id).all()
    assert batch["attention_mask"][0, 0] == 1


@pytest.mark.parametrize("kind", ["ours", "marian"])
@pytest.mark.parametrize("factor", [0.0, 0.2])
def test_one_label_smoothing_knob(start, marian_start, tmp_path, factor, kind):
    """`label_smoothing_factor=0` once still smoothed with the model's 0.1, and a MarianMTModel folder
    was once not smoothed at all: the training loss is now the cross entropy against (1 - factor)
    one-hot + factor / V targets, computed independently here, for either model."""
    model_dir, data = start
    model = model_dir if kind == "ours" else marian_start
    config = small_config(model, data, tmp_path / "out", max_steps=1, label_smoothing_factor=factor)
    trainer = build_trainer(config)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    batch.pop("source_length")  # Trainer drops columns the model's forward does not take
    assert set(batch) == {"input_ids", "attention_mask", "labels", "decoder_input_ids"}  # as in training
    batch = {name: values.to(trainer.model.device) for name, values in batch.items()}  # a GPU, if any
    trainer.model.eval()  # no dropout, so that the two computations see the same function
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))  # Trainer pops the labels it smooths
        logits = trainer.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=trainer.model.prepare_decoder_input_ids_from_labels(batch["labels"]),
        ).logits.flatten(0, 1)
    labels = batch["labels"].flatten()
    expected = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=factor)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_label_smoothing_other_than_the_models_is_said(start, tmp_path):
    """--label_smoothing_factor (0.1 by default) replaced a model's own label smoothing (0 for a model
    trained without) without a word, where the unlikelihood weight is kept unless given."""
    model_dir, data = start
    own = json.loads((Path(model_dir) / "config.json").read_text())["label_smoothing"]
    other = 0.2 if own != 0.2 else 0.3
    module = "vanilla_transformer.finetuning"
    with logged_messages(module) as warnings:
        trainer = build_trainer(
            small_config(model_dir, data, tmp_path / "other", max_steps=1, label_smoothing_factor=other)
        )
    assert trainer.model.config.label_smoothing == other
    said = [w for w in warnings if f"Fine-tuning with label smoothing {other:g}" in w]
    assert said and f"trained with {own:g}" in said[0] and f"--label_smoothing_factor {own:g}" in said[0]
    with logged_messages(module) as warnings:
        same = small_config(model_dir, data, tmp_path / "same", max_steps=1, label_smoothing_factor=own)
        build_trainer(same)
    assert not [w for w in warnings if "Fine-tuning with label smoothing" in w]


def test_a_half_precision_folder_is_fine_tuned_in_float32(start, tmp_path):
    """A folder saved in float16 or bfloat16 loads in that dtype, and Trainer's Adam ran on those weights
    without a float32 copy: 10 float16 steps took the loss from 5.5 to 49 (weights moved by up to 117),
    bfloat16 ones left 84% of the weights unchanged; both exited 0. Now they train (and save) in float32."""
    model_dir, data = start
    for dtype in (torch.float16, torch.bfloat16):
        folder = tmp_path / str(dtype).split(".")[-1]
        shutil.copytree(model_dir, folder)
        half = AutoModelForSeq2SeqLM.from_pretrained(model_dir).to(dtype)
        half.save_pretrained(folder)
        with logged_messages("vanilla_transformer.finetuning") as warnings:
            trainer = build_trainer(small_config(folder, data, tmp_path / f"out-{dtype}", max_steps=1))
        assert {parameter.dtype for parameter in trainer.model.parameters()} == {torch.float32}
        for name, parameter in half.named_parameters():  # the folder's values, widened
            assert torch.equal(trainer.model.get_parameter(name), parameter.float()), name
        said = [w for w in warnings if f"holds {dtype} weights: fine-tuned in float32" in w]
        assert said, warnings


def test_unlikelihood_weight_option(start, marian_start, tmp_path):
    """`--unlikelihood_weight` replaces the model's own weight in the loss Trainer optimises (the term
    written out per token, independently), is kept when not given, and is refused for a MarianMTModel."""
    model_dir, data = start
    kept = build_trainer(small_config(model_dir, data, tmp_path / "kept", max_steps=1))
    assert kept.model.config.unlikelihood_weight == 0.0  # the starting folder's
    trainer = build_trainer(
        small_config(model_dir, data, tmp_path / "out", max_steps=1, unlikelihood_weight=0.5)
    )
    assert trainer.model.config.unlikelihood_weight == 0.5
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    batch.pop("source_length")
    batch = {name: values.to(trainer.model.device) for name, values in batch.items()}
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        logits = trainer.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
        ).logits
    labels = batch["labels"]
    expected = per_token_formula(logits, labels, 0.1, 0.5, int((labels != -100).sum()))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert loss > per_token_formula(logits, labels, 0.1, 0.0, int((labels != -100).sum())) + 1e-3
    with pytest.raises(ValueError, match="this package's models only"):
        build_trainer(small_config(marian_start, data, tmp_path / "m", max_steps=1, unlikelihood_weight=1.0))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--unlikelihood_weight must be a non-negative finite number"):
            FinetuneConfig(model="m", train_file="t", output_dir="o", unlikelihood_weight=bad)


def test_pairs_left_out_are_reported(start, tmp_path, caplog):
    """Rows with an empty side and pairs over --max_length left without a word (train.py names them)."""
    model_dir, data = start
    rows = data.read_text(encoding="utf-8").splitlines()
    odd = tmp_path / "odd.tsv"
    odd.write_text("\n".join([*rows, "\tvacío", "empty\t"]) + "\n", encoding="utf-8")
    config = small_config(model_dir, odd, tmp_path / "out", max_length=48)
    with caplog.at_level("WARNING", logger="vanilla_transformer.finetuning"):
        build_trainer(config)
    assert "skipped 2 train rows with an empty source or target" in caplog.text
    assert re.search(r"skipped \d+ train pairs longer than max_length", caplog.text)


def test_the_script_prints_the_scores_before_and_after_and_exits_cleanly_on_errors(
    start, tmp_path, run_in_process, monkeypatch
):
    """scripts/finetune.py as a user runs it: a table of the scores before and after (the card's, for
    those it records), and an error line with no traceback for a file that is missing or flags that
    cannot work."""
    model_dir, data = start
    returned = []

    def recorded(config):
        returned.append(finetune(config))
        return returned[-1]

    monkeypatch.setattr("vanilla_transformer.finetuning.finetune", recorded)
    common = ["--model", str(model_dir), "--validation_size", "40", "--max_eval_samples", "8"]
    output = tmp_path / "tuned"
    run = run_in_process(
        "finetune.py", *common, "--train_file", str(data), "--output_dir", str(output), "--max_steps", "2"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    table = {}
    for line in run.stdout.splitlines():
        if match := re.fullmatch(r"(\w+) +before +(\S+) +after +(\S+)", line):
            table[match[1]] = float(match[2]), float(match[3])
    assert list(table) == ["loss", "bleu", "chrf", "gen_len"], run.stdout
    metrics = returned[0]
    for name, (before, after) in table.items():
        assert (before, after) == (round(metrics[f"before_{name}"], 3), round(metrics[f"after_{name}"], 3))
    card = {
        result.metric_type: result.metric_value for result in check_model_folder(output).data.eval_results
    }
    assert table["bleu"][1] == pytest.approx(card["bleu"], abs=0.01)
    assert table["chrf"][1] == pytest.approx(card["chrf"], abs=0.01)
    assert all(table["gen_len"][when] > 0 for when in (0, 1)) and table["loss"][0] > 0

    missing = run_in_process(
        "finetune.py",
        *common,
        "--train_file",
        str(tmp_path / "nope.tsv"),
        "--output_dir",
        str(tmp_path / "o"),
    )
    last = missing.stderr.splitlines()[-1]  # after the weights' loading bar
    assert missing.returncode == 1 and last.startswith("error: train file ") and "nope.tsv" in last
    assert "Traceback" not in missing.stderr and not (tmp_path / "o").exists()
    bad = run_in_process(
        "finetune.py", *common, "--train_file", str(data), "--output_dir", "o", "--max_steps", "0"
    )
    assert bad.returncode == 2 and "--max_steps must be positive" in bad.stderr  # argparse's usage error


def test_bad_finetune_options(tmp_path):
    with pytest.raises(ValueError, match="--max_steps must be positive"):
        FinetuneConfig(model="m", train_file="t", output_dir="o", max_steps=0)
    (tmp_path / "pairs.tsv").write_text("en\tes\nhello\thola\n", encoding="utf-8")
    pairs = str(tmp_path / "pairs.tsv")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        build_trainer(FinetuneConfig(model=str(Path(__file__).parent), train_file=pairs, output_dir="o"))
    for name, value in (
        ("gradient_accumulation_steps", 0),
        ("max_eval_samples", 0),
        ("validation_size", -3),
        ("warmup_steps", 0),  # transformers' inverse_sqrt would decay over 10,000 steps instead
    ):
        with pytest.raises(ValueError, match=f"--{name} must be positive"):
            FinetuneConfig(model="m", train_file="t", output_dir="o", **{name: value})
    with pytest.raises(ValueError, match="--learning_rate must be a positive finite number"):
        FinetuneConfig(model="m", train_file="t", output_dir="o", learning_rate=float("nan"))
    for factor in (1.0, -0.1, float("nan")):  # 1 would spread every label's whole weight uniformly
        with pytest.raises(ValueError, match=r"--label_smoothing_factor must be in \[0, 1\)"):
            FinetuneConfig(model="m", train_file="t", output_dir="o", label_smoothing_factor=factor)
    with pytest.raises(ValueError, match=r"--seed must be between 0 and 2\*\*32 - 1, got -1"):
        FinetuneConfig(model="m", train_file="t", output_dir="o", seed=-1)
    # A column's language cannot be guessed: the card named the embedded corpus's, English and Spanish.
    with pytest.raises(ValueError, match="--source_column src names the column, not its language"):
        FinetuneConfig(model="m", train_file="t", output_dir="o", source_column="src", target_lang="de")
    named = FinetuneConfig(model="m", train_file="t", output_dir="o", source_column="src", source_lang="fr")
    assert (named.source_lang, named.target_lang) == ("fr", "es")


def test_an_empty_output_dir_is_refused_before_any_work(tmp_path, monkeypatch):
    """`--output_dir ""` (an unset shell variable) got past the checks as the current folder, then failed
    in Trainer, once the model and data were loaded, with "No such file or directory: ''"."""
    monkeypatch.chdir(tmp_path)  # a folder the checks would accept as an output
    for empty in ("", " "):
        with pytest.raises(ValueError, match="--output_dir is empty"):
            FinetuneConfig(model="m", train_file="t", output_dir=empty)


def test_finetuning_never_writes_over_a_model(start, tmp_path):
    """`--output_dir` equal to `--model` once overwrote the starting weights and kept their card."""
    folder, _ = start
    with pytest.raises(ValueError, match="is the --model folder"):
        FinetuneConfig(model=str(folder), train_file="t", output_dir=str(folder))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a model"):
        FinetuneConfig(model=str(folder), train_file="t", output_dir=str(tmp_path / "other"))
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "README.md").write_text("someone's own notes")  # the card would replace them
    with pytest.raises(ValueError, match=r"holds a README\.md"):
        FinetuneConfig(model=str(folder), train_file="t", output_dir=str(tmp_path / "project"))
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is a file; name a folder"):
        FinetuneConfig(model=str(folder), train_file="t", output_dir=str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match=r"--output_dir .*notes\.txt/tuned cannot be written: .* is a file"):
        FinetuneConfig(model=str(folder), train_file="t", output_dir=str(tmp_path / "notes.txt" / "tuned"))


def test_an_interrupted_finetune_is_resumed_not_deleted(start, tmp_path, caplog, monkeypatch):
    """Seq2SeqTrainer keeps its last two checkpoints in --output_dir: a second fine-tune started there
    once deleted an interrupted one's, and there was no way to continue it. A fine-tune stopped after its
    last update (in the final evaluation or save) could not be finished either, and `latest` took a
    checkpoint stopped while written (Trainer's own choice) and refused it. A full disk in the final save
    gave safetensors' traceback."""
    from safetensors.torch import load_file

    start_dir, data = start
    output = tmp_path / "tuned"
    options = {"eval_steps": 3, "max_eval_samples": 4, "num_beams": 1, "per_device_train_batch_size": 16}
    saving = PreTrainedModel.save_pretrained

    def full_disk_at_the_end(self, directory, *args, **kwargs):  # checkpoints fit, the model does not
        if Path(directory) == output:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return saving(self, directory, *args, **kwargs)

    with monkeypatch.context() as patched:  # once a traceback; now what to do, and nothing lost
        patched.setattr(PreTrainedModel, "save_pretrained", full_disk_at_the_end)
        full = r"^Writing .*tuned failed \(.*\(os error 28\)\): [\d.,]+ MiB free"
        with pytest.raises(InputError, match=full) as error:
            finetune(small_config(start_dir, data, output, max_steps=6, **options))
    assert "--resume_from_checkpoint latest, which saves the model without training" in str(error.value)
    finished = load_file(output / "checkpoint-6" / "model.safetensors")  # the final update's weights
    for path in output.iterdir():  # what a kill in the final save leaves: the checkpoints, a config begun
        if not path.name.startswith("checkpoint-"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (output / "config.json").write_text("")
    assert sorted(p.name for p in output.iterdir()) == ["checkpoint-3", "checkpoint-6", "config.json"]
    finish = (
        r"already holds a model; .*checkpoint-6 the last: --resume_from_checkpoint latest, with its flags"
    )
    with pytest.raises(ValueError, match=finish):  # a new fine-tune: refused, saying how to finish this one
        small_config(start_dir, data, output, max_steps=9, **options)
    (output / "config.json").unlink()
    with pytest.raises(
        ValueError, match=r"checkpoints of an earlier fine-tune \(checkpoint-3, checkpoint-6\)"
    ):
        small_config(start_dir, data, output, max_steps=9, **options)
    (output / "config.json").write_text("")
    with pytest.raises(ValueError, match="is not a whole checkpoint of a fine-tune"):
        small_config(start_dir, data, output, resume_from_checkpoint=str(tmp_path), **options)
    train_checkpoint = tmp_path / "step-00000012"  # train.py's: a trainer_state.json of its own
    train_checkpoint.mkdir()
    (train_checkpoint / "trainer_state.json").write_text('{"step": 12}')
    with pytest.raises(ValueError, match="is not a whole checkpoint of a fine-tune"):
        small_config(start_dir, data, output, resume_from_checkpoint=str(train_checkpoint), **options)
    with pytest.raises(ValueError, match=r"checkpoint-6 is at step 6, past --max_steps 5"):
        small_config(start_dir, data, output, max_steps=5, resume_from_checkpoint="latest", **options)
    with pytest.raises(ValueError, match="holds no checkpoint-N folder"):
        small_config(start_dir, data, tmp_path / "new", resume_from_checkpoint="latest", **options)
    # Resumed with flags that shape what it trains changed: Trainer kept the checkpoint's optimizer, schedule
    # and data order, and the card stated the new flags. Those of evaluation and length may change.
    recorded = json.loads((output / "checkpoint-6" / "finetune_flags.json").read_text())
    assert recorded["model"] == str(start_dir.resolve()) and recorded["label_smoothing_factor"] == 0.1
    changed = r"other flags \(--label_smoothing_factor 0\.1 -> 0\.0; --seed 0 -> 3\): a resumed fine-tune"
    with pytest.raises(ValueError, match=changed):
        other = {"label_smoothing_factor": 0.0, "seed": 3}
        small_config(
            start_dir, data, output, max_steps=6, resume_from_checkpoint="latest", **options, **other
        )
    evaluation = options | {"eval_steps": 2, "num_beams": 2, "max_eval_samples": 2}
    small_config(start_dir, data, output, max_steps=8, resume_from_checkpoint="latest", **evaluation)

    # Stopped in the final save: resumed with the same flags, it is finished, without another update.
    finetune(small_config(start_dir, data, output, max_steps=6, resume_from_checkpoint="latest", **options))
    weights = load_file(output / "model.safetensors")
    assert weights.keys() == finished.keys() and all(torch.equal(weights[k], finished[k]) for k in weights)
    card = " ".join((output / "README.md").read_text().split())
    assert "| training steps | 6 |" in card

    # A checkpoint stopped while written (Trainer writes its trainer_state.json last) is skipped.
    (output / "checkpoint-7").mkdir()
    (output / "checkpoint-7" / "model.safetensors").write_bytes(b"")
    state_file = output / "checkpoint-6" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["log_history"].append({"step": 6, "marker": "from the interrupted run"})  # carried on if resumed
    state_file.write_text(json.dumps(state))
    resumed = small_config(start_dir, data, output, max_steps=9, resume_from_checkpoint="latest", **options)
    with caplog.at_level("WARNING", logger="vanilla_transformer.finetuning"):
        finetune(resumed)
    assert "Skipping checkpoint-7: stopped while written. Resuming from" in caplog.text
    card = " ".join((output / "README.md").read_text().split())
    assert "| training steps | 9 |" in card and "training time" not in card  # this process's part only
    state = json.loads((output / "checkpoint-9" / "trainer_state.json").read_text())
    assert (
        state["global_step"] == 9
        and {"step": 6, "marker": "from the interrupted run"} in state["log_history"]
    )
    # Only checkpoints stopped while written: a new fine-tune is told what they are.
    lone = tmp_path / "lone"
    (lone / "checkpoint-2").mkdir(parents=True)
    with pytest.raises(
        ValueError, match=r"holds checkpoint-2, incomplete .* delete it, or name a new folder"
    ):
        small_config(start_dir, data, lone, **options)
    with pytest.raises(
        ValueError, match=r"holds no whole \(checkpoint-2: stopped while written\) checkpoint"
    ):
        small_config(start_dir, data, lone, resume_from_checkpoint="latest", **options)


def test_scores_are_against_the_reference_texts_not_the_decoded_labels():
    """References were once the labels decoded: characters the tokenizer cannot represent ("{0}" for
    a vocabulary learnt without braces) vanished from them, and outputs missing them scored 100."""
    from datasets import Dataset
    from transformers import EvalPrediction

    tokenizer = train_bpe_tokenizer(["hello world, good day"] * 20, 60)
    texts = ["hello {0} world", "good day"]
    labels = [tokenizer(text_target=text)["input_ids"] for text in texts]
    width = max(map(len, labels))
    padded = np.array([ids + [-100] * (width - len(ids)) for ids in labels])
    outputs = EvalPrediction(predictions=padded, label_ids=padded)  # the labels themselves as outputs
    references = Dataset.from_dict({"target": texts, "labels": labels})
    assert bleu_metric_fn(tokenizer, references)(outputs)["chrf"] < 100  # "{0}" is missing
    assert bleu_metric_fn(tokenizer)(outputs)["chrf"] == 100  # what the decoded labels said
    other = Dataset.from_dict({"target": texts[::-1], "labels": labels[::-1]})  # not these labels
    assert bleu_metric_fn(tokenizer, other)(outputs)["chrf"] == 100  # falls back to decoding
    # The outputs are scored as the tokenizer decodes them, detokenised: sacreBLEU on those texts.
    decoded = tokenizer.batch_decode(labels, skip_special_tokens=True)
    scores = bleu_metric_fn(tokenizer, references)(outputs)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(decoded, [texts]).score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(decoded, [texts]).score, abs=1e-9)
    whole = ["hello world, good day", "good day, hello world"]  # texts the vocabulary writes score 100
    exact = [tokenizer(text_target=text)["input_ids"] for text in whole]
    longest = max(map(len, exact))
    exact = np.array([ids + [-100] * (longest - len(ids)) for ids in exact])
    matched = Dataset.from_dict({"target": whole, "labels": exact.tolist()})
    perfect = bleu_metric_fn(tokenizer, matched)(EvalPrediction(predictions=exact, label_ids=exact))
    assert perfect["bleu"] == pytest.approx(100) and perfect["chrf"] == pytest.approx(100)


def test_outputs_are_scored_against_the_reference_texts_of_their_pairs(start, tmp_path):
    """Evaluation batches grouped by length (transformers 5 groups them where training does) came back
    in another order than the split's: `BleuMetric` did not recognise the references and scored every
    evaluation against the decoded labels."""
    model_dir, data = start
    trainer = build_trainer(
        small_config(model_dir, data, tmp_path / "tuned", max_eval_samples=20), use_cpu=True
    )
    metric, in_order = trainer.compute_metrics, []

    def recorded(prediction):
        rows = [row[row != -100].tolist() for row in prediction.label_ids]
        in_order.append(rows == list(metric.references["labels"]))
        return metric(prediction)

    trainer.compute_metrics = recorded
    trainer.evaluate()
    assert in_order == [True]


def test_every_process_draws_the_same_batch_order_each_epoch(start, tmp_path):
    """Trainer's length-grouped sampler drew its order from the global RNG, which differs between
    processes once dropout has drawn from it for batches of other shapes: from the second epoch on, the
    processes' shards of their different orders trained some pairs twice per epoch and others never
    (64 pairs on 2 processes: 60 distinct in epoch 2). The order now follows the seed and the epoch."""
    model_dir, data = start
    trainer = build_trainer(small_config(model_dir, data, tmp_path / "tuned"), use_cpu=True)
    sampler = trainer._get_train_sampler()
    first = list(sampler)
    torch.rand(1000)  # dropout, on one process more than on another
    assert list(sampler) == first and sorted(first) == list(range(len(trainer.train_dataset)))
    trainer.state.epoch = 1.0
    assert list(sampler) != first


def test_a_marian_fine_tune_says_how_to_get_a_card(marian_start, start, tmp_path, caplog):
    """A fine-tuned MarianMTModel folder gets no card (the card describes this package's model), and
    push_to_hub.py refuses a folder without one: the run said nothing of either."""
    _, data = start
    config = small_config(marian_start, data, tmp_path / "tuned", max_steps=1, validation_size=8)
    with caplog.at_level("WARNING", logger="vanilla_transformer.finetuning"):
        finetune(config)
    assert not (tmp_path / "tuned" / "README.md").exists()
    assert "No model card was written" in caplog.text and "holds a MarianMTModel" in caplog.text
    assert f"convert_marian.py --model {tmp_path / 'tuned'} --output FOLDER --test_file" in caplog.text


def launch_two_cpu_processes(script: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 SCRIPT ARGS`, as the README
    and `processes_without_a_gpu` tell a user to run CPU processes."""
    from tests.test_training import cpu_only, free_port

    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--main_process_port", str(free_port()), str(script), *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, cwd=cwd, env=cpu_only()
    )


RECORDING_LAUNCHER = """
import json, runpy, sys
from vanilla_transformer import finetuning

score = finetuning.BleuMetric.__call__


def recorded(self, prediction):
    with open(SCORED, "a") as log:
        rows = [row[row != -100].tolist() for row in prediction.label_ids]
        in_order = rows == list(self.references["labels"])
        record = {"outputs": len(rows), "pairs": len(self.references), "in_order": in_order}
        print(json.dumps(record), file=log)
    return score(self, prediction)


finetuning.BleuMetric.__call__ = recorded
save = finetuning.FinetuneTrainer.save_model


def saved(self, output_dir=None, _internal_call=False):
    if not _internal_call:  # the fine-tuned model, saved by every process: its weights there
        with open(SCORED, "a") as log:
            total = sum(float(p.double().sum()) for p in self.model.parameters())
            print(json.dumps({"weights": total, "wrapped": type(self.model_wrapped).__name__}), file=log)
    return save(self, output_dir, _internal_call)


finetuning.FinetuneTrainer.save_model = saved
sys.argv[0] = SCRIPT
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_two_cpu_processes_fine_tune_as_one_data_parallel_run(start, tmp_path):
    """Two CPU processes train one model on halves of each update (gloo), not two copies on all of it:
    without `use_cpu`, Trainer left each process on its own, both writing the same folder."""
    model_dir, data = start
    output, scored = tmp_path / "tuned", tmp_path / "scored.jsonl"
    # finetune.py, with what each evaluation scores recorded (by every process) in `scored`.
    recording = tmp_path / "finetune_recording.py"
    recording.write_text(
        RECORDING_LAUNCHER.replace("SCORED", repr(str(scored))).replace(
            "SCRIPT", repr(str(ROOT / "scripts" / "finetune.py"))
        )
    )
    args = [f"--model={model_dir}", f"--train_file={data}", f"--output_dir={output}", "--max_steps=2"]
    args += ["--eval_steps=2", "--per_device_train_batch_size=8", "--per_device_eval_batch_size=8"]
    args += ["--num_beams=1", "--warmup_steps=1", "--validation_size=40", "--max_eval_samples=21"]
    result = launch_two_cpu_processes(recording, args, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    # Every evaluation (before, at step 2, after; on each process) scored the 21 pairs once each, in
    # order: the processes' last batches are filled up with repeated pairs, which were scored too (32
    # outputs), and batches grouped by length scored the outputs against the labels decoded.
    records = [json.loads(line) for line in scored.read_text().splitlines()]
    evaluations = [record for record in records if "outputs" in record]
    expected = {"outputs": 21, "pairs": 21, "in_order": True}
    assert len(evaluations) == 6 and all(e == expected for e in evaluations), evaluations
    # One model, trained under DistributedDataParallel: after the evaluation before training, which
    # prepared the model for evaluation only, Accelerate left it unwrapped and each process trained its
    # own copy on its share of the batches (the processes ended with different weights).
    weights = [record for record in records if "weights" in record]
    assert len(weights) == 2 and weights[0] == weights[1], weights
    assert weights[0]["wrapped"] == "DistributedDataParallel", weights
    text = " ".join((output / "README.md").read_text(encoding="utf-8").split())
    assert "16 sentence pairs per update" in text  # 8 per process x 2 processes
    assert "2 processes |" in text
    assert result.stdout.count("bleu     before") == 1, result.stdout  # one report, not one per process
    # The evaluation after the last update measured the loss one process measures on the saved model: the
    # processes' last batches, filled up with repeated pairs, counted those pairs' losses too.
    history = json.loads((output / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    two = [record["eval_loss"] for record in history if "eval_loss" in record]
    one = small_config(
        output, data, tmp_path / "one", max_eval_samples=21, per_device_eval_batch_size=8, num_beams=1
    )
    alone = build_trainer(one, use_cpu=True).evaluate()["eval_loss"]
    assert two == [pytest.approx(alone, rel=1e-6)], (two, alone)


@pytest.mark.parametrize("device, on_cpus", [(None, True), ("mps", True), ("xpu", False)])
def test_several_processes_run_on_cpus_only_without_an_accelerator(
    start, tmp_path, monkeypatch, device, on_cpus
):
    """Several processes without a CUDA GPU were all told `use_cpu`: on an Intel XPU (or Ascend NPU,
    Gaudi) machine, whose devices Trainer distributes over, the fine-tune then ran on the CPUs; on CPUs
    with torch's CUDA build, the processes were not told, and each ran alone as rank 0."""
    from vanilla_transformer import finetuning

    model_dir, data = start
    arguments = {}

    class Stop(Exception):
        pass

    def recorded(**kwargs):
        arguments.update(kwargs)
        raise Stop

    monkeypatch.setenv("WORLD_SIZE", "2")

    # As torch's builds answer: a CUDA build names CUDA without a GPU too, unless asked for one available.
    def current_accelerator(check_available=False):
        return torch.device("cuda") if not check_available else device and torch.device(device)

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)
    monkeypatch.setattr(finetuning, "Seq2SeqTrainingArguments", recorded)
    with pytest.raises(Stop):
        build_trainer(small_config(model_dir, data, tmp_path / "tuned"))
    assert arguments.get("use_cpu", False) is on_cpus


@pytest.mark.parametrize("kind", ["ours", "marian"])
def test_accumulated_loss_is_the_mean_over_the_whole_update(start, marian_start, tmp_path, kind):
    """With --gradient_accumulation_steps 2 and no label smoothing, a MarianMTModel's loss was its
    micro-batches' means added up: the model swallows Trainer's `num_items_in_batch` and averages per
    batch, and Trainer, seeing a model that takes loss keywords, no longer divided by the accumulation
    steps (the logged loss and the gradient were twice those of one large batch)."""
    model_dir, data = start
    model = model_dir if kind == "ours" else marian_start
    config = small_config(
        model, data, tmp_path / "out", max_steps=1, label_smoothing_factor=0.0, gradient_accumulation_steps=2
    )
    trainer = build_trainer(config)
    micro = []
    for rows in ([0, 1], [2, 3]):
        batch = trainer.data_collator([trainer.train_dataset[i] for i in rows])
        batch.pop("source_length")
        micro.append({name: values.to(trainer.model.device) for name, values in batch.items()})
    items = sum(int((batch["labels"] != -100).sum()) for batch in micro)
    trainer.model.eval()
    trainer.model.train = lambda mode=True: trainer.model  # no dropout: the sums below see one function
    trainer.current_gradient_accumulation_steps = 2  # as the training loop sets it for an update
    reported = sum(trainer.training_step(trainer.model, dict(b), torch.tensor(items)) for b in micro)
    with torch.no_grad():
        total = 0.0
        for batch in micro:
            logits = trainer.model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                decoder_input_ids=batch["decoder_input_ids"],
            ).logits.flatten(0, 1)
            total += torch.nn.functional.cross_entropy(logits, batch["labels"].flatten(), reduction="sum")
    torch.testing.assert_close(reported, total / items, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["ours", "marian"])
def test_evaluation_loss_is_the_token_mean_over_the_split(start, marian_start, tmp_path, kind):
    """The evaluation loss is the label-smoothed loss per target token over every validation pair, as
    train.py's. Trainer averaged its batches' means, the last (short) batch weighted as a full one, and on
    several processes that batch was filled up with repeated pairs whose losses counted (21 pairs in
    batches of 8: 6.555 on two processes, 6.548 on one)."""
    model_dir, data = start
    model = model_dir if kind == "ours" else marian_start
    config = small_config(
        model, data, tmp_path / "out", max_eval_samples=21, per_device_eval_batch_size=8, num_beams=1
    )
    trainer = build_trainer(config, use_cpu=True)
    reported = trainer.evaluate()["eval_loss"]
    pairs = trainer.data_collator([trainer.eval_dataset[i] for i in range(len(trainer.eval_dataset))])
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(
            input_ids=pairs["input_ids"],
            attention_mask=pairs["attention_mask"],
            decoder_input_ids=pairs["decoder_input_ids"],
        ).logits.flatten(0, 1)
    labels = pairs["labels"].flatten()
    total = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum")
    assert len(trainer.eval_dataset) == 21
    assert reported == pytest.approx(float(total / (labels != -100).sum()), rel=1e-5)


def test_short_references_are_scored_as_written(start, tmp_path, monkeypatch):
    """Seq2SeqTrainer pads the labels of a batch shorter than the generation config's `max_length` (20
    once its defaults are filled in) with the pad id, not -100: with short validation sentences
    `BleuMetric` no longer recognised its references and scored against the labels decoded, where the
    snowman, outside the vocabulary, is gone."""
    from vanilla_transformer import finetuning

    model_dir, data = start
    dev = tmp_path / "dev.tsv"
    dev.write_text("en\tes\nYes.\tSí.\nHello snowman.\tHola ☃.\nI don't know.\tNo lo sé.\n", encoding="utf-8")
    config = small_config(model_dir, data, tmp_path / "out", validation_file=str(dev), num_beams=1)
    trainer = build_trainer(config)
    assert max(map(len, trainer.eval_dataset["labels"])) < 20
    scored = []
    score = finetuning.score_translations

    def recorded(hypotheses, references, **kwargs):
        scored.append(list(references))
        return score(hypotheses, references, **kwargs)

    monkeypatch.setattr(finetuning, "score_translations", recorded)
    trainer.evaluate()
    assert scored == [["Sí.", "Hola ☃.", "No lo sé."]]


def test_a_resume_with_another_learning_rate_is_refused(tmp_path):
    """Trainer restores the checkpoint's scheduler, whose base rate is the one it was trained with: a
    resume with another --learning_rate kept training at the old rate (1e-3, resumed with 5e-5), while
    the model card stated the new one."""
    checkpoint = tmp_path / "tuned" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 4}')
    torch.save({"base_lrs": [1e-3, 1e-3], "last_epoch": 4}, checkpoint / "scheduler.pt")
    options = {"model": "m", "train_file": "t", "output_dir": str(tmp_path / "tuned")}
    with pytest.raises(ValueError, match=r"trained with --learning_rate 0\.001, not 5e-05"):
        FinetuneConfig(**options, learning_rate=5e-5, resume_from_checkpoint="latest")
    FinetuneConfig(**options, learning_rate=1e-3, resume_from_checkpoint="latest")


def test_a_resume_under_another_process_count_is_refused(tmp_path, monkeypatch):
    """The process count shapes the updates as the batch size does (per-process batches times processes)
    and the batches Trainer skips on resume: a fine-tune checkpointed by two processes and resumed by one
    went on with half the update size and another data order, and its card stated one process's batch."""
    from vanilla_transformer.finetuning import FLAGS_FILE, resume_flags

    options = {"model": "m", "train_file": "t", "output_dir": str(tmp_path / "tuned")}
    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch and torchrun set it for each process
    flags = resume_flags(FinetuneConfig(**options))
    checkpoint = tmp_path / "tuned" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 4}')
    (checkpoint / FLAGS_FILE).write_text(json.dumps(flags))
    FinetuneConfig(**options, resume_from_checkpoint="latest")  # two processes again: resumed
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"other flags \(2 processes -> 1, launched with --num_processes"):
        FinetuneConfig(**options, resume_from_checkpoint="latest")
    del flags["processes"]  # a checkpoint from before the count was recorded: resumed as it is
    (checkpoint / FLAGS_FILE).write_text(json.dumps(flags))
    FinetuneConfig(**options, resume_from_checkpoint="latest")


def test_a_resume_on_an_edited_training_file_is_refused(start, tmp_path):
    """Only --train_file's path was recorded: a fine-tune resumed after the file was edited in place went
    on, Trainer skipping the batches already trained by count over other pairs, and its card stated the
    new file's pairs as the whole fine-tune's. The pairs' count and text digest are recorded now."""
    start_dir, data = start
    pairs = tmp_path / "pairs.tsv"
    shutil.copy(data, pairs)
    options = {"eval_steps": 1, "max_eval_samples": 2, "num_beams": 1, "per_device_train_batch_size": 16}
    finetune(small_config(start_dir, pairs, tmp_path / "tuned", max_steps=1, **options))
    lines = pairs.read_text(encoding="utf-8").splitlines(keepends=True)
    pairs.write_text("".join(lines[:-100]), encoding="utf-8")  # the same path, 100 pairs fewer
    resumed = small_config(
        start_dir, pairs, tmp_path / "tuned", max_steps=2, resume_from_checkpoint="latest", **options
    )
    with pytest.raises(InputError, match=r"trained on other pairs than --train_file .* \(260 then, 160 now"):
        finetune(resumed)
    pairs.write_text("".join(lines), encoding="utf-8")
    finetune(resumed)  # the data it was trained on: resumed, from step 1
    state = json.loads((tmp_path / "tuned" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry][:1] == [1]  # the first run's
    # Checkpoints of versions that held validation out pair by pair (another split of the same file), with
    # and without the pairs' digest: resumed, they would validate on pairs they trained on.
    from vanilla_transformer.finetuning import FLAGS_FILE

    flags_file = tmp_path / "tuned" / "checkpoint-2" / FLAGS_FILE
    flags = json.loads(flags_file.read_text())
    assert flags.pop("validation_draw") == "by source sentence"
    flags_file.write_text(json.dumps(flags | {"train_sha256": "0" * 64}))
    again = small_config(
        start_dir, pairs, tmp_path / "tuned", max_steps=3, resume_from_checkpoint="latest", **options
    )
    with pytest.raises(InputError, match="the validation pairs are now held out otherwise"):
        finetune(again)
    del flags["train_sha256"]
    flags_file.write_text(json.dumps(flags))
    with pytest.raises(InputError, match="written by an earlier version of this package, which held its"):
        finetune(again)


def test_a_checkpoint_records_its_flags_before_it_counts_as_whole(start, tmp_path, monkeypatch):
    """A checkpoint is whole once Trainer wrote its trainer_state.json (`complete_checkpoints`); its
    finetune_flags.json was written after that, in `on_save`, past the old checkpoints' deletion: a fine-tune
    killed in between left a whole checkpoint without flags, and a resume with other flags went unchecked."""
    from transformers.trainer_callback import TrainerState

    start_dir, data = start
    output = tmp_path / "tuned"
    saving, flags_at_state = TrainerState.save_to_json, {}

    def save_to_json(self, json_path):
        folder = Path(json_path).parent
        flags_at_state[folder.name] = (folder / "finetune_flags.json").is_file()
        return saving(self, json_path)

    monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)
    options = {"eval_steps": 1, "max_eval_samples": 2, "num_beams": 1, "per_device_train_batch_size": 16}
    finetune(small_config(start_dir, data, output, max_steps=2, **options))
    assert flags_at_state == {"checkpoint-1": True, "checkpoint-2": True}


def test_trainer_label_smoothing_without_decoder_inputs_says_how_to_build_them(tmp_path):
    """Trainer with `label_smoothing_factor` takes the labels out of the batch before calling the model, so
    a collator made without `model=` leaves the model no decoder inputs: the error says so, and how to
    build them (the decoder's own message named two arguments the user never passed)."""
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    rows = load_default_corpus()["train"].select(range(16))
    tokenizer = train_bpe_tokenizer(list(rows["en"]) + list(rows["es"]), vocab_size=120)
    data = Dataset.from_dict(dict(tokenizer(list(rows["en"]), text_target=list(rows["es"]))))
    torch.manual_seed(0)
    sizes = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_encoder_layers": 1, "num_decoder_layers": 1}
    config = VanillaTransformerConfig(vocab_size=len(tokenizer), **sizes)
    model = VanillaTransformerForConditionalGeneration(config)
    arguments = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, label_smoothing_factor=0.1,
        report_to="none", save_strategy="no", use_cpu=True,
    )  # fmt: skip
    trainer = Seq2SeqTrainer(
        model=model, args=arguments, train_dataset=data, data_collator=DataCollatorForSeq2Seq(tokenizer)
    )
    with pytest.raises(ValueError, match=r"DataCollatorForSeq2Seq\(tokenizer, model=model\)"):
        trainer.train()
    # With the collator building them, the same run trains (Trainer's smoother computes the loss).
    trainer.data_collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    assert math.isfinite(trainer.train().training_loss)


@pytest.mark.parametrize("label_smoothing_factor", [0.0, 0.1])
def test_trainer_label_smoothing_says_the_unlikelihood_term_is_dropped(tmp_path, label_smoothing_factor):
    """Trainer's `label_smoothing_factor` computes the loss from the logits, without the model's
    unlikelihood term (which the tiny recipe's models carry, weight 2): it is said, once; the model's own
    loss (the factor at 0) keeps the term, and says nothing."""

    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    rows = load_default_corpus()["train"].select(range(16))
    tokenizer = train_bpe_tokenizer(list(rows["en"]) + list(rows["es"]), vocab_size=120)
    data = Dataset.from_dict(dict(tokenizer(list(rows["en"]), text_target=list(rows["es"]))))
    torch.manual_seed(0)
    sizes = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_encoder_layers": 1, "num_decoder_layers": 1}
    config = VanillaTransformerConfig(vocab_size=len(tokenizer), unlikelihood_weight=2.0, **sizes)
    model = VanillaTransformerForConditionalGeneration(config)
    arguments = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
        label_smoothing_factor=label_smoothing_factor, report_to="none", save_strategy="no", use_cpu=True,
    )  # fmt: skip
    trainer = Seq2SeqTrainer(
        model=model,
        args=arguments,
        train_dataset=data,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    with logged_messages(VanillaTransformerForConditionalGeneration.__module__) as warnings:
        trainer.train()
    dropped = [w for w in warnings if "without its unlikelihood term" in w]
    assert len(dropped) == (1 if label_smoothing_factor else 0), warnings


def test_data_files_are_checked_before_the_model_is_loaded(tmp_path, monkeypatch):
    """A missing, folder or unsupported --train_file/--validation_file is refused before the model is
    read: a Hub model would be downloaded first."""
    import vanilla_transformer.finetuning as finetuning

    loads = []
    monkeypatch.setattr(finetuning, "load_model_folder", lambda *a, **k: loads.append(a) or 1 / 0)
    (tmp_path / "pairs.tsv").write_text("en\tes\nhello\thola\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("hello\n", encoding="utf-8")
    output = str(tmp_path / "tuned")
    for files, error, message in (
        ({"train_file": str(tmp_path / "missing.tsv")}, FileNotFoundError, "train file .*missing.tsv does"),
        ({"train_file": str(tmp_path)}, DataError, "train file .* is a folder"),
        ({"train_file": str(tmp_path / "notes.txt")}, DataError, "unsupported file type '.txt'"),
        (
            {"train_file": str(tmp_path / "pairs.tsv"), "validation_file": str(tmp_path / "dev.tsv")},
            FileNotFoundError,
            "validation file .*dev.tsv does not exist",
        ),
    ):
        with pytest.raises(error, match=message):
            build_trainer(FinetuneConfig(model="some-user/some-model", output_dir=output, **files))
    assert loads == []
    with pytest.raises(ZeroDivisionError):  # files that exist: the model is loaded next
        build_trainer(FinetuneConfig(model="m", train_file=str(tmp_path / "pairs.tsv"), output_dir=output))
    assert len(loads) == 1


def test_a_full_disk_while_trainer_writes_a_checkpoint_is_explained(start, tmp_path, monkeypatch):
    """A full disk while Trainer wrote a checkpoint ended in a traceback (safetensors' error, torch's
    "iostream error", an OSError), and the unfinished checkpoint stayed, holding its space. Now the
    message names the last whole checkpoint and how to go on, the unfinished one is gone, and a resume
    finishes the fine-tune."""
    start_dir, data = start
    output = tmp_path / "tuned"
    options = {"eval_steps": 3, "max_eval_samples": 4, "num_beams": 1, "per_device_train_batch_size": 16}
    saving = PreTrainedModel.save_pretrained

    def full_disk_at_the_second(self, directory, *args, **kwargs):
        if Path(directory).name == "checkpoint-6":
            (Path(directory) / "model.safetensors").write_bytes(b"half")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return saving(self, directory, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(PreTrainedModel, "save_pretrained", full_disk_at_the_second)
        with pytest.raises(InputError) as error:
            finetune(small_config(start_dir, data, output, max_steps=9, **options))
    message = str(error.value)
    assert re.match(
        rf"^Writing checkpoint checkpoint-6 in {re.escape(str(output))} failed \(.*os error 28\)", message
    )
    assert "MiB free in" in message and "The last whole checkpoint is checkpoint-3" in message
    assert sorted(p.name for p in output.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]
    metrics = finetune(
        small_config(start_dir, data, output, max_steps=9, resume_from_checkpoint="latest", **options)
    )
    assert metrics["after_loss"] > 0 and (output / "model.safetensors").is_file()


def test_a_failed_training_is_blamed_on_the_disk_only_for_its_own_checkpoint(start, tmp_path, monkeypatch):
    """An error of the training itself keeps its cause (it was re-raised from itself, which hid it), and
    an unfinished checkpoint a killed run left is not taken for this training's failed write, nor
    removed, however little space is free."""
    from collections import namedtuple

    from transformers import Seq2SeqTrainer

    import vanilla_transformer.finetuning as finetuning
    import vanilla_transformer.publishing as publishing

    start_dir, data = start
    output = tmp_path / "tuned"
    config = small_config(start_dir, data, output, max_steps=2, max_eval_samples=4, num_beams=1)

    def failing_train(self, *args, **kwargs):
        try:
            {}["missing"]
        except KeyError as error:
            raise RuntimeError("the collator failed") from error

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(publishing.shutil, "disk_usage", lambda path: usage(2**30, 0, 1000))
    monkeypatch.setattr(Seq2SeqTrainer, "train", failing_train)
    with pytest.raises(RuntimeError, match="the collator failed") as error:
        finetune(config)
    assert isinstance(error.value.__cause__, KeyError)
    (output / "checkpoint-6").mkdir(parents=True)  # unfinished, as a killed run left it
    model = torch.nn.Linear(1000, 1000)
    trainer = type("Trainer", (), {"model": model, "is_world_process_zero": lambda: True})
    failure = RuntimeError("CUDA out of memory")
    earlier = finetuning.checkpoint_folders(output)
    assert finetuning.checkpoint_write_error(failure, config, trainer, earlier) is failure
    assert (output / "checkpoint-6").is_dir()  # not this training's: kept
    (output / "checkpoint-6" / "model.safetensors").write_bytes(b"half")  # Trainer writing it again
    explained = finetuning.checkpoint_write_error(failure, config, trainer, earlier)
    assert isinstance(explained, InputError) and "checkpoint-6" in str(explained)
    # A file removed while the folders are read (another process clearing them) is left out, not raised
    (output / "checkpoint-7").mkdir()
    (output / "checkpoint-7" / "optimizer.pt").write_bytes(b"x")
    stat, seen = Path.stat, []

    def vanished(self, *args, **kwargs):  # there when asked whether it is a file, gone when its time is
        if self.name == "optimizer.pt" and self in seen:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        seen.append(self)
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", vanished)
    assert finetuning.checkpoint_folders(output) == {output / "checkpoint-7": 0}
    assert not (output / "checkpoint-6").exists()
