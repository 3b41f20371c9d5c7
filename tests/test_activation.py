"""bias_act, swiglu, act_linear: kernels against float64 PyTorch references, the rebuilt
activation, gradcheck, opcheck, torch.compile, autocast, saved bytes, errors."""

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.ops.activation import (
    ACTIVATIONS,
    act_linear_ref,
    bias_act_ref,
    swiglu_ref,
)

from helpers import MemoptOpCalls, device_dtype_params, gpu, tolerances

SHAPES = [(1, 33), (97, 33), (123, 1025), (2, 5, 33), (7,)]
SWIGLU_SHAPES = [(1, 66), (97, 66), (123, 2050), (2, 5, 34), (8,)]


def _shape_id(shape):
    return "x".join(map(str, shape))


def _bias(n, device, dtype, with_bias):
    return torch.randn(n, device=device, dtype=dtype, requires_grad=True) if with_bias else None


def _reference_grads(ref_fn, inputs, grad):
    """Gradients of ref_fn in float64 with respect to the tensors in inputs (None stays None)."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    out = ref_fn(*leaves)
    out.backward(grad.double())
    return out, [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bias_act_matches_reference(device, dtype, activation, shape, with_bias):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    bias = _bias(shape[-1], device, dtype, with_bias)
    y = memopt.bias_act(x, bias, activation)
    assert y.dtype == dtype and y.shape == x.shape
    grad = torch.randn_like(y)
    ref, (ref_dx, ref_db) = _reference_grads(lambda a, b: bias_act_ref(a, b, activation), (x, bias), grad)
    torch.testing.assert_close(y.double(), ref.detach(), **tolerances(dtype))
    y.backward(grad)
    torch.testing.assert_close(x.grad.double(), ref_dx, **tolerances(dtype))
    if with_bias:
        assert bias.grad.dtype == dtype
        torch.testing.assert_close(bias.grad.double(), ref_db, **tolerances(dtype))


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_matches_reference(device, dtype, shape, with_bias):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    bias = _bias(shape[-1], device, dtype, with_bias)
    y = memopt.swiglu(x, bias)
    assert y.dtype == dtype and y.shape == shape[:-1] + (shape[-1] // 2,)
    grad = torch.randn_like(y)
    ref, (ref_dx, ref_db) = _reference_grads(swiglu_ref, (x, bias), grad)
    torch.testing.assert_close(y.double(), ref.detach(), **tolerances(dtype))
    y.backward(grad)
    torch.testing.assert_close(x.grad.double(), ref_dx, **tolerances(dtype))
    if with_bias:
        torch.testing.assert_close(bias.grad.double(), ref_db, **tolerances(dtype))


def _float32_bias_params():
    # A float32 bias beside lower-precision x: float64 x on CPU, half x on CUDA.
    return [pytest.param("cpu", torch.float64, id="cpu-float64")] + [
        pytest.param("cuda", dt, id=f"cuda-{str(dt).split('.')[-1]}", marks=gpu) for dt in (torch.float16, torch.bfloat16)
    ]


@pytest.mark.parametrize("device,dtype", _float32_bias_params())
@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_float32_bias_with_other_input_dtype(device, dtype, activation):
    x = torch.randn(97, 66, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(66, device=device, dtype=torch.float32, requires_grad=True)
    if activation == "swiglu":
        y, ref_fn = memopt.swiglu(x, bias), swiglu_ref
    else:
        y, ref_fn = memopt.bias_act(x, bias, activation), lambda a, b: bias_act_ref(a, b, activation)
    assert y.dtype == dtype
    grad = torch.randn_like(y)
    ref, (ref_dx, ref_db) = _reference_grads(ref_fn, (x, bias), grad)
    torch.testing.assert_close(y.double(), ref.detach(), **tolerances(dtype))
    y.backward(grad)
    assert bias.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), ref_dx, **tolerances(dtype))
    torch.testing.assert_close(bias.grad.double(), ref_db, **tolerances(torch.float32 if dtype == torch.float64 else dtype))


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
@pytest.mark.parametrize("with_bias", [False, True])
def test_backward_returns_forward_output_exactly(device, dtype, activation, with_bias):
    x = torch.randn(97, 66, device=device, dtype=dtype)
    bias = torch.randn(66, device=device, dtype=dtype) if with_bias else None
    if activation == "swiglu":
        y = torch.ops.memopt.swiglu_fwd(x, bias)
        grad_x, grad_bias, y_rebuilt = torch.ops.memopt.swiglu_bwd(torch.randn_like(y), x, bias, True)
        _, _, absent = torch.ops.memopt.swiglu_bwd(torch.randn_like(y), x, bias, False)
    else:
        y = torch.ops.memopt.bias_act_fwd(x, bias, activation)
        grad_x, grad_bias, y_rebuilt = torch.ops.memopt.bias_act_bwd(torch.randn_like(y), x, bias, activation, True)
        _, _, absent = torch.ops.memopt.bias_act_bwd(torch.randn_like(y), x, bias, activation, False)
    assert torch.equal(y_rebuilt, y)
    assert absent.numel() == 0
    assert grad_x.shape == x.shape
    assert grad_bias.shape == ((66,) if with_bias else (0,))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_zero_and_nan_behave_like_pytorch(activation):
    # relu: gradient 0 at exactly 0; NaN propagates through every activation, value and gradient.
    x = torch.tensor([-1.0, 0.0, 2.0, float("nan")], dtype=torch.float64, requires_grad=True)
    y = memopt.bias_act(x, None, activation)
    y.backward(torch.ones(4, dtype=torch.float64))
    x_ref = x.detach().clone().requires_grad_()
    y_ref = bias_act_ref(x_ref, None, activation)
    y_ref.backward(torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(y, y_ref, equal_nan=True)
    torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True)
    if activation == "relu":
        assert x.grad[1].item() == 0.0


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", "swiglu"])
def test_float32_gradient_error_within_twice_eager(activation):
    # s (1 - s) with s = sigmoid near 1 cancelled in 1 - s: gelu_tanh's float32 gradient was 3.5x
    # eager's largest error over x in [3, 5] (5.8x on randn samples). Dense x over [-8, 8], the
    # error compared per unit interval (eager's error varies by orders of magnitude over the range),
    # plus values where exp(-z) overflows: the gradient stays finite, as eager's.
    x = torch.cat([torch.linspace(-8, 8, 400_001)[:-1], torch.tensor([-100.0, -90.0, 90.0])])
    grad = torch.ones_like(x)
    if activation == "swiglu":  # the gate (first half) runs through silu; the up half is 1.5
        x = torch.cat([x, torch.full_like(x, 1.5)])
    x = x.requires_grad_()
    if activation == "swiglu":
        memopt.swiglu(x, None).backward(grad)
        ref_fn = lambda t: swiglu_ref(t, None)  # noqa: E731
    else:
        memopt.bias_act(x, None, activation).backward(grad)
        ref_fn = lambda t: bias_act_ref(t, None, activation)  # noqa: E731
    x64 = x.detach().double().requires_grad_()
    ref_fn(x64).backward(grad.double())
    x32 = x.detach().clone().requires_grad_()
    ref_fn(x32).backward(grad)  # eager PyTorch in float32
    assert torch.isfinite(x.grad).all()
    n = 400_000
    gate = slice(0, n)  # x in [-8, 8); for swiglu the gate's gradient (the up half's is silu(x))
    err = (x.grad[gate].double() - x64.grad[gate]).abs().view(16, -1).amax(1)
    eager_err = (x32.grad[gate].double() - x64.grad[gate]).abs().view(16, -1).amax(1)
    assert (err <= 2 * eager_err).all(), list(zip(range(-8, 8), (err / eager_err).tolist()))
    if activation == "swiglu":
        up = slice(x.shape[0] // 2, x.shape[0] // 2 + n)
        err = (x.grad[up].double() - x64.grad[up]).abs().max()
        assert err <= 2 * (x32.grad[up].double() - x64.grad[up]).abs().max()


def _away_from_zero(shape, margin=0.1):
    """float64 values with |v| >= margin + 0.05: relu's kink stays out of gradcheck's reach."""
    magnitude = margin + 0.05 + torch.rand(shape, dtype=torch.float64)
    return torch.where(torch.rand(shape) < 0.5, -magnitude, magnitude)


def _gradcheck_inputs(activation, shape):
    """x and a small bias such that x + bias stays at least 0.1 away from relu's kink."""
    x = _away_from_zero(shape) if activation == "relu" else torch.randn(shape, dtype=torch.float64)
    bias = (torch.rand(shape[-1], dtype=torch.float64) - 0.5) * 0.1
    return x.requires_grad_(), bias.requires_grad_()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gradcheck_bias_act_float64(activation, with_bias):
    x, bias = _gradcheck_inputs(activation, (5, 7))
    assert torch.autograd.gradcheck(torch.ops.memopt.bias_act, (x, bias if with_bias else None, activation))


