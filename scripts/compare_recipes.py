"""This package's default recipe against the standard transformers path, at equal training minutes.

Two runs on the same corpus and machine, one after the other, each in its own process:
- ours: `scripts/train.py` with the default (tiny) recipe, stopped by `--max_train_minutes MINUTES`
  alone (its 1,650 updates lifted: a fast machine finished them minutes early);
- marian: a MarianMTModel of the same shape (tiny preset: d_model, heads, d_ff, layers; its own joint
  BPE vocabulary of `--marian_vocab_size`) trained by `Seq2SeqTrainer` as a transformers user would:
  AdamW at 5e-4, inverse square-root schedule with 400 warm-up updates, label smoothing 0.1, 64
  sentences per batch grouped by length, dropout 0.1, stopped once its training loop has run MINUTES.
Both are then scored on the test split with the recipe's decoding (beam 4, length penalty 0.6, stopping
once every beam has finished; ours stops each output at its source's length + 50 new tokens, Marian each
at the longest source's + 50), by sacreBLEU's BLEU and chrF and the share of outputs with a word 4-gram
repeated three or more times. Both start from `--seed`. Prints a table and writes `comparison.json`, with
the commit, the machine and the arguments.

    python scripts/compare_recipes.py --train_file data/train.jsonl --validation_file data/validation.jsonl \\
        --test_file data/test.jsonl --target_lang de --minutes 10 --output_dir runs/compare-de
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from vanilla_transformer.cli import utf8_stdout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ folder

MARIAN = {
    "learning_rate": 5e-4,
    "warmup_steps": 400,
    "label_smoothing": 0.1,
    "batch_size": 64,
    "dropout": 0.1,
}


UNBOUNDED_STEPS = 10**9  # ours' update limit: the minutes end the run first

# The scripts/train.py flags that run_ours passes itself, from this script's own flags.
OWN_TRAIN_FLAGS = (
    "--output_dir",
    "--train_file",
    "--validation_file",
    "--test_file",
    "--source_lang",
    "--target_lang",
    "--max_train_minutes",
    "--seed",
)
# Flags that would train or score ours otherwise than the Marian side: other data, other decoding, part
# of the test split.
ONE_SIDED_FLAGS = (
    "--dataset_name",
    "--dataset_config",
    "--source_column",
    "--target_column",
    "--num_beams",
    "--length_penalty",
    "--length_penalty_form",
    "--no_repeat_ngram_size",
    "--test_samples",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from vanilla_transformer.cli import DefaultsOnce

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsOnce)
    parser.add_argument("--train_file", help="local .tsv/.csv/.jsonl (default: the embedded corpus)")
    parser.add_argument("--validation_file")
    parser.add_argument("--test_file")
    parser.add_argument("--source_lang", default="en", help="source column")
    parser.add_argument("--target_lang", default="es", help="target column")
    parser.add_argument("--minutes", type=float, default=8.0, help="training minutes of each run")
    parser.add_argument("--seed", type=int, default=0, help="the seed of both runs")
    parser.add_argument("--output_dir", required=True, help="folder for both runs and the comparison")
    parser.add_argument(
        "--marian_vocab_size", type=int, default=8000, help="BPE vocabulary of the MarianMTModel side"
    )
    parser.add_argument(
        "--ours_args",
        default="",
        help="extra scripts/train.py flags, one string (not those this script sets: the data files and "
        "languages, --output_dir, --max_train_minutes, --seed; nor those that would train or score ours "
        "alone otherwise: other data, decoding or test pairs)",
    )
    parser.add_argument("--only", choices=("ours", "marian"), help="run one side (in this process)")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    if args.marian_vocab_size <= 4:
        parser.error(f"--marian_vocab_size must exceed the 4 special tokens, got {args.marian_vocab_size}")
    # --train_file alone trained both sides, and then the Marian side, which scores a test split, failed
    if len({bool(args.train_file), bool(args.validation_file), bool(args.test_file)}) > 1:
        parser.error("pass --train_file, --validation_file and --test_file together, or none of them")
    from vanilla_transformer.publishing import check_writable_place

    if not args.output_dir.strip():  # Path("") is the current folder
        parser.error("--output_dir is empty: name a folder to write")
    args.output_dir = Path(args.output_dir)
    try:  # a file there (or above it) failed at the start with a traceback
        if args.output_dir.exists() and not args.output_dir.is_dir():
            raise ValueError(f"{args.output_dir} is a file, not a folder.")
        check_writable_place(args.output_dir)
    except ValueError as error:
        parser.error(f"--output_dir {error}")
    try:  # unbalanced quotes once ended in shlex's traceback, in the process running the ours side
        ours_args = shlex.split(args.ours_args)
    except ValueError as error:
        parser.error(f"--ours_args {args.ours_args!r}: {error}")
    # train.py takes the last of a repeated flag (and an abbreviation of one): these would have trained
    # ours on other data or for other minutes than the Marian side, or written it where it is not read.
    names = [token.split("=")[0] for token in ours_args if token.startswith("--") and len(token) > 2]
    taken = sorted({flag for flag in OWN_TRAIN_FLAGS for name in names if flag.startswith(name)})
    if taken:
        parser.error(
            f"--ours_args sets {', '.join(taken)}, which this script sets for train.py itself, alike for "
            "both sides: use its own flags (--train_file, ..., --minutes, --seed, --output_dir)"
        )
    one_sided = sorted({flag for flag in ONE_SIDED_FLAGS for name in names if flag.startswith(name)})
    if one_sided:
        parser.error(
            f"--ours_args sets {', '.join(one_sided)}, which would train or score ours otherwise than the "
            "Marian side (other data, decoding or test pairs): the comparison would not be like for like"
        )
    return args


def data_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--source_lang", args.source_lang, "--target_lang", args.target_lang]
    for name in ("train_file", "validation_file", "test_file"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    return flags


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """The default recipe, through the training script a user runs."""
    output = args.output_dir / "ours"
    command = [sys.executable, str(Path(__file__).with_name("train.py")), "--output_dir", str(output)]
    command += [*data_flags(args), "--max_train_minutes", str(args.minutes), "--report_to", "none"]
    # The minutes alone stop it (a --max_steps of the user's, later on the line, takes precedence)
    command += ["--max_steps", str(UNBOUNDED_STEPS), "--seed", str(args.seed)]
    command += shlex.split(args.ours_args)
    started = time.perf_counter()
    status = subprocess.run(command, check=False).returncode
    if status:  # train.py has said why (bad data, a full disk, Ctrl-C)
        sys.exit(status)
    wall = time.perf_counter() - started
    metrics = json.loads((output / "metrics.json").read_text())["metrics"]
    return {
        "command_minutes": wall / 60,
        "updates": metrics["steps"],
        "stopped_by": metrics["stopped_by"],
        "train_minutes": metrics["train_time_s"] / 60,
        "bleu": metrics["test_bleu"],
        "chrf": metrics["test_chrf"],
        "repetition": metrics["test_repetition"],
        "reference_repetition": metrics["reference_repetition"],
    }


def run_marian(args: argparse.Namespace) -> dict[str, Any]:
    """MarianMTModel + Seq2SeqTrainer as configured in `MARIAN`, stopped after `args.minutes`."""
    import torch
    from transformers import (
        DataCollatorForSeq2Seq,
        MarianMTModel,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
    )

    from tools.benchmark import marian_like
    from vanilla_transformer import VanillaTransformerConfig
    from vanilla_transformer.cli import InputError
    from vanilla_transformer.metrics import repetition_rate, score_translations
    from vanilla_transformer.parallel_data import load_parallel_data, tokenize_parallel_data
    from vanilla_transformer.tokenization import train_bpe_tokenizer
    from vanilla_transformer.training import TrainingConfig
    from vanilla_transformer.translation import translate

    class TimeLimit(TrainerCallback):
        """Stop training once the training loop has run `seconds`."""

        def __init__(self, seconds: float):
            self.seconds, self.started, self.elapsed = seconds, 0.0, 0.0

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, _args: Any, _state: Any, control: Any, **__: Any) -> None:
            self.elapsed = time.perf_counter() - self.started
            if self.elapsed >= self.seconds:
                control.should_training_stop = True

    torch.manual_seed(args.seed)
    try:  # the data files: missing, unreadable, without the columns (as train.py says for the other side)
        data, _ = load_parallel_data(
            train_file=args.train_file,
            validation_file=args.validation_file,
            test_file=args.test_file,
            source_lang=args.source_lang,
            target_lang=args.target_lang,
        )
        train = data["train"]
        tokenizer = train_bpe_tokenizer(list(train["source"]) + list(train["target"]), args.marian_vocab_size)
        tokenized = tokenize_parallel_data(data, tokenizer, 128)
    except (InputError, OSError) as error:
        sys.exit(f"error: {error}")
    columns = ["input_ids", "attention_mask", "labels"]
    train_set = tokenized["train"].select_columns(columns)
    shape = VanillaTransformerConfig.from_preset(
        "tiny",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        dropout=MARIAN["dropout"],
    )
    model = MarianMTModel(marian_like(shape))
    limit = TimeLimit(args.minutes * 60)
    trainer = Seq2SeqTrainer(
        model=model,
        args=Seq2SeqTrainingArguments(
            output_dir=str(args.output_dir / "marian"),
            per_device_train_batch_size=MARIAN["batch_size"],
            learning_rate=MARIAN["learning_rate"],
            lr_scheduler_type="inverse_sqrt",
            warmup_steps=MARIAN["warmup_steps"],
            label_smoothing_factor=MARIAN["label_smoothing"],
            train_sampling_strategy="group_by_length",
            max_steps=10**7,
            save_strategy="no",
            eval_strategy="no",
            logging_steps=50,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=args.seed,
        ),
        train_dataset=train_set,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        callbacks=[limit],
    )
    result = trainer.train()
    test = data["test"]
    longest = max(len(ids) for ids in tokenized["test"]["input_ids"])
    decoding = {field.name: field.default for field in fields(TrainingConfig)}  # the recipe's, as ours
    hypotheses = translate(
        model,
        tokenizer,
        test["source"],
        batch_size=64,
        num_beams=decoding["num_beams"],
        length_penalty=decoding["length_penalty"],
        early_stopping=True,
        max_new_tokens=longest + 50,
    )
    scores = score_translations(hypotheses, test["target"], target_lang=args.target_lang)
    return {
        "updates": result.global_step,
        "stopped_by": "max_train_minutes" if limit.elapsed >= limit.seconds else "max_steps",
        "train_minutes": limit.elapsed / 60,
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "repetition": repetition_rate(hypotheses),
        "reference_repetition": repetition_rate(test["target"]),
    }


def run_record(args: argparse.Namespace) -> dict[str, Any]:
    """What a reader needs to reproduce a comparison: the code, the machine, the versions, the flags."""
    import torch
    import transformers

    from vanilla_transformer.machine import describe_machine, source_commit

    flags = {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}
    return {
        "commit": source_commit(),
        "machine": describe_machine(measure=False),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "arguments": {name: value for name, value in flags.items() if name != "only"},
    }


def format_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| recipe | updates | training minutes | test BLEU | test chrF | outputs with a repeated 4-gram |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['updates']} | {r['train_minutes']:.1f} | {r['bleu']:.2f} | {r['chrf']:.2f} "
            f"| {r['repetition']:.1%} (references {r['reference_repetition']:.1%}) |"
        )
    if {"ours", "marian"} <= results.keys() and results["marian"]["bleu"] > 0:
        lines.append(f"\nBLEU ours / marian: {results['ours']['bleu'] / results['marian']['bleu']:.2f}x")
    for name, r in results.items():
        if r.get("stopped_by", "max_train_minutes") != "max_train_minutes":
            lines.append(
                f"The {name} run stopped at its update limit, not after the minutes: not an equal budget."
            )
    return "\n".join(lines)


def write_json(path: Path, value: Any) -> None:
    """`value` as `path`, whole or not at all: a run stopped while writing (or a value JSON cannot hold)
    leaves an earlier comparison's file as it was."""
    from vanilla_transformer.cli import replaced_when_complete

    with replaced_when_complete(path) as stream:
        json.dump(value, stream, indent=2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.only:
        result = run_ours(args) if args.only == "ours" else run_marian(args)
        write_json(args.output_dir / f"{args.only}.json", result)
        return 0
    results = {}
    for side in ("ours", "marian"):  # one after the other, each alone in its own process
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--only", side]
        status = subprocess.run(command, check=False, env=os.environ.copy()).returncode
        if status:  # that side has said why; a traceback here would only repeat its command line
            sys.exit(f"error: the {side} run failed (exit status {status}): nothing compared")
        results[side] = json.loads((args.output_dir / f"{side}.json").read_text())
    write_json(args.output_dir / "comparison.json", {**results, "run": run_record(args)})
    print(format_table(results))
    return 0


if __name__ == "__main__":
    utf8_stdout()  # what is printed, in UTF-8 whatever the locale
    sys.exit(main())
