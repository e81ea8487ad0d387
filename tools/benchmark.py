"""Side-by-side speed and memory of this model and transformers' MarianMTModel at the same shape.

MarianMTModel is configured as the paper's model (post-LN, ReLU, scaled embeddings, one tied
embedding matrix, same d_model/heads/d_ff/layers/vocabulary) and both run the same inputs, in
alternation, in one process, so that machine noise hits both alike; medians of repeated runs are
reported. Peak memory is measured in a fresh child process per model: the kernel's high-water mark of its
resident memory during three training steps (reset after building the model), above the level then (on
a GPU, CUDA's peak allocation above the allocation before the steps).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import CompileConfig, DataCollatorForSeq2Seq, MarianConfig, MarianMTModel

from vanilla_transformer.batching import TokenBatchSampler
from vanilla_transformer.cli import positive_int
from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.kernels_vanilla_transformer import LinearKernel, attention_kernel, linear_kernel
from vanilla_transformer.machine import (
    describe_machine,
    format_machine,
    matmul_rate,
    reset_peak_resident,
    resident_bytes,
    source_commit,
    synchronize,
)
from vanilla_transformer.modeling_vanilla_transformer import (
    VanillaTransformerEncoderLayer,
    VanillaTransformerForConditionalGeneration,
)
from vanilla_transformer.tokenization import train_bpe_tokenizer

MODELS = ("ours", "marian")
# generate() benchmarks: source length and number of new tokens
GENERATE_LENGTH = 32
# The joint BPE vocabulary the benchmark trains on the embedded corpus (tools that build models without
# it use this size, so that their "base" is the benchmark's).
BENCHMARK_VOCABULARY = 8000
# Training rows: batches of at most this many source + target tokens, this many batches a round.
TRAINING_MAX_TOKENS, TRAINING_BATCHES = 4096, 4


def marian_like(config: VanillaTransformerConfig) -> MarianConfig:
    """A MarianConfig of the same network as `config` (post-LN, ReLU, scaled, tied embeddings)."""
    return MarianConfig(
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        encoder_layers=config.num_encoder_layers,
        decoder_layers=config.num_decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=config.activation_function,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        scale_embedding=config.scale_embedding,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,
    )


def build_model(
    kind: str, config: VanillaTransformerConfig, device: str, dtype: torch.dtype, *, as_marian: bool = True
) -> torch.nn.Module:
    """This package's model or the equivalent MarianMTModel, both with SDPA attention (and both with
    biases on the attention projections, which MarianMTModel always has). `as_marian=False` builds ours
    with `config`'s own `attention_bias` (the paper's network by default), for the tools that time two
    ways of running this model against each other rather than against MarianMTModel."""
    torch.manual_seed(0)
    if kind == "ours":
        bias = True if as_marian else config.attention_bias
        config = VanillaTransformerConfig(**{**config.to_dict(), "attention_bias": bias})
        config._attn_implementation = "sdpa"
        model = VanillaTransformerForConditionalGeneration(config)
    elif kind == "marian":
        marian = marian_like(config)
        marian._attn_implementation = "sdpa"
        model = MarianMTModel(marian)
    else:
        raise ValueError(f"Unknown model {kind!r}; choose one of {MODELS}.")
    return model.to(device=device, dtype=dtype)


def benchmark_tokenizer() -> Any:
    """The benchmark's tokenizer: BPE of `BENCHMARK_VOCABULARY` tokens trained on the embedded corpus."""
    train = load_default_corpus()["train"]
    return train_bpe_tokenizer(list(train["en"]) + list(train["es"]), BENCHMARK_VOCABULARY)