@pytest.mark.parametrize("with_bias", [False, True])
def test_gradcheck_swiglu_float64(with_bias):
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(8, dtype=torch.float64, requires_grad=True) if with_bias else None
    assert torch.autograd.gradcheck(torch.ops.memopt.swiglu, (x, bias))


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
@pytest.mark.parametrize("with_linear_bias", [False, True])
def test_gradcheck_act_linear_float64(activation, with_linear_bias):
    x, bias = _gradcheck_inputs(activation, (2, 3, 8))
    k = 4 if activation == "swiglu" else 8
    weight = torch.randn(5, k, dtype=torch.float64, requires_grad=True)
    linear_bias = torch.randn(5, dtype=torch.float64, requires_grad=True) if with_linear_bias else None
    assert torch.autograd.gradcheck(torch.ops.memopt.act_linear, (x, bias, weight, linear_bias, activation))


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
@pytest.mark.parametrize("shape", [(1, 34), (2, 61, 66)])
def test_act_linear_matches_eager(device, dtype, activation, shape):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=True)
    k = shape[-1] // 2 if activation == "swiglu" else shape[-1]
    weight = (torch.randn(17, k, device=device, dtype=dtype) / k**0.5).requires_grad_()
    linear_bias = torch.randn(17, device=device, dtype=dtype, requires_grad=True)
    params = (x, bias, weight, linear_bias)

    out = memopt.act_linear(*params, activation=activation)
    grad = torch.randn_like(out)
    out.backward(grad)
    ours = [out] + [p.grad for p in params]

    ref64, grads64 = _reference_grads(lambda *a: act_linear_ref(*a, activation=activation), params, grad)
    low = [p.detach().clone().requires_grad_() for p in params]
    eager = act_linear_ref(*low, activation=activation)
    eager.backward(grad)
    eager_low = [eager] + [p.grad for p in low]
    # flash-attention's rule: at most twice the error of eager PyTorch in the same dtype.
    atol = tolerances(dtype)["atol"]
    for name, got, low_precision, exact in zip(["out", "x", "bias", "weight", "linear_bias"], ours, eager_low,
                                                 [ref64] + grads64):
        assert got.dtype == dtype, name
        err = (got.double() - exact.detach()).abs().max().item()
        eager_err = (low_precision.double() - exact.detach()).abs().max().item()
        assert err <= 2 * eager_err + atol, f"{name}: error {err} vs eager {eager_err}"


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_act_linear_under_cpu_autocast_matches_eager_autocast(activation):
    x = torch.randn(3, 29, 66, requires_grad=True)
    bias = torch.randn(66, requires_grad=True)
    k = 33 if activation == "swiglu" else 66
    weight = (torch.randn(40, k) / k**0.5).requires_grad_()
    linear_bias = torch.randn(40, requires_grad=True)
    params = (x, bias, weight, linear_bias)
    low = [p.detach().clone().requires_grad_() for p in params]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = memopt.act_linear(*params, activation=activation)
        eager = act_linear_ref(*low, activation=activation)
    assert out.dtype == eager.dtype == torch.bfloat16
    grad = torch.randn_like(out)
    out.backward(grad)
    eager.backward(grad)
    torch.testing.assert_close(out, eager, **tolerances(torch.bfloat16))
    for p, q in zip(params, low):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, atol=1.6e-2 * scale, rtol=1.6e-2)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("return_y", [False, True])
