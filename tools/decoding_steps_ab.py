"""What a decoder layer's `decoding_step` saves: `generate()` with it and with each layer's `forward`.

    python -m tools.decoding_steps_ab --presets tiny base --repeats 15

Both variants run in one process on the same model and inputs (`tools.benchmark`'s `generate()` cells:
32-token sources, exactly 32 new tokens), taking turns call by call so that machine noise hits both
alike; prints medians and their ratio, and whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from tools.benchmark import build_model, generation_inputs
from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling_vanilla_transformer import VanillaTransformerDecoderLayer

CELLS = ((1, 1), (1, 4), (32, 1), (32, 4))  # (batch size, beams)


def layer_forward_only():
    """Each layer runs its `forward` at every cached step (what `decoding_step` replaces)."""
    return mock.patch.object(VanillaTransformerDecoderLayer, "decoding_step", lambda *args: None)


def compare(config: VanillaTransformerConfig, repeats: int) -> list[dict[str, object]]:
    """One row per `generate()` cell: median seconds of each variant, their ratio, identical tokens."""
    model = build_model("ours", config, "cpu", torch.float32).eval()
    rows = []
    for batch_size, num_beams in CELLS:
        source, options = generation_inputs({"ours": model}, "cpu", batch_size, num_beams)
        times: dict[str, list[float]] = {"layer forward": [], "decoding_step": []}
        with torch.inference_mode():
            with layer_forward_only():
                plain = model.generate(source, **options)  # also the warm-up
            same = torch.equal(plain, model.generate(source, **options))
            for _ in range(repeats):
                for variant in times:
                    with layer_forward_only() if variant == "layer forward" else contextlib.nullcontext():
                        started = time.perf_counter()
                        model.generate(source, **options)
                        times[variant].append(time.perf_counter() - started)
        medians = {variant: statistics.median(values) for variant, values in times.items()}
        rows.append(
            {
                "cell": f"{'greedy' if num_beams == 1 else f'beam {num_beams}'} batch {batch_size}",
                **medians,
                "ratio": medians["decoding_step"] / medians["layer forward"],
                "same tokens": same,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "base"], choices=["tiny", "base", "big"])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls of each variant, in turns")
    args = parser.parse_args()
    print("| preset | generate() | layer forward (s) | decoding_step (s) | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        for row in compare(VanillaTransformerConfig.from_preset(preset), args.repeats):
            same = "yes" if row["same tokens"] else "no"
            print(
                f"| {preset} | {row['cell']} | {row['layer forward']:.4f} "
                f"| {row['decoding_step']:.4f} | {row['ratio']:.2f}x | {same} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
