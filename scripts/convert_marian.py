"""Convert an OPUS-MT / Marian checkpoint (a folder or a Hub id) into a vanilla_transformer model folder.

    python scripts/convert_marian.py --model Helsinki-NLP/opus-mt-en-de --output outputs/opus-mt-en-de

The folder then loads with AutoModelForSeq2SeqLM (trust_remote_code=True where the package is not
installed) and gives the same logits and generations as the MarianMTModel. The Marian tokenizer is
copied along (it needs the `sentencepiece` package); if it cannot be, nothing is written, unless
--no-tokenizer asks for the model alone. --output must be a new or empty folder.
"""

import argparse
from pathlib import Path

from transformers import AutoTokenizer, MarianMTModel, PretrainedConfig

from vanilla_transformer.cli import first_line
from vanilla_transformer.conversion import convert_from_marian
from vanilla_transformer.evaluation import looks_local
from vanilla_transformer.publishing import check_new_folder, publish_folder

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="Marian model folder or Hub id")
parser.add_argument("--output", required=True, help="folder to write")
parser.add_argument(
    "--tokenizer",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="copy the Marian tokenizer (needs sentencepiece); --no-tokenizer writes the model alone",
)
args = parser.parse_args()
output = Path(args.output)
try:
    check_new_folder(output)  # refused now, not after the work
except ValueError as error:
    parser.error(f"--output {error}")
if looks_local(args.model) and not Path(args.model).exists():
    parser.error(f"No model folder at {args.model}.")
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
    marian, loading = MarianMTModel.from_pretrained(args.model, output_loading_info=True)
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
with publish_folder(args.output) as staging:  # the folder appears complete or not at all
    model.save_pretrained(staging)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
print(f"model written to {args.output}")