def test_opcheck(with_bias, return_y):
    x = torch.randn(5, 34, dtype=torch.float64)
    bias = torch.randn(34, dtype=torch.float64) if with_bias else None
    grad = torch.randn(5, 34, dtype=torch.float64)
    for activation in ACTIVATIONS:
        torch.library.opcheck(torch.ops.memopt.bias_act_fwd.default, (x, bias, activation))
        torch.library.opcheck(torch.ops.memopt.bias_act_fwd_inplace.default, (x.clone(), bias, activation))
        torch.library.opcheck(torch.ops.memopt.bias_act_bwd.default, (grad, x, bias, activation, return_y))
        torch.library.opcheck(
            torch.ops.memopt.bias_act_bwd_inplace.default, (grad.clone(), x, bias, activation, return_y)
        )
    torch.library.opcheck(torch.ops.memopt.swiglu_fwd.default, (x, bias))
    torch.library.opcheck(torch.ops.memopt.swiglu_bwd.default, (grad[:, :17].contiguous(), x, bias, return_y))
    # The bias gradient not asked for: an empty output, in the fakes too.
    torch.library.opcheck(torch.ops.memopt.bias_act_bwd.default, (grad, x, bias, "gelu", return_y, False))
    torch.library.opcheck(torch.ops.memopt.bias_act_bwd_inplace.default, (grad.clone(), x, bias, "silu", return_y, False))
    torch.library.opcheck(torch.ops.memopt.swiglu_bwd.default, (grad[:, :17].contiguous(), x, bias, return_y, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_differentiable_activation_ops(dtype, with_bias):
    x = torch.randn(5, 34, dtype=dtype, requires_grad=True)
    bias = torch.randn(34, dtype=dtype, requires_grad=True) if with_bias else None
    weight = torch.randn(3, 34, dtype=dtype, requires_grad=True)
    linear_bias = torch.randn(3, dtype=dtype, requires_grad=True) if with_bias else None
    for activation in ACTIVATIONS:
        torch.library.opcheck(torch.ops.memopt.bias_act.default, (x, bias, activation))
        torch.library.opcheck(torch.ops.memopt.act_linear.default, (x, bias, weight, linear_bias, activation))
    torch.library.opcheck(torch.ops.memopt.swiglu.default, (x, bias))
    torch.library.opcheck(torch.ops.memopt.act_linear.default, (x, bias, weight[:, :17], linear_bias, "swiglu"))


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_backward_runs_in_a_cpp_node(activation):
    # No Python between the forward and backward kernels: memopt.bias_act / swiglu / act_linear
    # record the C++ nodes of csrc/activation_autograd.cpp (a Python autograd.Function records a
    # BackwardCFunction).
    x = torch.randn(4, 6, requires_grad=True)
    y = memopt.swiglu(x) if activation == "swiglu" else memopt.bias_act(x, None, activation)
    out = memopt.act_linear(x, None, torch.randn(2, 3 if activation == "swiglu" else 6), activation=activation)
    for t, node in ((y, "ActivationFunction"), (out, "ActLinearFunction")):
        assert not isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction)
        assert node in t.grad_fn.name(), t.grad_fn.name()


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_registered_ops_take_strided_input(activation):
    # The ops copy strided x and bias in a recorded op (as F.gelu takes any strides): gradients
    # reach the strided leaves, first and second order.
    base = torch.randn(8, 6, dtype=torch.float64)
    x = base.t().contiguous().t().requires_grad_()  # (8, 6) with strides (1, 8)
    bias = torch.randn(6, 2, dtype=torch.float64)[:, 0].detach().requires_grad_()
    assert not x.is_contiguous() and not bias.is_contiguous()
    op = (lambda a, b: torch.ops.memopt.swiglu(a, b)) if activation == "swiglu" else (
        lambda a, b: torch.ops.memopt.bias_act(a, b, activation))
    ref = (lambda a, b: swiglu_ref(a, b)) if activation == "swiglu" else (lambda a, b: bias_act_ref(a, b, activation))
    x_ref, bias_ref = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    y, y_ref = op(x, bias), ref(x_ref, bias_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(y)
    gx, gb = torch.autograd.grad(y, (x, bias), grad, create_graph=True)
    gx_ref, gb_ref = torch.autograd.grad(y_ref, (x_ref, bias_ref), grad, create_graph=True)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb, gb_ref, rtol=1e-12, atol=1e-12)
    second = torch.autograd.grad((gx * gx).sum() + gb.sum(), (x, bias), allow_unused=True)
    second_ref = torch.autograd.grad((gx_ref * gx_ref).sum() + gb_ref.sum(), (x_ref, bias_ref), allow_unused=True)
    for got, want in zip(second, second_ref):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_act_linear_op_takes_strided_input(activation):
    x = torch.randn(8, 6, dtype=torch.float64).t().contiguous().t().requires_grad_()  # (8, 6), strides (1, 8)
    bias = torch.randn(6, 2, dtype=torch.float64)[:, 0].detach().requires_grad_()
    weight = torch.randn(3, 3 if activation == "swiglu" else 6, dtype=torch.float64, requires_grad=True)
    assert not x.is_contiguous() and not bias.is_contiguous()
    leaves = [x, bias, weight]
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    out = torch.ops.memopt.act_linear(x, bias, weight, None, activation)
    ref = act_linear_ref(*refs, activation=activation)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, refs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bias_act_op_refuses_swiglu_as_an_activation():
    # swiglu halves the width: memopt::bias_act must not run it under its own name.
    with pytest.raises(RuntimeError, match='memopt.bias_act: activation must be one of "relu", "gelu", "gelu_tanh", "silu", got "swiglu"'):
        torch.ops.memopt.bias_act(torch.randn(3, 4, requires_grad=True), None, "swiglu")


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("return_y", [False, True])
def test_bias_act_bwd_inplace_writes_grad_x_over_grad_y(device, dtype, with_bias, return_y):
    x = torch.randn(97, 1025, device=device, dtype=dtype)
    bias = torch.randn(1025, device=device, dtype=dtype) if with_bias else None
    grad = torch.randn_like(x)
    for activation in ACTIVATIONS:
        ref, (ref_dx, ref_db) = _reference_grads(lambda a, b: bias_act_ref(a, b, activation), (x, bias), grad)
        scratch = grad.clone()
        grad_bias, y = torch.ops.memopt.bias_act_bwd_inplace(scratch, x, bias, activation, return_y)
        torch.testing.assert_close(scratch.double(), ref_dx, **tolerances(dtype))
        # The same numbers as the out-of-place op, bit for bit (one kernel, two destinations).
        grad_x, grad_bias_copy, y_copy = torch.ops.memopt.bias_act_bwd(grad, x, bias, activation, return_y)
        assert torch.equal(scratch, grad_x)
        if with_bias:
            torch.testing.assert_close(grad_bias.double(), ref_db, **tolerances(dtype))
            assert torch.equal(grad_bias, grad_bias_copy)
        else:
            assert grad_bias.numel() == 0
        if return_y:
            torch.testing.assert_close(y.double(), ref.detach(), **tolerances(dtype))
            assert torch.equal(y, y_copy)
        else:
            assert y.numel() == 0


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("op", ["bias_act_bwd", "bias_act_bwd_inplace", "swiglu_bwd"])
@pytest.mark.parametrize("return_y", [False, True])
@pytest.mark.parametrize("cols", [1026, 1024])  # 1024: the CUDA kernels' 16-byte packs
def test_bwd_ops_skip_the_bias_gradient_not_asked_for(device, dtype, op, return_y, cols):
    """return_grad_bias False (a frozen bias): the bias gradient comes back empty, and grad_x and
    the rebuilt y are the full call's bit for bit (checked against float64 above)."""
    x = torch.randn(97, cols, device=device, dtype=dtype)
    bias = torch.randn(cols, device=device, dtype=dtype)
    grad = torch.randn(97, cols // 2 if op == "swiglu_bwd" else cols, device=device, dtype=dtype)
    ops = torch.ops.memopt
    for activation in ("swiglu",) if op == "swiglu_bwd" else ACTIVATIONS:
        if op == "swiglu_bwd":
            full, got = ops.swiglu_bwd(grad, x, bias, return_y), ops.swiglu_bwd(grad, x, bias, return_y, False)
        else:
            full = ops.bias_act_bwd(grad, x, bias, activation, return_y)
            if op == "bias_act_bwd":
                got = ops.bias_act_bwd(grad, x, bias, activation, return_y, False)
            else:
                scratch = grad.clone()
                got = (scratch, *ops.bias_act_bwd_inplace(scratch, x, bias, activation, return_y, False))
        assert full[1].shape == bias.shape and got[1].numel() == 0, activation
        assert torch.equal(got[0], full[0]) and torch.equal(got[2], full[2]), activation


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
@pytest.mark.parametrize("linear", [False, True], ids=["act", "act_linear"])
def test_frozen_bias_gets_no_gradient_and_none_is_computed(activation, linear):
    """A bias that does not require grad (PEFT, LoRA) gets none and is not asked of the kernel;
    x's gradient (and act_linear's weight's) match the float64 reference."""
    x = torch.randn(2, 31, 66, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(66)  # frozen
    params = [x, bias]
    if linear:
        k = 33 if activation == "swiglu" else 66
        params += [(torch.randn(17, k) / k**0.5).requires_grad_(), torch.randn(17, requires_grad=True)]
        fn = lambda *a: memopt.act_linear(*a, activation=activation)  # noqa: E731
        ref_fn = lambda *a: act_linear_ref(*a, activation=activation)  # noqa: E731
    elif activation == "swiglu":
        fn, ref_fn = memopt.swiglu, swiglu_ref
    else:
        fn = lambda a, b: memopt.bias_act(a, b, activation)  # noqa: E731
        ref_fn = lambda a, b: bias_act_ref(a, b, activation)  # noqa: E731
    out = fn(*params)
    grad = torch.randn_like(out)
    with MemoptOpCalls("_bwd") as calls:
        out.backward(grad)
    assert [c["return_grad_bias"] for c in calls.calls] == [False]
    _, expected = _reference_grads(ref_fn, params, grad)
    assert bias.grad is None
    tol = {k: 4 * v for k, v in tolerances(torch.float32).items()}  # the matmul sums 66 products
    for p, e in zip(params, expected):
        if p.requires_grad:
            torch.testing.assert_close(p.grad.double(), e, **tol)


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(97, 123), (123, 1025), (2, 5, 33), (7,)], ids=_shape_id)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bias_act_fwd_inplace_writes_y_over_x(device, dtype, activation, shape, with_bias):
    x = torch.randn(shape, device=device, dtype=dtype)
    bias = torch.randn(shape[-1], device=device, dtype=dtype) if with_bias else None
    scratch = x.clone()
    address = scratch.data_ptr()
    assert torch.ops.memopt.bias_act_fwd_inplace(scratch, bias, activation) is None
    assert scratch.data_ptr() == address and scratch.shape == x.shape
    torch.testing.assert_close(scratch.double(), bias_act_ref(x, bias, activation, upcast=True), **tolerances(dtype))
    # The out-of-place op's bits: the same kernel, its output written where its input was read.
    assert torch.equal(scratch, torch.ops.memopt.bias_act_fwd(x, bias, activation))


@pytest.mark.parametrize("device,dtype", _float32_bias_params())
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_act_fwd_inplace_with_float32_bias(device, dtype, activation):
    x = torch.randn(97, 123, device=device, dtype=dtype)
    bias = torch.randn(123, device=device, dtype=torch.float32)
    scratch = x.clone()
    torch.ops.memopt.bias_act_fwd_inplace(scratch, bias, activation)
    torch.testing.assert_close(scratch.double(), bias_act_ref(x, bias, activation, upcast=True), **tolerances(dtype))
    assert torch.equal(scratch, torch.ops.memopt.bias_act_fwd(x, bias, activation))


def test_bias_act_fwd_inplace_compiles_fullgraph(compile_cache):
    # torch.compile functionalizes the mutation of an intermediate: the same numbers as eager.
    def fn(x, bias):
        u = x * 2.0  # a tensor of fn's own, as fc1's output is block_forward's
        torch.ops.memopt.bias_act_fwd_inplace(u, bias, "gelu")
        return u + x

    x, bias = torch.randn(97, 123), torch.randn(123)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, bias), fn(x, bias), atol=0, rtol=0)
    expected = bias_act_ref(2.0 * x.double(), bias.double(), "gelu") + x.double()
    torch.testing.assert_close(compiled(x, bias).double(), expected, **tolerances(torch.float32))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_act_linear_backward_allocates_one_activation_sized_buffer(activation):
    """act_linear's backward rebuilds the activation in one buffer, takes the weight gradient from
    it and writes grad_act over it (and, but for swiglu, grad_x over grad_act): of x's size it
    holds that buffer and swiglu's grad_x, where eager peaks at three (x + bias, y, grad_act)."""
    from bench.memory import LiveTensorTracker

    x = torch.randn(64, 512, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(512, dtype=torch.float64, requires_grad=True)
    act_width = 256 if activation == "swiglu" else 512
    weight = torch.randn(8, act_width, dtype=torch.float64, requires_grad=True)
    out = memopt.act_linear(x, bias, weight, activation=activation)
    grad_out = torch.randn_like(out)
    x_bytes = x.numel() * x.element_size()
    with LiveTensorTracker(exclude=[x, bias, weight, out, grad_out]) as tracker:
        out.backward(grad_out)
    # gelu: y, then grad_act and grad_x in it; swiglu: y (half x's width), then grad_act in it, and grad_x.
    floor = 1.5 * x_bytes if activation == "swiglu" else x_bytes
    assert floor <= tracker.peak_bytes("cpu") < floor + 0.25 * x_bytes
    ref_x = x.detach().clone().requires_grad_()
    ref_b = bias.detach().clone().requires_grad_()
    ref_w = weight.detach().clone().requires_grad_()
    act_linear_ref(ref_x, ref_b, ref_w, None, activation=activation).backward(grad_out)
    for got, want in ((x, ref_x), (bias, ref_b), (weight, ref_w)):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)


