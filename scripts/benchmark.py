"""Benchmark this model against transformers' MarianMTModel of identical shape; print tables.

    python scripts/benchmark.py                                   # tiny and base presets, CPU, float32
    python scripts/benchmark.py --presets tiny --json bench.json --plot docs/attention_scaling.png
    python scripts/benchmark.py --device cuda --dtype bfloat16

Logic in tools/benchmark.py (outside the installed package).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ folder
from tools.benchmark import TRAINING_BATCHES, TRAINING_MAX_TOKENS, format_tables, run, save_json
from vanilla_transformer.cli import check_output_file, positive_int, utf8_stdout
from vanilla_transformer.export_ctranslate2 import import_ctranslate2

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

ROOT = Path(__file__).resolve().parents[1]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--presets", nargs="+", default=["tiny", "base"], choices=["tiny", "base", "big"])
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
parser.add_argument(
    "--max_tokens",
    type=positive_int,
    default=TRAINING_MAX_TOKENS,
    help="source + target tokens per training batch",
)
parser.add_argument(
    "--batches", type=positive_int, default=TRAINING_BATCHES, help="training batches per round"
)
parser.add_argument("--rounds", type=positive_int, default=2, help="passes over those batches")
parser.add_argument(
    "--repeats", type=positive_int, default=9, help="timed runs of each generate() call, in turns"
)
parser.add_argument("--attention_lengths", type=positive_int, nargs="*", default=[256, 512, 1024, 2048, 4096])
parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument(
    "--deploy",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also time CTranslate2 float32/int8 exports beside both models' generate(), each in its own process "
    "(on the CPU only: with another --device, no deployment table)",
)
parser.add_argument(
    "--compile",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="also time torch.compile: static-cache decoding and the training step (minutes of compilation)",
)
parser.add_argument("--json", help="also write every measurement here")
parser.add_argument(
    "--plot",
    default=str(ROOT / "docs" / "attention_scaling.png"),
    help="log-log plot of attention cost (default: the repository's docs/attention_scaling.png)",
)
args = parser.parse_args()
try:
    torch.empty(0, device=args.device)
except (RuntimeError, AssertionError) as error:  # an unknown device, or one this torch cannot use
    parser.error(f"--device {args.device}: {error}")
# Checked before minutes of measuring: a file that cannot be written would lose them at the end.
for flag, output in (("--json", args.json), ("--plot", args.plot if args.attention_lengths else None)):
    if output is not None:
        try:
            check_output_file(output)
        except ValueError as error:
            parser.error(f"{flag} {error}")
if args.deploy and args.device == "cpu":  # the deployment table comes after minutes of other measuring
    try:
        import_ctranslate2()
    except ImportError as error:
        parser.error(f"--deploy (the default on the CPU): {error}; or pass --no-deploy")
results = run(
    args.presets,
    device=args.device,
    dtype=args.dtype,
    max_tokens=args.max_tokens,
    batches=args.batches,
    rounds=args.rounds,
    repeats=args.repeats,
    attention_lengths=args.attention_lengths,
    memory=args.memory,
    with_compile=args.compile,
    deploy=args.deploy and args.device == "cpu",
    plot_path=args.plot if args.attention_lengths else None,
)
print(format_tables(results))
if args.json:
    save_json(results, args.json)
