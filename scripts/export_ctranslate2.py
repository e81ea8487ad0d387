"""Export a trained model folder to CTranslate2 (the fast CPU/GPU inference engine of OpenNMT).

    python scripts/export_ctranslate2.py outputs/tiny-en-es outputs/tiny-en-es-ct2
    python scripts/export_ctranslate2.py outputs/tiny-en-es outputs/tiny-en-es-ct2-int8 --quantization int8

Then: python scripts/translate.py --model outputs/tiny-en-es-ct2 --engine ctranslate2 < en.txt
Needs `pip install -e ".[ctranslate2]"`. Logic in vanilla_transformer/export_ctranslate2.py.
"""

import argparse
import shutil
import sys
from pathlib import Path

from vanilla_transformer.cli import positive_int, utf8_stdout
from vanilla_transformer.export_ctranslate2 import DEFAULT_MAX_POSITIONS, QUANTIZATIONS, export_ctranslate2
from vanilla_transformer.publishing import mebibytes, out_of_space

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("model_dir", help="a model folder written by scripts/train.py (or save_pretrained)")
parser.add_argument(
    "output_dir", help="the CTranslate2 folder to write: a new one, or an earlier export to replace"
)
parser.add_argument(
    "--quantization", choices=QUANTIZATIONS, help="weight type (default: float32, identical outputs)"
)
parser.add_argument(
    "--max_positions",
    type=positive_int,
    default=DEFAULT_MAX_POSITIONS,
    help="positions in the exported encoding table: the longest source, and output, it can translate "
    f"(default: {DEFAULT_MAX_POSITIONS})",
)
args = parser.parse_args()
if args.max_positions < 2:
    parser.error("--max_positions must be at least 2")
try:
    folder = export_ctranslate2(
        args.model_dir, args.output_dir, quantization=args.quantization, max_positions=args.max_positions
    )
except (OSError, ValueError, ImportError) as error:
    if out_of_space(error):  # the folder is written aside: an earlier export stays as it was
        sys.exit(
            f"error: writing {args.output_dir} failed ({error}): "
            f"{mebibytes(shutil.disk_usage(Path(args.output_dir).resolve().parent).free)} MiB free there. "
            "An earlier export there is intact: free some space and run again."
        )
    parser.error(str(error))
print(f"wrote {folder}")