def test_compile_fullgraph(compile_cache):
    x = torch.randn(2, 9, 34, requires_grad=True)
    bias = torch.randn(34, requires_grad=True)
    weight = torch.randn(6, 17, requires_grad=True)

    def fn(a, b, w):
        h = memopt.bias_act(a, b, "gelu_tanh") + memopt.swiglu(a, b).sum(-1, keepdim=True)
        return memopt.act_linear(h, b, w, None, activation="swiglu")

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(x, bias, weight)
    out.sum().backward()
    got = [out.detach()] + [t.grad.clone() for t in (x, bias, weight)]
    for t in (x, bias, weight):
        t.grad = None
    expected = fn(x, bias, weight)
    expected.sum().backward()
    torch.testing.assert_close(got[0], expected.detach())
    for g, t in zip(got[1:], (x, bias, weight)):
        torch.testing.assert_close(g, t.grad)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bias_act_saves_no_more_than_eager(activation, with_bias):
    x = torch.randn(64, 96, requires_grad=True)
    bias = torch.randn(96, requires_grad=True) if with_bias else None
    nbytes = x.numel() * x.element_size()
    fused = memopt.saved_bytes(memopt.bias_act, x, bias, activation)
    eager = memopt.saved_bytes(lambda a, b: bias_act_ref(a, b, activation), x, bias)
    # memopt keeps x and bias only (arguments, not counted). Eager relu keeps its output; gelu and
    # silu keep their input, a new tensor x + bias when there is a bias, else x itself.
    assert fused == 0
    assert eager == (nbytes if activation == "relu" or with_bias else 0)
    assert fused <= eager


