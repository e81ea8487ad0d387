"""One cell of the benchmark, a `generate()` cell or a training row, timed in several fresh processes:
the spread between processes that one benchmark run cannot show. Each process of this model measures
its own kernel choices (`kernels_vanilla_transformer`'s probe) on the machine's state of the moment,
and the benchmark runs every cell in one process, after the cells before it.

    python -m tools.benchmark_processes --preset base --batch_size 1 --beams 1 --processes 4
    python -m tools.benchmark_processes --preset base --train length-bucketed --processes 4

Each process builds both models as `tools.benchmark` does (same network, seed, 32-token sources and
exactly 32 new tokens; for training, the benchmark's batches of the embedded corpus) and times them as
the benchmark does, in turns call by call or batch by batch, so that each process's ratio is as robust
to the machine's changing speed as the benchmark's: printed, every process's figures (median seconds
per `generate()` call, or target tokens per second) and their ratio ours / MarianMTModel, and the
median of those ratios, with the machine they ran on.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from tools.benchmark import BENCHMARK_VOCABULARY, MODELS, add_generate_cell_arguments, in_fresh_process
from vanilla_transformer.cli import positive_int

# `--train` choices and the benchmark rows they time
TRAINING_ROWS = {"length-bucketed": "length-bucketed", "trainer": "Trainer path"}


def child(preset: str, batch_size: int, beams: int, repeats: int) -> dict[str, float]:
    """Median seconds per `generate()` call of both models, freshly built in this process, in turns."""
    import torch

    from tools.benchmark import benchmark_generate, build_model
    from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig

    config = VanillaTransformerConfig.from_preset(preset, vocab_size=BENCHMARK_VOCABULARY)
    models = {kind: build_model(kind, config, "cpu", torch.float32) for kind in MODELS}
    return benchmark_generate(models, "cpu", batch_size=batch_size, num_beams=beams, repeats=repeats)


def training_child(preset: str, row: str, rounds: int) -> dict[str, float]:
    """Target tokens per second of both models' training steps, freshly built in this process, batch by
    batch in turns: the benchmark's `row` ("length-bucketed" or "Trainer path")."""
    import torch

    from tools import benchmark
    from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig

    tokenizer = benchmark.benchmark_tokenizer()
    batches = benchmark.corpus_batches(
        tokenizer, benchmark.TRAINING_MAX_TOKENS, benchmark.TRAINING_BATCHES, padding_heavy=False
    )
    config = VanillaTransformerConfig.from_preset(preset, vocab_size=len(tokenizer))
    models = {kind: benchmark.build_model(kind, config, "cpu", torch.float32) for kind in MODELS}
    loss = benchmark.trainer_loss if row == "Trainer path" else benchmark.training_loss
    measured = benchmark.benchmark_training(models, batches, "cpu", rounds, loss)
    return {kind: measured[kind]["tokens_per_s"] for kind in MODELS}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_generate_cell_arguments(parser)
    parser.add_argument(
        "--processes", type=positive_int, default=4, help="fresh processes, one after the other"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=7, help="timed generate() calls of each model per process"
    )
    parser.add_argument(
        "--train",
        choices=sorted(TRAINING_ROWS),
        help="time this training row instead of generate() (--batch_size and --beams unused)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=2, help="with --train: passes over the batches per process"
    )
    args = parser.parse_args(argv)
    from vanilla_transformer.machine import describe_machine, format_machine

    print(format_machine(describe_machine()))
    if args.train:
        row = TRAINING_ROWS[args.train]
        print(f"train {row}, {args.preset}: target tokens per second, both models in turns in each process")
    else:
        beams = "greedy" if args.beams == 1 else f"beam {args.beams}"
        print(
            f"generate() {args.preset}, batch {args.batch_size}, {beams}: median seconds per call, "
            "both models in turns in each fresh process"
        )
    print("| process | ours | MarianMTModel | ours / Marian |")
    print("|---|---|---|---|")
    ratios = []
    for process in range(1, args.processes + 1):
        if args.train:
            figures = in_fresh_process("benchmark_processes", "training_child", args.preset, row, args.rounds)
            ours, marian = f"{figures['ours']:,.0f}", f"{figures['marian']:,.0f}"
        else:
            cell = (args.preset, args.batch_size, args.beams, args.repeats)
            figures = in_fresh_process("benchmark_processes", "child", *cell)
            ours, marian = f"{figures['ours']:.4f}", f"{figures['marian']:.4f}"
        ratios.append(figures["ours"] / figures["marian"])
        print(f"| {process} | {ours} | {marian} | {ratios[-1]:.2f}x |", flush=True)
    print(f"median ratio {statistics.median(ratios):.2f}x (from {min(ratios):.2f}x to {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
