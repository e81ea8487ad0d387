"""Which kernel computes the model's linear layers on CPU: decided by timing, on the running machine.

torch computes float32 CPU matrix products with its BLAS (MKL on x86-64). It also ships oneDNN, whose
linear kernel (`torch.ops.mkldnn._linear_pointwise`, a private op that torch.compile uses on CPU) is
faster for some shapes on some CPUs and slower on others: on one 2-core AMD EPYC with AVX-512 it ran a
one-row product through an 8000 x 256 matrix in 0.56x of torch's time and a 256 x 256 one in 2.7x;
on AVX2-only machines it was slower than torch's BLAS even for large products. Nothing about a CPU model
predicts this, so the choice is measured, once per shape class and process, and only where it costs
nothing else:

- Only products that carry no derivatives (reverse mode, forward mode, torch.func), outside
  compilation and tracing, with at most `MAX_ROWS` rows: decoding steps, which run the same few shapes
  through every weight matrix. Training and long inputs always use torch's kernel: oneDNN
  keeps state for every shape it has seen (about half a MiB each), and token-based training batches
  come in hundreds of shapes (1.4 GB of resident memory in a measured training run).
- Rows are padded to a power of two before they reach oneDNN, so that at most 9 shapes per weight
  matrix ever do (rows are independent: padding changes no result row).
- The first product of a class (padded rows, weight shape, bias or not) times both kernels on its own
  inputs and keeps the faster one, which must also give the same result; any exception means torch's
  kernel. The decisions are kept in `linear_kernel().decisions`.

`VANILLA_TRANSFORMER_ONEDNN=0` (or `torch`) never uses oneDNN, `=1` (or `onednn`) uses it for every
eligible product without timing (the test suite runs both), unset or `auto` measures. Only summation
order differs between the kernels.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ENVIRONMENT_VARIABLE = "VANILLA_TRANSFORMER_ONEDNN"
MODES = {"auto": "auto", "0": "torch", "torch": "torch", "1": "onednn", "onednn": "onednn"}
# Decoding regime: batch x beams rows per step. Larger products run on torch's kernel.
MAX_ROWS = 256
# A probe times each kernel this many times after one untimed call, alternating between them.
PROBE_ROUNDS = 5


def _find_onednn_linear() -> Callable | None:
    """oneDNN's linear kernel, if this torch build has one that computes a known product correctly."""
    try:
        kernel = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        probe = kernel(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4), "none", [], "")
        return kernel if probe.shape == (2, 4) and bool((probe == 4).all()) else None
    except Exception:  # any failure means: not available
        return None


def _parse_mode(value: str | None) -> str:
    mode = MODES.get((value or "auto").strip().lower())
    if mode is None:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={value!r} is not understood: use auto (measure, the default), "
            "0 or torch (never oneDNN), 1 or onednn (oneDNN for every eligible product)."
        )
    return mode


