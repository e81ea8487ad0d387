"""The machinery beside the paper's model: kernels chosen by measurement, and the work it skips.

- Which kernel computes a linear layer, and a decoding step's attention, on CPU: decided by timing,
  on the running machine (below, and at "Attention of a decoding step").
- `dropout`: `F.dropout` with a cheaper mask draw on CPU.
- `TokenPacking`: per-token work on the real tokens of a padded batch only (on CPU: see
  `reads_are_free`); layers pass it to attention as `PackedTokens` keyword arguments.
- `PositionTable`: the sinusoidal encodings kept for reuse while decoding.
- `projected_label_smoothed_loss`: output projection and label-smoothed loss in chunks, without the
  (N, V) logits.
- Input checks (`check_token_ids`, `check_mask`), `LeanGenerationSteps` (less work per decoding
  step than `GenerationMixin`'s hooks) and `RemoteCodeFolder` (a saved folder that loads with
  `trust_remote_code` where this package is not installed).

Shortcuts that read tensor values on the host (packing, selecting labelled tokens, token-id checks) run
only on CPU tensors (`reads_are_free`): on an accelerator a forward pass never waits for the device.

The model module imports these; each gives the plain computation's result (tests/test_kernels.py,
tests/test_optimised_paths.py), so the paper can be read in `modeling_vanilla_transformer.py` alone.

Linear layers.

torch computes float32 CPU matrix products with its BLAS (MKL on x86-64). Two other kernels ship with
it, each faster for some shapes on some CPUs and slower on others:

- oneDNN's linear kernel (`torch.ops.mkldnn._linear_pointwise`, a private op that torch.compile uses on
  CPU): on one 2-core AMD EPYC with AVX-512 it ran a one-row product through an 8000 x 256 matrix in
  0.56x of torch's time and a 256 x 256 one in 2.7x; on AVX2-only machines it was slower than torch's
  BLAS even for large products.
- MKL's product with a matrix packed in advance (`torch.ops.mkl._mkl_linear`, what torch.compile's
  weight freezing uses on CPU): MKL packs the matrix into its internal layout at every plain call, a
  cost that dominates when there are few rows. On a 2-core Intel Xeon (AVX-512, AMX) 32 rows through
  the base model's feed-forward matrices (512 x 2048, 2048 x 512) took 0.35x-0.56x of torch's time (three
  ad-hoc timings), one row through them 1.05x.

Nothing about a CPU model predicts this, so the choice is measured, once per shape class and process,
and only where it costs nothing else:

- Only products that carry no derivatives (reverse mode, forward mode, torch.func), outside
  compilation and tracing, with at most `MAX_ROWS` rows: decoding steps, which run the same few shapes
  through every weight matrix. Training and long inputs always use torch's kernel: oneDNN
  keeps state for every shape it has seen (about half a MiB each), and token-based training batches
  come in hundreds of shapes (1.4 GB of resident memory in a measured training run).
- Rows are padded to a power of two before they reach another kernel, so that at most 9 shapes per
  weight matrix ever do (rows are independent: padding changes no result row).
- Both read a matrix fastest in their own layout. A matrix that runs at every decoding step (the
  decoder's, the output projection: `Linear(..., per_step=True)`) is converted once into that layout for
  the row count in use and the copy is kept (`WeightCopies`: one per matrix and kernel, dropped when
  the matrix changes, is converted (`.to()`, `.half()`) or is freed, or when the class is decided for
  another kernel), so decoding holds one more copy of those matrices; only decodings with a cache use
  the copies (`kept_copies`): a forward without one (an evaluation loss) computes on the matrices
  themselves. The others (the encoder's, used once per input) may run on oneDNN, which then reorders
  at each call, but never on packed MKL, whose packing would be paid at every call; training runs on
  neither.
- The first product of a class (padded rows, weight shape, bias or not, kept layout or not) times the
  kernels in turns on its own inputs and keeps the fastest, which must also give the same result; any
  exception means torch's kernel. The decisions are kept in `linear_kernel().decisions`.

`VANILLA_TRANSFORMER_LINEAR=torch` never uses another kernel, `=onednn` uses oneDNN for every eligible
product and `=mkl` packed MKL for every eligible per-step product, without timing (the test suite runs
all three); unset or `auto` measures, except under `torch.use_deterministic_algorithms(True)`, where
it uses torch's kernel (as `VANILLA_TRANSFORMER_DECODE_ATTENTION=auto` then uses SDPA): choices made by
timing differ between runs, and so would the results' last bits. The older
`VANILLA_TRANSFORMER_ONEDNN=0` / `=1` (torch / onednn) is read when the new variable is unset. torch's
own switch, `torch.backends.mkldnn.enabled = False`, keeps oneDNN out in every mode. Only summation
order differs between the kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

LINEAR_VARIABLE = "VANILLA_TRANSFORMER_LINEAR"
ENVIRONMENT_VARIABLE = "VANILLA_TRANSFORMER_ONEDNN"  # the older switch: 0 or 1, read when the above is unset
MODES = {
    "auto": "auto",
    "0": "torch",
    "torch": "torch",
    "1": "onednn",
    "onednn": "onednn",
    "mkl": "mkl",
}
# Decoding regime: batch x beams rows per step. Larger products run on torch's kernel.
MAX_ROWS = 256
# A probe times each kernel at least this many times after one untimed call, alternating between them,
# and for products of a few microseconds more times, until one kernel has taken PROBE_SECONDS in all
# (or PROBE_MAX_ROUNDS): a median of five such short calls is mostly timer and machine noise.
PROBE_ROUNDS = 5
PROBE_SECONDS = 0.002
PROBE_MAX_ROUNDS = 200
# From the second round on, a kernel whose fastest call took more than PROBE_MARGIN times another's
# slowest is out: it cannot win, and timing it again costs most for the largest products.
PROBE_MARGIN = 1.25
# A one-row product of a matrix run at every decoding step is timed with that matrix out of the core's
# cache (EVICTION_BYTES read between calls, more than a core's L2 on the CPUs seen, 1-2 MiB), as a
# decoding step meets it after reading the other layers' matrices. Timed cache-hot, MKL's packed
# product won classes that it lost in decoding (the tiny model's 576 x 192 and 768 x 192 on an Intel
# Xeon of family 6 model 167: greedy batch 1 decoding took 1.08x-1.09x the time it takes with the
# choices timed out of cache; docs/performance.md). More rows reuse each matrix element across rows, and
# there cold timing changed no cell for the better. Each such call is slower and the reads between cost
# time, so these are PROBE_COLD_ROUNDS rounds.
EVICTION_BYTES = 8 << 20
PROBE_COLD_ROUNDS = 25


def _ones(*shape: int) -> torch.Tensor:
    """float32 CPU ones for the probes below: not of a default dtype or on a default device a program may
    have set before importing this module (`torch.set_default_dtype(torch.float64)`,
    `torch.set_default_device("cuda")`), where the kernels would fail and never be used in the process."""
    return torch.ones(*shape, dtype=torch.float32, device="cpu")


# What `torch.backends.mkldnn.enabled` reads, called directly: a oneDNN product asks at every call, and
# the module property costs six times as much (262 ns against 41, AMD EPYC of family 25 model 17).
_onednn_enabled: Callable[[], bool] = getattr(
    torch._C, "_get_mkldnn_enabled", lambda: torch.backends.mkldnn.enabled
)


def _find_onednn_linear() -> Callable | None:
    """oneDNN's linear kernel, if this torch build has one that computes a known product correctly."""
    try:
        kernel = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        probe = kernel(_ones(2, 3), _ones(4, 3), _ones(4), "none", [], "")
        return kernel if probe.shape == (2, 4) and bool((probe == 4).all()) else None
    except Exception:  # any failure means: not available
        return None


