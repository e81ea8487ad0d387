"""The linear-layer kernel policy: oneDNN or packed MKL only where measured faster, never in training,
bounded shapes.

References: `F.linear` (torch's own kernel) for every result; counting wrappers show which kernel ran.
"""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import assert_same_up_to_rounding, tiny_model
from vanilla_transformer import kernels_vanilla_transformer as kernels

ONEDNN = kernels.linear_kernel().onednn
MKL = kernels.linear_kernel().mkl
needs_onednn = pytest.mark.skipif(ONEDNN is None, reason="this torch build has no oneDNN linear kernel")
needs_mkl = pytest.mark.skipif(MKL is None, reason="this torch build has no MKL packed product")


@pytest.fixture
def policy(monkeypatch):
    """The process's policy with its decisions and mode restored afterwards; calls to oneDNN counted
    (and, in `policy.mkl_shapes`, calls to packed MKL)."""
    state = kernels.linear_kernel()
    previous = kernels.set_linear_kernel("auto")
    shapes, mkl_shapes = [], []

    def counting(inputs, *args):
        shapes.append(tuple(inputs.shape))
        return ONEDNN(inputs, *args)

    def counting_mkl(inputs, *args):
        mkl_shapes.append(tuple(inputs.shape))
        return MKL(inputs, *args)

    monkeypatch.setattr(state, "onednn", counting)
    if MKL is not None:
        monkeypatch.setattr(state, "mkl", counting_mkl)
    with kernels.kept_copies():  # as inside a decoding, where per-step products may keep copies
        yield state, shapes, mkl_shapes
    kernels.set_linear_kernel(previous)


@pytest.mark.parametrize("mode", ["torch", "onednn", "mkl", "auto"])
def test_linear_equals_f_linear_in_every_mode(policy, mode):
    if {"onednn": ONEDNN, "mkl": MKL}.get(mode, True) is None:
        pytest.skip(f"this torch build has no {mode} kernel")
    kernels.set_linear_kernel(mode)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=generator)
    bias = torch.randn(96, generator=generator)
    with torch.no_grad():  # not inference mode: copies of the weight may be kept
        for rows in (1, 3, 4, 37, 256, 257, 600):
            inputs = torch.randn(48, rows, generator=generator).t()  # not contiguous
            for b, per_step in ((bias, False), (None, False), (bias, True), (None, True)):
                got = kernels.linear(inputs, weight, b, per_step)
                assert got.shape == (rows, 96)
                assert_same_up_to_rounding(got, F.linear(inputs, weight, b), 48)
    with torch.inference_mode():
        batched = torch.randn(2, 5, 48, generator=generator)
        assert_same_up_to_rounding(kernels.linear(batched, weight, bias), F.linear(batched, weight, bias), 48)
        assert kernels.linear(torch.zeros(0, 48), weight, bias).shape == (0, 96)


@pytest.mark.parametrize("setting", ["float64", "meta"])
def test_kernels_are_found_whatever_the_default_dtype_and_device(setting):
    """The kernels are looked for when the package is imported, with small products of their own. Made in
    the default dtype and on the default device, those failed where a program had set
    `torch.set_default_dtype(torch.float64)` or `torch.set_default_device(...)` before importing it, and
    the process then never used oneDNN or packed MKL, for float32 CPU models either."""
    found = (kernels._find_onednn_linear(), kernels._find_onednn_reorder(), kernels._find_mkl_packed())
    previous = torch.get_default_dtype()
    try:
        if setting == "float64":
            torch.set_default_dtype(torch.float64)
        else:
            torch.set_default_device("meta")
        again = (kernels._find_onednn_linear(), kernels._find_onednn_reorder(), kernels._find_mkl_packed())
    finally:
        torch.set_default_dtype(previous)
        torch.set_default_device(None)
    assert again == found


@needs_onednn
def test_unusual_biases_and_derivatives_stay_exact(policy):
    """A strided or broadcast bias, forward-mode derivatives and torch.func transforms: oneDNN's op
    would give wrong numbers or drop the derivative, so these run on torch's kernel."""
    _, shapes, _ = policy
    kernels.set_linear_kernel("onednn")
    generator = torch.Generator().manual_seed(0)
    weight, inputs = torch.randn(16, 8, generator=generator), torch.randn(5, 8, generator=generator)
    with torch.no_grad():
        for bias in (
            torch.randn(16, 2, generator=generator)[:, 0],
            torch.randn(1, generator=generator).expand(16),
        ):
            torch.testing.assert_close(kernels.linear(inputs, weight, bias), F.linear(inputs, weight, bias))
        tangent = torch.randn(5, 8, generator=generator)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(inputs, tangent)
            output = torch.autograd.forward_ad.unpack_dual(kernels.linear(dual, weight))
            torch.testing.assert_close(output.tangent, tangent @ weight.t())
    layer = kernels.Linear(8, 16).requires_grad_(False)
    _, jvp = torch.func.jvp(layer, (inputs,), (tangent,))
    torch.testing.assert_close(jvp, tangent @ layer.weight.t())
    grad = torch.func.grad(lambda w: kernels.linear(inputs, w).sum())(weight)
    torch.testing.assert_close(grad, torch.ones(16, 5) @ inputs)
    assert shapes == []
    with torch.no_grad():
        kernels.linear(inputs, weight, torch.randn(16))  # and a plain product still may
    assert shapes == [(8, 8)]


