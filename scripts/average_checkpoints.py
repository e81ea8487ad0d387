"""Average chosen checkpoints of a training run into a new model folder (paper Section 6.1).

    python scripts/average_checkpoints.py --model outputs/tiny-en-es \\
        --checkpoints outputs/tiny-en-es/checkpoints/step-0000{1450,1500,1550,1600,1650} --output averaged
    python scripts/evaluate_model.py --model averaged

The training job already averages its last `--average_checkpoints`; this script averages any others
(another span, an earlier point of a longer run). The new folder gets the run's configuration, code,
generation settings and tokenizer, and the averaged weights; not the run's metrics or curves, which
describe the run's own model. Its model card is the run's with the averaged checkpoints and their own
scores, measured on the split the run scored, decoded as the run decoded (--no-card skips that); a run
whose metrics.json predates that record, or whose scored split was held out of its training data at
random, gets no card. --output must be a new or empty folder, not under a file, in a place that can be
written (checked before anything is loaded). Checkpoints of different runs (each run
records an id in its checkpoints and metrics.json), of another run than --model's, or trained with
another vocabulary than --model's tokenizer are refused.
"""

import argparse
import contextlib
import json
from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoTokenizer

from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.cli import first_line, positive_int, utf8_stdout
from vanilla_transformer.evaluation import (
    evaluate_model,
    format_scores,
    looks_local,
    warn_without_generation_config,
)
from vanilla_transformer.publishing import (
    check_files_readable,
    check_folder_json,
    check_has_tokenizer,
    check_new_folder,
    disk_full_message,
    hidden_sibling,
    lock_folder,
    publish_folder,
)
from vanilla_transformer.training import (
    checkpoint_problems,
    checkpoint_steps,
    foreign_checkpoints,
    load_averaged_weights,
    write_averaged_card,
)

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="the run's model folder (configuration and tokenizer)")
parser.add_argument(
    "--checkpoints", required=True, nargs="+", type=Path, help="checkpoint folders to average"
)
parser.add_argument("--output", required=True, help="folder to write")
parser.add_argument(
    "--card",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="score the average on the split the run scored (its test split, else validation) and write its "
    "model card (what push_to_hub.py needs)",
)
parser.add_argument(
    "--batch_size", type=positive_int, default=32, help="sentences per batch when scoring (default: 32)"
)
args = parser.parse_args()
if not args.output.strip():  # Path("") is the current folder
    parser.error("--output is empty: name a new folder to write")
output = Path(args.output)
try:
    check_new_folder(output)  # refused now, not after the work
except ValueError as error:
    parser.error(f"--output {error}")
# One run per --output (a command started twice, a retried job): a second one removed the first's
# half-written folder as an interrupted run's, and a folder with one's weights and the other's card was
# published. Held until the script ends.
try:
    output_lock = lock_folder(output)
except BlockingIOError:
    parser.error(
        f"--output {output} is being written by another run (it holds {hidden_sibling(output, 'lock')}): "
        "wait for it to end, or name another folder."
    )
if len(set(map(Path.resolve, args.checkpoints))) < len(args.checkpoints):
    parser.error("--checkpoints names a folder twice; it would count twice in the average.")
for checkpoint in args.checkpoints:
    if not checkpoint.is_dir():
        parser.error(f"No checkpoint folder at {checkpoint}.")
    problems = checkpoint_problems(checkpoint)
    if problems:
        parser.error(f"{checkpoint} cannot be averaged: {'; '.join(problems)}")
if looks_local(args.model) and not Path(args.model).is_dir():
    parser.error(f"No model folder at {args.model}.")
local = looks_local(args.model) or Path(args.model).is_dir()  # "my-model": a folder here, or a Hub id
if local:
    try:
        check_files_readable(args.model)
        check_has_tokenizer(args.model)
        check_folder_json(args.model)  # a broken generation config would be saved as none at all
    except (OSError, ValueError) as error:
        parser.error(str(error))
problems = foreign_checkpoints(Path(args.model), args.checkpoints)
if problems:
    parser.error(" ".join(problems))
# The run's record of its card and of the data it scored, for the average's card.
record: dict = {}
with contextlib.suppress(OSError, ValueError):  # a Hub model's is not read; an unreadable one is none
    record = json.loads((Path(args.model) / "metrics.json").read_text(encoding="utf-8"))
no_card = None
if not args.card:
    no_card = "--no-card"
elif not (Path(args.model) / "metrics.json").is_file():
    no_card = f"{args.model} has no metrics.json (a Hub model, or a folder scripts/train.py did not write)"
elif not isinstance(record, dict) or "card" not in record:
    no_card = f"{args.model}'s metrics.json does not record its card's contents (an earlier version's run)"
elif record.get("scored_data") is None:
    no_card = f"the split {args.model}'s run scored was held out of its training data at random"
else:
    try:  # the card names the steps averaged
        steps = checkpoint_steps(args.checkpoints)
    except ValueError as error:
        no_card = str(error)
    data_files = [path for key, path in record["scored_data"].items() if key.endswith("_file")]
    for path in data_files if no_card is None else []:
        if not Path(path).is_file():
            parser.error(
                f"{path}, the data {args.model}'s run scored, is gone: the average's card cannot be scored "
                "(--no-card writes the average without a card)"
            )
try:
    model = VanillaTransformerForConditionalGeneration.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
except (OSError, ValueError, SafetensorError) as error:  # safetensors' (a truncated file) is neither
    parser.error(f"the model in {args.model} could not be read: {first_line(error)}")
if local:
    warn_without_generation_config(Path(args.model), model)  # the average would be saved greedy
try:
    load_averaged_weights(model, args.checkpoints)
except (OSError, ValueError) as error:  # a checkpoint without averageable weights (sharded FSDP)
    parser.error(first_line(error))
except RuntimeError as error:  # torch lists every mismatched weight: name the first
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    shapes = next((line for line in lines if line.startswith("size mismatch")), lines[0] if lines else "")
    parser.error(f"the checkpoints' weights do not fit {args.model}'s model: {shapes[:300]}")
try:
    with publish_folder(output, keep_other_files=False) as staging:  # complete or not at all
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if no_card is None:
            try:
                scores = evaluate_model(
                    staging,
                    split=record["metrics"]["split"],
                    max_samples=record["metrics"]["scored_pairs"],
                    batch_size=args.batch_size,
                    data_options=record["scored_data"],
                )
            except (OSError, ValueError) as error:  # the run's data moved, or a Hub dataset not reached
                split = record["metrics"]["split"]
                parser.error(
                    f"the run's {split} data could not be scored: {first_line(error)} (--no-card skips it)"
                )
            print("\n".join(format_scores(scores)))
            write_averaged_card(
                staging,
                model_name=output.resolve().name,
                run_record=record,
                steps=steps,
                scores=scores,
            )
except Exception as error:  # safetensors' and tokenizers' errors are not OSErrors
    message = disk_full_message(error, output, model, "Nothing was written: free some space and run again.")
    if message is None:
        raise
    parser.error(message)
if len(args.checkpoints) > 1:
    print(f"the average of {len(args.checkpoints)} checkpoints written to {output}")
else:
    print(f"the weights of {args.checkpoints[0]} (one checkpoint: nothing averaged) written to {output}")
if no_card is not None and args.card:
    print(f"no model card: {no_card}")