def _find_onednn_reorder() -> Callable | None:
    """oneDNN's weight reordering (`weight, rows -> blocked copy`), if its product with `_linear_pointwise`
    computes a known result in this torch build."""
    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        kernel = _find_onednn_linear()
        if kernel is None:
            return None
        probe = kernel(_ones(2, 3), reorder(_ones(4, 3), 2), _ones(4), "none", [], "")
        return reorder if probe.shape == (2, 4) and bool((probe == 4).all()) else None
    except Exception:  # any failure means: not available
        return None


def _find_mkl_packed() -> tuple[Callable, Callable] | tuple[None, None]:
    """MKL's product with a packed matrix (`torch.ops.mkl._mkl_linear`) and its packing
    (`_mkl_reorder_linear_weight`: `weight, rows -> packed copy`), if this torch build has both and
    they compute a known result; (None, None) otherwise."""
    try:
        pack, kernel = torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
        if not torch.backends.mkl.is_available():
            return None, None
        weight = _ones(4, 3)
        probe = kernel(_ones(2, 3), pack(weight, 2), weight, _ones(4), 2)
        return (kernel, pack) if probe.shape == (2, 4) and bool((probe == 4).all()) else (None, None)
    except Exception:  # any failure means: not available
        return None, None


def _parse_mode(value: str | None, variable: str = LINEAR_VARIABLE) -> str:
    mode = MODES.get((value or "auto").strip().lower())
    if mode is None:
        raise ValueError(
            f"{variable}={value!r} is not understood: use auto (measure, the default), "
            "0 or torch (torch's kernel only), 1 or onednn (oneDNN for every eligible product), "
            "mkl (MKL with packed matrices for every product of a decoding step)."
        )
    return mode


def _mode_from_environment() -> str:
    value = os.environ.get(LINEAR_VARIABLE)
    if value is None:
        return _parse_mode(os.environ.get(ENVIRONMENT_VARIABLE), ENVIRONMENT_VARIABLE)
    return _parse_mode(value)


# Decodings started so far (`new_generate_call`: each `generate()` call and first cached forward): kept
# weight copies are checked against their sources' values once in each.
_GENERATE_CALLS = [0]
CHECKSUM_CHUNK = 1 << 20  # elements of a narrower-than-float32 tensor widened at once by `value_checksum`
_PROBES: dict[tuple[int, int, torch.device, torch.dtype], torch.Tensor] = {}


# Whether products of per-step layers may use (and keep) copies of their matrices: only inside a
# decoding with a cache (`kept_copies`), where those copies are checked against the weights' values once
# per decoding (`new_generate_call`). Elsewhere (an evaluation loss, a forward without a cache, the
# output layer called directly) a copy would have to be checked at every call, one more read of its
# matrix than the product itself needs, so none is used.
_KEEP_COPIES: contextvars.ContextVar[bool] = contextvars.ContextVar("keep_weight_copies", default=False)


@contextlib.contextmanager
def kept_copies(active: bool = True) -> Iterator[None]:
    """Inside it (where `active`), per-step layers may compute on copies of their matrices in other
    kernels' layouts, kept across calls; callers are decodings with a cache. Inactive under
    torch.compile, which cannot trace the context variable (and computes on torch's kernels anyway)."""
    if not active or torch.compiler.is_compiling():
        yield
        return
    token = _KEEP_COPIES.set(True)
    try:
        yield
    finally:
        _KEEP_COPIES.reset(token)


def new_generate_call() -> None:
    """Start a `generate()` call or another decoding (a first cached forward, as a hand-written decoding
    loop runs): each kept copy is checked against its sources' values once in it."""
    _GENERATE_CALLS[0] += 1


def _probe(size: int, like: torch.Tensor, side: int) -> torch.Tensor:
    """The fixed vector of `size` positive values for a matrix's rows (`side` 0) or columns (1): one
    vector for both sides of a square matrix would give its transpose the same checksum."""
    key = (size, side, like.device, like.dtype)
    if key not in _PROBES:
        generator = torch.Generator().manual_seed(2 * size + side)
        # On the CPU, as its generator: not on a default device (`torch.set_default_device("cuda")`), where
        # a CPU generator is refused
        _PROBES[key] = (torch.rand(size, generator=generator, device="cpu") + 0.5).to(like.device, like.dtype)
    return _PROBES[key]


