"""What a forward without a cache costs on few rows: one sentence scored with labels, in eval mode and
without gradients (`Seq2SeqTrainer`'s evaluation loss at batch 1, a scoring loop), three ways side by
side in one process, taking turns:

- shipped: the decoder's products on the matrices themselves (`kept_copies` is for decodings),
  nothing checked;
- checked copies: on the copies kept for decoding (other kernels' layouts), each checked against its
  matrix's values at every call (`value_checksum`), as before 2026-12-05;
- unchecked copies: the kept copies without the check, the lower bound, but wrong after a write that
  leaves the version counter as it was (a fused optimiser step, a `.data` write).

    python -m tools.scoring_forward --presets tiny base --lengths 8 30 --rounds 8

Prints median milliseconds per forward and the machine they were measured on; the ratios are what to quote.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from unittest import mock

import torch

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer import kernels_vanilla_transformer as kernels
from vanilla_transformer import modeling_vanilla_transformer as modeling
from vanilla_transformer.cli import positive_int
from vanilla_transformer.machine import describe_machine, format_machine

WAYS = ("shipped", "checked copies", "unchecked copies")


@contextlib.contextmanager
def kept_copies_in_every_forward(checked: bool) -> Iterator[None]:
    """Forwards without a cache use the copies kept for decoding; `checked`: each call checks them."""
    shipped = modeling.kept_copies

    @contextlib.contextmanager
    def keep(active: bool = True) -> Iterator[None]:
        if checked and not active:  # a forward without a cache: its copies are checked once in it
            kernels.new_generate_call()
        with shipped():
            yield

    with mock.patch.object(modeling, "kept_copies", keep):
        yield


def way(name: str) -> contextlib.AbstractContextManager:
    if name == "shipped":
        return contextlib.nullcontext()
    return kept_copies_in_every_forward(checked=name == "checked copies")


def time_ways(forward: Callable[[], object], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of `forward` each way: `rounds` rounds of `calls` calls, in turns."""
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for name in WAYS:  # warm-up: the kernel probe and the kept copies
        with way(name):
            forward()
    for _ in range(rounds):
        for name in WAYS:
            with way(name):
                for _ in range(calls):
                    started = time.perf_counter()
                    forward()
                    times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "base"], choices=["tiny", "base", "big"])
    parser.add_argument("--lengths", nargs="+", type=positive_int, default=[8, 30], help="target tokens")
    parser.add_argument("--source_length", type=positive_int, default=30)
    parser.add_argument("--vocab_size", type=positive_int, default=8000)
    parser.add_argument("--rounds", type=positive_int, default=8)
    parser.add_argument("--calls", type=positive_int, default=15, help="forwards per round and way")
    args = parser.parse_args(argv)
    print(format_machine(describe_machine()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms per forward")
    print(f"| preset | target tokens | {' | '.join(WAYS)} | shipped / checked |")
    print("|---|---|" + "---|" * (len(WAYS) + 1))
    generator = torch.Generator().manual_seed(0)
    for preset in args.presets:
        torch.manual_seed(0)
        config = VanillaTransformerConfig.from_preset(preset, vocab_size=args.vocab_size)
        model = VanillaTransformerForConditionalGeneration(config).eval()
        source = torch.randint(4, args.vocab_size, (1, args.source_length), generator=generator)
        for length in args.lengths:
            labels = torch.randint(4, args.vocab_size, (1, length), generator=generator)
            with torch.no_grad():
                medians = time_ways(
                    lambda m=model, s=source, t=labels: m(input_ids=s, labels=t), args.rounds, args.calls
                )
            cells = " | ".join(f"{medians[name] * 1e3:.2f}" for name in WAYS)
            print(
                f"| {preset} | {length} | {cells} | {medians['shipped'] / medians['checked copies']:.2f}x |"
            )


if __name__ == "__main__":
    main()