@dataclass
class LinearKernel:
    """The kernel policy of this process: its mode and the decisions measured so far."""

    mode: str
    onednn: Callable | None
    # (padded rows, weight shape (out, in), has bias) -> whether oneDNN computes that class
    decisions: dict[tuple[int, tuple[int, int], bool], bool] = field(default_factory=dict)
    probe_seconds: float = 0.0

    def decide(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Measure and remember whether the class of `rows` (M, in) x this weight runs on oneDNN."""
        started = time.perf_counter()
        decision = self._faster_on_onednn(rows, weight, bias)
        self.decisions[(rows.shape[0], weight.shape, bias is not None)] = decision
        self.probe_seconds += time.perf_counter() - started
        return decision

    def _faster_on_onednn(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Time both kernels on this product, alternating; oneDNN only if faster and equal in result."""
        try:
            kernels = {
                False: lambda: F.linear(rows, weight, bias),
                True: lambda: self.onednn(rows, weight, bias, "none", [], ""),
            }
            expected, got = kernels[False](), kernels[True]()
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            tolerance = 16 * torch.finfo(torch.float32).eps * weight.shape[1] ** 0.5 * max(scale, 1.0)
            if got.shape != expected.shape or not bool(((got - expected).abs() <= tolerance).all()):
                return False
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(PROBE_ROUNDS):
                for choice, kernel in kernels.items():
                    started = time.perf_counter()
                    kernel()
                    times[choice].append(time.perf_counter() - started)
            return statistics.median(times[True]) < statistics.median(times[False])
        except Exception:  # fail closed: torch's own kernel
            return False


_POLICY = LinearKernel(mode=_parse_mode(os.environ.get(ENVIRONMENT_VARIABLE)), onednn=_find_onednn_linear())


def linear_kernel() -> LinearKernel:
    """This process's kernel policy (mode, measured decisions, seconds spent measuring)."""
    return _POLICY


def set_linear_kernel(mode: str) -> str:
    """Switch the policy ("auto", "torch" or "onednn") forgetting its decisions; returns the old mode."""
    previous, _POLICY.mode = _POLICY.mode, _parse_mode(mode)
    _POLICY.decisions.clear()
    return previous


def _fail_closed(*_: object) -> bool:
    return True


# Tensors of torch.func transforms (grad, jvp, vmap) look plain but carry derivatives the private op
# would drop; without this check there is no telling them apart, so then oneDNN is never used.
_is_transformed = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", _fail_closed)


def _eligible(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Plain float32 tensors (a contiguous bias), no derivatives of any kind to carry (reverse mode,
    forward mode, torch.func), no autocast, not traced. inputs: CPU float32 already, not compiling."""
    plain = (torch.Tensor, nn.Parameter)
    return (
        weight.dtype is torch.float32
        and type(inputs) in plain
        and type(weight) in plain
        and (bias is None or (type(bias) in plain and bias.dtype is torch.float32 and bias.is_contiguous()))
        and not (
            torch.is_grad_enabled()
            and (inputs.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
        and getattr(forward_ad, "_current_level", 0) < 0  # no forward-mode AD level open: no dual tensors
        and not (
            _is_transformed(inputs) or _is_transformed(weight) or (bias is not None and _is_transformed(bias))
        )
        and not torch.is_autocast_enabled("cpu")
        and not torch.jit.is_tracing()
    )


def linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`: on oneDNN where `LinearKernel` chose it (few rows, no autograd), else torch's kernel."""
    policy = _POLICY
    if (
        policy.onednn is None
        or policy.mode == "torch"
        or torch.compiler.is_compiling()  # first: nothing below needs tracing
        or not inputs.is_cpu
        or inputs.dtype is not torch.float32
    ):
        return F.linear(inputs, weight, bias)
    width = inputs.shape[-1] if inputs.dim() >= 2 else 0
    rows = inputs.numel() // width if width else 0
    if not 0 < rows <= MAX_ROWS:
        return F.linear(inputs, weight, bias)
    padded_rows = 1 << (rows - 1).bit_length()  # a power of two: few shapes reach oneDNN
    # A class measured slower on oneDNN goes straight to torch's kernel: decoding steps repeat the same
    # few classes, so this lookup is what most calls cost here.
    decision = (
        True
        if policy.mode == "onednn"
        else policy.decisions.get((padded_rows, weight.shape, bias is not None))
    )
    if decision is False or not _eligible(inputs, weight, bias):
        return F.linear(inputs, weight, bias)
    flat = inputs.reshape(rows, width)
    if padded_rows != rows:
        flat = torch.cat((flat, flat.new_zeros(padded_rows - rows, width)))
    if decision is None and not policy.decide(flat, weight, bias):
        return F.linear(inputs, weight, bias)
    output = policy.onednn(flat, weight, bias, "none", [], "")[:rows]  # (M, out)
    return output.view(*inputs.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoints) whose product goes through `linear`."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return linear(inputs, self.weight, self.bias)


# Attention of a decoding step ---------------------------------------------------------------------
#
# A decoding step attends with one query per row. torch's SDPA runs it through its blocked CPU kernel,
# which is the faster choice for a few rows but not for many: on the 2-core AVX-512 EPYC of the README
# (medians of 300 calls, head width 48 or 64, 64 keys), 1 row x 4 heads took 12 us against 24 us for
# two matrix products and a softmax, 32 rows x 8 heads 220 us against 162 us, and 128 rows x 8 heads
# (the base model, beam 4, batch 32) 2.1 ms against 0.64 ms. As for the linear
# layers, the first call of each class (rows x heads and key count, both rounded up to a power of two,
# head width, kind of mask) times both on its own inputs, and keeps the matrix products only if they
# are faster and give the same result; any exception means SDPA. Training, gradients, compilation and
# several queries always go to SDPA. VANILLA_TRANSFORMER_DECODE_ATTENTION=sdpa or =matmul forces one.

ATTENTION_VARIABLE = "VANILLA_TRANSFORMER_DECODE_ATTENTION"
ATTENTION_MODES = ("auto", "sdpa", "matmul")


def _parse_attention_mode(value: str | None) -> str:
    mode = (value or "auto").strip().lower()
    if mode not in ATTENTION_MODES:
        raise ValueError(
            f"{ATTENTION_VARIABLE}={value!r} is not understood: "
            "use auto (measure, the default), sdpa or matmul."
        )
    return mode


def matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """softmax(Q K^T * scaling + mask) V as two batched matrix products (Equation 1); a boolean mask
    keeps its True positions, a float mask is added to the scores. (B, H, T, Dh) in and out."""
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scaling)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype is torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1), value)


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)


