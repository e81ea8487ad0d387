"""The linear-layer kernel policy: oneDNN only where measured faster, never in training, bounded shapes.

References: `F.linear` (torch's own kernel) for every result; counting wrappers show which kernel ran.
"""

import time

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_same_up_to_rounding, tiny_model
from vanilla_transformer import kernels_vanilla_transformer as kernels

ONEDNN = kernels.linear_kernel().onednn
needs_onednn = pytest.mark.skipif(ONEDNN is None, reason="this torch build has no oneDNN linear kernel")


@pytest.fixture
def policy(monkeypatch):
    """The process's policy with its decisions and mode restored afterwards; calls to oneDNN counted."""
    state = kernels.linear_kernel()
    previous = kernels.set_linear_kernel("auto")
    shapes = []

    def counting(inputs, *args):
        shapes.append(tuple(inputs.shape))
        return ONEDNN(inputs, *args)

    monkeypatch.setattr(state, "onednn", counting)
    yield state, shapes
    kernels.set_linear_kernel(previous)


@needs_onednn
@pytest.mark.parametrize("mode", ["torch", "onednn", "auto"])
def test_linear_equals_f_linear_in_every_mode(policy, mode):
    kernels.set_linear_kernel(mode)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=generator)
    bias = torch.randn(96, generator=generator)
    with torch.inference_mode():
        for rows in (1, 3, 4, 37, 256, 257, 600):
            inputs = torch.randn(48, rows, generator=generator).t()  # not contiguous
            for b in (bias, None):
                got = kernels.linear(inputs, weight, b)
                assert got.shape == (rows, 96)
                assert_same_up_to_rounding(got, F.linear(inputs, weight, b), 48)
        batched = torch.randn(2, 5, 48, generator=generator)
        assert_same_up_to_rounding(kernels.linear(batched, weight, bias), F.linear(batched, weight, bias), 48)
        assert kernels.linear(torch.zeros(0, 48), weight, bias).shape == (0, 96)


@needs_onednn
def test_unusual_biases_and_derivatives_stay_exact(policy):
    """A strided or broadcast bias, forward-mode derivatives and torch.func transforms: oneDNN's op
    would give wrong numbers or drop the derivative, so these run on torch's kernel."""
    _, shapes = policy
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
    _, shapes = policy
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
    _, shapes = policy
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
    state, shapes = policy
    weight = torch.randn(16, 8)
    slow_calls = []

    def slow_onednn(inputs, *args):
        slow_calls.append(1)
        time.sleep(0.002)  # far slower than any 1 x 8 x 16 product
        return ONEDNN(inputs, *args)

    monkeypatch.setattr(state, "onednn", slow_onednn)
    with torch.inference_mode():
        for _ in range(3):
            kernels.linear(torch.randn(3, 8), weight)  # class: 4 padded rows, 16 x 8, no bias
    assert state.decisions == {(4, (16, 8), False): False}
    assert len(slow_calls) == 1 + kernels.PROBE_ROUNDS  # the probe only: then torch's kernel
    assert state.probe_seconds > 0

    # The other way round: torch's kernel slowed down, so oneDNN measures faster and is kept.
    fast_onednn = ONEDNN
    monkeypatch.setattr(
        state, "onednn", lambda inputs, *args: shapes.append(inputs.shape) or fast_onednn(inputs, *args)
    )

    original = F.linear

    def slow_f_linear(*args):
        time.sleep(0.002)
        return original(*args)

    monkeypatch.setattr(kernels.F, "linear", slow_f_linear)
    with torch.inference_mode():
        kernels.linear(torch.randn(5, 8), weight)
        kernels.linear(torch.randn(6, 8), weight)  # same class: decided already
    assert state.decisions[(8, (16, 8), False)] is True
    assert len(shapes) == 2 + 1 + kernels.PROBE_ROUNDS


@needs_onednn
@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_probe_fails_closed(policy, monkeypatch, failure):
    state, _ = policy

    def broken(inputs, weight, *args):
        if failure == "raises":
            raise RuntimeError("no primitive for this shape")
        return torch.zeros(inputs.shape[0], weight.shape[0])  # fast, and wrong

    monkeypatch.setattr(state, "onednn", broken)
    weight, inputs = torch.randn(16, 8), torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(inputs, weight), F.linear(inputs, weight))
    assert state.decisions == {(2, (16, 8), False): False}


@needs_onednn
def test_model_outputs_agree_between_kernels(policy):
    """A tiny model's logits and generated tokens with oneDNN everywhere equal those with torch's kernels."""
    model = tiny_model("sdpa", d_model=64, d_ff=128)
    source = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("torch", "onednn"):
        kernels.set_linear_kernel(mode)
        with torch.inference_mode():
            logits = model(input_ids=source, decoder_input_ids=source[:, :5]).logits
            tokens = model.generate(source, num_beams=2, max_new_tokens=6)
        results[mode] = logits, tokens
    assert_same_up_to_rounding(results["onednn"][0], results["torch"][0], 6 * 128)
    assert torch.equal(results["onednn"][1], results["torch"][1])
    assert policy[1], "oneDNN was never called"


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("0", "torch"),
        ("torch", "torch"),
        ("1", "onednn"),
        (" ONEDNN ", "onednn"),
    ],
)
def test_environment_variable(value, mode):
    assert kernels._parse_mode(value) == mode


def test_environment_variable_with_a_bad_value_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"VANILLA_TRANSFORMER_ONEDNN='yes' .* 0 or torch"):
        kernels._parse_mode("yes")