@needs_onednn
def test_training_products_run_on_torch_kernels(policy):
    """oneDNN keeps state per shape; training batches have hundreds of shapes: never there."""
    _, shapes, _ = policy
    kernels.set_linear_kernel("onednn")
    weight = torch.randn(32, 16, requires_grad=True)
    inputs = torch.randn(8, 16, requires_grad=True)
    output = kernels.linear(inputs, weight)
    (grad,) = torch.autograd.grad(output.sum(), weight)
    assert shapes == []
    torch.testing.assert_close(grad, torch.ones(32, 8) @ inputs.detach())
    with torch.no_grad():  # no autograd: the same call may run on oneDNN
        kernels.linear(inputs, weight)
    assert shapes == [(8, 16)]


@needs_onednn
def test_rows_reach_onednn_in_at_most_nine_shapes_per_matrix(policy):
    _, shapes, _ = policy
    kernels.set_linear_kernel("onednn")
    weight = torch.randn(24, 8)
    with torch.inference_mode():
        for rows in range(1, 400):
            expected = F.linear(torch.ones(rows, 8), weight)
            torch.testing.assert_close(kernels.linear(torch.ones(rows, 8), weight), expected)
    assert sorted({shape[0] for shape in shapes}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert len(shapes) == 256  # rows above MAX_ROWS stay on torch's kernel


@needs_onednn
def test_probe_runs_once_per_class_and_keeps_the_faster_kernel(policy, monkeypatch):
    state, shapes, _ = policy
    weight = torch.randn(16, 8)
    slow_calls = []

    def slow_onednn(inputs, *args):
        slow_calls.append(1)
        time.sleep(0.02)  # far slower than any 1 x 8 x 16 product, even on a loaded machine
        return ONEDNN(inputs, *args)

    monkeypatch.setattr(state, "onednn", slow_onednn)
    with torch.inference_mode():
        for _ in range(3):
            kernels.linear(torch.randn(3, 8), weight)  # class: 4 padded rows, 16 x 8, no bias
    assert state.decisions == {(4, (16, 8), False, False): "torch"}
    assert len(slow_calls) == 1 + 2  # the probe only, out after two rounds: then torch's kernel
    assert state.probe_seconds > 0

    # The other way round: torch's kernel slowed down, so oneDNN measures faster and is kept.
    fast_onednn = ONEDNN
    monkeypatch.setattr(
        state, "onednn", lambda inputs, *args: shapes.append(inputs.shape) or fast_onednn(inputs, *args)
    )

    original = F.linear

    def slow_f_linear(*args):
        time.sleep(0.02)
        return original(*args)

    monkeypatch.setattr(kernels.F, "linear", slow_f_linear)
    with torch.inference_mode():
        kernels.linear(torch.randn(5, 8), weight)
        kernels.linear(torch.randn(6, 8), weight)  # same class: decided already
    assert state.decisions[(8, (16, 8), False, False)] == "onednn"
    assert len(shapes) == 2 + 1 + 2


def test_probe_stops_timing_a_kernel_once_it_cannot_win(monkeypatch):
    """On a fake clock: a kernel whose fastest call is over PROBE_MARGIN times another's slowest is
    timed twice and no more; kernels within the margin are timed every round, and one slow outlier
    call (a machine hiccup) does not put the fastest kernel out."""
    clock = [0.0]
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    result = torch.ones(2, 2)

    def kernel(costs, calls):
        def run():
            clock[0] += costs[min(len(calls), len(costs) - 1)]
            calls.append(1)
            return result

        return run

    calls = {name: [] for name in ("torch", "close", "slow")}
    plain = kernel([1.0, 9.0, 1.0], calls["torch"])  # the untimed call, a hiccup, then steady
    candidates = {"close": kernel([1.1], calls["close"]), "slow": kernel([2.0], calls["slow"])}
    assert kernels.fastest_equal(plain, candidates, terms=2) == "torch"
    rounds = kernels.PROBE_ROUNDS
    assert [len(calls[name]) for name in ("torch", "close", "slow")] == [1 + rounds, 1 + rounds, 1 + 2]

    calls = {name: [] for name in ("torch", "close", "slow")}
    plain = kernel([1.0, 3.0], calls["torch"])  # three times the candidate's time, from the first round
    assert kernels.fastest_equal(plain, {"close": kernel([1.0], calls["close"])}, terms=2) == "close"
    assert [len(calls["torch"]), len(calls["close"])] == [1 + 2, 1 + 2]  # one kernel left: decided


@needs_onednn
@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_probe_fails_closed(policy, monkeypatch, failure):
    state, _, _ = policy

    def broken(inputs, weight, *args):
        if failure == "raises":
            raise RuntimeError("no primitive for this shape")
        return torch.zeros(inputs.shape[0], weight.shape[0])  # fast, and wrong

    monkeypatch.setattr(state, "onednn", broken)
    weight, inputs = torch.randn(16, 8), torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(inputs, weight), F.linear(inputs, weight))
    assert state.decisions == {(2, (16, 8), False, False): "torch"}