@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
@pytest.mark.parametrize("with_bias", [False, True])
def test_act_linear_saves_the_activation_output_less(activation, with_bias):
    rows, width, out_features = 2 * 48, 128, 80
    x = torch.randn(2, 48, width, requires_grad=True)
    bias = torch.randn(width, requires_grad=True) if with_bias else None
    act_width = width // 2 if activation == "swiglu" else width
    weight = torch.randn(out_features, act_width, requires_grad=True)
    linear_bias = torch.randn(out_features, requires_grad=True)
    y_bytes = rows * act_width * 4
    h_bytes = rows * width * 4

    def unfused(a, b, w, lb):
        y = memopt.swiglu(a, b) if activation == "swiglu" else memopt.bias_act(a, b, activation)
        return F.linear(y, w, lb)

    def eager(a, b, w, lb):
        return act_linear_ref(a, b, w, lb, activation=activation)

    args = (x, bias, weight, linear_bias)
    fused = memopt.saved_bytes(lambda *a: memopt.act_linear(*a, activation=activation), *args)
    # x and the parameters are arguments (not counted): act_linear keeps nothing else.
    assert fused == 0
    # memopt's activation followed by F.linear keeps exactly the activation output more.
    assert memopt.saved_bytes(unfused, *args) == fused + y_bytes
    # Eager PyTorch keeps the activation output too, and besides, gelu/silu keep x + bias and
    # swiglu keeps x + bias (its gate and up views) and silu(gate).
    eager_extra = {
        "relu": 0,
        "gelu": h_bytes if with_bias else 0,
        "gelu_tanh": h_bytes if with_bias else 0,
        "silu": h_bytes if with_bias else 0,
        "swiglu": (h_bytes if with_bias else 0) + y_bytes,
    }[activation]
    assert memopt.saved_bytes(eager, *args) == fused + y_bytes + eager_extra