def value_checksum(tensors: tuple[torch.Tensor, ...]) -> tuple[float, ...]:
    """u^T W v per tensor (as a matrix of its first dimension's rows), with fixed positive vectors u and
    v: one read of the values, and changed by any change of them short of a coincidence (a sum would
    miss a permutation; u = v, a square matrix transposed). Computed in float32 at least: products
    rounded to bfloat16's 8 bits left real edits (5% of every element) unseen in about one case of 50."""
    sums = []
    for tensor in tensors:
        rows = tensor.reshape(tensor.shape[0] if tensor.dim() > 1 else 1, -1)
        if rows.dtype in (torch.float32, torch.float64):
            sums.append(float(_probe(rows.shape[0], rows, 0) @ (rows @ _probe(rows.shape[1], rows, 1))))
            continue
        wide = rows.new_empty(0, dtype=torch.float32)
        step = max(1, CHECKSUM_CHUNK // rows.shape[1])  # widened a block of rows at a time
        parts = [
            rows[i : i + step].to(torch.float32) @ _probe(rows.shape[1], wide, 1)
            for i in range(0, len(rows), step)
        ]
        sums.append(float(_probe(rows.shape[0], wide, 0) @ torch.cat(parts)))
    return tuple(sums)


class WeightCopies:
    """Tensors derived from weights for inference (a reordered layout, a concatenation), kept while their
    sources are unchanged: the same storage and version counter (most optimiser steps and
    `load_state_dict` write in place and bump it). Some writes do not bump it: fused optimisers
    (`torch.optim.AdamW(fused=True)`, transformers' default), and writes through `weight.data` (it has a
    version counter of its own): PEFT's adapter merging (`weight.data += delta`), weights averaged or
    swapped with `p.data.copy_(...)`. So once per decoding (`new_generate_call`) a copy is also checked
    against its sources' values (`value_checksum`, one read of them) and remade if they changed. Copies
    are used inside decodings with a cache only (`kept_copies`).
    At most one copy per first source tensor, dropped when that tensor's memory is freed. Tensors of
    `torch.inference_mode` keep no version counter: nothing is kept for them.

    Looked up at every decoding-step product, so by the source's `id` in a plain dict (a weak-keyed
    dictionary's lookup cost a microsecond more). No weak reference is taken to a source itself: torch
    refuses to swap a tensor that has one (`torch.utils.swap_tensors`, which `.to()`, `load_state_dict`
    and `fully_shard` use under `torch.__future__.set_swap_module_params_on_conversion(True)`), so a
    model once decoded could no longer be converted. Each entry holds a weak reference to the source's
    storage instead (torch keeps one Python object per live storage), which with the tensor's shape and
    strides (checked once per decoding) tells a reused `id` from its tensor; a finalizer on the storage
    removes the entry when the memory goes."""

    def __init__(self) -> None:
        # id(first source) -> (weak reference to its storage, fingerprint, copy, generate() call, checksum,
        # its shape and strides)
        self._copies: dict[int, tuple[weakref.ref, tuple, torch.Tensor, int, tuple, tuple]] = {}
        self._watched: set[tuple[int, int]] = set()  # (key, id(storage)) with a finalizer registered

    def _forget(self, key: int, storage: int) -> None:
        """A source's storage was freed: its entry goes, unless the key is already another tensor's."""
        self._watched.discard((key, storage))
        kept = self._copies.get(key)
        if kept is not None and kept[0]() is None:
            self._copies.pop(key, None)

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, sources: tuple[torch.Tensor, ...], make: Callable[[], torch.Tensor], tag: object = None):
        """The kept copy for `sources` (and `tag`), made by `make()` if there is none or it is stale;
        None when the sources cannot be tracked."""
        source = sources[0]
        try:
            storage = source.untyped_storage()
            if len(sources) == 1:
                fingerprint: tuple = (tag, source.data_ptr(), source._version)
            else:
                fingerprint = (tag, *((t.data_ptr(), t._version) for t in sources))
        except Exception:  # inference tensors have no version counter; no storage, nothing to track
            return None
        key = id(source)
        kept = self._copies.get(key)
        call = _GENERATE_CALLS[0]
        current = kept is not None and kept[1] == fingerprint and kept[0]() is storage
        if current and kept[3] == call:  # every decoding step's path: nothing more to check
            return kept[2]
        # The shape and strides too: another tensor at a reused `id`, a view of the same memory (a
        # transpose), is another matrix.
        layout = (source.shape, source.stride())
        current = current and kept[5] == layout
        # Once per generate() call. Copies made here (a concatenation, then packed) are written by no
        # one: their version counter is enough, and checking their values would read the weights twice.
        # Not under autocast (a `generate()` inside `torch.autocast("cpu")`): the checksum's products in
        # bfloat16 left 5% edits of every element unseen in one case of 25.
        device = source.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        with torch.no_grad(), torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            derived = all(getattr(t, "_kept_copy", False) for t in sources)
            checksum = () if derived else value_checksum(sources)
        if current and checksum == kept[4]:
            self._copies[key] = (*kept[:3], call, checksum, layout)
            return kept[2]
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, itself trackable
            copy = make()
        copy._kept_copy = True
        if (key, id(storage)) not in self._watched:
            self._watched.add((key, id(storage)))
            weakref.finalize(storage, self._forget, key, id(storage))
        self._copies[key] = (weakref.ref(storage), fingerprint, copy, call, checksum, layout)
        return copy

    def drop(self, source: torch.Tensor) -> None:
        """Forget the copy kept for `source`, if any."""
        key = id(source)
        kept = self._copies.get(key)
        try:
            storage = source.untyped_storage()
        except Exception:  # nothing was kept for it
            return
        if kept is not None and kept[0]() is storage:
            self._copies.pop(key, None)  # another thread may have dropped it meanwhile


