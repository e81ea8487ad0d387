"""Two ways of running the same `generate()`, timed side by side:

- `--compare decoding_step`: what a decoder layer's `decoding_step` saves, against each layer's
  `forward` at every cached step;
- `--compare linear_kernel`: what MKL's packed products add to the measured linear-kernel policy,
  against the same policy choosing between torch's kernel and oneDNN only.

    python -m tools.decoding_steps_ab --presets tiny base --repeats 15
    python -m tools.decoding_steps_ab --compare linear_kernel --presets base --repeats 7

Both variants run in one process on the same model and inputs (`tools.benchmark`'s `generate()` cells:
32-token sources, exactly 32 new tokens), taking turns call by call so that machine noise hits both
alike; prints medians and their ratio, and whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from tools.benchmark import BENCHMARK_VOCABULARY, build_model, generation_inputs
from vanilla_transformer.cli import positive_int
from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.kernels_vanilla_transformer import linear_kernel
from vanilla_transformer.modeling_vanilla_transformer import VanillaTransformerDecoderLayer

CELLS = ((1, 1), (1, 4), (32, 1), (32, 4))  # (batch size, beams)


def layer_forward_only():
    """Each layer runs its `forward` at every cached step (what `decoding_step` replaces)."""
    return mock.patch.object(VanillaTransformerDecoderLayer, "decoding_step", lambda *args: None)


def linear_kernels(with_mkl: bool, kept: dict[bool, dict]) -> contextlib.AbstractContextManager:
    """The process's linear-kernel policy with or without MKL's packed products; each variant keeps its
    own measured decisions in `kept` between calls (so that each class is timed once per variant)."""

    @contextlib.contextmanager
    def switched() -> Iterator[None]:
        policy = linear_kernel()
        mkl, decisions = policy.mkl, dict(policy.decisions)
        policy.mkl = mkl if with_mkl else None
        policy.decisions.clear()
        policy.decisions.update(kept.get(with_mkl, {}))
        try:
            yield
        finally:
            kept[with_mkl] = dict(policy.decisions)
            policy.mkl = mkl
            policy.decisions.clear()
            policy.decisions.update(decisions)

    return switched()


def variants(comparison: str) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """The two variants of a comparison, baseline first, as context-manager factories."""
    if comparison == "decoding_step":
        return {"layer forward": layer_forward_only, "decoding_step": contextlib.nullcontext}
    if comparison == "linear_kernel":
        kept: dict[bool, dict] = {}
        return {
            "without packed MKL": lambda: linear_kernels(False, kept),
            "with packed MKL": lambda: linear_kernels(True, kept),
        }
    raise ValueError(f"unknown comparison {comparison!r}: decoding_step or linear_kernel")


def compare(
    config: VanillaTransformerConfig, repeats: int, comparison: str = "decoding_step"
) -> list[dict[str, Any]]:
    """One row per `generate()` cell: median seconds of each variant, their ratio (second / first),
    identical tokens."""
    model = build_model("ours", config, "cpu", torch.float32, as_marian=False).eval()
    setups = variants(comparison)
    (baseline, candidate) = setups
    rows = []
    for batch_size, num_beams in CELLS:
        source, options = generation_inputs({"ours": model}, "cpu", batch_size, num_beams)
        times: dict[str, list[float]] = {variant: [] for variant in setups}
        with torch.inference_mode():
            tokens = {}
            for variant, setup in setups.items():
                with setup():
                    tokens[variant] = model.generate(source, **options)  # also the warm-up
            for _ in range(repeats):
                for variant, setup in setups.items():
                    with setup():
                        started = time.perf_counter()
                        model.generate(source, **options)
                        times[variant].append(time.perf_counter() - started)
        medians = {variant: statistics.median(values) for variant, values in times.items()}
        rows.append(
            {
                "cell": f"{'greedy' if num_beams == 1 else f'beam {num_beams}'} batch {batch_size}",
                **medians,
                "ratio": medians[candidate] / medians[baseline],
                "same tokens": torch.equal(tokens[baseline], tokens[candidate]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", default="decoding_step", choices=["decoding_step", "linear_kernel"])
    parser.add_argument("--presets", nargs="+", default=["tiny", "base"], choices=["tiny", "base", "big"])
    parser.add_argument(
        "--repeats", type=positive_int, default=15, help="timed calls of each variant, in turns"
    )
    args = parser.parse_args()
    baseline, candidate = variants(args.compare)
    print(f"| preset | generate() | {baseline} (s) | {candidate} (s) | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        config = VanillaTransformerConfig.from_preset(preset, vocab_size=BENCHMARK_VOCABULARY)
        for row in compare(config, args.repeats, args.compare):
            same = "yes" if row["same tokens"] else "no"
            print(
                f"| {preset} | {row['cell']} | {row[baseline]:.4f} "
                f"| {row[candidate]:.4f} | {row['ratio']:.2f}x | {same} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
