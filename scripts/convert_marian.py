"""Convert an OPUS-MT / Marian checkpoint (a folder or a Hub id) into a vanilla_transformer model folder.

    python scripts/convert_marian.py --model Helsinki-NLP/opus-mt-en-de --output outputs/opus-mt-en-de \\
        --test_file newstest2014.tsv --source_lang en --target_lang de

The folder then loads with AutoModelForSeq2SeqLM (trust_remote_code=True where the package is not
installed) and gives the same logits and generations as the MarianMTModel. The Marian tokenizer is
copied along (it needs the `sentencepiece` package); if it cannot be, nothing is written, unless
--no-tokenizer asks for the model alone. --output must be a new or empty folder.

With --test_file, the converted model is scored on it (BLEU and chrF, decoded with its generation
config, as scripts/evaluate_model.py scores) and the folder gets a model card with the scores, the
model it was converted from and that model's licence: what scripts/push_to_hub.py needs to publish it.
"""

import argparse
from pathlib import Path

from transformers import AutoTokenizer, MarianMTModel, PretrainedConfig

from vanilla_transformer.cli import first_line, positive_int, utf8_stdout
from vanilla_transformer.conversion import convert_from_marian, write_converted_card
from vanilla_transformer.evaluation import evaluate_model, format_scores, looks_local
from vanilla_transformer.model_card import base_license, copy_license_file
from vanilla_transformer.parallel_data import load_parallel_data, resolve_languages
from vanilla_transformer.publishing import check_new_folder, disk_full_message, publish_folder

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="Marian model folder or Hub id")
parser.add_argument("--output", required=True, help="folder to write")
parser.add_argument(
    "--tokenizer",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="copy the Marian tokenizer (needs sentencepiece); --no-tokenizer writes the model alone",
)
card = parser.add_argument_group("model card (what push_to_hub.py needs): scores on a test file")
card.add_argument("--test_file", help="local .tsv/.csv/.jsonl file of sentence pairs to score")
card.add_argument("--source_lang", help="its source language code (the card's; the column's name too)")
card.add_argument("--target_lang", help="its target language code")
card.add_argument("--source_column", help="default: --source_lang")
card.add_argument("--target_column", help="default: --target_lang")
card.add_argument("--max_samples", type=positive_int, help="score only the first N pairs")
card.add_argument("--batch_size", type=positive_int, help="sentences per batch when scoring (default: 32)")
args = parser.parse_args()
if not args.output.strip():  # Path("") is the current folder
    parser.error("--output is empty: name a new folder to write")
output = Path(args.output)
columns = ("source_lang", "target_lang", "source_column", "target_column")
if args.test_file is None:
    scoring = (*columns, "max_samples", "batch_size")
    given = [f"--{name}" for name in scoring if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)}: only with --test_file (the data to score for the model card)")
else:
    if not (args.source_lang and args.target_lang):
        parser.error("--test_file needs --source_lang and --target_lang (the languages the card states)")
    try:  # language codes, not columns' names
        resolve_languages(args)
    except ValueError as error:
        parser.error(str(error))
    if not args.tokenizer:
        parser.error("--test_file needs the tokenizer to translate with; it cannot go with --no-tokenizer")
    if not Path(args.test_file).is_file():
        parser.error(f"--test_file {args.test_file}: no such file")
    scoring_data = {"test_file": args.test_file, **{name: getattr(args, name) for name in columns}}
    try:  # its columns and pairs checked now, not after the conversion
        pairs = len(load_parallel_data(**scoring_data, for_training=False)[0]["test"])
    except (OSError, ValueError) as error:
        parser.error(f"--test_file {args.test_file}: {first_line(error)}")
    if not pairs:
        parser.error(f"--test_file {args.test_file} has no sentence pair with both sides non-empty")
try:
    check_new_folder(output)  # refused now, not after the work
except ValueError as error:
    parser.error(f"--output {error}")
if looks_local(args.model) and not Path(args.model).exists():
    parser.error(f"No model folder at {args.model}.")
if Path(args.model).is_file():  # transformers would read it as the config and unpickle it as the weights
    parser.error(f"--model {args.model} is a file: give the model folder that holds it (or a Hub id).")
if Path(args.model).is_dir() and not (Path(args.model) / "config.json").is_file():
    parser.error(f"{args.model} has no config.json: it is not a model folder (a MarianMTModel's).")
try:
    model_type = PretrainedConfig.get_config_dict(args.model)[0].get("model_type")
    if model_type != "marian":
        parser.error(
            f"{args.model} is not a Marian checkpoint: its config.json has model_type {model_type!r}."
        )
    # A local folder without a tokenizer's files: said before the weights are read (the tokenizer
    # loader's own error would blame sentencepiece).
    files = ("source.spm", "target.spm", "vocab.json", "tokenizer.json", "tokenizer_config.json")
    folder = Path(args.model)
    if args.tokenizer and folder.is_dir() and not any((folder / name).is_file() for name in files):
        parser.error(
            f"{args.model} has no tokenizer files (none of {', '.join(files)}); --no-tokenizer converts "
            "the model alone"
        )
    # Weights of other shapes than config.json gives are reported here (transformers' own refusal is a
    # RuntimeError traceback after its load report), and refused below like missing ones.
    marian, loading = MarianMTModel.from_pretrained(
        args.model, output_loading_info=True, ignore_mismatched_sizes=True
    )
    mismatched = sorted(loading["mismatched_keys"])
    if mismatched:
        key, stored, expected = mismatched[0]
        parser.error(
            f"{args.model}: {len(mismatched)} of its weights do not have the shapes its config.json gives "
            f"(the first: {key}, {tuple(stored)} in the checkpoint, {tuple(expected)} from the config); "
            "the weights and the configuration are not of one model."
        )
    # transformers fills weights the checkpoint lacks with random ones and only warns (a saved
    # MarianForCausalLM has model_type "marian" and no encoder); the positions are computed anyway.
    missing = sorted(key for key in loading["missing_keys"] if "embed_positions" not in key)
    if missing:
        parser.error(
            f"{args.model} lacks {len(missing)} of a MarianMTModel's weights (the first: "
            f"{', '.join(missing[:3])}); it is not a complete translation model."
        )
    model = convert_from_marian(marian)
except (OSError, ValueError) as error:
    parser.error(str(error))
tokenizer = None
if args.tokenizer:
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as error:  # sentencepiece missing, or files it cannot read (TypeError, RuntimeError)
        parser.error(
            f"the Marian tokenizer of {args.model} could not be loaded (it needs sentencepiece; "
            f"--no-tokenizer converts the model alone): {first_line(error)}"
        )
try:
    with publish_folder(args.output, keep_other_files=False) as staging:  # complete or not at all
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if args.test_file is not None:
            scores = evaluate_model(
                staging,
                max_samples=args.max_samples,
                batch_size=args.batch_size or 32,
                data_options=scoring_data,
            )
            print("\n".join(format_scores(scores)))
            write_converted_card(
                staging,
                model_name=output.resolve().name,
                converted_from=args.model,
                scores=scores,
                test_file=args.test_file,
                source_lang=args.source_lang,
                target_lang=args.target_lang,
                **(licence := base_license(args.model)),
            )
            copy_license_file(args.model, staging, licence["license_link"])
except Exception as error:  # safetensors' and tokenizers' errors are not OSErrors
    message = disk_full_message(
        error, args.output, model, "Nothing was written: free some space and run again."
    )
    if message is None:
        raise
    parser.error(message)
print(f"model written to {args.output}")
if args.test_file is None:
    print("no model card: --test_file (with --source_lang, --target_lang) scores the model and writes one")