@needs_onednn
def test_model_outputs_agree_between_kernels(policy):
    """A tiny model's logits and generated tokens with oneDNN everywhere equal those with torch's kernels."""
    model = tiny_model("sdpa", d_model=64, d_ff=128)
    source = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("torch", "onednn", "mkl"):
        kernels.set_linear_kernel(mode)
        with torch.inference_mode():
            logits = model(input_ids=source, decoder_input_ids=source[:, :5]).logits
            tokens = model.generate(source, num_beams=2, max_new_tokens=6)
        results[mode] = logits, tokens
    for mode in ("onednn", "mkl"):
        assert_same_up_to_rounding(results[mode][0], results["torch"][0], 6 * 128)
        assert torch.equal(results[mode][1], results["torch"][1])
    assert policy[1], "oneDNN was never called"
    assert policy[2] or MKL is None, "packed MKL was never called"


@needs_onednn
@pytest.mark.skipif(kernels.linear_kernel().reorder is None, reason="no oneDNN weight reordering here")
def test_reordered_copies_follow_their_weights(policy):
    """oneDNN's copy of a matrix in its own layout is kept for matrices that run at every decoding step
    (and only for them), one per matrix, remade when the matrix is written in place or given new storage
    or when the row count changes, and freed with the matrix."""
    state, shapes, _ = policy
    kernels.set_linear_kernel("onednn")
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    layouts = state.layouts
    before = len(layouts)

    def check(inputs, weight):
        got = kernels.linear(inputs, weight, bias, per_step=True)
        assert_same_up_to_rounding(got, F.linear(inputs, weight, bias), 24)

    with torch.no_grad():
        kernels.linear(torch.randn(4, 24, generator=generator), weight, bias)  # not per step: no copy
        assert len(layouts) == before
        for rows in (1, 8, 8, 3):
            check(torch.randn(rows, 24, generator=generator), weight)
        assert len(layouts) == before + 1  # one copy, for the latest row count
        weight.mul_(-2)  # in place, as an optimiser step or load_state_dict would
        check(torch.randn(3, 24, generator=generator), weight)
        weight.data = torch.randn(40, 24, generator=generator)  # new storage, same tensor object
        check(torch.randn(3, 24, generator=generator), weight)
    assert len(shapes) == 7
    del weight
    assert len(layouts) == before
    with torch.inference_mode():  # inference tensors have no version counter: used as they are
        frozen = torch.randn(40, 24)
        inputs = torch.randn(2, 24)
        got = kernels.linear(inputs, frozen, per_step=True)
        assert_same_up_to_rounding(got, F.linear(inputs, frozen), 24)
    assert len(layouts) == before


def test_weight_copies_register_one_finalizer_per_tensor_and_drop_idempotently():
    """Dropping and remaking a copy (each decision does) adds no finalizer; dropping twice, as two threads
    deciding at once may, is harmless; the entry goes with its tensor."""
    import gc
    import weakref

    copies = kernels.WeightCopies()
    weight = torch.randn(8, 4)

    def make_copy():
        return torch.ones(8, 4)

    def finalizers_of(tensor):
        return sum(1 for f in list(weakref.finalize._registry) if (f.peek() or (None,))[0] is tensor)

    for _ in range(50):
        assert torch.equal(copies.get((weight,), make_copy, tag=1), torch.ones(8, 4))
        copies.drop(weight)
        copies.drop(weight)
    copies.get((weight,), make_copy, tag=1)
    assert finalizers_of(weight.untyped_storage()) == 1 and len(copies) == 1
    assert not weakref.getweakrefs(weight)  # torch would refuse to swap it (`torch.utils.swap_tensors`)
    del weight
    gc.collect()
    assert len(copies) == 0 and not copies._watched


def test_a_freed_storage_leaves_the_copy_of_the_tensor_now_at_its_key():
    """A source given new storage (`weight.data = ...`) gets a new copy; when the old storage is freed
    afterwards (a view kept it), its finalizer leaves the new copy alone."""
    import gc

    copies = kernels.WeightCopies()
    weight = torch.randn(8, 4)
    view = weight.detach()  # keeps the first storage alive
    copies.get((weight,), lambda: weight * 2, tag=1)
    weight.data = torch.randn(8, 4)
    fresh = copies.get((weight,), lambda: weight * 2, tag=1)
    assert torch.equal(fresh, weight * 2)
    del view
    gc.collect()
    assert len(copies) == 1 and copies.get((weight,), lambda: weight * 3, tag=1) is fresh


