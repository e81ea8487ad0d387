"""One `generate()` cell of the benchmark timed in several fresh processes: the spread between
processes that one benchmark run cannot show. Each process of this model measures its own kernel
choices (`kernels_vanilla_transformer`'s probe) on the machine's state of the moment, and the benchmark
runs every cell in one process, after its training steps.

    python -m tools.generate_processes --preset base --batch_size 1 --beams 1 --processes 4

Each process builds both models as `tools.benchmark` does (same network, seed, 32-token sources, exactly
32 new tokens) and times them as the benchmark does, in turns call by call (`benchmark_generate`), so
that each process's ratio is as robust to the machine's changing speed as the benchmark's: printed,
every process's medians and their ratio ours / MarianMTModel, and the median of those ratios, with the
machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tools.benchmark import BENCHMARK_VOCABULARY, MODELS
from vanilla_transformer.cli import positive_int


def child(preset: str, batch_size: int, beams: int, repeats: int) -> dict[str, float]:
    """Median seconds per `generate()` call of both models, freshly built in this process, in turns."""
    import torch

    from tools.benchmark import benchmark_generate, build_model
    from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig

    config = VanillaTransformerConfig.from_preset(preset, vocab_size=BENCHMARK_VOCABULARY)
    models = {kind: build_model(kind, config, "cpu", torch.float32) for kind in MODELS}
    return benchmark_generate(models, "cpu", batch_size=batch_size, num_beams=beams, repeats=repeats)


def in_fresh_process(preset: str, batch_size: int, beams: int, repeats: int) -> dict[str, float]:
    arguments = [preset, batch_size, beams, repeats]
    code = (
        f"import json; from tools.generate_processes import child; print(json.dumps(child(*{arguments!r})))"
    )
    root = Path(__file__).resolve().parents[1]  # where `tools` imports from, wherever this runs
    finished = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root
    )
    if finished.returncode != 0:
        raise RuntimeError(f"A benchmark process failed:\n{finished.stderr}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="base", choices=["tiny", "base", "big"])
    parser.add_argument("--batch_size", type=positive_int, default=1)
    parser.add_argument("--beams", type=positive_int, default=1)
    parser.add_argument(
        "--processes", type=positive_int, default=4, help="fresh processes, one after the other"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=7, help="timed generate() calls of each model per process"
    )
    args = parser.parse_args(argv)
    from vanilla_transformer.machine import describe_machine, format_machine

    print(format_machine(describe_machine()))
    cell = f"{args.preset}, batch {args.batch_size}, {'greedy' if args.beams == 1 else f'beam {args.beams}'}"
    print(f"generate() {cell}: median seconds per call, both models in turns in each fresh process")
    print("| process | ours | MarianMTModel | ours / Marian |")
    print("|---|---|---|---|")
    ratios = []
    for process in range(1, args.processes + 1):
        medians = in_fresh_process(args.preset, args.batch_size, args.beams, args.repeats)
        ratios.append(medians["ours"] / medians["marian"])
        print(
            f"| {process} | {medians['ours']:.4f} | {medians['marian']:.4f} | {ratios[-1]:.2f}x |", flush=True
        )
    print(f"median ratio {statistics.median(ratios):.2f}x (from {min(ratios):.2f}x to {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
