"""Shared fixtures: a tiny configuration (vocab 99, d_model 32, 2+2 layers, 4 heads) and inputs; each of
the three linear-layer kernels (torch, oneDNN, packed MKL); tolerances that follow from dtype and problem
size; running a script in this process."""

import copy
import io
import logging
import math
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer import kernels_vanilla_transformer as kernels

PAD, BOS, EOS = 0, 1, 2
# The longest chain of sums behind an output of the tiny model: 2 + 2 layers, the embedding and the
# output projection, each summing at most 99 terms (the vocabulary; d_model 32 and d_ff 64 are smaller).
TINY_TERMS = (2 + 2 + 2) * 99
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def tiny_config(**overrides) -> VanillaTransformerConfig:
    values = {
        "vocab_size": 99,
        "d_model": 32,
        "num_heads": 4,
        "d_ff": 64,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "dropout": 0.0,
    }
    return VanillaTransformerConfig(**{**values, **overrides})


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = attn_implementation
    return VanillaTransformerForConditionalGeneration(config).eval()


@pytest.fixture
def config() -> VanillaTransformerConfig:
    return tiny_config()


@pytest.fixture
def model() -> VanillaTransformerForConditionalGeneration:
    return tiny_model()


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    """Two source and target sequences; the second of each is padded."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 6:], attention_mask[1, 6:] = PAD, 0
    labels = torch.randint(3, 99, (2, 7), generator=generator)
    labels[:, -1] = EOS
    labels[1, 4] = EOS
    labels[1, 5:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.fixture(params=["torch", "onednn", "mkl"])
def each_linear_kernel(request):
    """Run a test with torch's kernel, with oneDNN's for every eligible product and with packed MKL for
    every eligible decoding-step product (where this torch has them), whatever the measured choice on
    this machine would be."""
    policy = kernels.linear_kernel()
    if request.param == "onednn" and policy.onednn is None:
        pytest.skip("this torch build has no oneDNN linear kernel")
    if request.param == "mkl" and policy.mkl is None:
        pytest.skip("this torch build has no MKL packed product")
    previous = kernels.set_linear_kernel(request.param)
    yield request.param
    kernels.set_linear_kernel(previous)


def rounding_tolerance(dtype: torch.dtype, terms: int) -> float:
    """Relative difference allowed between two computations of the same quantity that differ only in
    summation order (kernels, blocking, padding): a few units of `dtype`'s roundoff, grown by the square
    root of the number of terms summed (the typical growth of rounding error in a sum)."""
    return 8 * torch.finfo(dtype).eps * math.sqrt(terms)


def assert_same_up_to_rounding(
    got: torch.Tensor, expected: torch.Tensor, terms: int, scale: float | None = None, msg=None
) -> None:
    """`got` equals `expected` to `rounding_tolerance`, relative to `scale`: by default the largest
    magnitude in `expected`; for gradients that cancel to nearly 0 (a key bias: softmax ignores a
    constant shift) pass the magnitude of the computation they come from, e.g. of all gradients."""
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    tolerance = rounding_tolerance(expected.dtype, terms)
    if scale is None:
        scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * max(scale, 1e-30), msg=msg)


def gradient_scale(grads: dict[str, torch.Tensor]) -> float:
    """The largest gradient entry of a model: the magnitude rounding errors in its backward scale with."""
    return max(float(g.abs().max()) for g in grads.values())


@pytest.fixture
def keeping_spaces_at_the_ends():
    """A function that gives a copy of one of this package's tokenizers keeping the spaces at a text's
    ends, as those trained before e107b12 did (and folders saved with them still do)."""
    from tokenizers import Regex, normalizers

    def copy_of(tokenizer):
        kept = copy.deepcopy(tokenizer)
        steps = [normalizers.NFKC(), normalizers.Replace(Regex(r"\s"), " ")]
        kept.backend_tokenizer.normalizer = normalizers.Sequence(steps)
        return kept

    return copy_of


@contextmanager
def logged_messages(name: str) -> Iterator[list[str]]:
    """The messages logged through logger `name` (and its children) inside the block, warnings that
    transformers gives once per process included (`warning_once`'s memory is cleared first): transformers'
    loggers do not propagate to the root logger, where pytest's caplog listens."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        logging.Logger.warning_once.cache_clear()
        yield messages
    finally:
        logger.removeHandler(handler)


def count_returns(monkeypatch, cls: type, method: str) -> list[int]:
    """Patches `cls.method` to count the calls that returned something (not None); returns the counts."""
    steps = []
    original = getattr(cls, method)

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        if result is not None:
            steps.append(1)
        return result

    monkeypatch.setattr(cls, method, counted)
    return steps


# Modules whose tests compare computed values (kernels, fast paths, references) within rounding: the
# README's test command runs them a second time on torch's, oneDNN's and MKL's AVX2 kernels
# (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`), so that a machine
# with AVX-512 also checks what AVX2-only machines compute: they round differently (an exact equality
# held with one machine's kernels only).
NUMERICS_MODULES = {
    "test_export_ctranslate2",
    "test_generation",
    "test_kernels",
    "test_marian_conversion",
    "test_modeling",
    "test_optimised_paths",
    "test_serialization",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rpartition(".")[2] in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run_in_process(monkeypatch, capsys):
    """`run_in_process("train.py", *args, stdin=text)` runs scripts/train.py in this process as `python
    scripts/train.py *args` would run it, and returns its exit code and output, without a subprocess's
    seconds of imports: for scripts that set nothing process-wide (what a subprocess must check, such as
    the locale's encoding, a terminal or a signal, needs one). An exception the script does not turn
    into an exit propagates, failing the test with its traceback."""

    def run(name: str, *args: str, stdin: str | None = "") -> ScriptRun:  # None: standard input closed
        script = str(SCRIPTS / name)
        monkeypatch.setattr(sys, "argv", [script, *args])
        given = None if stdin is None else io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
        monkeypatch.setattr(sys, "stdin", given)
        capsys.readouterr()
        code, message = 0, ""
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:  # as the interpreter does: a message goes to stderr with status 1
            if isinstance(exit_.code, int):
                code = exit_.code
            elif exit_.code is not None:
                code, message = 1, f"{exit_.code}\n"
        out, err = capsys.readouterr()
        return ScriptRun(code, out, err + message)

    return run