def test_converting_a_model_frees_the_copies_kept_of_its_matrices(each_linear_kernel):
    """A model decoded in float32 and then converted (`.to(torch.bfloat16)`, `.half()`, a move to the GPU)
    kept the float32 copies of its decoder's matrices (stacked Q/K/V, oneDNN's or packed MKL's layouts)
    until its next float32 decoding on the CPU, which may never come: about 200 MB of resident memory
    for a 32,000-token model in bfloat16. They go with the conversion; converted back, the model decodes
    as before."""
    import gc
    import weakref

    stores = (kernels.linear_kernel().layouts, kernels.linear_kernel().packed, kernels._CONCATENATIONS)
    before = {id(entry[2]) for store in stores for entry in store._copies.values()}
    model = tiny_model("sdpa")
    source = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # not inference mode: copies of the weights may be kept
        expected = model.generate(source, num_beams=2, max_new_tokens=6)
    kept = [entry[2] for store in stores for entry in store._copies.values()]
    copies = [weakref.ref(copy) for copy in kept if id(copy) not in before]
    del kept
    assert copies, "the decoding kept no copy"
    model.to(torch.bfloat16)
    gc.collect()
    assert [copy for copy in copies if copy() is not None] == []
    model.float()
    with torch.no_grad():
        assert torch.equal(model.generate(source, num_beams=2, max_new_tokens=6), expected)


def test_a_decoded_model_can_still_swap_its_parameters(each_linear_kernel):
    """Under `torch.__future__.set_swap_module_params_on_conversion(True)` `.to()` and `load_state_dict`
    swap each parameter with `torch.utils.swap_tensors`, which refuses a tensor that has a weak reference:
    the copies kept for decoding took one on each matrix they came from, so after one `generate()` the
    model could no longer be converted or loaded (MarianMTModel could). Converted and back, it decodes
    as before."""
    model = tiny_model("sdpa").eval()
    other = tiny_model("sdpa").eval()
    source = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad():
            expected = model.generate(source, num_beams=2, max_new_tokens=6)
        model.to(torch.bfloat16)
        model.to(torch.float32)
        with torch.no_grad():
            assert torch.equal(model.generate(source, num_beams=2, max_new_tokens=6), expected)
        model.load_state_dict(other.state_dict())
        with torch.no_grad():
            got = model.generate(source, num_beams=2, max_new_tokens=6)
            assert torch.equal(got, other.generate(source, num_beams=2, max_new_tokens=6))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def test_kept_copies_see_edits_through_data_under_autocast():
    """A decoding inside `torch.autocast("cpu", dtype=torch.bfloat16)` checked its kept copies (the
    stacked Q/K/V) with checksum products autocast to bfloat16: a 5% edit of every element through
    `.data` (no version bump) went unseen in about one case of 25, and the next decoding used the old
    weights."""
    copies = kernels.WeightCopies()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=generator) * 0.125
    for _ in range(100):
        kernels.new_generate_call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            copy = copies.get((weight,), weight.clone)
        assert torch.equal(copy, weight)
        weight.data += torch.randn(64, 64, generator=generator) * 0.125 * 0.05