def _raises(call, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        call()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: memopt.bias_act(torch.randn(3, 4), None, "tanh"), "activation must be one of"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(3, 4), None, "tanh"), "activation must be one of"),
        (lambda: memopt.act_linear(torch.randn(3, 4), None, torch.randn(2, 4), activation="gelu2"),
         "activation must be one of"),
        (lambda: memopt.bias_act(torch.randn(3, 4), torch.randn(5)), r"bias must have shape \[4\]"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(3, 4), torch.randn(5), "gelu"), r"bias must have shape \[4\]"),
        (lambda: torch.ops.memopt.swiglu_fwd(torch.randn(3, 4), torch.randn(2)), r"bias must have shape \[4\]"),
        (lambda: memopt.bias_act(torch.randn(3, 4), torch.randn(4, device="meta")), "bias must be on x's device"),
        (lambda: memopt.swiglu(torch.randn(3, 4), torch.randn(4, device="meta")), "bias must be on x's device"),
        # A meta bias sends the kernel ops to their fakes (the Meta kernels), which must refuse it
        # too rather than hand back an uninitialised CPU tensor.
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(3, 4), torch.randn(4, device="meta"), "gelu"),
         "bias must be on x's device"),
        (lambda: torch.ops.memopt.swiglu_fwd(torch.randn(3, 4), torch.randn(4, device="meta")),
         "bias must be on x's device"),
        (lambda: torch.ops.memopt.bias_act_bwd(torch.randn(3, 4, device="meta"), torch.randn(3, 4), None, "gelu", False),
         "grad_y must be on x's device"),
        (lambda: memopt.act_linear(torch.randn(3, 4), None, torch.randn(2, 4, device="meta")),
         "linear_weight must be on x's device"),
        (lambda: memopt.act_linear(torch.randn(3, 4), None, torch.randn(2, 3)), r"linear_weight must have shape \[out_features, 4\]"),
        (lambda: memopt.act_linear(torch.randn(3, 4), None, torch.randn(2, 4), torch.randn(3)),
         r"linear_bias must have shape \[2\]"),
        (lambda: memopt.swiglu(torch.randn(3, 5)), "last dimension must be even"),
        (lambda: torch.ops.memopt.swiglu_fwd(torch.randn(3, 5), None), "last dimension must be even"),
        (lambda: memopt.act_linear(torch.randn(3, 5), None, torch.randn(2, 2), activation="swiglu"),
         "last dimension must be even"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(4, 4).t(), None, "gelu"), "x must be contiguous"),
        (lambda: torch.ops.memopt.swiglu_fwd(torch.randn(4, 4).t(), None), "x must be contiguous"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(4, 8), torch.randn(16)[::2], "gelu"), "bias must be contiguous"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(4, dtype=torch.float16), None, "gelu"), "x is"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.ones(4, dtype=torch.int32), None, "gelu"), "x must be float32"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.randn(4), torch.randn(4, dtype=torch.float64), "gelu"),
         r"bias must have x's dtype \(Float\) or float32"),
        (lambda: torch.ops.memopt.bias_act_fwd_inplace(torch.randn(4, 4).t(), None, "gelu"), "x must be contiguous"),
        (lambda: torch.ops.memopt.bias_act_fwd_inplace(torch.randn(3, 4), torch.randn(4, dtype=torch.float64), "gelu"),
         r"bias must have x's dtype \(Float\) or float32, got Double"),
        (lambda: torch.ops.memopt.bias_act_fwd_inplace(torch.randn(3, 4), torch.randn(5), "gelu"),
         r"bias must have shape \[4\]"),
        (lambda: torch.ops.memopt.bias_act_fwd_inplace(torch.ones(4, dtype=torch.int32), None, "gelu"),
         "x must be float32"),
        (lambda: torch.ops.memopt.bias_act_fwd_inplace(torch.randn(3, 4), None, "tanh"), "activation must be one of"),
        (lambda: (lambda x: torch.ops.memopt.bias_act_fwd_inplace(x, x[0], "gelu"))(torch.randn(3, 4)),
         "x is overwritten with y, so it must not share memory with bias"),
        (lambda: torch.ops.memopt.bias_act_bwd(torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4), None, "gelu",
                                               False), "grad_y must have the dtype of x"),
        (lambda: torch.ops.memopt.bias_act_bwd(torch.randn(3, 5), torch.randn(3, 4), None, "gelu", False),
         "grad_y must have the forward output's shape"),
        (lambda: torch.ops.memopt.bias_act_bwd_inplace(torch.randn(3, 5), torch.randn(3, 4), None, "gelu", False),
         "grad_y must have the forward output's shape"),
        (lambda: (lambda x: torch.ops.memopt.bias_act_bwd_inplace(x, x, None, "gelu", False))(torch.randn(3, 4)),
         "grad_y is overwritten with grad_x, so it must not share memory with x"),
        (lambda: torch.ops.memopt.swiglu_bwd(torch.randn(3, 4), torch.randn(3, 4), None, False),
         r"grad_y must have the forward output's shape \[3, 2\]"),
        (lambda: torch.ops.memopt.bias_act_fwd(torch.tensor(1.0), None, "gelu"), "at least 1 dimension"),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    _raises(call, match)