@dataclass
class AttentionKernel:
    """Which computation a decoding step's attention uses: the mode and the decisions measured so far."""

    mode: str
    # (rows x heads, keys, head width, mask kind), the first two rounded up to a power of two -> matmul?
    decisions: dict[tuple[int, int, int, str], bool] = field(default_factory=dict)
    probe_seconds: float = 0.0

    def decide(self, key_: tuple[int, int, int, str], *inputs: object) -> bool:
        started = time.perf_counter()
        decision = self._faster_as_matmul(*inputs)
        self.decisions[key_] = decision
        self.probe_seconds += time.perf_counter() - started
        return decision

    @staticmethod
    def _faster_as_matmul(query, key, value, mask, scaling) -> bool:
        try:
            kernels = {
                False: lambda: _sdpa(query, key, value, mask, scaling),
                True: lambda: matmul_attention(query, key, value, mask, scaling),
            }
            expected, got = kernels[False](), kernels[True]()
            scale = max(float(value.abs().max()), 1.0)
            tolerance = 16 * torch.finfo(query.dtype).eps * key.shape[-2] ** 0.5 * scale
            if got.shape != expected.shape or not bool(((got - expected).abs() <= tolerance).all()):
                return False
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(PROBE_ROUNDS):
                for choice, kernel in kernels.items():
                    started = time.perf_counter()
                    kernel()
                    times[choice].append(time.perf_counter() - started)
            return statistics.median(times[True]) < statistics.median(times[False])
        except Exception:  # fail closed: SDPA
            return False


_ATTENTION = AttentionKernel(mode=_parse_attention_mode(os.environ.get(ATTENTION_VARIABLE)))


def attention_kernel() -> AttentionKernel:
    """This process's decoding-attention policy (mode, measured decisions, seconds spent measuring)."""
    return _ATTENTION


def set_attention_kernel(mode: str) -> str:
    """Switch the policy ("auto", "sdpa" or "matmul") forgetting its decisions; returns the old mode."""
    previous, _ATTENTION.mode = _ATTENTION.mode, _parse_attention_mode(mode)
    _ATTENTION.decisions.clear()
    return previous


def decoding_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention function, except that a single-query step on CPU is computed as
    matrix products where `AttentionKernel` measured that faster. Returns (B, T, H, Dh), None."""
    policy = _ATTENTION
    mask = attention_mask
    if (
        policy.mode == "sdpa"
        or query.shape[2] != 1
        or dropout
        or kwargs.get("output_attentions")
        or torch.compiler.is_compiling()
        or not query.is_cpu
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
        or torch.is_autocast_enabled("cpu")
        or (mask is not None and (mask.dim() != 4 or mask.requires_grad))
        or torch.jit.is_tracing()
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    rows_heads = query.shape[0] * query.shape[1]
    class_ = (
        1 << (rows_heads - 1).bit_length(),
        1 << (key.shape[2] - 1).bit_length(),
        query.shape[-1],
        "none" if mask is None else str(mask.dtype),
    )
    decision = True if policy.mode == "matmul" else policy.decisions.get(class_)
    if decision is None:
        decision = policy.decide(class_, query, key, value, mask, scaling)
    if not decision:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return matmul_attention(query, key, value, mask, scaling).transpose(1, 2), None


__all__ = [
    "AttentionKernel",
    "Linear",
    "LinearKernel",
    "attention_kernel",
    "decoding_attention",
    "linear",
    "linear_kernel",
    "matmul_attention",
    "set_attention_kernel",
    "set_linear_kernel",
]
