"""Training-step times of this model and MarianMTModel (tiny preset), each loss path, cold and warm.

    python tools/training_steps_cold_warm.py --device cuda --batches 8

For each variant (this model's training-script loss and Trainer path, MarianMTModel's the same), a fresh
model takes one pass over length-bucketed batches of the embedded corpus (cold: the first use of each
shape), then three more (warm). The variants run one after another in one process, so process-wide
first-use costs (CUDA context, kernels loaded on first use) fall on the first variant of each dtype:
compare the warm columns, and read the cold ones for what a new shape costs. Prints a table (warm
tokens/s counts target tokens); with --profile (CUDA), also the heaviest operations of four warm steps
of each variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.benchmark import (
    TRAINING_MAX_TOKENS,
    benchmark_tokenizer,
    build_model,
    corpus_batches,
    median_time,
    synchronize,
    to_device,
    train_step_fn,
    trainer_loss,
    training_loss,
)
from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.machine import describe_gpu, describe_machine, format_machine

Step = Callable[[dict[str, torch.Tensor]], None]


def timed(step: Step, batch: dict[str, torch.Tensor], device: str) -> float:
    """Seconds of one step on `batch` (the benchmark's timer, with the device synchronised)."""
    return median_time(lambda: step(batch), device, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, default=8, help="length-bucketed batches of 4,096 tokens")
    dtypes = ["bfloat16", "float32"]
    parser.add_argument("--dtypes", nargs="+", default=dtypes, choices=dtypes)
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables (CUDA)")
    args = parser.parse_args()
    machine = describe_machine(measure=False)
    if args.device.startswith("cuda"):
        machine |= describe_gpu(args.device, torch.bfloat16)
    print(f"machine: {format_machine(machine)}; device {args.device}, torch {torch.__version__}")
    tokenizer = benchmark_tokenizer()
    cpu_batches = corpus_batches(tokenizer, TRAINING_MAX_TOKENS, args.batches, padding_heavy=False)
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer))
    print("| dtype | variant | cold pass (s) | first step (ms) | warm step, median (ms) | warm tokens/s |")
    print("|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        batches = [to_device(batch, args.device) for batch in cpu_batches]
        tokens = sum(int((batch["labels"] != -100).sum()) for batch in batches)
        steps: dict[str, Step] = {}
        for kind, label in (("ours", "this model"), ("marian", "MarianMTModel")):
            for path, loss in (("training script", training_loss), ("Trainer path", trainer_loss)):
                model = build_model(kind, config, args.device, dtype)
                steps[f"{label}, {path}"] = train_step_fn(model, loss)
        for name, step in steps.items():
            cold = [timed(step, batch, args.device) for batch in batches]
            warm = [timed(step, batch, args.device) for _ in range(3) for batch in batches]
            print(
                f"| {dtype_name} | {name} | {sum(cold):.3f} | {cold[0] * 1e3:.1f} | "
                f"{statistics.median(warm) * 1e3:.2f} | {3 * tokens / sum(warm):,.0f} |"
            )
        if args.profile and args.device.startswith("cuda"):
            from torch.profiler import ProfilerActivity, profile

            for name, step in steps.items():
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
                    for batch in batches[:4]:
                        step(batch)
                    synchronize(args.device)
                print(f"\n{dtype_name}, {name}: heaviest operations on the GPU")
                print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=8))


if __name__ == "__main__":
    main()