@gpu
def test_mixed_devices_raise_at_op_level():
    x = torch.randn(3, 4, device="cuda")
    _raises(lambda: torch.ops.memopt.bias_act_fwd(x, torch.randn(4), "gelu"), "bias must be on x's device")
    _raises(lambda: torch.ops.memopt.swiglu_fwd(x, torch.randn(4)), "bias must be on x's device")
    _raises(lambda: torch.ops.memopt.bias_act_bwd(torch.randn(3, 4), x, None, "gelu", False), "grad_y must be on x's device")
    _raises(lambda: torch.ops.memopt.bias_act_fwd(x.double(), None, "gelu"), "float64 on CUDA")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bias_gradient_over_many_row_chunks_is_deterministic(dtype, activation):
    # 5000 rows span many row chunks of the CUDA bias-gradient kernel; no atomics: runs agree bitwise.
    x = torch.randn(5000, 1026, device="cuda", dtype=dtype)
    bias = torch.randn(1026, device="cuda", dtype=torch.float32)
    out_width = 513 if activation == "swiglu" else 1026
    grad = torch.randn(5000, out_width, device="cuda", dtype=dtype)
    if activation == "swiglu":
        run = lambda: torch.ops.memopt.swiglu_bwd(grad, x, bias, False)  # noqa: E731
        ref_fn = swiglu_ref
    else:
        run = lambda: torch.ops.memopt.bias_act_bwd(grad, x, bias, activation, False)  # noqa: E731
        ref_fn = lambda a, b: bias_act_ref(a, b, activation)  # noqa: E731
    grad_x, grad_bias, _ = run()
    grad_x_again, grad_bias_again, _ = run()
    assert torch.equal(grad_x, grad_x_again) and torch.equal(grad_bias, grad_bias_again)
    _, (ref_dx, ref_db) = _reference_grads(ref_fn, (x, bias), grad)
    torch.testing.assert_close(grad_x.double(), ref_dx, **tolerances(dtype))
    # The kernel sums unrounded float32 gradients over 5000 rows into a float32 bias gradient: the
    # float32 summation bound, relative to the largest column's sum of magnitudes.
    scale = ref_dx.abs().reshape(-1, ref_dx.shape[-1]).sum(0).max().item()
    torch.testing.assert_close(grad_bias.double(), ref_db, atol=1e-5 * scale, rtol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_cuda_packed_and_elementwise_kernels_agree(activation, with_bias, dtype):
    # Rows (swiglu: half rows) of a multiple of 16 bytes in 16-byte aligned tensors take the packed
    # kernels (one 16-byte access per thread and tensor); the same x one element into a buffer is
    # misaligned and takes the element-wise ones. y, grad_x and the rebuilt y are the same bits
    # both ways (in place too); the bias gradient, whose row chunks follow each grid, agrees to
    # float32 summation; both match float64. 3000 rows is more than one row chunk.
    rows, width = 3000, 2048 if activation == "swiglu" else 1024
    x = torch.randn(rows, width, device="cuda", dtype=dtype)
    buffer = torch.empty(rows * width + 1, device="cuda", dtype=dtype)
    x_shifted = buffer[1:].view(rows, width)
    x_shifted.copy_(x)
    assert x.data_ptr() % 16 == 0 and x_shifted.data_ptr() % 16 != 0
    bias = torch.randn(width, device="cuda", dtype=dtype) if with_bias else None
    out_width = width // 2 if activation == "swiglu" else width
    grad = torch.randn(rows, out_width, device="cuda", dtype=dtype)

    def run(x_in):
        if activation == "swiglu":
            y = torch.ops.memopt.swiglu_fwd(x_in, bias)
            return (y, *torch.ops.memopt.swiglu_bwd(grad, x_in, bias, True))
        y = torch.ops.memopt.bias_act_fwd(x_in, bias, activation)
        grad_x, grad_bias, rebuilt = torch.ops.memopt.bias_act_bwd(grad, x_in, bias, activation, True)
        # y written over a copy of x_in with x_in's alignment (the same kernel choice).
        buffer_in_place = torch.empty(x_in.numel() + 1, device="cuda", dtype=dtype)
        y_in_place = buffer_in_place[int(x_in.data_ptr() % 16 != 0):][: x_in.numel()].view_as(x_in).copy_(x_in)
        assert y_in_place.data_ptr() % 16 == x_in.data_ptr() % 16
        torch.ops.memopt.bias_act_fwd_inplace(y_in_place, bias, activation)
        assert torch.equal(y_in_place, y)
        in_place = grad.clone()
        grad_bias_in_place, _ = torch.ops.memopt.bias_act_bwd_inplace(in_place, x_in, bias, activation, False)
        assert torch.equal(in_place, grad_x)
        if with_bias:
            assert torch.equal(grad_bias_in_place, grad_bias)
        return y, grad_x, grad_bias, rebuilt

    y, grad_x, grad_bias, rebuilt = run(x)
    y_e, grad_x_e, grad_bias_e, rebuilt_e = run(x_shifted)
    assert torch.equal(y, y_e) and torch.equal(rebuilt, rebuilt_e) and torch.equal(grad_x, grad_x_e)
    assert torch.equal(rebuilt, y)
    if activation == "swiglu":
        ref_fn = swiglu_ref
    else:
        ref_fn = lambda a, b: bias_act_ref(a, b, activation)  # noqa: E731
    ref, (ref_dx, ref_db) = _reference_grads(ref_fn, (x, bias), grad)
    torch.testing.assert_close(y.double(), ref.detach(), **tolerances(dtype))
    torch.testing.assert_close(grad_x.double(), ref_dx, **tolerances(dtype))
    if with_bias:
        # float32 sums over 3000 rows: the summation bound, relative to a column's sum of magnitudes
        scale = ref_dx.abs().sum(0).max().item()
        for got in (grad_bias, grad_bias_e):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), ref_db, atol=1e-5 * scale + tolerances(dtype)["atol"],
                                       rtol=tolerances(dtype)["rtol"])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS + ("swiglu",))