def test_weight_checksums_see_a_square_matrix_transposed():
    """u^T W v with u = v (the same vector for a matrix's rows and columns when it is square) equals
    u^T W^T v: a transposed matrix, or two elements swapped across its diagonal, kept its checksum."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 32, generator=generator)
    swapped = weight.clone()
    swapped[3, 7], swapped[7, 3] = weight[7, 3], weight[3, 7]
    assert kernels.value_checksum((weight.t().contiguous(),)) != kernels.value_checksum((weight,))
    assert kernels.value_checksum((swapped,)) != kernels.value_checksum((weight,))


def test_weight_checksums_ignore_the_default_device(monkeypatch):
    """The checksum's fixed vectors were drawn with a CPU generator on the default device: under
    `torch.set_default_device("cuda")` the draw is refused, and the first decoding step of a model on
    the GPU (its stacked Q/K/V are checked) raised. The default-device context is emulated with the
    meta device, whose draw could not be read back either."""
    monkeypatch.setattr(kernels, "_PROBES", {})
    weight = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        inside = kernels.value_checksum((weight,))
    monkeypatch.setattr(kernels, "_PROBES", {})
    assert inside == kernels.value_checksum((weight,))


def test_joint_projection_equals_the_separate_layers():
    """Q, K and V of a decoding step from one product with the matrices stacked: the same as three
    products, following in-place weight changes; not used with gradients, hooks or mixed biases, nor
    outside a decoding with a cache (`kept_copies`), where the stacked copy would go unchecked."""
    torch.manual_seed(0)
    layers = (kernels.Linear(24, 24), kernels.Linear(24, 24), kernels.Linear(24, 24))
    inputs = torch.randn(3, 1, 24)
    with torch.no_grad():
        assert kernels.joint_projection(inputs, layers) is None
    with torch.no_grad(), kernels.kept_copies():
        for _ in range(2):
            joint = kernels.joint_projection(inputs, layers)
            assert joint is not None and len(joint) == 3
            for got, layer in zip(joint, layers, strict=True):
                assert_same_up_to_rounding(got, F.linear(inputs, layer.weight, layer.bias), 24)
            layers[1].weight.mul_(3)  # the next round must see it
        bias_free = (kernels.Linear(24, 8, bias=False), nn.Linear(24, 16, bias=False))
        joint = kernels.joint_projection(inputs, bias_free)
        assert [t.shape[-1] for t in joint] == [8, 16]
        torch.testing.assert_close(joint[1], F.linear(inputs, bias_free[1].weight))
        assert kernels.joint_projection(inputs, (layers[0], bias_free[0])) is None  # mixed biases
        handle = layers[2].register_forward_hook(lambda *args: None)
        assert kernels.joint_projection(inputs, layers) is None
        handle.remove()
    with kernels.kept_copies():
        assert kernels.joint_projection(inputs, layers) is None  # gradients enabled
        with torch.inference_mode():
            frozen = (kernels.Linear(24, 24), kernels.Linear(24, 24))
            assert kernels.joint_projection(inputs, frozen) is None  # inference tensors: nothing to track


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("0", "torch"),
        ("torch", "torch"),
        ("1", "onednn"),
        (" ONEDNN ", "onednn"),
        ("mkl", "mkl"),
    ],
    ids=lambda item: "unset" if item is None else item.replace(" ", "_"),  # ids without spaces
)
def test_environment_variable(value, mode):
    assert kernels._parse_mode(value) == mode


def test_environment_variable_with_a_bad_value_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"VANILLA_TRANSFORMER_LINEAR='yes' .* 0 or torch .* mkl"):
        kernels._parse_mode("yes")


@pytest.mark.parametrize(
    ("new", "old", "mode"),
    [
        (None, None, "auto"),
        ("mkl", None, "mkl"),
        (None, "0", "torch"),
        (None, "1", "onednn"),
        ("auto", "0", "auto"),
    ],
)
def test_the_older_variable_is_read_when_the_new_one_is_unset(monkeypatch, new, old, mode):
    for name, value in ((kernels.LINEAR_VARIABLE, new), (kernels.ENVIRONMENT_VARIABLE, old)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert kernels._mode_from_environment() == mode
    monkeypatch.setenv(kernels.ENVIRONMENT_VARIABLE, "mkl?")
    monkeypatch.delenv(kernels.LINEAR_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=r"VANILLA_TRANSFORMER_ONEDNN='mkl\?'"):
        kernels._mode_from_environment()


def test_a_probe_with_reads_between_calls_runs_them_before_each_timed_call_for_a_fixed_number_of_rounds(
    monkeypatch,
):
    """`between` (the cache eviction) runs untimed before every timed call, and such a probe runs
    PROBE_COLD_ROUNDS rounds, not extended to PROBE_SECONDS of calls (the reads between cost time)."""
    clock, events = [0.0], []
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    result = torch.ones(2, 2)

    def kernel(name, cost):
        def run():
            clock[0] += cost
            events.append(name)
            return result

        return run

    def between():
        clock[0] += 100.0  # untimed: were it timed, "torch" would lose to nothing
        events.append("between")

    plain, candidates = kernel("torch", 1e-6), {"close": kernel("close", 1.1e-6)}
    assert kernels.fastest_equal(plain, candidates, terms=2, between=between) == "torch"
    timed = events[2:]  # after one untimed call of each, to compare results
    rounds = kernels.PROBE_COLD_ROUNDS
    assert timed == ["between", "torch", "between", "close"] * rounds
    events.clear()
    assert kernels.fastest_equal(plain, candidates, terms=2) == "torch"  # without: PROBE_SECONDS of calls
    assert events.count("torch") == 1 + kernels.PROBE_MAX_ROUNDS and "between" not in events


def test_only_one_row_products_of_per_step_matrices_are_timed_out_of_cache(policy, monkeypatch):
    """A decoding step reads each per-step matrix after the other layers' matrices, so a one-row
    product (it streams its matrix) is timed with the cache emptied between calls; products of more
    rows, and matrices that do not run at every step, are timed as before."""
    state, _, _ = policy
    if state.onednn is None and state.mkl is None:
        pytest.skip("this torch build has neither oneDNN's nor MKL's kernel: nothing to time")
    evictions = []
    monkeypatch.setattr(kernels, "evict_cache", lambda: evictions.append(1))
    weight = torch.randn(24, 16)
    with torch.no_grad():
        for rows, per_step in ((2, True), (1, False)):
            kernels.linear(torch.ones(rows, 16), weight, per_step=per_step)
            assert evictions == []
        torch.testing.assert_close(
            kernels.linear(torch.ones(1, 16), weight, per_step=True), F.linear(torch.ones(1, 16), weight)
        )
    assert 0 < len(evictions) <= 3 * kernels.PROBE_COLD_ROUNDS  # torch's, oneDNN's, packed MKL's calls
    assert (1, (24, 16), False, True) in state.decisions


@needs_mkl
def test_probe_keeps_packed_mkl_only_for_per_step_products_where_fastest(policy, monkeypatch):
    """With torch's and oneDNN's kernels slowed down, a per-step product's class goes to packed MKL,
    whose packed copy is kept and oneDNN's dropped; a product that is not per step never runs packed
    (its packing would be paid at every call)."""
    state, onednn_shapes, mkl_shapes = policy
    original, counting_onednn = F.linear, state.onednn

    def slow(kernel):
        def run(*args):
            time.sleep(0.02)  # 2 ms once lost to a loaded machine's scheduling
            return kernel(*args)

        return run

    monkeypatch.setattr(kernels.F, "linear", slow(original))
    monkeypatch.setattr(state, "onednn", slow(counting_onednn))
    weight, bias = torch.randn(16, 8), torch.randn(16)
    packed, layouts = len(state.packed), len(state.layouts)
    with torch.no_grad():
        for rows in (3, 4):  # one class: 4 padded rows
            got = kernels.linear(torch.ones(rows, 8), weight, bias, per_step=True)
            torch.testing.assert_close(got, original(torch.ones(rows, 8), weight, bias))
        assert state.decisions[(4, (16, 8), True, True)] == "mkl"
        assert len(state.packed) == packed + 1 and len(state.layouts) == layouts
        calls = len(mkl_shapes)
        kernels.linear(torch.ones(2, 8), weight, bias)  # not per step
        assert state.decisions[(2, (16, 8), True, False)] in ("torch", "onednn")
        assert len(mkl_shapes) == calls
    assert {shape[0] for shape in mkl_shapes} == {4}
    assert onednn_shapes  # it was timed


@needs_mkl
def test_packed_copies_follow_their_weights(policy):
    """A packed copy is made for per-step products only, remade when its matrix is written in place,
    given new storage or used with another row count, and freed with the matrix; inference tensors
    (no version counter to follow) and products with gradients run on torch's kernel."""
    state, _, mkl_shapes = policy
    kernels.set_linear_kernel("mkl")
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    before = len(state.packed)

    def check(rows, weight, per_step=True):
        inputs = torch.randn(rows, 24, generator=generator)
        got = kernels.linear(inputs, weight, bias, per_step=per_step)
        assert_same_up_to_rounding(got, F.linear(inputs, weight, bias), 24)

    with torch.no_grad():
        check(4, weight, per_step=False)
        assert len(state.packed) == before and mkl_shapes == []
        for rows in (1, 8, 8, 3):
            check(rows, weight)
        assert len(state.packed) == before + 1
        weight.mul_(-2)
        check(3, weight)
        weight.data = torch.randn(40, 24, generator=generator)
        check(3, weight)
    assert [shape[0] for shape in mkl_shapes] == [1, 8, 8, 4, 4, 4]
    trained = torch.randn(40, 24, requires_grad=True)
    output = kernels.linear(torch.randn(2, 24), trained, per_step=True)
    output.sum().backward()
    assert trained.grad is not None and len(mkl_shapes) == 6
    del weight
    assert len(state.packed) == before
    with torch.inference_mode():
        frozen, inputs = torch.randn(40, 24), torch.randn(2, 24)
        assert_same_up_to_rounding(
            kernels.linear(inputs, frozen, per_step=True), F.linear(inputs, frozen), 24
        )
    assert len(mkl_shapes) == 6 and len(state.packed) == before