def corpus_batches(
    tokenizer: Any, max_tokens: int, count: int, *, padding_heavy: bool, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Training batches of real sentence pairs from the embedded corpus.

    Length-bucketed: TokenBatchSampler's batches. Padding-heavy: the same number of pairs per batch,
    drawn at random, so short sentences are padded to the longest one.
    """
    train = load_default_corpus()["train"]
    encoded = tokenizer(list(train["en"]), text_target=list(train["es"]))
    rows = [
        {"input_ids": i, "attention_mask": m, "labels": t}
        for i, m, t in zip(encoded["input_ids"], encoded["attention_mask"], encoded["labels"], strict=True)
    ]
    sampler = TokenBatchSampler(
        [len(r["input_ids"]) for r in rows], [len(r["labels"]) for r in rows], max_tokens, seed=seed
    )
    batches = list(sampler)[:count]
    if padding_heavy:
        rng = random.Random(seed)
        batches = [rng.sample(range(len(rows)), len(batch)) for batch in batches]
    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    collated = []
    for batch in batches:
        features = collate([rows[i] for i in batch])
        labels = features["labels"]
        decoder_input_ids = labels.new_full(labels.shape, tokenizer.pad_token_id)
        decoder_input_ids[:, 0] = tokenizer.bos_token_id
        decoder_input_ids[:, 1:] = labels[:, :-1].clamp(min=0)
        features["decoder_input_ids"] = decoder_input_ids.masked_fill(decoder_input_ids == -100, 0)
        collated.append(dict(features))
    return collated


def to_device(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def training_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The paper's loss for either model: label-smoothed (0.1) cross entropy over non-padding targets.

    This package's model computes it itself (`return_logits=False`, as the training script does: no
    work on padding, no (N, V) logits kept); MarianMTModel's own loss has no smoothing, so its logits
    go through the same `cross_entropy` call (what transformers' Trainer label smoother amounts to).
    """
    if isinstance(model, VanillaTransformerForConditionalGeneration):
        return model(**batch, return_logits=False).loss  # what the training script runs
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # Without labels MarianMTModel's config turns its generation cache on: keys and values concatenated
    # per layer, work that training does not do (ours gets labels, which turn it off).
    logits = model(**inputs, use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, label_smoothing=0.1
    )


def trainer_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What transformers' `Trainer` runs for either model: `model(input_ids, attention_mask, labels).loss`
    in training mode, decoder inputs derived from the labels (each model's own loss: label-smoothed for
    this package, plain cross entropy for MarianMTModel)."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    return model(**inputs).loss


def train_step_fn(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] = training_loss,
) -> Callable[[dict[str, torch.Tensor]], None]:
    """Forward + backward + Adam step on one batch: torch's fused Adam, as the training script and
    transformers' `Trainer` (its default `adamw_torch_fused`) both run."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    model.train()

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def median_time(fn: Callable[[], Any], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_flops(
    device: str, dtype: torch.dtype, size: int | None = None, repeats: int = 5
) -> dict[str, float]:
    """The machine's measured matrix-multiply rate (FLOP/s) at this dtype, per kernel: `torch.matmul`
    (the BLAS that transformers' models and this package's training use) and, on CPU, oneDNN (one of the
    kernels this package's decoding products may measure faster). The faster of the two is the machine's
    peak, the MFU denominator. Products of 2048 x 2048 on a CPU; 4096 x 4096 on an accelerator, where a
    2048 product takes tens of microseconds and its launch would count (as `describe_gpu`)."""
    size = size or (2048 if device == "cpu" else 4096)
    rates = {"torch.matmul": matmul_rate(device, dtype, size, repeats)}
    if device == "cpu" and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        onednn = torch.ops.mkldnn._linear_pointwise  # a @ b.T: as many FLOPs as a @ b

        def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return onednn(a, b, None, "none", [], "")

        with contextlib.suppress(RuntimeError):  # a dtype this CPU's oneDNN lacks (bfloat16 on AVX2): no row
            rates["oneDNN"] = matmul_rate(device, dtype, size, repeats, product)
    return rates


def read_bandwidth(device: str, megabytes: int = 512, repeats: int = 5) -> float:
    """The machine's measured memory read rate (bytes/s): a sum over a tensor far larger than the caches."""
    data = torch.ones(megabytes * 2**20 // 4, device=device)
    data.sum()
    return data.numel() * 4 / median_time(data.sum, device, repeats)


def decode_bytes_per_token(model: VanillaTransformerForConditionalGeneration) -> int:
    """Bytes of weights one greedy decoding step at batch 1 must read: every decoder weight except the
    cross-attention key/value projections (their outputs are cached), plus the output projection."""
    decoder = model.get_decoder()
    skipped = {
        id(p)
        for layer in decoder.layers
        for m in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)
        for p in m.parameters()
    }
    weights = [p for p in decoder.layers.parameters() if id(p) not in skipped] + [model.lm_head.weight]
    return sum(p.numel() * p.element_size() for p in weights)


def dropout_timing(shape: Sequence[int] = (3500, 512), p: float = 0.1, repeats: int = 20) -> dict[str, float]:
    """Median seconds of dropout forward + backward on CPU: `F.dropout` against this package's `dropout`."""
    from vanilla_transformer.kernels_vanilla_transformer import dropout

    inputs = torch.randn(*shape, requires_grad=True)
    functions = {
        "F.dropout": lambda: torch.nn.functional.dropout(inputs, p, True),
        "vanilla_transformer dropout": lambda: dropout(inputs, p, True),
    }
    results = {}
    for _ in range(2):  # alternate, keep the second pass
        for name, function in functions.items():
            results[name] = median_time(lambda f=function: f().sum().backward(), "cpu", repeats)
    return results


def step_flops(config: VanillaTransformerConfig, batch: dict[str, torch.Tensor]) -> int:
    """Matrix-multiply FLOPs of one training step (forward + backward = 3 x forward) of the paper's
    network on `batch`, counted over each pair's real source and target lengths (no padding).

    Per layer and token: the attention projections (4 d^2 multiply-adds per token of the queries' side;
    cross-attention projects keys and values from the source), the two attention products (scores and
    weighted values: 2 d per query-key pair) and the feed-forward network (2 d d_ff); then the output
    projection (d V per target token). A multiply-add is 2 FLOPs. The same count serves both models, so
    model FLOPs utilisation compares their speed on the same work.
    """
    d, d_ff, vocab = config.d_model, config.d_ff, config.vocab_size
    sources = batch["attention_mask"].sum(dim=1).tolist()
    targets = (batch["labels"] != -100).sum(dim=1).tolist()
    multiply_adds = 0
    for s, t in zip(sources, targets, strict=True):
        encoder = 4 * s * d * d + 2 * s * s * d + 2 * s * d * d_ff
        decoder = 4 * t * d * d + 2 * t * t * d  # masked self-attention
        decoder += 2 * t * d * d + 2 * s * d * d + 2 * t * s * d  # cross-attention
        decoder += 2 * t * d * d_ff
        multiply_adds += config.num_encoder_layers * encoder + config.num_decoder_layers * decoder
        multiply_adds += t * d * vocab
    return 3 * 2 * multiply_adds


def benchmark_training(
    models: dict[str, torch.nn.Module],
    batches: Sequence[dict[str, torch.Tensor]],
    device: str,
    rounds: int,
    loss_fn: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] = training_loss,
) -> dict[str, dict[str, float]]:
    """Target tokens per second of full training steps, the models taking turns batch by batch."""
    steps = {kind: train_step_fn(model, loss_fn) for kind, model in models.items()}
    # Warm-up: every batch once per model, so that costs paid once per new shape in a process (kernels
    # met for the first time, oneDNN building a primitive per shape) stay out of the timed rounds: these
    # are warm-step figures. With two batches of warm-up, such costs once made this model 0.08x
    # MarianMTModel on a GPU, where warm steps were equally fast; `tools/training_steps_cold_warm.py`
    # times the cold pass too.
    for kind in models:
        for batch in batches:
            steps[kind](batch)
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for _ in range(rounds):
        for batch in batches:
            for kind in models:
                times[kind].append(median_time(lambda k=kind, b=batch: steps[k](b), device, 1))
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches) * rounds
    return {
        kind: {"tokens_per_s": tokens / sum(t), "step_s": statistics.median(t), "total_s": sum(t)}
        for kind, t in times.items()
    }