@dataclass
class LinearKernel:
    """The kernel policy of this process: its mode and the decisions measured so far."""

    mode: str
    onednn: Callable | None
    reorder: Callable | None = None
    mkl: Callable | None = None
    pack: Callable | None = None
    # oneDNN's blocked copies and MKL's packed copies of the matrices they compute, for the row count in use
    layouts: WeightCopies = field(default_factory=WeightCopies)
    packed: WeightCopies = field(default_factory=WeightCopies)
    # (padded rows, weight shape (out, in), has bias, kept layout) -> the kernel that computes that class
    decisions: dict[tuple[int, tuple[int, int], bool, bool], str] = field(default_factory=dict)
    probe_seconds: float = 0.0

    def decide(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_step: bool
    ) -> str:
        """Measure and remember which kernel computes the class of `rows` (M, in) x this weight; the
        copies made for the kernels not chosen are dropped."""
        started = time.perf_counter()
        candidates = {}
        if self.onednn is not None and _onednn_enabled():
            candidates["onednn"] = lambda: self.compute("onednn", rows, weight, bias, per_step)
        if self.mkl is not None and per_step:
            candidates["mkl"] = lambda: self.compute("mkl", rows, weight, bias, per_step)
        between = evict_cache if per_step and rows.shape[0] == 1 else None
        decision = fastest_equal(
            lambda: F.linear(rows, weight, bias), candidates, terms=weight.shape[1], between=between
        )
        self.decisions[(rows.shape[0], weight.shape, bias is not None, per_step)] = decision
        if decision != "onednn":
            self.layouts.drop(weight)
        if decision != "mkl":
            self.packed.drop(weight)
        self.probe_seconds += time.perf_counter() - started
        return decision

    def compute(
        self, kernel: str, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_step: bool
    ) -> torch.Tensor:
        """`F.linear(rows, weight, bias)` for 2-D `rows` on `kernel`, looking up the kept copy of `weight`
        each time (as `linear` does: at one row that lookup is not free). oneDNN only while torch's switch
        for it is on (`torch.backends.mkldnn.flags(enabled=False)` turns it off, as for torch's own uses)."""
        if kernel == "onednn" and self.onednn is not None and _onednn_enabled():
            return self.onednn(
                rows, self.onednn_weight(weight, rows.shape[0], per_step), bias, "none", [], ""
            )
        if kernel == "mkl" and self.mkl is not None and per_step:
            packed = self.mkl_weight(weight, rows.shape[0])
            if packed is not None:
                return self.mkl(rows, packed, weight, bias, rows.shape[0])
        return F.linear(rows, weight, bias)

    def onednn_weight(self, weight: torch.Tensor, rows: int, per_step: bool) -> torch.Tensor:
        """`weight` in oneDNN's layout for products of `rows` rows, kept, if it runs at every decoding
        step; `weight` itself otherwise or if that fails."""
        if self.reorder is None or not per_step:
            return weight
        try:
            copy = self.layouts.get((weight,), lambda: self.reorder(weight, rows), tag=rows)
        except Exception:  # fail closed: the plain layout is always right
            return weight
        return weight if copy is None else copy

    def mkl_weight(self, weight: torch.Tensor, rows: int) -> torch.Tensor | None:
        """`weight` packed by MKL for products of `rows` rows, kept; None where it cannot be kept
        (inference tensors) or packing fails."""
        try:
            return self.packed.get((weight,), lambda: self.pack(weight, rows), tag=rows)
        except Exception:  # fail closed: torch's kernel
            return None


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    return _ones(EVICTION_BYTES // 4)


def evict_cache() -> None:
    """Read EVICTION_BYTES of memory of no use (on every thread of the product), so that what a core's
    cache held before is mostly gone from it."""
    _eviction_buffer().sum()


def fastest_equal(
    plain: Callable[[], torch.Tensor],
    candidates: dict[str, Callable[[], torch.Tensor]],
    terms: int,
    between: Callable[[], None] | None = None,
) -> str:
    """The fastest of `plain` ("torch") and those `candidates` that give its result (to float32 rounding
    of `terms`-term sums, relative to max(|result|, 1)): medians of timed calls, in turns, after one
    untimed call (see `PROBE_ROUNDS`); a kernel clearly slower than another stops being timed
    (`PROBE_MARGIN`). `between`, if given, runs untimed before each timed call (`evict_cache`), and then
    there are `PROBE_COLD_ROUNDS` rounds. Fails closed: a candidate that raises is out; "torch" if all are."""
    kernels = {"torch": plain}
    try:
        expected = plain()
        scale = max(float(expected.abs().max()) if expected.numel() else 0.0, 1.0)
    except Exception:
        return "torch"
    tolerance = 16 * torch.finfo(torch.float32).eps * terms**0.5 * scale
    for name, candidate in candidates.items():
        try:
            got = candidate()
            if got.shape == expected.shape and bool(((got - expected).abs() <= tolerance).all()):
                kernels[name] = candidate
        except Exception:
            continue
    if len(kernels) == 1:
        return "torch"
    times: dict[str, list[float]] = {name: [] for name in kernels}
    rounds = 0
    try:
        while len(kernels) > 1 and (
            rounds < (PROBE_ROUNDS if between is None else PROBE_COLD_ROUNDS)
            or (
                between is None
                and rounds < PROBE_MAX_ROUNDS
                and max(sum(times[name]) for name in kernels) < PROBE_SECONDS
            )
        ):
            for name, kernel in kernels.items():
                if between is not None:
                    between()
                started = time.perf_counter()
                kernel()
                times[name].append(time.perf_counter() - started)
            rounds += 1
            if rounds >= 2:
                slowest = min(max(times[name]) for name in kernels)  # the best worst call
                kernels = {
                    name: k for name, k in kernels.items() if min(times[name]) <= PROBE_MARGIN * slowest
                }
    except Exception:
        return "torch"
    return min(kernels, key=lambda name: statistics.median(times[name]))


def faster_and_equal(
    plain: Callable[[], torch.Tensor], candidate: Callable[[], torch.Tensor], terms: int
) -> bool:
    """Whether `candidate` gives `plain`'s result and is faster (`fastest_equal` of the two)."""
    return fastest_equal(plain, {"candidate": candidate}, terms) == "candidate"


_MKL, _PACK = _find_mkl_packed()
_POLICY = LinearKernel(
    mode=_mode_from_environment(),
    onednn=_find_onednn_linear(),
    reorder=_find_onednn_reorder(),
    mkl=_MKL,
    pack=_PACK,
)


def linear_kernel() -> LinearKernel:
    """This process's kernel policy (mode, measured decisions, seconds spent measuring)."""
    return _POLICY


def set_linear_kernel(mode: str) -> str:
    """Switch the policy ("auto", "torch", "onednn" or "mkl") forgetting its decisions; returns the old
    mode."""
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
    forward mode, torch.func), no autocast. inputs: CPU float32 already, not compiling nor traced."""
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
    )


def linear(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, per_step: bool = False
) -> torch.Tensor:
    """`F.linear`: on oneDNN or MKL with a packed matrix where `LinearKernel` chose it (few rows, no
    autograd), else torch's kernel. `per_step`: the weight runs at every decoding step, so a copy of it
    in the kernel's own layout is kept."""
    policy = _POLICY
    if (
        policy.mode == "torch"
        or (policy.onednn is None and policy.mkl is None)
        or torch.compiler.is_compiling()  # first: nothing below needs tracing
        or torch.jit.is_tracing()  # (traced, sizes are tensors: `bit_length` below would fail)
        or not inputs.is_cpu
        or inputs.dtype is not torch.float32
    ):
        return F.linear(inputs, weight, bias)
    width = inputs.shape[-1] if inputs.dim() >= 2 else 0
    rows = inputs.numel() // width if width else 0
    if not 0 < rows <= MAX_ROWS:
        return F.linear(inputs, weight, bias)
    padded_rows = 1 << (rows - 1).bit_length()  # a power of two: few shapes reach the other kernels
    per_step = per_step and _KEEP_COPIES.get()
    # A class measured fastest on torch's kernel goes straight there: decoding steps repeat the same
    # few classes, so this lookup is what most calls cost here. Under
    # `torch.use_deterministic_algorithms(True)` nothing is measured: timings differ between runs, and
    # with them the kernels chosen and the results' last bits.
    if policy.mode == "auto":
        kernel = policy.decisions.get((padded_rows, weight.shape, bias is not None, per_step))
        if kernel != "torch" and torch.are_deterministic_algorithms_enabled():
            kernel = "torch"
    else:
        kernel = policy.mode
    if kernel == "torch" or (kernel == "mkl" and not per_step) or not _eligible(inputs, weight, bias):
        return F.linear(inputs, weight, bias)
    flat = inputs if inputs.dim() == 2 else inputs.reshape(rows, width)
    if padded_rows != rows:
        flat = torch.cat((flat, flat.new_zeros(padded_rows - rows, width)))
    if kernel is None:
        kernel = policy.decide(flat, weight, bias, per_step)
        if kernel == "torch":
            return F.linear(inputs, weight, bias)
    output = policy.compute(kernel, flat, weight, bias, per_step)  # (padded M, out)
    if padded_rows != rows:
        output = output[:rows]
    return output if inputs.dim() == 2 else output.view(*inputs.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoints) whose product goes through `linear`; `per_step`
    marks a layer that runs at every decoding step."""

    def __init__(self, *args: Any, per_step: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.per_step = per_step

    @classmethod
    def over(cls, layer: nn.Linear, per_step: bool = False) -> Linear:
        """This class over `layer`'s own parameters (shared, not copied)."""
        kernel = cls(layer.in_features, layer.out_features, bias=False, per_step=per_step, device="meta")
        kernel.weight, kernel.bias = layer.weight, layer.bias
        return kernel

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return linear(inputs, self.weight, self.bias, self.per_step)

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Linear:
        # A conversion (`.to(dtype)`, `.half()`, a move to another device) replaces the matrices' values:
        # the copies kept of them go now, not at the next float32 decoding on the CPU, which after
        # `.to(torch.bfloat16)` or `.cuda()` may never come (they held the old matrices' memory).
        forget_kept_copies(*self._parameters.values())
        return super()._apply(fn, *args, **kwargs)


# Fails closed (as if there were one) where this private function of torch is missing.
_any_global_hook: Callable[[], object] = getattr(nn.modules.module, "_has_any_global_hook", lambda: True)


def unwrapped(module: nn.Module, *classes: type) -> bool:
    """Whether `module` is exactly one of `classes` with nothing wrapped around its forward (forward or
    backward hooks, its own or those for every module, an instance's own `forward` as accelerate's
    offloading sets, a subclass such as an adapter's), so that a caller may do its forward's work without
    calling it."""
    attributes = module.__dict__  # accelerate sets `_hf_hook` and `forward` there
    return (
        type(module) in classes
        and not _any_global_hook()
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not module._backward_hooks
        and not module._backward_pre_hooks
        and "forward" not in attributes
        and "_hf_hook" not in attributes
    )