# Attention of a decoding step -------------------------------------------------------------------


@pytest.fixture
def attention_policy():
    previous = kernels.set_attention_kernel("auto")
    yield kernels.attention_kernel()
    kernels.set_attention_kernel(previous)


def single_query(batch=3, heads=4, keys=5, width=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, 1, width), (batch, heads, keys, width), (batch, heads, keys, width)]
    return [torch.randn(*shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_matmul_attention_is_equation_1(mask_kind):
    """Against softmax(QK^T / sqrt(d_k)) V computed in float64, and SDPA, with each kind of mask."""
    query, key, value = single_query()
    keep = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    keep[1, ..., 3:] = keep[2, ..., 1:] = False  # padded sources
    mask = {"none": None, "bool": keep, "float": torch.zeros(keep.shape).masked_fill(~keep, -1e9)}[mask_kind]
    got = kernels.matmul_attention(query, key, value, mask, 8**-0.5)
    scores = query.double() @ key.double().transpose(-1, -2) / 8**0.5
    if mask is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    expected = (scores.softmax(-1) @ value.double()).float()
    assert_same_up_to_rounding(got, expected, 8 + 5)
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert_same_up_to_rounding(got, sdpa, 8 + 5)


def test_matmul_attention_gives_zeros_where_no_key_is_kept():
    """An all-padding source row leaves a query nothing to attend to: SDPA returns zeros for it (a
    softmax over -inf alone would be NaN), and so do the matrix products; other rows are unchanged."""
    query, key, value = single_query()
    keep = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    keep[1] = False
    keep[2, ..., 2:] = False
    query.requires_grad_()
    got = kernels.matmul_attention(query, key, value, keep, 8**-0.5)
    assert not got.isnan().any() and torch.equal(got[1], torch.zeros_like(got[1]))
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=keep)
    assert_same_up_to_rounding(got, sdpa, 8 + 5)
    got.sum().backward()  # nothing the backward pass needs was overwritten in place
    assert query.grad.isfinite().all() and torch.equal(query.grad[1], torch.zeros_like(query.grad[1]))


def test_matmul_attention_gives_zeros_where_a_float_mask_blocks_every_key():
    """A float mask of -inf at every key of a row (a 4-D mask written by hand): SDPA gives zeros there,
    the products gave NaN; rows with some key left are as before."""
    query, key, value = single_query()
    mask = torch.zeros(3, 1, 1, 5)
    mask[1] = float("-inf")
    mask[2, ..., 2:] = float("-inf")
    got = kernels.matmul_attention(query, key, value, mask, 8**-0.5)
    assert not got.isnan().any() and torch.equal(got[1], torch.zeros_like(got[1]))
    assert_same_up_to_rounding(got, F.scaled_dot_product_attention(query, key, value, attn_mask=mask), 8 + 5)
    query[0, 0, 0, 0] = float("nan")  # a NaN of the inputs still shows
    assert kernels.matmul_attention(query, key, value, mask, 8**-0.5)[0].isnan().any()


def test_decoding_attention_follows_the_measurement(attention_policy, monkeypatch):
    """One probe per class; the measured choice computes later calls; several queries, gradients and
    dropout always go to SDPA."""
    calls = []
    monkeypatch.setattr(kernels, "matmul_attention", lambda *a: (calls.append(a), kernels._sdpa(*a))[1])
    monkeypatch.setattr(attention_policy, "_faster_as_matmul", lambda *a: True)
    module = torch.nn.Module()
    query, key, value = single_query(keys=6)
    with torch.inference_mode():
        output, weights = kernels.decoding_attention(module, query, key, value, None, scaling=8**-0.5)
        kernels.decoding_attention(module, query, key[:, :, :5], value[:, :, :5], None, scaling=8**-0.5)
    # 3 x 4 -> 16 rows, 6 and 5 -> 8 keys
    assert attention_policy.decisions == {(16, 8, 8, "none", torch.float32): True}
    assert len(calls) == 2 and output.shape == (3, 1, 4, 8) and weights is None
    torch.testing.assert_close(output, F.scaled_dot_product_attention(query, key, value).transpose(1, 2))
    many = torch.randn(3, 4, 2, 8)
    kernels.decoding_attention(module, many, key, value, None)
    kernels.decoding_attention(module, query.requires_grad_(), key, value, None)
    kernels.decoding_attention(module, query.detach(), key, value, None, dropout=0.1)
    assert len(calls) == 2


@pytest.fixture
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@needs_onednn
@pytest.mark.parametrize("mode", ["auto", "onednn"])
def test_onednn_is_not_used_while_torch_switches_it_off(policy, monkeypatch, mode):
    """`torch.backends.mkldnn.flags(enabled=False)` (or `torch.backends.mkldnn.enabled = False`), which a
    program sets to keep oneDNN out of its computations, was not seen: products still ran on oneDNN, also
    classes measured before the switch."""
    state, shapes, _ = policy
    kernels.set_linear_kernel(mode)
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 48, generator=generator), torch.randn(96, generator=generator)
    inputs = torch.randn(4, 48, generator=generator)
    state.decisions[(4, weight.shape, True, True)] = "onednn"
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    with torch.no_grad():
        for rows in (1, 4, 7):
            assert torch.equal(
                kernels.linear(inputs[:rows], weight, bias, per_step=True),
                F.linear(inputs[:rows], weight, bias),
            )
        assert shapes == []
        torch.backends.mkldnn.enabled = True
        kernels.linear(inputs, weight, bias, per_step=True)
    assert shapes == [(4, 48)]  # on again


