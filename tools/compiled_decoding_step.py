"""This model's own cached decoding step, eager against `torch.compile`, per new token:

    python -m tools.compiled_decoding_step --presets tiny base --repeats 7

Greedy decoding at batch 1 of `tools.benchmark`'s 32-token sources, 32 new tokens, with the usual
dynamic cache, in a loop that does nothing but the step: the decoder's `decoding_step`, the output
projection and the argmax. The eager step takes turns with each of four compiled variants in one
process on the same model and inputs: the step under `torch.compile(dynamic=True, fullgraph=True)` (it
fails on a graph break), the same with inductor's weight freezing (weights as constants, prepacked for
the CPU's matrix kernels), and both again with inductor's C++ wrapper (the compiled kernels called from
generated C++ rather than Python). After a line naming the machine, the table gives medians in milliseconds
per token, each compiled variant's first call (mostly compiling), whether its tokens are eager's, and
for context `generate()`'s time per token for the same decoding (its whole call over the 32 tokens:
the encoder, the first step and transformers' generation loop included).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from tools.benchmark import (
    BENCHMARK_VOCABULARY,
    GENERATE_LENGTH,
    build_model,
    generation_inputs,
    median_time,
)
from vanilla_transformer.cli import positive_int
from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.kernels_vanilla_transformer import kept_copies
from vanilla_transformer.machine import describe_machine, format_machine

Step = Callable[[torch.Tensor, torch.Tensor, EncoderDecoderCache], torch.Tensor]


def greedy_step(model: torch.nn.Module) -> Step:
    """One cached greedy step: (B, 1) token ids, the encoder output and the filled cache -> next ids."""
    decoder = model.get_decoder()

    def step(tokens: torch.Tensor, encoder_states: torch.Tensor, cache: EncoderDecoderCache) -> torch.Tensor:
        hidden_states = decoder.decoding_step(tokens, encoder_states, None, cache)
        if hidden_states is None:
            raise RuntimeError("The decoder's decoding_step does not apply to this model and cache.")
        return model.project(hidden_states)[:, -1].argmax(-1, keepdim=True)

    return step


def decode(
    model: torch.nn.Module, source: torch.Tensor, step: Step, new_tokens: int
) -> tuple[float, torch.Tensor]:
    """Seconds per cached step of greedy decoding with `step`, and the tokens. The encoder and the first
    step (which fills the cross-attention cache) run outside the timing."""
    with torch.inference_mode():
        encoder_states = model.get_encoder()(input_ids=source)[0]
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full((source.shape[0], 1), model.config.decoder_start_token_id)
        first = model(encoder_outputs=(encoder_states,), decoder_input_ids=start, cache=cache, use_cache=True)
        tokens = [first.logits[:, -1].argmax(-1, keepdim=True)]
        started = time.perf_counter()
        with kept_copies():  # a decoding with a cache, as generate()'s steps are (not traced: outside)
            for _ in range(new_tokens - 1):
                tokens.append(step(tokens[-1], encoder_states, cache))
        elapsed = time.perf_counter() - started
    return elapsed / (new_tokens - 1), torch.cat(tokens, dim=1)


# inductor's settings per compiled variant
COMPILED_VARIANTS = {
    "compiled": {},
    "compiled, frozen weights": {"freezing": True},
    "compiled, C++ wrapper": {"cpp_wrapper": True},
    "compiled, C++ wrapper, frozen weights": {"cpp_wrapper": True, "freezing": True},
}


def compare(config: VanillaTransformerConfig, repeats: int, backend: str = "inductor") -> dict[str, Any]:
    """Medians of seconds per token for each variant and for `generate()`, compiled variants' first-call
    seconds, and whether each variant's tokens are eager's (`backend`: torch.compile's).

    Each compiled variant is compiled afresh (`torch._dynamo.reset()`: compiled code is kept per code
    object, and every variant runs the same step's code) and timed in turns with the eager step and
    `generate()`, whose rows take the medians over all turns."""
    model = build_model("ours", config, "cpu", torch.float32, as_marian=False).eval()
    source, options = generation_inputs({"ours": model}, "cpu", 1, 1)
    step = greedy_step(model)
    _, eager_tokens = decode(model, source, step, GENERATE_LENGTH)  # also the warm-up
    with torch.inference_mode():
        model.generate(source, **options)
    times: dict[str, list[float]] = {"eager": [], "generate()": []}
    first_call: dict[str, float] = {}
    same_tokens: dict[str, bool] = {}
    for name, inductor in COMPILED_VARIANTS.items():
        torch._dynamo.reset()
        compiled = torch.compile(step, dynamic=True, fullgraph=True, backend=backend)
        with torch._inductor.config.patch(**inductor):
            started = time.perf_counter()
            _, tokens = decode(model, source, compiled, GENERATE_LENGTH)
            first_call[name] = time.perf_counter() - started
        same_tokens[name] = torch.equal(tokens, eager_tokens)
        times[name] = []
        for _ in range(repeats):  # in turns
            times["eager"].append(decode(model, source, step, GENERATE_LENGTH)[0])
            times[name].append(decode(model, source, compiled, GENERATE_LENGTH)[0])
            with torch.inference_mode():
                call = median_time(lambda: model.generate(source, **options), "cpu", 1)
            times["generate()"].append(call / GENERATE_LENGTH)
    torch._dynamo.reset()
    return {
        "seconds_per_token": {name: statistics.median(values) for name, values in times.items()},
        "first_call_s": first_call,
        "same_tokens": same_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "base"], choices=["tiny", "base", "big"])
    parser.add_argument(
        "--repeats", type=positive_int, default=7, help="timed decodings of each variant, in turns"
    )
    args = parser.parse_args()
    print(format_machine(describe_machine()))  # what the figures were measured on
    print("| preset | variant | ms per token | / eager step | first call (s) | same tokens as eager |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        config = VanillaTransformerConfig.from_preset(preset, vocab_size=BENCHMARK_VOCABULARY)
        result = compare(config, args.repeats)
        per_token = result["seconds_per_token"]
        for name, seconds in per_token.items():
            first = result["first_call_s"].get(name)
            same = result["same_tokens"].get(name)
            first_text = "" if first is None else f"{first:.1f}"
            same_text = "" if same is None else "yes" if same else "no"
            ratio = seconds / per_token["eager"]
            print(
                f"| {preset} | {name} | {seconds * 1e3:.3f} | {ratio:.2f}x | {first_text} | {same_text} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