def bare_linear(layer: nn.Module) -> bool:
    """Whether `layer` is a linear layer with nothing wrapped around it, so that its weight may be read
    directly (hooks, adapters, offloading or ZeRO-3 sharding need its forward to run)."""
    return unwrapped(layer, Linear, nn.Linear)


# Parameters below are read from `_parameters`: a module's attribute lookup of a parameter goes through
# `nn.Module.__getattr__` (0.7 us), and a decoding step reads a few dozen of them.


def linear_of(layer: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    """`layer(inputs)` for a `bare_linear` layer, without the module call."""
    parameters = layer._parameters
    if type(layer) is Linear:
        return linear(inputs, parameters["weight"], parameters["bias"], layer.per_step)
    return F.linear(inputs, parameters["weight"], parameters["bias"])


def layer_norm_of(norm: nn.LayerNorm, inputs: torch.Tensor) -> torch.Tensor:
    """`norm(inputs)` for an unwrapped `nn.LayerNorm`, without the module call."""
    parameters = norm._parameters
    return torch.layer_norm(inputs, norm.normalized_shape, parameters["weight"], parameters["bias"], norm.eps)


def global_module_hooks() -> bool:
    """Whether hooks for every module are registered (`nn.modules.module.register_module_forward_hook`)."""
    return bool(_any_global_hook())


_CONCATENATIONS = WeightCopies()


def forget_kept_copies(*sources: torch.Tensor | None) -> None:
    """Drop every copy kept of these tensors (other kernels' layouts, stacked matrices; copies made from
    a stacked matrix go with it)."""
    for copies in (_POLICY.layouts, _POLICY.packed, _CONCATENATIONS):
        for source in sources:
            if source is not None:
                copies.drop(source)


def joint_projection(inputs: torch.Tensor, layers: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...] | None:
    """`tuple(layer(inputs) for layer in layers)` as one product with the layers' matrices stacked (kept
    in `WeightCopies`), for inference: one read of a longer matrix costs less than several of short
    ones (a decoding step's self-attention projections at batch 1 read their weights from memory).
    None where that does not apply: gradients, compilation, layers with biases of mixed presence or
    wrapped by hooks or adapters, untrackable (inference-mode) weights."""
    if (
        torch.compiler.is_compiling()  # first: nothing below needs tracing
        or not _KEEP_COPIES.get()  # outside a decoding with a cache (`kept_copies`)
        or torch.is_grad_enabled()
        or torch.jit.is_tracing()
        or not all(bare_linear(layer) for layer in layers)
    ):
        return None
    weights = tuple(layer._parameters["weight"] for layer in layers)
    biases = tuple(layer._parameters["bias"] for layer in layers)
    if any(bias is None for bias in biases):
        if not all(bias is None for bias in biases):
            return None
        biases = ()
    # Each stack from its own sources only: once per decoding a copy's sources are read to check their
    # values, and the biases' stack listed the matrices too, which read them all a second time.
    weight = _CONCATENATIONS.get(weights, lambda: torch.cat(weights), tag="weight")
    if weight is None:
        return None
    bias = None
    if biases:
        bias = _CONCATENATIONS.get(biases, lambda: torch.cat(biases), tag="bias")
        if bias is None:
            return None
    return linear(inputs, weight, bias, per_step=True).split_with_sizes([w.shape[0] for w in weights], dim=-1)


# Attention of a decoding step ---------------------------------------------------------------------
#
# A decoding step attends with one query per row. torch's SDPA runs it through its blocked CPU kernel, which
# is the faster choice for a few rows but not for many: on the 2-core AVX-512 EPYC of docs/performance.md
# (medians of 300 calls, head width 48 or 64, 64 keys), 1 row x 4 heads took 12 us against 24 us for two
# matrix products and a softmax, 32 rows x 8 heads 220 us against 162 us, and 128 rows x 8 heads
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
    keeps its True positions, a float mask is added to the scores. (B, H, T, Dh) in and out.

    A query whose boolean mask keeps no key (an all-padding source row) gets zeros, as from SDPA, not
    the NaN of a softmax over -inf alone: masked scores are the lowest finite value, whose exponential
    is exactly 0 beside any kept score, and the probabilities are multiplied by the mask. So does a
    query whose float mask is -inf at every key."""
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scaling)
    if mask is None:
        return torch.matmul(scores.softmax(-1), value)
    if mask.dtype is not torch.bool:
        probabilities = (scores + mask).softmax(-1)
        blocked = (mask == float("-inf")).all(-1, keepdim=True)  # a query with no key left: NaN, not SDPA's 0
        if blocked.any():
            probabilities = probabilities.masked_fill(blocked, 0.0)
        return torch.matmul(probabilities, value)
    probabilities = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1).mul(mask)
    return torch.matmul(probabilities, value)


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)


@dataclass
class AttentionKernel:
    """Which computation a decoding step's attention uses: the mode and the decisions measured so far."""

    mode: str
    # (rows x heads, keys, head width, mask kind, dtype), the first two rounded up to a power of two ->
    # matmul?
    decisions: dict[tuple[int, int, int, str, torch.dtype], bool] = field(default_factory=dict)
    probe_seconds: float = 0.0

    def decide(self, key_: tuple[int, int, int, str, torch.dtype], *inputs: object) -> bool:
        started = time.perf_counter()
        decision = self._faster_as_matmul(*inputs)
        self.decisions[key_] = decision
        self.probe_seconds += time.perf_counter() - started
        return decision

    @staticmethod
    def _faster_as_matmul(query, key, value, mask, scaling) -> bool:
        """Matrix products only if faster than SDPA here and equal in result (any error: SDPA)."""
        return faster_and_equal(
            lambda: _sdpa(query, key, value, mask, scaling),
            lambda: matmul_attention(query, key, value, mask, scaling),
            terms=key.shape[-2],
        )


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
    """transformers' SDPA attention function, except that a single-query step on CPU calls whichever of
    torch's SDPA and two matrix products `AttentionKernel` measured faster, directly. Returns (B, T, H,
    Dh), None."""
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
        query.dtype,  # a choice measured in float32 may not give the same result in bfloat16
    )
    decision = True if policy.mode == "matmul" else policy.decisions.get(class_)
    if decision is not False and policy.mode != "matmul" and torch.are_deterministic_algorithms_enabled():
        decision = False  # measured choices differ between runs (see `linear`)
    if decision is None:
        decision = policy.decide(class_, query, key, value, mask, scaling)
    # What was timed: one query per row needs neither transformers' causal nor grouped-head handling.
    attention = matmul_attention if decision else _sdpa
    return attention(query, key, value, mask, scaling).transpose(1, 2), None


# Dropout, token packing, the position table and the chunked loss ---------------------------------