@needs_onednn
def test_nothing_is_measured_under_deterministic_algorithms(
    policy, attention_policy, monkeypatch, deterministic_algorithms
):
    """The measured choices differ between runs (the timings do), and with them the results' last bits:
    three processes running one float32 model's `generate()` under `torch.use_deterministic_algorithms
    (True)` gave two different sets of scores. There the automatic mode uses torch's kernels, also for
    classes measured before; a mode set by hand (no timing) is kept."""
    state, shapes, _ = policy
    monkeypatch.setattr(state, "decide", lambda *a: pytest.fail("a linear product was timed"))
    monkeypatch.setattr(attention_policy, "decide", lambda *a: pytest.fail("an attention was timed"))
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 48, generator=generator), torch.randn(96, generator=generator)
    inputs = torch.randn(4, 48, generator=generator)
    state.decisions[(4, weight.shape, True, True)] = "onednn"  # measured before the switch
    query, key, value = single_query()
    attention_policy.decisions[(16, 8, 8, "none", torch.float32)] = True
    module = torch.nn.Module()
    with torch.no_grad():
        assert torch.equal(
            kernels.linear(inputs, weight, bias, per_step=True), F.linear(inputs, weight, bias)
        )
        assert torch.equal(kernels.linear(inputs[:3], weight, None), F.linear(inputs[:3], weight))
        output, _ = kernels.decoding_attention(module, query, key, value, None, scaling=8**-0.5)
        assert torch.equal(output, kernels._sdpa(query, key, value, None, 8**-0.5).transpose(1, 2))
        assert shapes == []
        kernels.set_linear_kernel("onednn")
        kernels.linear(inputs, weight, bias)
        assert shapes == [(4, 48)]