def generation_inputs(
    models: dict[str, torch.nn.Module], device: str, batch_size: int, num_beams: int
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Random `GENERATE_LENGTH`-token sources and `generate` options producing exactly that many tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    source = torch.randint(4, vocab, (batch_size, GENERATE_LENGTH), generator=generator).to(device)
    return source, generate_options(num_beams)


def add_generate_cell_arguments(parser: argparse.ArgumentParser) -> None:
    """`--preset`, `--batch_size` and `--beams`: the tools' way of naming one `generate()` cell."""
    parser.add_argument("--preset", default="base", choices=["tiny", "base", "big"])
    parser.add_argument("--batch_size", type=positive_int, default=1)
    parser.add_argument("--beams", type=positive_int, default=1)


def generate_options(num_beams: int, *, suppress_end: bool = False) -> dict[str, Any]:
    """`generate` options for exactly `GENERATE_LENGTH` new tokens, no sampling.

    By default generation has no end token and runs to the length: each step computes what a
    translation's step computes, without the end-of-sentence check (with no end token, transformers
    stops on the length alone, for both models). `suppress_end=True` keeps the end
    token but forbids it before the length, as CTranslate2's `min_decoding_length` does, for comparing
    tokens with it; transformers does that with two logits processors (`min_length`, `min_new_tokens`),
    each copying and masking the (rows x vocabulary) scores at every step, which no translation runs.
    """
    if suppress_end:
        length = {"max_new_tokens": GENERATE_LENGTH, "min_new_tokens": GENERATE_LENGTH}
    else:
        length = {"max_new_tokens": GENERATE_LENGTH, "eos_token_id": None}
    return {"num_beams": num_beams, "do_sample": False, **length}


def benchmark_generate(
    models: dict[str, torch.nn.Module], device: str, *, batch_size: int, num_beams: int, repeats: int
) -> dict[str, float]:
    """Median seconds for `generate` on 32-token sources, producing exactly 32 new tokens."""
    source, options = generation_inputs(models, device, batch_size, num_beams)
    times: dict[str, list[float]] = {kind: [] for kind in models}
    with torch.inference_mode():
        for model in models.values():
            model.eval()
            model.generate(source, **options)  # warm-up
        for _ in range(repeats):  # the models take turns, so that machine noise hits both alike
            for kind, model in models.items():
                times[kind].append(median_time(lambda m=model: m.generate(source, **options), device, 1))
    return {kind: statistics.median(t) for kind, t in times.items()}


def forward_share(model: torch.nn.Module, device: str, fn: Callable[[], Any]) -> float:
    """Fraction of the wall time of `fn()` spent inside `model`'s forward calls and its encoder's
    (`generate` runs the encoder once, outside the model's forward); nested calls count once."""
    inside, started, depth = [0.0], [0.0], [0]

    def before(*_: Any) -> None:
        if depth[0] == 0:
            synchronize(device)
            started[0] = time.perf_counter()
        depth[0] += 1

    def after(*_: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            synchronize(device)
            inside[0] += time.perf_counter() - started[0]

    parts = [model]
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
    if encoder is not None and encoder is not model:
        parts.append(encoder)
    hooks = [part.register_forward_pre_hook(before) for part in parts]
    hooks += [part.register_forward_hook(after) for part in parts]
    try:
        total = median_time(fn, device, 1)
    finally:
        for hook in hooks:
            hook.remove()
    return inside[0] / total


def generate_forward_share(
    models: dict[str, torch.nn.Module], device: str, *, batch_size: int, num_beams: int
) -> dict[str, float]:
    """Fraction of `generate()` time spent inside the model (its encoder and its forward calls); the rest
    is transformers' generation loop (logits processing, beam bookkeeping, cache reordering), which the
    models share."""
    source, options = generation_inputs(models, device, batch_size, num_beams)
    shares = {}
    with torch.inference_mode():
        for kind, model in models.items():
            model.eval()
            model.generate(source, **options)  # warm-up
            shares[kind] = forward_share(model, device, lambda m=model: m.generate(source, **options))
    return shares


def benchmark_compiled_generate(
    models: dict[str, torch.nn.Module], device: str, *, batch_size: int, num_beams: int, repeats: int
) -> dict[str, dict[str, float]]:
    """`generate()` with a static cache and `torch.compile` of the decoding step (transformers' own path,
    `cache_implementation="static"` with a `CompileConfig`), against the usual dynamic cache, per model:
    seconds of the first compiled call (mostly compilation) and medians of both paths."""
    compile_config = CompileConfig(mode="default", fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    source, options = generation_inputs(models, device, batch_size, num_beams)
    compiled = {"cache_implementation": "static", "compile_config": compile_config}
    results = {}
    with torch.inference_mode():
        for kind, model in models.items():
            model.eval()
            model.generate(source, **options)  # warm-up
            started = time.perf_counter()
            model.generate(source, **options, **compiled)
            first = time.perf_counter() - started
            eager, static = [], []
            for _ in range(repeats):  # in turns
                eager.append(median_time(lambda m=model: m.generate(source, **options), device, 1))
                static.append(
                    median_time(lambda m=model: m.generate(source, **options, **compiled), device, 1)
                )
            results[kind] = {
                "eager_s": statistics.median(eager),
                "compiled_s": statistics.median(static),
                "first_compiled_call_s": first,
            }
            torch._dynamo.reset()
    return results


def benchmark_compiled_training(
    model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]], device: str, rounds: int
) -> dict[str, float]:
    """This package's training step with its loss under `torch.compile(dynamic=True)`, against eager:
    seconds of the first pass over the batches (compilation for each new shape family included) and
    target tokens per second afterwards, the two taking turns batch by batch."""
    eager_model = model
    compiled_model = copy.deepcopy(model)
    compiled_loss = torch.compile(training_loss, dynamic=True)
    steps = {
        "eager": train_step_fn(eager_model),
        "compiled": train_step_fn(compiled_model, compiled_loss),
    }
    started = time.perf_counter()
    for batch in batches:
        steps["compiled"](batch)
    first_pass = time.perf_counter() - started
    for batch in batches:
        steps["eager"](batch)
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(rounds):
        for batch in batches:
            for kind, step in steps.items():
                times[kind].append(median_time(lambda s=step, b=batch: s(b), device, 1))
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches) * rounds
    torch._dynamo.reset()
    return {
        "first_pass_s": first_pass,
        "eager_tokens_per_s": tokens / sum(times["eager"]),
        "compiled_tokens_per_s": tokens / sum(times["compiled"]),
    }


