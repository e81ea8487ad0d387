"""One `generate()` cell of the benchmark timed in fresh processes, this model and MarianMTModel in
turns: the spread between processes that one benchmark run cannot show. Each process of this model
measures its own kernel choices (`kernels_vanilla_transformer`'s probe), on the machine's state of the
moment, and the benchmark runs every cell in one process, after its training steps.

    python -m tools.generate_processes --preset base --batch_size 1 --beams 1 --processes 4

Each process builds one model as `tools.benchmark` does (same network, seed, 32-token sources, exactly
32 new tokens), decodes once untimed, then times `--calls` calls; printed: every process's median
seconds per call, and per round (one process of each model, one after the other) the ratio ours /
MarianMTModel, with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tools.benchmark import BENCHMARK_VOCABULARY, MODELS


def child(preset: str, kind: str, batch_size: int, beams: int, calls: int) -> float:
    """Median seconds per `generate()` call of a freshly built model, in this process."""
    import torch

    from tools.benchmark import build_model, generation_inputs
    from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig

    config = VanillaTransformerConfig.from_preset(preset, vocab_size=BENCHMARK_VOCABULARY)
    model = build_model(kind, config, "cpu", torch.float32).eval()
    source, options = generation_inputs({kind: model}, "cpu", batch_size, beams)
    times = []
    with torch.inference_mode():
        model.generate(source, **options)  # warm-up: the kernel probe, the kept copies
        for _ in range(calls):
            started = time.perf_counter()
            model.generate(source, **options)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def in_fresh_process(preset: str, kind: str, batch_size: int, beams: int, calls: int) -> float:
    arguments = [preset, kind, batch_size, beams, calls]
    code = (
        f"import json; from tools.generate_processes import child; print(json.dumps(child(*{arguments!r})))"
    )
    root = Path(__file__).resolve().parents[1]  # where `tools` imports from, wherever this runs
    finished = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root
    )
    if finished.returncode != 0:
        raise RuntimeError(f"The {kind} process failed:\n{finished.stderr}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="base", choices=["tiny", "base", "big"])
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--beams", type=int, default=1)
    parser.add_argument("--processes", type=int, default=4, help="fresh processes of each model, in turns")
    parser.add_argument("--calls", type=int, default=7, help="timed generate() calls in each process")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.beams, args.processes, args.calls) < 1:
        parser.error("--batch_size, --beams, --processes and --calls must be at least 1")
    from vanilla_transformer.machine import describe_machine, format_machine

    print(format_machine(describe_machine()))
    cell = f"{args.preset}, batch {args.batch_size}, {'greedy' if args.beams == 1 else f'beam {args.beams}'}"
    print(f"generate() {cell}: median seconds per call in each fresh process")
    print("| round | ours | MarianMTModel | ours / Marian |")
    print("|---|---|---|---|")
    medians: dict[str, list[float]] = {kind: [] for kind in MODELS}
    for round_ in range(1, args.processes + 1):
        for kind in MODELS:
            medians[kind].append(in_fresh_process(args.preset, kind, args.batch_size, args.beams, args.calls))
        ours, marian = medians["ours"][-1], medians["marian"][-1]
        print(f"| {round_} | {ours:.4f} | {marian:.4f} | {ours / marian:.2f}x |", flush=True)
    ours, marian = (statistics.median(medians[kind]) for kind in MODELS)
    print(f"| median | {ours:.4f} | {marian:.4f} | {ours / marian:.2f}x |")


if __name__ == "__main__":
    main()