def test_cuda_forward_with_a_misaligned_bias_equals_the_aligned_one(activation, dtype):
    # The packed forward kernels read a pack's bias columns as one pack (59de34d): a bias view one
    # element into its buffer is not aligned to it and takes the element-wise kernels, with the
    # same bits (x aligned either way).
    rows, width = 300, 2048 if activation == "swiglu" else 1024
    x = torch.randn(rows, width, device="cuda", dtype=dtype)
    bias = torch.randn(width, device="cuda", dtype=dtype)
    bias_shifted = torch.empty(width + 1, device="cuda", dtype=dtype)[1:].copy_(bias)
    assert bias.data_ptr() % 16 == 0 and bias_shifted.data_ptr() % 16 != 0

    def forward(b):
        if activation == "swiglu":
            return torch.ops.memopt.swiglu_fwd(x, b)
        y = torch.ops.memopt.bias_act_fwd(x, b, activation)
        in_place = x.clone()
        torch.ops.memopt.bias_act_fwd_inplace(in_place, b, activation)
        assert torch.equal(in_place, y)
        return y

    y = forward(bias)
    assert torch.equal(forward(bias_shifted), y)
    ref_fn = swiglu_ref if activation == "swiglu" else (lambda a, b: bias_act_ref(a, b, activation))
    ref = ref_fn(x.double(), bias.double())
    torch.testing.assert_close(y.double(), ref, **tolerances(dtype))


@gpu
def test_cuda_matches_cpu_float32():
    x = torch.randn(97, 66)
    bias = torch.randn(66)
    grad = torch.randn(97, 66)
    for activation in ACTIVATIONS:
        cpu = torch.ops.memopt.bias_act_bwd(grad, x, bias, activation, True)
        cuda = torch.ops.memopt.bias_act_bwd(grad.cuda(), x.cuda(), bias.cuda(), activation, True)
        for a, b in zip(cpu, cuda):
            torch.testing.assert_close(b.cpu(), a, **tolerances(torch.float32))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_act_linear_with_a_frozen_linear_weight(activation):
    """A frozen linear weight (a LoRA base, say) takes the backward that rebuilds no activation:
    x's and the bias's gradients are still the float64 reference's, and the weight gets none."""
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(64, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 32 if activation == "swiglu" else 64, dtype=torch.float64)
    linear_bias = torch.randn(24, dtype=torch.float64, requires_grad=True)
    out = memopt.act_linear(x, bias, weight, linear_bias, activation=activation)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    leaves = [t.detach().clone().requires_grad_() for t in (x, bias, linear_bias)]
    act_linear_ref(leaves[0], leaves[1], weight, leaves[2], activation=activation).backward(grad_out)
    assert weight.grad is None
    for got, want in zip((x, bias, linear_bias), leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
