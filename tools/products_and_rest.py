"""A `generate()` cell of the benchmark split in two, per later decoding step: the linear layers'
products, and the rest (attention, layer norms, the cache, Python, transformers' generation loop):

    python -m tools.products_and_rest --preset base --batch_size 1 --beams 1 --repeats 9

Both models are built as `tools.benchmark` builds them (same network, seed, 32-token sources). Each
decodes 2 and 32 new tokens, in turns with the other model, `--repeats` calls each: the difference over
the 30 later steps is the time per later step, without the encoder, the first step and the call's setup.
Then the same again with every linear layer's product replaced by a zero tensor of its output's shape,
made once per shape (`torch.nn.functional.linear`, which both models' layers call, is swapped for the
lookup; this model's own kernels are switched to torch's for that run, so that its products go there
too): what is left is the rest, and products = with - without. The zero outputs change the tokens, not
the work of a step, as every step runs to the same length (no end token). Where the rest is already
far below MarianMTModel's and the products are equal, the products are what sets the ratio.

The time spent outside the model's `forward` in the first run (the calls with products) is the
generation loop's: transformers' own work around each step (the logits' copy, log-softmax, top-k or
argmax, the beams' bookkeeping, the cache's reordering, the stopping checks), which no change to a
model's forward removes.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tools.benchmark import (
    BENCHMARK_VOCABULARY,
    MODELS,
    add_generate_cell_arguments,
    build_model,
    generation_inputs,
)
from vanilla_transformer import kernels_vanilla_transformer as kernels
from vanilla_transformer.cli import positive_int

LATER_STEPS = 30  # (32 - 2) new tokens: the steps between the two lengths timed


@contextlib.contextmanager
def products_replaced(counts: dict[str, int]) -> Iterator[None]:
    """Inside it every `F.linear` returns a zero tensor of its output's shape (one per shape, reused),
    counted in `counts["products"]`, and this model's linear layers all go to `F.linear`."""
    zeros: dict[tuple[int, ...], torch.Tensor] = {}

    def no_product(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        counts["products"] += 1
        shape = (*inputs.shape[:-1], weight.shape[0])
        if shape not in zeros:
            zeros[shape] = inputs.new_zeros(shape)
        return zeros[shape]

    linear, mode = F.linear, kernels.set_linear_kernel("torch")
    F.linear = no_product
    try:
        yield
    finally:
        F.linear = linear
        kernels.set_linear_kernel(mode)


@contextlib.contextmanager
def forward_timed(model: torch.nn.Module, spent: list[float]) -> Iterator[None]:
    """Inside it each call of `model.forward` adds its seconds to `spent[0]`."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    forward, own = model.forward, vars(model).get("forward")  # an instance's own (accelerate's hooks)
    model.forward = timed
    try:
        yield
    finally:
        if own is None:
            del model.forward  # the class's again
        else:
            model.forward = own


def per_later_step(
    models: dict[str, torch.nn.Module],
    source: torch.Tensor,
    options: dict[str, Any],
    repeats: int,
    in_forward: dict[str, float] | None = None,
) -> dict[str, float]:
    """Seconds per decoding step after the second, each model's: (median call with 32 new tokens -
    median call with 2) / 30, the models taking turns call by call. Into `in_forward`, if given, the same
    for the seconds spent inside the model's `forward`."""
    medians, forward_medians = {}, {}
    with torch.inference_mode():
        for new_tokens in (2, 2 + LATER_STEPS):
            settings = {**options, "max_new_tokens": new_tokens}
            times: dict[str, list[float]] = {kind: [] for kind in models}
            forward_times: dict[str, list[float]] = {kind: [] for kind in models}
            for model in models.values():
                model.generate(source, **settings)  # warm-up (and this length's kernel choices)
            for _ in range(repeats):
                for kind, model in models.items():
                    spent = [0.0]
                    with forward_timed(model, spent) if in_forward is not None else contextlib.nullcontext():
                        start = time.perf_counter()
                        model.generate(source, **settings)
                        times[kind].append(time.perf_counter() - start)
                    forward_times[kind].append(spent[0])
            medians[new_tokens] = {kind: statistics.median(t) for kind, t in times.items()}
            forward_medians[new_tokens] = {kind: statistics.median(t) for kind, t in forward_times.items()}
    if in_forward is not None:
        for kind in models:
            later = forward_medians[2 + LATER_STEPS][kind] - forward_medians[2][kind]
            in_forward[kind] = later / LATER_STEPS
    return {kind: (medians[2 + LATER_STEPS][kind] - medians[2][kind]) / LATER_STEPS for kind in models}


def split(preset: str, batch_size: int, beams: int, repeats: int) -> dict[str, Any]:
    """Per later step, each model's time with its products and without them, and outside its `forward`
    (seconds), and the number of products replaced per later step."""
    from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig

    config = VanillaTransformerConfig.from_preset(preset, vocab_size=BENCHMARK_VOCABULARY)
    models = {kind: build_model(kind, config, "cpu", torch.float32).eval() for kind in MODELS}
    source, options = generation_inputs(models, "cpu", batch_size, beams)
    in_forward: dict[str, float] = {}
    whole = per_later_step(models, source, options, repeats, in_forward)
    products = {}
    for kind, model in models.items():
        counts = {"products": 0}
        with products_replaced(counts), torch.inference_mode():
            model.generate(source, **{**options, "max_new_tokens": 2})
            before = counts["products"]
            model.generate(source, **{**options, "max_new_tokens": 2 + LATER_STEPS})
            products[kind] = (counts["products"] - 2 * before) // LATER_STEPS
    with products_replaced({"products": 0}):
        rest = per_later_step(models, source, options, repeats)
    loop = {kind: whole[kind] - in_forward[kind] for kind in models}
    return {"whole": whole, "rest": rest, "loop": loop, "products_per_step": products}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_generate_cell_arguments(parser)
    parser.add_argument(
        "--repeats", type=positive_int, default=9, help="timed generate() calls of each model per length"
    )
    args = parser.parse_args(argv)
    from vanilla_transformer.machine import describe_machine, format_machine

    print(format_machine(describe_machine()))
    result = split(args.preset, args.batch_size, args.beams, args.repeats)
    beams = "greedy" if args.beams == 1 else f"beam {args.beams}"
    print(f"generate() {args.preset}, batch {args.batch_size}, {beams}: ms per later decoding step")
    print("| | ours | MarianMTModel | ours / Marian |")
    print("|---|---|---|---|")
    whole, rest = result["whole"], result["rest"]
    rows = {
        "whole step": whole,
        "products": {kind: whole[kind] - rest[kind] for kind in MODELS},
        "rest": rest,
        "of which the generation loop": result["loop"],
    }
    for name, row in rows.items():
        ours, marian = row["ours"], row["marian"]
        print(f"| {name} | {ours * 1e3:.3f} | {marian * 1e3:.3f} | {ours / marian:.2f}x |")
    counts = result["products_per_step"]
    print(f"linear products per later step: ours {counts['ours']}, MarianMTModel {counts['marian']}")


if __name__ == "__main__":
    main()
