"""Average chosen checkpoints of a training run into a new model folder (paper Section 6.1).

    python scripts/average_checkpoints.py --model outputs/tiny-en-es \\
        --checkpoints outputs/tiny-en-es/checkpoints/step-0000{1450,1500,1550,1600,1650} --output averaged
    python scripts/evaluate_model.py --model averaged

The training job already averages its last `--average_checkpoints`; this script averages any others
(another span, an earlier point of a longer run). The new folder gets the run's configuration, code,
generation settings and tokenizer, and the averaged weights; not the run's model card, metrics or curves,
which describe the run's own model. --output must be a new or empty folder.
"""

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.publishing import publish_folder
from vanilla_transformer.training import checkpoint_problems, load_averaged_weights

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="the run's model folder (configuration and tokenizer)")
parser.add_argument(
    "--checkpoints", required=True, nargs="+", type=Path, help="checkpoint folders to average"
)
parser.add_argument("--output", required=True, help="folder to write")
args = parser.parse_args()
output = Path(args.output)
if output.exists() and (not output.is_dir() or any(output.iterdir())):
    parser.error(f"--output {args.output} exists and is not an empty folder; name a new one.")
if len(set(map(Path.resolve, args.checkpoints))) < len(args.checkpoints):
    parser.error("--checkpoints names a folder twice; it would count twice in the average.")
for checkpoint in args.checkpoints:
    if not checkpoint.is_dir():
        parser.error(f"No checkpoint folder at {checkpoint}.")
    problems = checkpoint_problems(checkpoint)
    if problems:
        parser.error(f"{checkpoint} is not a complete checkpoint: {'; '.join(problems)}")
try:
    model = VanillaTransformerForConditionalGeneration.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_averaged_weights(model, args.checkpoints)
except (OSError, ValueError, RuntimeError) as error:
    parser.error(str(error))
with publish_folder(output) as staging:  # the folder appears complete or not at all
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
print(f"the average of {len(args.checkpoints)} checkpoints written to {output}")