def probe_memory(kind: str, preset: str, max_tokens: int, device: str, dtype: str) -> int:
    """Run in a child process: peak memory (bytes) of training steps above the level after setup."""
    config = VanillaTransformerConfig.from_preset(preset, vocab_size=8000)
    model = build_model(kind, config, device, getattr(torch, dtype))
    generator = torch.Generator().manual_seed(0)
    batch_size = max_tokens // 64
    batch = {
        "input_ids": torch.randint(4, 8000, (batch_size, 32), generator=generator),
        "decoder_input_ids": torch.randint(4, 8000, (batch_size, 32), generator=generator),
        "labels": torch.randint(4, 8000, (batch_size, 32), generator=generator),
    }
    batch = to_device(batch, device)
    step = train_step_fn(model)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(3):
            step(batch)
        return torch.cuda.max_memory_allocated() - base
    # On CPU: the kernel's high-water mark of this process's resident memory, reset after setup.
    base = resident_bytes()
    try:
        reset_peak_resident()
    except OSError:  # no /proc/self/clear_refs (not Linux, or a sandbox): no figure rather than a wrong one
        return -1
    for _ in range(3):
        step(batch)
    return resident_bytes("VmHWM") - base


def in_fresh_process(module: str, function: str, *arguments: object) -> Any:
    """`function(*arguments)` of `tools.<module>` run in a new Python process, in the repository (where
    `tools` imports from, wherever this runs), its JSON result read back from the last line it prints."""
    call = f"{function}(*{list(arguments)!r})"
    code = f"import json; from tools.{module} import {function}; print(json.dumps({call}))"
    root = Path(__file__).resolve().parents[1]
    finished = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root
    )
    if finished.returncode != 0:
        raise RuntimeError(f"A benchmark process failed:\n{finished.stderr}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def peak_memory(kind: str, preset: str, max_tokens: int, device: str, dtype: str) -> int:
    """`probe_memory` in a fresh Python process, so that each model starts from the same baseline
    (-1 where the peak cannot be measured)."""
    return in_fresh_process("benchmark", "probe_memory", kind, preset, max_tokens, device, dtype)


def attention_scaling(
    lengths: Sequence[int],
    device: str,
    dtype: torch.dtype,
    repeats: int = 3,
    d_model: int = 512,
    heads: int = 8,
) -> list[dict[str, Any]]:
    """Forward time of one encoder layer on one sequence of each length, eager vs SDPA.

    Memory is the size of the attention-probability tensor the eager kernel materialises,
    heads x n x n; SDPA's fused kernels on GPU avoid it (on CPU it is computed in blocks).
    """
    rows = []
    for implementation in ("eager", "sdpa"):
        config = VanillaTransformerConfig(d_model=d_model, num_heads=heads, d_ff=4 * d_model, dropout=0.0)
        config._attn_implementation = implementation
        torch.manual_seed(0)
        layer = VanillaTransformerEncoderLayer(config).to(device=device, dtype=dtype).eval()
        for n in lengths:
            x = torch.randn(1, n, d_model, device=device, dtype=dtype)
            with torch.inference_mode():
                layer(x)
                seconds = median_time(lambda la=layer, xx=x: la(xx), device, repeats)
            element = torch.finfo(dtype).bits // 8
            rows.append(
                {
                    "attention": implementation,
                    "n": n,
                    "seconds": seconds,
                    "scores_bytes": heads * n * n * element,
                }
            )
    return rows


def plot_attention_scaling(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Log-log plot of layer time against n, with an n^2 reference line."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    figure = Figure(figsize=(6, 4.2))
    axes = figure.add_subplot()
    for implementation in ("eager", "sdpa"):
        points = [(r["n"], r["seconds"]) for r in rows if r["attention"] == implementation]
        axes.loglog(*zip(*points, strict=True), marker="o", label=f"{implementation} attention")
    n0, t0 = max((r["n"], r["seconds"]) for r in rows if r["attention"] == "eager")
    ns = sorted({r["n"] for r in rows})
    axes.loglog(ns, [t0 * (n / n0) ** 2 for n in ns], "k--", linewidth=1, label="∝ n² (paper, Table 1)")
    axes.set_xticks(ns, [str(n) for n in ns])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlabel("sequence length n")
    axes.set_ylabel("seconds per encoder-layer forward")
    axes.set_title("One encoder layer: the n² attention term takes over at long n", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


# Deployment: each engine in its own process --------------------------------------------------------
# torch's OpenMP threads keep spinning after each call and slow another engine in the same process
# several-fold, so every engine is timed in a fresh child process, on the same inputs and output length:
# the CTranslate2 exports hold this model's weights (their tokens are checked against its), MarianMTModel
# its own random ones (a fixed number of new tokens costs the same whatever the weights).

ENGINES = ("ours", "marian", "ctranslate2 float32", "ctranslate2 int8")
DEPLOY_SETTINGS = ((1, 1), (1, 4), (32, 1), (32, 4))  # (batch size, beams)


class NumberedVocabulary:
    """A stand-in tokenizer for exporting random weights: token i is named "<i>"."""

    def __init__(self, size: int):
        self.size, self.unk_token = size, "<3>"

    def __len__(self) -> int:
        return self.size

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [f"<{i}>" for i in ids]


def prepare_deployment(config: VanillaTransformerConfig, folder: Path) -> None:
    """The same random weights as this package's model folder and as CTranslate2 float32 and int8 exports
    (the network `build_model` makes, MarianMTModel's)."""
    from vanilla_transformer.export_ctranslate2 import ctranslate2_spec

    model = build_model("ours", config, "cpu", torch.float32).eval()
    model.save_pretrained(folder / "ours")
    for quantization in ("float32", "int8"):
        spec = ctranslate2_spec(model, NumberedVocabulary(config.vocab_size), max_positions=256)
        spec.validate()
        spec.optimize(quantization=quantization)
        (folder / f"ctranslate2 {quantization}").mkdir()
        spec.save(str(folder / f"ctranslate2 {quantization}"))


def deployment_sources(config: VanillaTransformerConfig) -> dict[str, list[list[int]]]:
    """Random `GENERATE_LENGTH`-token sources ending with the end token, per "batch beams" setting."""
    sources = {}
    for batch_size, beams in DEPLOY_SETTINGS:
        generator = torch.Generator().manual_seed(0)
        source = torch.randint(4, config.vocab_size, (batch_size, GENERATE_LENGTH), generator=generator)
        source[:, -1] = config.eos_token_id
        sources[f"{batch_size} {beams}"] = source.tolist()
    return sources


def generate_latency(engine: str, folder: str, repeats: int) -> dict[str, Any]:
    """Median seconds of `generate()` for each setting (exactly `GENERATE_LENGTH` new tokens), with the
    output ids; this model's saved weights or a MarianMTModel of the same shape (a child process)."""
    root = Path(folder)
    config = VanillaTransformerConfig.from_pretrained(root / "ours")
    if engine == "ours":
        model = VanillaTransformerForConditionalGeneration.from_pretrained(root / "ours").eval()
    else:
        model = build_model("marian", config, "cpu", torch.float32).eval()
    results: dict[str, Any] = {}
    for key, rows in json.loads((root / "sources.json").read_text()).items():
        source, options = torch.tensor(rows), generate_options(int(key.split()[1]), suppress_end=True)
        with torch.inference_mode():
            outputs = model.generate(source, **options)[:, 1:].tolist()  # warm-up
            seconds = median_time(functools.partial(model.generate, source, **options), "cpu", repeats)
        results[key] = {"seconds": seconds, "tokens": outputs}
    return results


def deployment(config: VanillaTransformerConfig, repeats: int) -> dict[str, Any]:
    """Latency and sentences per second of `generate()` (this model, MarianMTModel) and of CTranslate2
    float32 and int8 exports of this model's weights, each engine alone in its own process; and whether
    the float32 export produced exactly this model's tokens."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as folder:
        prepare_deployment(config, Path(folder))
        (Path(folder) / "sources.json").write_text(json.dumps(deployment_sources(config)))
        measured = {}
        for engine in ENGINES:
            if not engine.startswith("ctranslate2"):
                measured[engine] = in_fresh_process("benchmark", "generate_latency", engine, folder, repeats)
                continue
            command = ["tools/ctranslate2_latency.py", str(Path(folder) / engine)]  # a process without torch
            command += [str(Path(folder) / "sources.json"), str(repeats)]
            result = subprocess.run(
                [sys.executable, *command], capture_output=True, text=True, check=True, cwd=root
            )
            measured[engine] = json.loads(result.stdout.strip().splitlines()[-1])
    table: dict[str, Any] = {}
    for batch_size, beams in DEPLOY_SETTINGS:
        key = f"{batch_size} {beams}"
        name = f"{'greedy' if beams == 1 else 'beam 4'} batch {batch_size}"
        table[name] = {
            engine: {
                "seconds": m[key]["seconds"],
                "sentences_per_s": batch_size / m[key]["seconds"],
                **({"threads": m[key]["threads"]} if "threads" in m[key] else {}),
            }
            for engine, m in measured.items()
        }
        exported, own = measured["ctranslate2 float32"][key]["tokens"], measured["ours"][key]["tokens"]
        table[name]["float32 export identical"] = exported == own
        table[name]["float32 export rows differing"] = sum(a != b for a, b in zip(exported, own, strict=True))
    return table


def linear_kernel_report(policy: LinearKernel) -> dict[str, Any]:
    """The linear kernel policy's mode and measured decisions, as JSON."""
    return {
        "mode": policy.mode,
        "onednn_available": policy.onednn is not None,
        "mkl_packed_available": policy.mkl is not None,
        "classes": [
            {"rows": rows, "out": out, "in": width, "bias": bias, "kept_layout": kept, "kernel": chosen}
            for (rows, (out, width), bias, kept), chosen in sorted(policy.decisions.items())
        ],
        "probe_seconds": policy.probe_seconds,
    }


def run(
    presets: Sequence[str] = ("tiny", "base"),
    *,
    device: str = "cpu",
    dtype: str = "float32",
    max_tokens: int = TRAINING_MAX_TOKENS,
    batches: int = TRAINING_BATCHES,
    rounds: int = 2,
    repeats: int = 9,
    attention_lengths: Sequence[int] = (256, 512, 1024, 2048, 4096),
    memory: bool = True,
    with_compile: bool = False,
    deploy: bool = True,
    plot_path: str | Path | None = None,
) -> dict[str, Any]:
    """Every measurement, as a dict (what `--json` writes)."""
    torch_dtype = getattr(torch, dtype)
    tokenizer = benchmark_tokenizer()
    data = {
        "length-bucketed": corpus_batches(tokenizer, max_tokens, batches, padding_heavy=False),
        "padding-heavy": corpus_batches(tokenizer, max_tokens, batches, padding_heavy=True),
    }
    results: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,  # MarianMTModel's speed is this version's
        "commit": source_commit(),
        "options": {
            "presets": list(presets),
            "max_tokens": max_tokens,
            "batches": batches,
            "rounds": rounds,
            "repeats": repeats,
            "attention_lengths": list(attention_lengths),
            "memory": memory,
            "compile": with_compile,
            "deploy": deploy,
        },
        "machine": describe_machine(measure=False),
        "matmul_flops": matmul_peak_flops(device, torch_dtype),
        "read_bandwidth": read_bandwidth(device),
        "presets": {},
    }
    results["matmul_peak_flops"] = max(results["matmul_flops"].values())
    for preset in presets:
        config = VanillaTransformerConfig.from_preset(preset, vocab_size=len(tokenizer))
        models = {kind: build_model(kind, config, device, torch_dtype) for kind in MODELS}
        entry: dict[str, Any] = {"parameters": sum(p.numel() for p in models["ours"].parameters())}
        # The Trainer path on the length-bucketed batches, right after them: run after the padding-heavy
        # batches, MarianMTModel's Trainer-path steps were 15-23% faster than in a fresh process or after
        # the length-bucketed ones (this model's 0-6%; base, Intel Xeon family 6 model 167), a state the
        # larger padded batches leave behind, not one its training on length-bucketed batches reaches.
        rows = (
            ("length-bucketed", "length-bucketed", training_loss),
            ("Trainer path", "length-bucketed", trainer_loss),
            ("padding-heavy", "padding-heavy", training_loss),
        )
        for name, batches_name, loss_fn in rows:
            moved = [to_device(b, device) for b in data[batches_name]]
            entry[f"train {name}"] = benchmark_training(models, moved, device, rounds, loss_fn)
            padded = sum(b["labels"].numel() for b in moved)
            entry[f"train {name}"]["padding_fraction"] = (
                1 - sum(int((b["labels"] != -100).sum()) for b in moved) / padded
            )
        # All the timed steps' FLOPs over all their time: the same statistic as the throughput row's.
        flops = rounds * sum(step_flops(config, batch) for batch in data["length-bucketed"])
        for kind in MODELS:
            total_s = entry["train length-bucketed"][kind]["total_s"]
            entry["train length-bucketed"][kind]["mfu"] = flops / total_s / results["matmul_peak_flops"]
        for batch_size in (1, 32):
            for beams in (1, 4):
                name = f"generate {'greedy' if beams == 1 else 'beam 4'} batch {batch_size}"
                entry[name] = benchmark_generate(
                    models, device, batch_size=batch_size, num_beams=beams, repeats=repeats
                )
                entry[f"{name} share in forward"] = generate_forward_share(
                    models, device, batch_size=batch_size, num_beams=beams
                )
        entry["decode bytes per token"] = decode_bytes_per_token(models["ours"])
        if with_compile:
            entry["compiled generate greedy batch 1"] = benchmark_compiled_generate(
                models, device, batch_size=1, num_beams=1, repeats=repeats
            )
            entry["compiled training"] = benchmark_compiled_training(
                models["ours"], [to_device(b, device) for b in data["length-bucketed"]], device, rounds
            )
        if memory:
            entry["peak training memory"] = {
                kind: peak_memory(kind, preset, max_tokens, device, dtype) for kind in MODELS
            }
        if deploy:
            entry["deployment"] = deployment(config, repeats)
        results["presets"][preset] = entry
        del models
    results["linear_kernel"] = linear_kernel_report(linear_kernel())
    attention = attention_kernel()
    results["decode_attention"] = {
        "mode": attention.mode,
        "matmul_chosen": [
            {
                "rows_x_heads": rows,
                "keys": keys,
                "head_dim": width,
                "mask": mask,
                "dtype": str(dtype).removeprefix("torch."),
                "matmul": chosen,
            }
            for (rows, keys, width, mask, dtype), chosen in sorted(
                attention.decisions.items(), key=lambda item: (*item[0][:4], str(item[0][4]))
            )
        ],
        "probe_seconds": attention.probe_seconds,
    }
    if attention_lengths:
        results["attention"] = attention_scaling(attention_lengths, device, torch_dtype)
        if plot_path is not None:
            results["attention_plot"] = str(plot_attention_scaling(results["attention"], plot_path))
    return results


def format_tables(results: dict[str, Any]) -> str:
    """Markdown tables: absolute figures for both models and the ratio ours / Marian."""
    lines = [
        *([f"machine: {format_machine(results['machine'])}"] if "machine" in results else []),
        f"device {results['device']}, {results['dtype']}, {results['threads']} threads, "
        f"torch {results['torch']}; measured matmul peak {results['matmul_peak_flops'] / 1e9:.1f} GFLOP/s"
        + (
            " (" + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in results["matmul_flops"].items()) + ")"
            if "matmul_flops" in results
            else ""
        )
        + (
            f", memory read bandwidth {results['read_bandwidth'] / 1e9:.1f} GB/s"
            if "read_bandwidth" in results
            else ""
        ),
        "",
        "| preset | measurement | ours | MarianMTModel | ours / Marian |",
        "|---|---|---|---|---|",
    ]
    for preset, entry in results["presets"].items():
        for name, values in entry.items():
            if name.startswith("train"):
                ours, marian = values["ours"]["tokens_per_s"], values["marian"]["tokens_per_s"]
                label = f"{name} (target tokens/s, {values['padding_fraction']:.0%} padding)"
                lines.append(f"| {preset} | {label} | {ours:,.0f} | {marian:,.0f} | {ours / marian:.2f}x |")
                if "mfu" in values["ours"]:
                    o, m = values["ours"]["mfu"], values["marian"]["mfu"]
                    lines.append(f"| {preset} | model FLOPs utilisation | {o:.1%} | {m:.1%} | {o / m:.2f}x |")
            elif name == "decode bytes per token":
                greedy = entry.get("generate greedy batch 1")
                if greedy is None or "read_bandwidth" not in results:
                    continue
                floor = values / results["read_bandwidth"]  # seconds per token if only weights were read
                ours, marian = greedy["ours"] / GENERATE_LENGTH, greedy["marian"] / GENERATE_LENGTH
                lines.append(
                    f"| {preset} | greedy batch 1, ms per new token (floor: {values / 2**20:,.0f} MiB of "
                    f"weights per token / read bandwidth = {floor * 1e3:.2f} ms) | {ours * 1e3:.2f} "
                    f"| {marian * 1e3:.2f} | {ours / marian:.2f}x |"
                )
            elif name.endswith("share in forward"):
                ours, marian = values["ours"], values["marian"]
                cell = name.removesuffix(" share in forward")
                lines.append(
                    f"| {preset} | {cell}: share of time in model forward | {ours:.0%} | {marian:.0%} "
                    f"| {ours / marian:.2f}x |"
                )
                timed = entry.get(cell)
                if timed is not None:  # the models' own part of the cell; the rest is transformers' loop
                    ours, marian = ours * timed["ours"], marian * timed["marian"]
                    lines.append(
                        f"| {preset} | {cell}: time in model forward (s, median x share) | {ours:.3f} "
                        f"| {marian:.3f} | {ours / marian:.2f}x |"
                    )
            elif name.startswith("generate"):
                ours, marian = values["ours"], values["marian"]
                lines.append(f"| {preset} | {name} (s) | {ours:.3f} | {marian:.3f} | {ours / marian:.2f}x |")
            elif name.startswith("compiled generate"):
                for kind, label in (("ours", "ours"), ("marian", "MarianMTModel")):
                    v = values[kind]
                    lines.append(
                        f"| {preset} | {label}: {name[len('compiled ') :]}, static cache + torch.compile "
                        f"(s; eager {v['eager_s']:.3f}, first call {v['first_compiled_call_s']:.1f} s) "
                        f"| {v['compiled_s']:.3f} | | {v['compiled_s'] / v['eager_s']:.2f}x of eager |"
                    )
            elif name == "compiled training":
                ratio = values["compiled_tokens_per_s"] / values["eager_tokens_per_s"]
                lines.append(
                    f"| {preset} | ours: training step, torch.compile(dynamic=True) (target tokens/s; eager "
                    f"{values['eager_tokens_per_s']:,.0f}, first pass {values['first_pass_s']:.0f} s) "
                    f"| {values['compiled_tokens_per_s']:,.0f} | | {ratio:.2f}x of eager |"
                )
            elif name == "peak training memory":
                ours, marian = values["ours"], values["marian"]
                if min(ours, marian) < 0:
                    lines.append(f"| {preset} | peak training memory (MiB) | n/a | n/a | |")
                    continue
                lines.append(
                    f"| {preset} | peak training memory (MiB) | {ours / 2**20:,.0f} | {marian / 2**20:,.0f} "
                    f"| {ours / max(marian, 1):.2f}x |"
                )
    for preset, entry in results["presets"].items():
        if "deployment" not in entry:
            continue
        lines += [
            "",
            f"Deployment, {preset}: milliseconds per generate()/translate_batch call (sentences per second), "
            "each engine alone in its own process; CTranslate2 with the faster of 1 thread and one per core",
            "",
            "| setting | ours generate() | MarianMTModel generate() | CTranslate2 float32 | CTranslate2 int8 "
            "| float32 speed-up over Marian | float32 output identical to ours |",
            "|---|---|---|---|---|---|---|",
        ]
        for setting, engines in entry["deployment"].items():
            cells = []
            for engine in ENGINES:
                value = engines[engine]
                threads = f", {value['threads']} thr" if "threads" in value else ""
                cells.append(f"{value['seconds'] * 1e3:,.1f} ({value['sentences_per_s']:,.1f}/s{threads})")
            speedup = engines["marian"]["seconds"] / engines["ctranslate2 float32"]["seconds"]
            differing = engines.get("float32 export rows differing")  # absent from older JSON files
            identical = "yes" if engines["float32 export identical"] else "NO"
            identical += f" ({differing} rows differ)" if differing else ""
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {speedup:.1f}x | {identical} |")
    if "linear_kernel" in results:
        kernel = results["linear_kernel"]
        if kernel["mode"] != "auto":
            lines += ["", f"linear kernel mode {kernel['mode']} (set, not measured)"]
        else:
            classes = kernel["classes"]
            counts = {name: sum(c["kernel"] == name for c in classes) for name in ("onednn", "mkl")}
            lines += [
                "",
                f"linear kernel mode {kernel['mode']}: of {len(classes)} decoding product classes, "
                f"{counts['onednn']} measured fastest on oneDNN, {counts['mkl']} on packed MKL, "
                f"{len(classes) - sum(counts.values())} on torch's kernel"
                + "".join(
                    f"\n  {c['rows']} rows x ({c['out']} x {c['in']}){', kept layout' * c['kept_layout']}: "
                    + {"onednn": "oneDNN", "mkl": "packed MKL"}[c["kernel"]]
                    for c in classes
                    if c["kernel"] != "torch"
                )
                + f"\n  ({kernel['probe_seconds'] * 1e3:.0f} ms spent measuring)",
            ]
    if "decode_attention" in results:
        attention = results["decode_attention"]
        chosen = [c for c in attention["matmul_chosen"] if c["matmul"]]
        lines += [
            "",
            f"decoding attention mode {attention['mode']}: matrix products measured faster than SDPA for "
            f"{len(chosen)} of {len(attention['matmul_chosen'])} single-query classes"
            + "".join(f"\n  {c['rows_x_heads']} rows x heads, {c['keys']} keys" for c in chosen)
            + f"\n  ({attention['probe_seconds'] * 1e3:.0f} ms spent measuring)",
        ]
    if "attention" in results:
        lines += ["", "| n | eager (s) | SDPA (s) | eager scores tensor (MiB) |", "|---|---|---|---|"]
        by_n: dict[int, dict[str, Any]] = {}
        for row in results["attention"]:
            by_n.setdefault(row["n"], {})[row["attention"]] = row
        for n, pair in sorted(by_n.items()):
            lines.append(
                f"| {n} | {pair['eager']['seconds']:.4f} | {pair['sdpa']['seconds']:.4f} "
                f"| {pair['eager']['scores_bytes'] / 2**20:,.0f} |"
            )
    return "\n".join(lines)


def save_json(results: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=1, default=float))


__all__ = ["format_tables", "marian_like", "run", "save_json"]
