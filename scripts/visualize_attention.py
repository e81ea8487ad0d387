"""Draw a trained model's attention maps for one sentence, and the sinusoidal positional encoding.

python scripts/visualize_attention.py --model outputs/tiny-en-es --source "The animal did not cross the road."
python scripts/visualize_attention.py --model DIR --source "..." --target "..." --output_dir pictures

Writes encoder_self_attention.png, decoder_self_attention.png, cross_attention.png (a grid of layers x
heads plus the mean over heads) and, for this package's models, positional_encoding.png (another model,
a MarianMTModel say, gets the attention maps alone). Without --target, the model's own translation (beam
search, its generation config) is used. Logic in vanilla_transformer.visualization.
"""

import argparse
import sys
from pathlib import Path

from vanilla_transformer.cli import utf8_stdout
from vanilla_transformer.evaluation import load_model_folder
from vanilla_transformer.visualization import (
    MAX_ENCODING_POSITIONS,
    attention_maps,
    plot_attention_maps,
    plot_positional_encoding,
)

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="model folder (or Hub id) with its tokenizer")
parser.add_argument("--source", required=True, help="source sentence")
parser.add_argument("--target", help="target sentence (default: the model's translation)")
parser.add_argument(
    "--output_dir", default="attention_maps", help="where the PNGs go (default: attention_maps)"
)
parser.add_argument(
    "--positions", type=int, default=100, help="positions in the encoding pictures (default: 100)"
)
parser.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
parser.add_argument(
    "--trust_remote_code",
    action="store_true",
    help="load a model whose folder (or Hub repo) holds model code of its own, running that code; this "
    "package's models need none",
)
args = parser.parse_args()
if not 2 <= args.positions <= MAX_ENCODING_POSITIONS:
    parser.error(f"--positions must be between 2 and {MAX_ENCODING_POSITIONS}, got {args.positions}.")
if not args.output_dir.strip():  # Path("") is the current folder, and "" + "/name" the root's file
    parser.error("--output_dir is empty: name the folder to write the pictures in")
# Checked before the model loads and runs: the first folder on the way that exists must be a folder, and
# the folder must be made now (no permission, a name too long, ...), not after the model ran.
try:
    existing = next(
        p for p in (Path(args.output_dir), *Path(args.output_dir).absolute().parents) if p.exists()
    )
    if not existing.is_dir():
        parser.error(f"--output_dir {args.output_dir}: {existing} is a file, not a folder.")
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
except OSError as error:
    parser.error(f"--output_dir {args.output_dir}: {error.strerror or error}")
try:
    model, tokenizer = load_model_folder(args.model, args.device, args.trust_remote_code)
    maps = attention_maps(model, tokenizer, args.source, args.target)
except (OSError, ValueError) as error:
    parser.error(str(error))

try:
    paths = plot_attention_maps(maps, args.output_dir)
    # Another model's configuration has no encoding layout: read as one, it ended in an AttributeError.
    own_model = model.config.model_type == "vanilla_transformer"
    if own_model:
        paths["positional_encoding"] = Path(args.output_dir) / "positional_encoding.png"
        plot_positional_encoding(
            paths["positional_encoding"],
            d_model=model.config.d_model,
            length=args.positions,
            layout=model.config.position_encoding_layout,
        )
except OSError as error:  # a full disk, a folder made read-only meanwhile
    sys.exit(f"error: --output_dir {args.output_dir}: {error}")
except ValueError as error:  # a picture too large to render
    parser.error(str(error))
print("source:", " ".join(maps.source_tokens))
print("target:", " ".join(maps.target_tokens))
for path in paths.values():
    print("wrote", path)
if not own_model:
    print(
        f"positional_encoding.png not drawn: it shows this package's position encoding, and this is a "
        f"{model.config.model_type!r} model",
        file=sys.stderr,
    )