def test_attention_is_measured_again_in_another_dtype(attention_policy, monkeypatch):
    """Matrix products that give SDPA's float32 result may not give its bfloat16 result: a choice
    measured in float32 once computed a later bfloat16 model's steps, whose translations then depended
    on what the process had decoded before."""
    measured = []

    def faster_as_matmul(query, *_):
        measured.append(query.dtype)
        return query.dtype is torch.float32

    monkeypatch.setattr(attention_policy, "_faster_as_matmul", faster_as_matmul)
    module = torch.nn.Module()
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
            query, key, value = (t.to(dtype) for t in single_query())
            kernels.decoding_attention(module, query, key, value, None, scaling=8**-0.5)
    assert measured == [torch.float32, torch.bfloat16]
    assert attention_policy.decisions == {
        (16, 8, 8, "none", torch.float32): True,
        (16, 8, 8, "none", torch.bfloat16): False,
    }


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_attention_probe_fails_closed(attention_policy, monkeypatch, failure):
    def broken(query, key, value, mask, scaling):
        if failure == "raises":
            raise RuntimeError("out of memory")
        return torch.zeros_like(query)

    monkeypatch.setattr(kernels, "matmul_attention", broken)
    query, key, value = single_query()
    with torch.inference_mode():
        output, _ = kernels.decoding_attention(torch.nn.Module(), query, key, value, None)
    torch.testing.assert_close(output, F.scaled_dot_product_attention(query, key, value).transpose(1, 2))
    assert attention_policy.decisions == {(16, 8, 8, "none", torch.float32): False}


@pytest.mark.parametrize("empty_row", [False, True])
def test_generated_tokens_agree_between_attention_kernels(attention_policy, monkeypatch, empty_row):
    """Greedy and beam search over padded sources (a boolean cross-attention mask), with and without a
    source that is all padding, give the same tokens with every decoding step's attention on SDPA and on
    the matrix products."""
    calls = []
    products = kernels.matmul_attention
    monkeypatch.setattr(kernels, "matmul_attention", lambda *a: (calls.append(1), products(*a))[1])
    model = tiny_model("sdpa", d_model=64, d_ff=128)
    source = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(source)
    attention_mask[1, 4:] = attention_mask[2, 2:] = 0
    results = {}
    if empty_row:  # a source row that is all padding: nothing for cross-attention to attend to
        source, attention_mask = (
            torch.cat([source, source[:1]]),
            torch.cat([attention_mask, 0 * attention_mask[:1]]),
        )
    for mode in ("sdpa", "matmul"):
        kernels.set_attention_kernel(mode)
        with torch.inference_mode():
            results[mode] = [
                model.generate(source, attention_mask=attention_mask, num_beams=beams, max_new_tokens=8)
                for beams in (1, 3)
            ]
        assert bool(calls) == (mode == "matmul")  # the products did compute the "matmul" run
    for sdpa, matmul in zip(results["sdpa"], results["matmul"], strict=True):
        assert torch.equal(sdpa, matmul)


def test_attention_environment_variable():
    assert kernels._parse_attention_mode(None) == "auto"
    assert kernels._parse_attention_mode(" MatMul ") == "matmul"
    with pytest.raises(ValueError, match=r"VANILLA_TRANSFORMER_DECODE_ATTENTION='fast' .* sdpa or matmul"):
        kernels._parse_attention_mode("fast")


def test_layer_norm_of_is_the_modules_norm_with_its_epsilon():
    """Cached decoding steps compute layer norms without the module call: with the module's epsilon, which
    dominates the variance of small inputs (a hard-coded default would pass models built with it)."""
    norm = torch.nn.LayerNorm(8, eps=0.1)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    inputs = 0.2 * torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kernels.layer_norm_of(norm, inputs), norm(inputs), rtol=0, atol=0)
    mean, variance = inputs.mean(-1, keepdim=True), inputs.var(-1, unbiased=False, keepdim=True)
    formula = (inputs - mean) / torch.sqrt(variance + 0.1) * norm.weight + norm.bias  # the paper's LayerNorm
    torch.testing.assert_close(kernels.layer_norm_of(norm, inputs).detach(), formula.detach())