class _CPUDropout(torch.autograd.Function):
    """Dropout whose keep mask comes from 32-bit random integers, for CPU tensors.

    The same operation as `F.dropout` (each element kept with probability 1 - p, to within 2^-32, and
    scaled by 1 / (1 - p)), but torch's CPU `bernoulli_` draws one random number per element on a
    single thread and costs more than a (T, d_model) x (d_model, d_model) matrix product; drawing 64
    random bits at a time makes dropout forward + backward faster (`benchmark.dropout_timing`).
    """

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, p: float) -> torch.Tensor:
        count = inputs.numel()
        bits = torch.empty((count + 1) // 2, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
        uniform = bits.view(torch.int32)[:count].view(inputs.shape)  # uniform over [-2^31, 2^31)
        keep = uniform >= round(p * 2**32) - 2**31
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.mul(inputs, keep).mul_(ctx.scale)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return torch.mul(grad_output, keep).mul_(ctx.scale), None


def dropout(inputs: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout`, with a faster mask draw on CPU (`_CPUDropout`)."""
    if not training or p == 0.0:
        return inputs
    if inputs.device.type == "cpu" and p > 0.0 and round(p * 2**32) < 2**32 and inputs.numel() > 0:
        return _CPUDropout.apply(inputs, p)
    return F.dropout(inputs, p=p, training=True)


def reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether the host can read `tensor`'s values without waiting for a device: CPU tensors only.

    Shortcuts that depend on values (packing, boolean selection of labelled tokens, early token-id
    checks) are taken only then, so that a forward pass on an accelerator never synchronises with it.
    Never under `torch.export` or `torch.jit.trace`: there values are symbolic (export cannot branch on
    them) or the branch taken would be frozen into the graph for every later input.
    """
    return tensor.device.type == "cpu" and not (torch.compiler.is_exporting() or torch.jit.is_tracing())


class TokenPacking:
    """Where the computed tokens of a padded (B, L) batch sit, to run per-token work on them only.

    Everything in a layer except attention acts on each token separately (projections, feed-forward,
    layer norms, dropout), so it can run on the (N, D) rows of real tokens instead of the (B, L, D)
    padded batch. Attention unpacks its queries, keys and values into the padded layout (zeros at
    padding, which the mask excludes) and packs its output again. Results at the kept positions are
    the same as the padded computation's; skipped positions come back as zeros.
    """

    def __init__(self, keep: torch.Tensor):
        self.batch_size, self.length = keep.shape
        self.index = keep.flatten().nonzero().squeeze(-1)  # (N,) flat positions b * L + t

    @classmethod
    def from_mask(cls, keep: torch.Tensor | None) -> TokenPacking | None:
        """A packing for `keep` (B, L) (True = compute), or None when nothing would be skipped."""
        if keep is None or keep.dim() != 2 or not reads_are_free(keep) or bool(keep.all()):
            return None
        return cls(keep.bool())

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)."""
        return padded.flatten(0, 1).index_select(0, self.index)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...), zeros at skipped positions."""
        padded = packed.new_zeros(self.batch_size * self.length, *packed.shape[1:])
        padded.index_copy_(0, self.index, packed)  # in place: a fresh tensor needs no copy of itself
        return padded.view(self.batch_size, self.length, *packed.shape[1:])


class PackedTokens(TypedDict, total=False):
    """Keyword arguments that layers pass through to attention when their states are packed tokens
    (the way transformers passes padding-free batch information to its attention kernels).

    packing: the (N, D) states stand for these positions of the (B, T) queries' sequence.
    encoder_packing: the encoder states that cross-attention reads are packed, (N_S, D).
    """

    packing: TokenPacking | None
    encoder_packing: TokenPacking | None


def split_heads(states: torch.Tensor, head_dim: int, packing: TokenPacking | None = None) -> torch.Tensor:
    """(B, L, D), or (N, D) packed, -> (B, H, L, Dh) (packed tokens are unpacked, zeros at padding)."""
    if packing is not None:
        states = packing.unpack(states)
    batch_size, length, _ = states.shape
    return states.view(batch_size, length, -1, head_dim).transpose(1, 2)


def merge_heads(output: torch.Tensor, packing: TokenPacking | None = None) -> torch.Tensor:
    """(B, L, H, Dh) -> (B, L, D), or (N, D) when the layer runs on packed tokens."""
    output = output.reshape(*output.shape[:2], -1)
    return output if packing is None else packing.pack(output)


class PositionTable:
    """Sinusoidal encodings of positions 0..n-1, computed by `encode` (the model's
    `sinusoidal_position_encoding`) and kept for reuse (not a buffer: nothing goes into checkpoints),
    grown by doubling when a longer sequence comes, so there is still no maximum length. Saves
    recomputing the table at every decoding step."""

    def __init__(self, d_model: int, layout: str, encode: Callable[..., torch.Tensor]):
        self.d_model, self.layout, self.encode = d_model, layout, encode
        self.table: torch.Tensor | None = None

    def __call__(
        self,
        start: int | torch.Tensor,
        length: int,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int | None = None,
    ) -> torch.Tensor:
        """Encodings of positions start..start+length-1. A tensor `start` (a static cache's length, under
        torch.compile) is not read on the host: the rows are selected from a table of `capacity` rows."""
        if isinstance(start, torch.Tensor):
            table = self(0, capacity, device, dtype)
            return table.index_select(0, start + torch.arange(length, device=device))
        if torch.compiler.is_exporting() or torch.jit.is_tracing():
            # Traced, lengths may be symbolic and tensors fake: encode these positions, keep nothing.
            return self.encode(start + torch.arange(length, device=device), self.d_model, self.layout, dtype)
        table = self.table
        if table is None or table.shape[0] < start + length or table.device != device or table.dtype != dtype:
            size = max(64, 1 << (start + length - 1).bit_length())
            positions = torch.arange(size, device=device)
            table = self.encode(positions, self.d_model, self.layout, dtype)
            self.table = None if device.type == "meta" else table
        return table[start : start + length]


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """Losses are computed in float32, or in the input's dtype where it is wider (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def per_item(
    loss_sum: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None
) -> torch.Tensor:
    """The summed loss over `num_items_in_batch`, by default the count of labels that are not -100."""
    if num_items_in_batch is None:
        num_items_in_batch = (labels != -100).sum().clamp(min=1)  # all ignored: loss 0, not NaN
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


class _ProjectedLabelSmoothedLoss(torch.autograd.Function):
    """Sum over N tokens of the label-smoothed cross entropy of logits = hidden W^T + b.

    Equal to `label_smoothed_cross_entropy(F.linear(hidden, weight, bias), labels, smoothing)` summed,
    without ever holding the (N, V) logits: tokens go through in chunks, and since the loss is a
    scalar each chunk's gradient (softmax - (1 - eps) one-hot - eps / V) is formed right away and
    multiplied into the gradients of hidden, W and b. Backward only scales them. This saves the
    memory of the logits, log-probabilities and their gradient (3 x N x V floats) and two passes over
    them, the largest tensors of a training step.

    With `candidates` (N, K) and a positive `unlikelihood` weight it adds the token-level unlikelihood
    term, `unlikelihood * -sum_c log(max(1 - p_c, UNLIKELIHOOD_FLOOR))` over each token's candidates
    (ids >= 0), whose gradient with respect to the logits is sum_c w_c (onehot_c - softmax) with
    w_c = p_c / (1 - p_c) (0 where the floor holds).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        smoothing: float,
        with_gradients: bool,
        candidates: torch.Tensor | None = None,
        unlikelihood: float = 0.0,
    ) -> torch.Tensor:
        vocab_size = weight.shape[0]
        if not unlikelihood:
            candidates = None
        chunk = max(1, 2**22 // vocab_size)  # ~16 MiB of float32 logits at a time
        compute = loss_dtype(hidden.dtype)
        total = torch.zeros((), device=hidden.device, dtype=compute)
        # Under autocast the product is rounded to its low precision: the bias is added to it after, as
        # the model's logits (`project`, MarianMTModel) add a float32 bias, not rounded with it.
        device = hidden.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        product_bias = None if autocast else bias
        grads = None
        if with_gradients:
            grads = [
                torch.empty_like(hidden),
                torch.zeros_like(weight, dtype=compute),
                None if bias is None else torch.zeros_like(bias, dtype=compute),
            ]
        for start in range(0, hidden.shape[0], chunk):
            part, targets = hidden[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(part, weight, product_bias).to(compute)  # (C, V)
            if autocast and bias is not None:
                logits = logits + bias
            target_logits = logits.gather(1, targets[:, None]).squeeze(1)
            mean_logits = logits.mean(-1)
            # log-sum-exp, reusing exp(logits - max) in place for the softmax below
            maximum = logits.amax(-1, keepdim=True)
            exponentials = logits.sub_(maximum).exp_()
            normalizer = exponentials.sum(-1)
            log_normalizer = maximum.squeeze(1) + normalizer.log()  # (C,)
            # -(1 - eps) log p_y - eps / V sum_v log p_v, with log p_v = logit_v - log_normalizer
            losses = log_normalizer - (1.0 - smoothing) * target_logits - smoothing * mean_logits
            total += losses.sum()
            if candidates is not None:
                ids = candidates[start : start + chunk]  # (C, K), -1: no candidate
                present = ids >= 0
                ids = ids.clamp(min=0)
                probs = exponentials.gather(1, ids) / normalizer[:, None]  # p_c
                complement = 1.0 - probs
                usable = present & (complement >= UNLIKELIHOOD_FLOOR)
                floored = torch.where(present, complement.clamp(min=UNLIKELIHOOD_FLOOR), 1.0)
                total -= unlikelihood * floored.log().sum()
                odds = torch.where(usable, probs / floored, 0.0)  # w_c, (C, K)
            if grads is None:
                continue
            grad_logits = exponentials.div_(normalizer[:, None])  # softmax
            if candidates is not None:
                grad_logits.mul_(1.0 - unlikelihood * odds.sum(1, keepdim=True))
                grad_logits.scatter_add_(1, ids, unlikelihood * odds)
            grad_logits.sub_(smoothing / vocab_size)
            grad_logits[torch.arange(len(targets), device=targets.device), targets] -= 1.0 - smoothing
            grads[1].addmm_(grad_logits.t(), part.to(compute))  # (V, D)
            if grads[2] is not None:
                grads[2] += grad_logits.sum(0)
            grads[0][start : start + chunk] = grad_logits.to(hidden.dtype) @ weight  # (C, D)
        if grads is not None:
            ctx.save_for_backward(*(g for g in grads if g is not None))
            ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    @once_differentiable  # the gradients were formed in forward: no second derivatives
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, *grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_total.to(grad_weight.dtype)  # the loss's compute dtype
        return (
            (grad_hidden.to(scale.dtype) * scale).to(grad_hidden.dtype),
            (grad_weight * scale).to(weight_dtype),
            (grad_bias[0] * scale).to(bias_dtype) if grad_bias else None,
            None,
            None,
            None,
            None,
            None,
        )


def projected_label_smoothed_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    smoothing: float,
    num_items_in_batch: int | torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    unlikelihood: float = 0.0,
) -> torch.Tensor:
    """`label_smoothed_cross_entropy(F.linear(hidden, weight, bias), labels, ...)` for labels without -100,
    in bounded memory (`_ProjectedLabelSmoothedLoss`). hidden: (N, D); weight: (V, D); labels: (N,);
    candidates: (N, K) unlikelihood candidates (see `unlikelihood_candidates`)."""
    with_gradients = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    total = _ProjectedLabelSmoothedLoss.apply(
        hidden, weight, bias, labels, smoothing, with_gradients, candidates, unlikelihood
    )
    return per_item(total, labels, num_items_in_batch)


# Token-level unlikelihood training (Welleck et al., 2019, "Neural Text Generation with Unlikelihood
# Training", Section 4): besides raising p(y_t), push down p(c) for each distinct token c of the target
# prefix y_<t other than y_t, by -log(1 - p(c)) (floored as in the paper's code). Not in the Transformer
# paper; off unless `unlikelihood_weight` is set.
UNLIKELIHOOD_FLOOR = 1e-5


def unlikelihood_candidates(labels: torch.Tensor) -> torch.Tensor:
    """The negative candidates of each target position of `labels` (B, T): the distinct tokens earlier in
    its row, other than its own label. Returns (B, T, T) token ids, -1 where none (and on rows of -100)."""
    length = labels.shape[1]
    earlier = torch.ones(length, length, dtype=torch.bool, device=labels.device).tril(-1)  # [t, j]: j < t
    same = labels[:, :, None] == labels[:, None, :]  # (B, T, T)
    repeated = (same & earlier).any(-1)  # (B, T): the token at j occurred before j
    labelled = labels != -100
    keep = earlier & ~same & ~repeated[:, None, :] & labelled[:, None, :] & labelled[:, :, None]
    return torch.where(keep, labels[:, None, :], -1)


def unlikelihood_loss(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Summed token-level unlikelihood term of logits (N, V) for candidates (N, K) (-1: none). Only the
    candidates' probabilities are formed: (N, K) and a log-normaliser, not another (N, V) tensor."""
    logits = logits.to(loss_dtype(logits.dtype))
    log_normalizer = logits.logsumexp(-1, keepdim=True)  # (N, 1)
    probs = (logits.gather(1, candidates.clamp(min=0)) - log_normalizer).exp()
    complement = (1.0 - probs).clamp(min=UNLIKELIHOOD_FLOOR)
    return -(complement.log() * (candidates >= 0)).sum()


# Input checks at the model's boundary.


def check_token_ids(name: str, ids: torch.Tensor | None, vocab_size: int, allow_ignore: bool = False) -> None:
    """Raise a clear error for ids outside [0, vocab_size), or of a type the embedding does not index
    with, instead of an error inside the embedding.

    On an accelerator the range check would make the host wait for the device; there the embedding's own
    device-side assertion reports such ids."""
    if ids is not None and ids.dim() != 2:  # the shape costs no read: checked on every device
        raise ValueError(
            f"`{name}` must be a (batch, length) tensor, got shape {tuple(ids.shape)}"
            + (": for one sequence, add the batch dimension (`ids[None]`)." if ids.dim() == 1 else ".")
        )
    if ids is None or ids.numel() == 0:
        return
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"`{name}` must hold integer token ids, got dtype {ids.dtype}.")
    if ids.dtype not in (torch.int64, torch.int32):  # the embedding indexes with no other
        raise ValueError(
            f"`{name}` must hold int64 or int32 token ids, got {ids.dtype}: convert with `.long()`."
        )
    if not reads_are_free(ids):
        return
    invalid = (ids < 0) | (ids >= vocab_size)
    if allow_ignore:
        invalid &= ids != -100
    if invalid.any():  # one reduction; the details only on the error path
        allowed = f"[0, {vocab_size})" + (" or -100 (ignored)" if allow_ignore else "")
        seen = ids[ids != -100] if allow_ignore else ids
        raise ValueError(
            f"`{name}` holds ids from {int(seen.min())} to {int(seen.max())}, outside {allowed}. "
            "Was the input tokenized with this model's tokenizer?"
        )


# Attention cannot reshape 0 rows; the encoder and the decoder (which `generate` and a forward with
# `encoder_outputs` reach without the encoder) say so instead.
EMPTY_BATCH = "The batch is empty (0 sequences): pass at least one."


def check_mask(name: str, mask: torch.Tensor | None, batch_size: int, length: int) -> None:
    """A (batch, length) mask of that sequence's shape, or a 4-D one prepared for attention (as
    transformers' mask builders take it; `generate` makes them for static caches). Any other would fail
    inside the mask builder, or be taken whole whatever its length."""
    if mask is not None and mask.dim() not in (2, 4):
        raise ValueError(
            f"`{name}` must be (batch, length), 1 for tokens and 0 for padding, got shape {tuple(mask.shape)}"
            + (": for one sequence, add the batch dimension (`mask[None]`)." if mask.dim() == 1 else ".")
        )
    if mask is not None and mask.dim() == 2 and tuple(mask.shape) != (batch_size, length):
        raise ValueError(
            f"`{name}` has shape {tuple(mask.shape)}, but the sequence it masks has shape "
            f"({batch_size}, {length})."
        )


def plain_linear(head: nn.Module) -> bool:
    """Whether `head` is a bias-free `bare_linear` layer, whose weight the chunked loss may read."""
    return bare_linear(head) and head.bias is None


def loss_without_logits(
    model: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None,
    label_smoothed_cross_entropy: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The model's label-smoothed loss from its final decoder states (B, T, D), computing logits only at
    labelled positions (on CPU; on an accelerator selecting them would wait for the device) and, when
    the output projection is a plain linear layer, in chunks without keeping (N, V) logits."""
    targets = labels.to(hidden_states.device)
    smoothing = model.config.label_smoothing
    unlikelihood = model.config.unlikelihood_weight
    candidates = unlikelihood_candidates(targets) if unlikelihood else None  # (B, T, T)
    if reads_are_free(targets):
        kept = targets != -100
        hidden_states, targets = hidden_states[kept], targets[kept]  # (N, D), (N,)
        candidates = None if candidates is None else candidates[kept]  # (N, T)
        if plain_linear(model.lm_head):
            bias = None if model.final_logits_bias is None else model.final_logits_bias[0]
            weight = model.lm_head.weight
            return projected_label_smoothed_loss(
                hidden_states, weight, bias, targets, smoothing, num_items_in_batch, candidates, unlikelihood
            )
    logits = model.project(hidden_states)
    if candidates is not None:
        candidates = candidates.reshape(-1, candidates.shape[-1])
    return label_smoothed_cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        smoothing,
        num_items_in_batch,
        candidates,
        unlikelihood,
    )


class LeanGenerationSteps:
    """Two `GenerationMixin` hooks with less work per decoding step; the model class inherits them
    before `GenerationMixin`."""

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One generation step's inputs: the newest target tokens, the cache, the source mask and what else
        `generate` passes on. `GenerationMixin`'s version does more at every step that this model does
        not need (position ids, a signature inspection for custom-code models); it still handles
        compilable (static) caches, which need 4-D masks."""
        if (cache is not None and cache.is_compileable) or kwargs.get("decoder_position_ids") is not None:
            return super().prepare_inputs_for_generation(
                input_ids, next_sequence_length, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if next_sequence_length is not None:
            input_ids = input_ids[:, -next_sequence_length:]
        inputs: dict[str, Any] = {"decoder_input_ids": input_ids}
        if cache is not None:
            inputs["cache"] = cache
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        skipped = ("labels", "next_sequence_length", "inputs_embeds", "is_first_iteration")
        inputs |= {key: value for key, value in kwargs.items() if key not in skipped and key not in inputs}
        return inputs

    def _reorder_cache(self, cache: Cache, beam_idx: torch.LongTensor) -> Cache:
        """Beam search's cache reordering, without copying the cross-attention keys and values.

        `generate` gives every beam of an input the same encoder output, and beam search only
        reorders beams within an input, so the cross-attention cache is unchanged by any reordering:
        only the self-attention cache is gathered (transformers' default gathers both).
        """
        if isinstance(cache, EncoderDecoderCache):
            cache.self_attention_cache.reorder_cache(beam_idx)
        else:
            cache.reorder_cache(beam_idx)
        return cache


class RemoteCodeFolder:
    """`save_pretrained` for a folder that works where this package is not installed."""

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """`PreTrainedModel.save_pretrained`, plus what makes the folder usable without this package.

        `auto_map` names both model classes, so the folder loads with `AutoModel` and
        `AutoModelForSeq2SeqLM` under `trust_remote_code=True`; and the translation pipeline's code is
        copied next to the model with `custom_pipelines` in config.json, so that
        `pipeline("translation", model=folder, trust_remote_code=True)` works (transformers 5 has none).
        """
        module = type(self).__module__.rsplit(".", 1)[-1]
        if self._auto_class is not None:
            self.config.auto_map = {
                **(getattr(self.config, "auto_map", None) or {}),
                "AutoModel": f"{module}.VanillaTransformerModel",
                "AutoModelForSeq2SeqLM": f"{module}.VanillaTransformerForConditionalGeneration",
            }
        # A relative import, which transformers follows: it copies the pipeline's module into every folder
        # saved (as it copies this one) and into the remote-code cache wherever a folder is loaded with
        # `trust_remote_code`. Found only where the pipeline had been used, a model loaded that way and
        # saved again once lost its `custom_pipelines` entry, and with it `pipeline("translation")`.
        from .pipeline_vanilla_transformer import TranslationPipeline

        self.config.custom_pipelines = {
            **(getattr(self.config, "custom_pipelines", None) or {}),
            "translation": {
                "impl": f"{TranslationPipeline.__module__.rsplit('.', 1)[-1]}.TranslationPipeline",
                "pt": ["AutoModelForSeq2SeqLM"],
                "type": "text",
            },
        }
        return super().save_pretrained(save_directory, *args, **kwargs)


__all__ = [
    "EMPTY_BATCH",
    "AttentionKernel",
    "LeanGenerationSteps",
    "Linear",
    "LinearKernel",
    "PackedTokens",
    "PositionTable",
    "RemoteCodeFolder",
    "TokenPacking",
    "attention_kernel",
    "check_mask",
    "check_token_ids",
    "decoding_attention",
    "dropout",
    "kept_copies",
    "linear",
    "linear_kernel",
    "loss_dtype",
    "loss_without_logits",
    "matmul_attention",
    "merge_heads",
    "new_generate_call",
    "per_item",
    "plain_linear",
    "projected_label_smoothed_loss",
    "reads_are_free",
    "set_attention_kernel",
    "set_linear_kernel",
    "split_heads",
]
