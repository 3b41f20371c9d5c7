"""layer_norm, rms_norm and norm_linear: kernels against float64 references, gradients three ways
(reference, gradcheck, opcheck), torch.compile, autocast, saved bytes and errors."""

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.ops.norm import (
    layer_norm_ref,
    rms_norm_ref,
)

from helpers import MemoptOpCalls, device_dtype_params, gpu, tolerances

# Rows 1, 97, 123 and widths 33, 97, 1025 (odd, not multiples of a warp), plus 3-D inputs.
SHAPES = [(1, 33), (97, 97), (123, 33), (3, 1025), (2, 5, 97), (4, 3, 33)]
AFFINE = ["none", "weight", "weight_bias"]
NORMS = ["layernorm", "rmsnorm"]


def make_inputs(shape, device, dtype, affine, with_residual, param_dtype=None, norm="layernorm"):
    n = shape[-1]
    param_dtype = param_dtype or dtype
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    residual = torch.randn(shape, device=device, dtype=dtype, requires_grad=True) if with_residual else None
    weight = bias = None
    if affine != "none":
        weight = (1 + 0.5 * torch.randn(n, device=device, dtype=param_dtype)).requires_grad_()
    if affine == "weight_bias" and norm == "layernorm":
        bias = (0.5 * torch.randn(n, device=device, dtype=param_dtype)).requires_grad_()
    return x, residual, weight, bias


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def grads_of(outputs, inputs, grad_outputs):
    """Gradients of sum(out * g) w.r.t. the inputs that are tensors (None stays None)."""
    present = [t for t in inputs if t is not None]
    grads = iter(torch.autograd.grad(outputs, present, grad_outputs))
    return [None if t is None else next(grads) for t in inputs]


def double_leaf(t):
    return None if t is None else t.detach().double().requires_grad_()


def rounded_residual(x, residual, x64, residual64):
    """residual64 shifted by a constant so that x64 + result equals x + residual rounded to x's
    dtype: the kernels normalise the rounded sum (the residual_out they return)."""
    if residual is None:
        return None
    rounding = ((x + residual).detach().double() - (x64 + residual64)).detach()
    return residual64 + rounding


def run_norm(norm, x, residual, weight, bias, eps):
    if norm == "layernorm":
        return as_tuple(memopt.layer_norm(x, weight, bias, eps=eps, residual=residual))
    return as_tuple(memopt.rms_norm(x, weight, eps=eps, residual=residual))


def run_norm_ref(norm, x, residual, weight, bias, eps):
    if norm == "layernorm":
        return as_tuple(layer_norm_ref(x, weight, bias, eps=eps, residual=residual, upcast=True))
    return as_tuple(rms_norm_ref(x, weight, eps=eps, residual=residual, upcast=True))


def check_against_reference(norm, x, residual, weight, bias, tol, eps=1e-5):
    outs = run_norm(norm, x, residual, weight, bias, eps)
    assert all(o.dtype == x.dtype and o.shape == x.shape and o.is_contiguous() for o in outs)
    leaves = [double_leaf(t) for t in (x, residual, weight, bias)]
    refs = run_norm_ref(norm, leaves[0], rounded_residual(x, residual, *leaves[:2]), *leaves[2:], eps)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.double(), ref, **tol)

    grad_outs = [torch.randn_like(o) for o in outs]
    inputs = (x, residual, weight, bias)
    got = grads_of(outs, inputs, grad_outs)
    expected = grads_of(refs, leaves, [g.double() for g in grad_outs])
    for name, g, e, t in zip(("x", "residual", "weight", "bias"), got, expected, inputs):
        if t is None:
            continue
        assert g.dtype == t.dtype, name
        torch.testing.assert_close(g.double(), e, **tol, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_matches_reference(norm, device, dtype, shape, affine, with_residual):
    inputs = make_inputs(shape, device, dtype, affine, with_residual, norm=norm)
    check_against_reference(norm, *inputs, tolerances(dtype))


# Mixed precision keeps float32 master parameters beside half activations; on CPU the same path
# is float64 activations with float32 parameters.
@pytest.mark.parametrize(
    "device,dtype",
    [
        pytest.param("cpu", torch.float64, id="cpu-float64"),
        pytest.param("cuda", torch.float16, id="cuda-float16", marks=gpu),
        pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=gpu),
    ],
)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_float32_params_with_other_activation_dtype(norm, device, dtype, with_residual):
    inputs = make_inputs((97, 123), device, dtype, "weight_bias", with_residual, torch.float32, norm=norm)
    # float64 x with float32 parameters: the parameters' own rounding is in both computations.
    tol = tolerances(torch.float32 if dtype == torch.float64 else dtype)
    check_against_reference(norm, *inputs, tol)


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_statistics_match_reference(norm, device, dtype, with_residual):
    x = torch.randn(123, 97, device=device, dtype=dtype)
    residual = torch.randn_like(x) if with_residual else None
    v = x.double() + (residual.double() if with_residual else 0)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if norm == "layernorm":
        _, residual_out, mean, rstd = torch.ops.memopt.layer_norm_fwd(x, residual, None, None, 1e-5)
        torch.testing.assert_close(mean.double(), v.mean(-1), **tolerances(dtype))
        expected_rstd = torch.rsqrt(v.var(-1, unbiased=False) + 1e-5)
        assert mean.dtype == stat_dtype
    else:
        _, residual_out, rstd = torch.ops.memopt.rms_norm_fwd(x, residual, None, 1e-5)
        expected_rstd = torch.rsqrt(v.pow(2).mean(-1) + 1e-5)
    assert rstd.dtype == stat_dtype and rstd.shape == (123,)
    torch.testing.assert_close(rstd.double(), expected_rstd, **tolerances(dtype))
    assert residual_out.numel() == (x.numel() if with_residual else 0)


@pytest.mark.parametrize("norm", NORMS)
def test_backward_rebuilds_y_exactly_as_forward(norm):
    x = torch.randn(97, 1025, dtype=torch.float32)
    weight, bias = torch.randn(1025), torch.randn(1025)
    grad_y = torch.randn_like(x)
    if norm == "layernorm":
        y, _, mean, rstd = torch.ops.memopt.layer_norm_fwd(x, None, weight, bias, 1e-5)
        *_, rebuilt = torch.ops.memopt.layer_norm_bwd(grad_y, x, weight, bias, mean, rstd, None, True)
    else:
        y, _, rstd = torch.ops.memopt.rms_norm_fwd(x, None, weight, 1e-5)
        *_, rebuilt = torch.ops.memopt.rms_norm_bwd(grad_y, x, weight, rstd, None, True)
    assert torch.equal(rebuilt, y)


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("n", [1025, 512])  # odd: the scalar CUDA kernel; 512: the vectorised one
def test_bwd_inplace_writes_grad_x_over_grad_y(device, dtype, norm, with_extra, n):
    """The *_bwd_inplace ops give the out-of-place backward's grad_x bit for bit, written over
    grad_y, and the same parameter gradients and rebuilt y; grad_x against float64 autograd."""
    x = torch.randn(97, n, device=device, dtype=dtype)
    weight = 1 + 0.5 * torch.randn(n, device=device, dtype=dtype)
    bias = 0.5 * torch.randn(n, device=device, dtype=dtype) if norm == "layernorm" else None
    grad_y = torch.randn_like(x)
    extra = torch.randn_like(x) if with_extra else None
    ops = torch.ops.memopt
    scratch = grad_y.clone()
    if norm == "layernorm":
        _, _, mean, rstd = ops.layer_norm_fwd(x, None, weight, bias, 1e-5)
        grad_x, grad_w, grad_b, y = ops.layer_norm_bwd(grad_y, x, weight, bias, mean, rstd, extra, True)
        grad_w2, grad_b2, y2 = ops.layer_norm_bwd_inplace(scratch, x, weight, bias, mean, rstd, extra, True)
        assert torch.equal(grad_b2, grad_b)
        ref_fn = lambda a: layer_norm_ref(a, weight.double(), bias.double(), eps=1e-5)  # noqa: E731
    else:
        _, _, rstd = ops.rms_norm_fwd(x, None, weight, 1e-5)
        grad_x, grad_w, y = ops.rms_norm_bwd(grad_y, x, weight, rstd, extra, True)
        grad_w2, y2 = ops.rms_norm_bwd_inplace(scratch, x, weight, rstd, extra, True)
        ref_fn = lambda a: rms_norm_ref(a, weight.double(), eps=1e-5)  # noqa: E731
    assert torch.equal(scratch, grad_x) and torch.equal(grad_w2, grad_w) and torch.equal(y2, y)
    x64 = x.detach().double().requires_grad_()
    ref_fn(x64).backward(grad_y.double())
    expected = x64.grad + (extra.double() if with_extra else 0)
    torch.testing.assert_close(scratch.double(), expected, **tolerances(dtype))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("extra_of", ["same", "shifted", "x"])
def test_bwd_inplace_refuses_memory_it_would_overwrite_before_reading(norm, extra_of):
    """grad_x is written over grad_y: a grad_x_extra in grad_y's memory (the same tensor, or a
    view one row on) or an x there would be read after part of it was overwritten."""
    buffer = torch.randn(9, 16)
    grad_y, x = buffer[:8], torch.randn(8, 16)
    extra = {"same": buffer[:8], "shifted": buffer[1:], "x": None}[extra_of]
    if extra_of == "x":
        x = buffer[1:]
    weight, bias = torch.ones(16), torch.zeros(16)
    ops = torch.ops.memopt
    if norm == "layernorm":
        _, _, mean, rstd = ops.layer_norm_fwd(x, None, weight, bias, 1e-5)
        call = lambda: ops.layer_norm_bwd_inplace(grad_y, x, weight, bias, mean, rstd, extra, False)  # noqa: E731
    else:
        _, _, rstd = ops.rms_norm_fwd(x, None, weight, 1e-5)
        call = lambda: ops.rms_norm_bwd_inplace(grad_y, x, weight, rstd, extra, False)  # noqa: E731
    what = "x" if extra_of == "x" else "grad_x_extra"
    with pytest.raises(RuntimeError, match=f"grad_y is overwritten with grad_x, so it must not share memory with {what}"):
        call()


@pytest.mark.parametrize("norm", NORMS)
def test_norm_linear_backward_allocates_one_buffer_of_x_size(norm):
    """norm_linear's backward allocates one buffer of x's size: the norm output is rebuilt in it,
    grad_y written over it once the weight gradient is taken, grad_x over grad_y. Eager norm +
    linear peaks at two (y and grad_y); so did rebuilding y in the norm's backward kernel."""
    from bench.memory import LiveTensorTracker

    x = torch.randn(256, 512, dtype=torch.float64, requires_grad=True)
    w = torch.randn(512, dtype=torch.float64, requires_grad=True)
    b = torch.randn(512, dtype=torch.float64, requires_grad=True) if norm == "layernorm" else None
    linear_w = torch.randn(8, 512, dtype=torch.float64, requires_grad=True)
    out = memopt.norm_linear(x, w, b, linear_w, norm=norm, eps=1e-5)
    grad_out = torch.randn_like(out)
    leaves = [t for t in (x, w, b, linear_w) if t is not None]
    with LiveTensorTracker(exclude=[*leaves, out, grad_out]) as tracker:
        out.backward(grad_out)
    x_bytes = x.numel() * x.element_size()
    assert x_bytes <= tracker.peak_bytes("cpu") < 2 * x_bytes
    ref = [t.detach().clone().requires_grad_() for t in leaves]
    if norm == "layernorm":
        normed = F.layer_norm(ref[0], (512,), ref[1], ref[2], eps=1e-5)
    else:
        normed = F.rms_norm(ref[0], (512,), ref[1], eps=1e-5)
    F.linear(normed, ref[-1]).backward(grad_out)
    for got, expected in zip(leaves, ref):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", NORMS)
def test_parameter_gradients_do_not_depend_on_thread_count(norm):
    x, residual, weight, bias = make_inputs((1000, 97), "cpu", torch.float32, "weight_bias", True, norm=norm)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            outs = run_norm(norm, x, residual, weight, bias, 1e-5)
            results.append(grads_of(outs, (x, residual, weight, bias), [torch.ones_like(o) for o in outs]))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)


FROZEN = [("weight",), ("bias",), ("weight", "bias")]


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("frozen", FROZEN, ids="+".join)
@pytest.mark.parametrize("n", [1025, 512])  # odd: the scalar CUDA kernel; 512: the vectorised one
def test_bwd_ops_skip_parameter_gradients_not_asked_for(device, dtype, norm, inplace, frozen, n):
    """return_grad_weight / return_grad_bias False (a frozen parameter, as ATen's output_mask):
    that gradient comes back empty, and grad_x, the other gradient and the rebuilt y are the full
    call's bit for bit (the full call's are checked against float64 elsewhere)."""
    if norm == "rmsnorm" and frozen == ("bias",):
        pytest.skip("RMSNorm has no bias")
    x = torch.randn(97, n, device=device, dtype=dtype)
    weight = 1 + 0.5 * torch.randn(n, device=device, dtype=dtype)
    bias = 0.5 * torch.randn(n, device=device, dtype=dtype) if norm == "layernorm" else None
    grad_y, extra = torch.randn_like(x), torch.randn_like(x)
    want_weight, want_bias = "weight" not in frozen, "bias" not in frozen
    ops = torch.ops.memopt
    if norm == "layernorm":
        _, _, mean, rstd = ops.layer_norm_fwd(x, None, weight, bias, 1e-5)
        args = (x, weight, bias, mean, rstd, extra, True)
        full = ops.layer_norm_bwd(grad_y, *args)
        if inplace:
            scratch = grad_y.clone()
            got = (scratch, *ops.layer_norm_bwd_inplace(scratch, *args, want_weight, want_bias))
        else:
            got = ops.layer_norm_bwd(grad_y, *args, want_weight, want_bias)
        wanted = (True, want_weight, want_bias, True)
    else:
        _, _, rstd = ops.rms_norm_fwd(x, None, weight, 1e-5)
        args = (x, weight, rstd, extra, True)
        full = ops.rms_norm_bwd(grad_y, *args)
        if inplace:
            scratch = grad_y.clone()
            got = (scratch, *ops.rms_norm_bwd_inplace(scratch, *args, want_weight))
        else:
            got = ops.rms_norm_bwd(grad_y, *args, want_weight)
        wanted = (True, want_weight, True)
    for name, g, f, want in zip(("grad_x", "grad_weight", "grad_bias", "y")[: len(wanted)], got, full, wanted):
        if want:
            assert torch.equal(g, f), name
        else:
            assert g.numel() == 0, f"{name} was not asked for, got shape {tuple(g.shape)}"


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("linear", [False, True], ids=["norm", "norm_linear"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("frozen", FROZEN, ids="+".join)
@pytest.mark.parametrize("norm", NORMS)
def test_frozen_norm_parameters_get_no_gradient_and_none_is_computed(device, dtype, norm, frozen, with_residual,
                                                                     linear):
    """A norm weight or bias that does not require grad (PEFT, LoRA) gets none, its gradient is
    not asked of the kernel (ATen's layer-norm backward skips it too), and every other gradient
    matches the float64 reference; norm_linear's frozen linear bias is not summed either."""
    if norm == "rmsnorm" and frozen == ("bias",):
        pytest.skip("RMSNorm has no bias")
    shape = (2, 7, 97)
    x, residual, weight, bias = make_inputs(shape, device, dtype, "weight_bias", with_residual, norm=norm)
    for param in (weight if "weight" in frozen else None, bias if "bias" in frozen else None):
        if param is not None:
            param.requires_grad_(False)
    inputs = [x, residual, weight, bias]
    if linear:
        linear_weight = (torch.randn(45, 97, device=device, dtype=dtype) / 97**0.5).requires_grad_()
        linear_bias = torch.randn(45, device=device, dtype=dtype)  # frozen
        outs = as_tuple(memopt.norm_linear(x, weight, bias, linear_weight, linear_bias, norm=norm, residual=residual))
        inputs += [linear_weight, linear_bias]
    else:
        outs = run_norm(norm, x, residual, weight, bias, 1e-5)
    leaves = [double_leaf(t) for t in inputs]
    refs = run_norm_ref(norm, leaves[0], rounded_residual(x, residual, *leaves[:2]), *leaves[2:4], 1e-5)
    if linear:
        refs = (F.linear(refs[0], *leaves[4:]), *refs[1:])
    grad_outs = [torch.randn_like(o) for o in outs]
    with MemoptOpCalls("norm_bwd") as calls:
        torch.autograd.backward(outs, grad_outs)
    torch.autograd.backward(refs, [g.double() for g in grad_outs])
    has_bias = norm == "layernorm"
    asked = [(c["return_grad_weight"], c.get("return_grad_bias", False)) for c in calls.calls]
    assert asked == [("weight" not in frozen, has_bias and "bias" not in frozen)]
    # The matmul reduces over n: its error grows like sqrt(n) times the elementwise one.
    tol = {k: v * (4 if linear else 1) for k, v in tolerances(dtype).items()}
    names = ("x", "residual", "weight", "bias", "linear_weight", "linear_bias")
    for name, t, ref in zip(names, inputs, leaves):
        if t is None:
            continue
        if not t.requires_grad:
            assert t.grad is None, name
            continue
        torch.testing.assert_close(t.grad.double(), ref.grad, **tol, msg=lambda m: f"grad of {name}: {m}")


def norm_linear_ref(norm, x, residual, norm_weight, norm_bias, linear_weight, linear_bias, eps):
    normed = run_norm_ref(norm, x, residual, norm_weight, norm_bias, eps)
    out = F.linear(normed[0], linear_weight, linear_bias)
    return (out,) + normed[1:]


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("shape", [(1, 33), (123, 97), (2, 5, 33)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("with_linear_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_linear_matches_reference(norm, device, dtype, shape, with_residual, with_linear_bias):
    x, residual, norm_weight, norm_bias = make_inputs(shape, device, dtype, "weight_bias", with_residual, norm=norm)
    out_features = 45
    linear_weight = (torch.randn(out_features, shape[-1], device=device, dtype=dtype) / shape[-1] ** 0.5)
    linear_weight.requires_grad_()
    linear_bias = torch.randn(out_features, device=device, dtype=dtype, requires_grad=True) if with_linear_bias else None
    eps = 1e-5
    outs = as_tuple(
        memopt.norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, norm=norm, eps=eps, residual=residual)
    )
    inputs = (x, residual, norm_weight, norm_bias, linear_weight, linear_bias)
    leaves = [double_leaf(t) for t in inputs]
    refs = norm_linear_ref(norm, leaves[0], rounded_residual(x, residual, *leaves[:2]), *leaves[2:], eps)
    # The matmul reduces over n: its error grows like sqrt(n) times the elementwise one.
    tol = {k: v * 4 for k, v in tolerances(dtype).items()}
    assert outs[0].shape == (*shape[:-1], out_features) and outs[0].dtype == dtype
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.double(), ref, **tol)
    grad_outs = [torch.randn_like(o) for o in outs]
    got = grads_of(outs, inputs, grad_outs)
    expected = grads_of(refs, leaves, [g.double() for g in grad_outs])
    names = ("x", "residual", "norm_weight", "norm_bias", "linear_weight", "linear_bias")
    if dtype in (torch.float16, torch.bfloat16):
        # Half precision: flash-attention's rule. The weight gradient reduces over all rows, so
        # a fixed tolerance is either loose or flaky; instead the kernel's error against float64
        # may be at most twice the error of plain PyTorch run in the same dtype.
        low = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
        eager = eager_norm_linear(norm, *low, eps)
        eager_grads = grads_of(eager, low, grad_outs)
        for name, g, ge, e, t in zip(names, got, eager_grads, expected, inputs):
            if t is None:
                continue
            assert g.dtype == t.dtype, name
            err, eager_err = (g.double() - e).abs().max().item(), (ge.double() - e).abs().max().item()
            assert err <= 2 * eager_err + tol["atol"] / 4, f"grad of {name}: error {err:.3g}, eager {eager_err:.3g}"
        return
    for name, g, e, t in zip(names, got, expected, inputs):
        if t is None:
            continue
        assert g.dtype == t.dtype, name
        torch.testing.assert_close(g.double(), e, **tol, msg=lambda m: f"grad of {name}: {m}")


def eager_norm_linear(norm, x, residual, norm_weight, norm_bias, linear_weight, linear_bias, eps):
    """What a user writes in plain PyTorch, in the inputs' own dtype."""
    h = x if residual is None else x + residual
    if norm == "layernorm":
        normed = F.layer_norm(h, (h.shape[-1],), norm_weight, norm_bias, eps)
    else:
        normed = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps).to(h.dtype)
        normed = normed if norm_weight is None else normed * norm_weight
    out = F.linear(normed, linear_weight, linear_bias)
    return (out,) if residual is None else (out, h)


@pytest.mark.parametrize(
    "device,dtype",
    [
        pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
        pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=gpu),
        pytest.param("cuda", torch.float16, id="cuda-float16", marks=gpu),
    ],
)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_linear_under_autocast_matches_norm_then_linear(norm, device, dtype, with_residual):
    """float32 inputs and parameters under autocast: the linear runs in the autocast dtype."""
    x, residual, norm_weight, norm_bias = make_inputs((2, 37, 97), device, torch.float32, "weight_bias",
                                                      with_residual, norm=norm)
    linear_weight = (torch.randn(64, 97, device=device) / 10).requires_grad_()
    linear_bias = torch.randn(64, device=device, requires_grad=True)
    inputs = (x, residual, norm_weight, norm_bias, linear_weight, linear_bias)

    with torch.autocast(device, dtype=dtype):
        fused = as_tuple(memopt.norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, norm=norm,
                                            residual=residual))
        normed = run_norm(norm, x, residual, norm_weight, norm_bias, 1e-5)
        eager = (F.linear(normed[0], linear_weight, linear_bias),) + normed[1:]
    assert fused[0].dtype == eager[0].dtype == dtype
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, **tolerances(dtype))
    grad_outs = [torch.randn_like(o) for o in fused]
    got = grads_of(fused, inputs, grad_outs)
    expected = grads_of(eager, inputs, grad_outs)
    for g, e, t in zip(got, expected, inputs):
        if t is not None:
            assert g.dtype == e.dtype == torch.float32
            # Both run the same bf16/fp16 matmuls on the same operands.
            torch.testing.assert_close(g, e, **tolerances(dtype))


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gradcheck_layer_norm(with_residual):
    # memopt.layer_norm's C++ autograd node (csrc/norm_autograd.cpp): first and second derivatives.
    x, residual, weight, bias = (double_leaf(t) for t in make_inputs((5, 7), "cpu", torch.float64,
                                                                       "weight_bias", with_residual))
    fn = lambda x, r, w, b: memopt.layer_norm(x, w, b, eps=1e-5, residual=r)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, residual, weight, bias))
    assert torch.autograd.gradgradcheck(fn, (x, residual, weight, bias))


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gradcheck_rms_norm(with_residual):
    x, residual, weight, _ = (double_leaf(t) for t in make_inputs((5, 7), "cpu", torch.float64, "weight",
                                                                   with_residual, norm="rmsnorm"))
    fn = lambda x, r, w: memopt.rms_norm(x, w, eps=1e-6, residual=r)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, residual, weight))
    assert torch.autograd.gradgradcheck(fn, (x, residual, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_opcheck_differentiable_norm_ops(with_residual, dtype):
    x, residual, weight, bias = make_inputs((6, 16), "cpu", dtype, "weight_bias", with_residual)
    x, weight, bias = (t.requires_grad_() for t in (x, weight, bias))
    torch.library.opcheck(torch.ops.memopt.layer_norm.default, (x, residual, weight, bias, 1e-5))
    torch.library.opcheck(torch.ops.memopt.rms_norm.default, (x, residual, weight, 1e-6))


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_gradcheck_norm_linear_op(norm, with_residual):
    x, residual, norm_weight, norm_bias = (
        double_leaf(t) for t in make_inputs((2, 3, 7), "cpu", torch.float64, "weight_bias", with_residual, norm=norm)
    )
    linear_weight = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    linear_bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    is_rms = norm == "rmsnorm"
    assert torch.autograd.gradcheck(
        lambda *a: torch.ops.memopt.norm_linear(*a, is_rms, 1e-5)[0 if a[1] is None else slice(None)],
        (x, residual, norm_weight, norm_bias, linear_weight, linear_bias),
    )


def strided_leaf(t):
    """t's values as a non-contiguous leaf (a transposed view of a transposed copy)."""
    if t is None:
        return None
    view = t.detach().transpose(0, -1).contiguous().transpose(0, -1)
    assert not view.is_contiguous()
    return view.requires_grad_()


def registered_op(norm, linear):
    """The registered differentiable op itself (not memopt's Python wrapper, which copies first) and
    a function that gives its arguments from (x, residual, weight, bias[, linear_weight, linear_bias])."""
    is_rms = norm == "rmsnorm"
    if linear:
        return torch.ops.memopt.norm_linear.default, lambda x, r, w, b, lw, lb: (x, r, w, b, lw, lb, is_rms, 1e-5)
    if is_rms:
        return torch.ops.memopt.rms_norm.default, lambda x, r, w, b: (x, r, w, 1e-5)
    return torch.ops.memopt.layer_norm.default, lambda x, r, w, b: (x, r, w, b, 1e-5)


@pytest.mark.parametrize("linear", [False, True], ids=["norm", "norm_linear"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_registered_ops_take_strided_input(norm, with_residual, linear):
    # As F.layer_norm does, the ops take x and residual of any strides: they copy such input in a
    # recorded op (raising and retrying from Python cost ~80 us a call at 256 x 512), so gradients
    # reach the strided leaves, first and second order.
    x, residual, weight, bias = make_inputs((6, 2, 33), "cpu", torch.float64, "weight_bias", with_residual, norm=norm)
    bias = bias if norm == "layernorm" else None
    args = [strided_leaf(x), strided_leaf(residual), double_leaf(weight), double_leaf(bias)]
    if linear:
        args += [torch.randn(5, 33, dtype=torch.float64, requires_grad=True),
                 torch.randn(5, dtype=torch.float64, requires_grad=True)]
    op, op_args = registered_op(norm, linear)
    outs = op(*op_args(*args))
    outs = outs[:1] if residual is None else outs
    # The reference on contiguous copies, in float64.
    leaves = [double_leaf(t) for t in args]
    h = leaves[0] if residual is None else leaves[0] + leaves[1]
    if norm == "layernorm":
        normed = F.layer_norm(h, (33,), leaves[2], leaves[3], 1e-5)
    else:
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * leaves[2]
    refs = (F.linear(normed, leaves[4], leaves[5]) if linear else normed,) + (() if residual is None else (h,))
    for out, ref in zip(outs, refs):
        assert out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad_outs = [torch.randn_like(o) for o in outs]
    got = grads_of(outs, args, grad_outs)
    expected = grads_of(refs, leaves, grad_outs)
    for g, e, t in zip(got, expected, args):
        if t is not None:
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
    with torch.inference_mode():  # below autograd: the CompositeExplicitAutograd kernel
        detached = [None if t is None else t.detach() for t in args]
        torch.testing.assert_close(op(*op_args(*detached))[0], refs[0], rtol=1e-12, atol=1e-12)
    present = [i for i, t in enumerate(args) if t is not None]

    def first_output(*tensors):
        full = list(args)
        for i, t in zip(present, tensors):
            full[i] = t
        return op(*op_args(*full))[0]

    assert torch.autograd.gradgradcheck(first_output, [args[i] for i in present])
    torch.library.opcheck(op, op_args(*args))


@pytest.mark.parametrize("with_linear_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_opcheck_norm_linear_op(norm, with_residual, with_linear_bias):
    x, residual, norm_weight, norm_bias = make_inputs((2, 3, 16), "cpu", torch.float32, "weight_bias", with_residual,
                                                      norm=norm)
    linear_weight = torch.randn(8, 16, requires_grad=True)
    linear_bias = torch.randn(8, requires_grad=True) if with_linear_bias else None
    torch.library.opcheck(
        torch.ops.memopt.norm_linear.default,
        (x, residual, norm_weight, norm_bias, linear_weight, linear_bias, norm == "rmsnorm", 1e-5),
    )


@pytest.mark.parametrize("optional", [False, True], ids=["required_only", "with_optional"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(optional, dtype):
    x = torch.randn(2, 3, 33, dtype=dtype)
    residual = torch.randn_like(x) if optional else None
    weight = torch.randn(33, dtype=dtype) if optional else None
    bias = torch.randn(33, dtype=dtype) if optional else None
    grad_x_extra = torch.randn_like(x) if optional else None
    ops = torch.ops.memopt
    torch.library.opcheck(ops.layer_norm_fwd.default, (x, residual, weight, bias, 1e-5))
    torch.library.opcheck(ops.rms_norm_fwd.default, (x, residual, weight, 1e-5))
    _, _, mean, rstd = ops.layer_norm_fwd(x, None, weight, bias, 1e-5)
    grad_y = torch.randn_like(x)
    torch.library.opcheck(ops.layer_norm_bwd.default, (grad_y, x, weight, bias, mean, rstd, grad_x_extra, optional))
    _, _, rstd = ops.rms_norm_fwd(x, None, weight, 1e-5)
    torch.library.opcheck(ops.rms_norm_bwd.default, (grad_y, x, weight, rstd, grad_x_extra, optional))
    torch.library.opcheck(
        ops.layer_norm_bwd_inplace.default, (grad_y.clone(), x, weight, bias, mean, rstd, grad_x_extra, optional)
    )
    torch.library.opcheck(ops.rms_norm_bwd_inplace.default, (grad_y.clone(), x, weight, rstd, grad_x_extra, optional))
    if optional:  # the parameter gradients not asked for: empty outputs, in the fakes too
        torch.library.opcheck(ops.layer_norm_bwd.default, (grad_y, x, weight, bias, mean, rstd, None, False, False, True))
        torch.library.opcheck(ops.rms_norm_bwd.default, (grad_y, x, weight, rstd, None, False, False))
        torch.library.opcheck(
            ops.layer_norm_bwd_inplace.default, (grad_y.clone(), x, weight, bias, mean, rstd, None, True, True, False)
        )
        torch.library.opcheck(ops.rms_norm_bwd_inplace.default, (grad_y.clone(), x, weight, rstd, None, True, False))


def test_opcheck_float32_params_with_float64_x():
    x = torch.randn(4, 33, dtype=torch.float64)
    weight, bias = torch.randn(33), torch.randn(33)
    torch.library.opcheck(torch.ops.memopt.layer_norm_fwd.default, (x, None, weight, bias, 1e-5))
    _, _, mean, rstd = torch.ops.memopt.layer_norm_fwd(x, None, weight, bias, 1e-5)
    torch.library.opcheck(
        torch.ops.memopt.layer_norm_bwd.default, (torch.randn_like(x), x, weight, bias, mean, rstd, None, True)
    )


@pytest.mark.parametrize("norm", NORMS)
def test_compile_fullgraph(norm, compile_cache):
    x, residual, weight, bias = make_inputs((8, 33), "cpu", torch.float32, "weight_bias", True, norm=norm)
    linear_weight = torch.randn(16, 33, requires_grad=True)

    def block(x, residual):
        normed, residual_out = run_norm(norm, x, residual, weight, bias, 1e-5)
        out, _ = memopt.norm_linear(residual_out, weight, bias, linear_weight, norm=norm, residual=normed)
        return out

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x, residual)
    torch.testing.assert_close(out, block(x, residual))
    params = (x, residual, weight, linear_weight) + ((bias,) if bias is not None else ())
    got = torch.autograd.grad(out.sum(), params)
    expected = torch.autograd.grad(block(x, residual).sum(), params)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("norm", NORMS)
def test_compile_fullgraph_norm_linear_under_autocast(norm, compile_cache):
    x, _, norm_weight, norm_bias = make_inputs((2, 8, 33), "cpu", torch.float32, "weight_bias", False, norm=norm)
    linear_weight = torch.randn(16, 33, requires_grad=True)
    params = [t for t in (x, norm_weight, norm_bias, linear_weight) if t is not None]

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return memopt.norm_linear(x, norm_weight, norm_bias, linear_weight, norm=norm)

    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    expected = fn(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.float().sum(), params)
    wanted = torch.autograd.grad(expected.float().sum(), params)
    for g, e in zip(got, wanted):
        torch.testing.assert_close(g, e, **tolerances(torch.bfloat16))


def stats_bytes(rows, norm):
    per_stat = rows * 4  # float32 per row
    return 2 * per_stat if norm == "layernorm" else per_stat


def eager_norm(norm, x, weight, bias):
    if norm == "layernorm":
        return F.layer_norm(x, x.shape[-1:], weight, bias, 1e-5)
    return rms_norm_ref(x, weight, 1e-5)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_saves_no_more_than_eager(norm, with_residual):
    rows, n = 64, 256
    x, residual, weight, bias = make_inputs((rows, n), "cpu", torch.float32, "weight_bias", with_residual, norm=norm)
    x_bytes = rows * n * 4

    def ours(x, residual):
        return run_norm(norm, x, residual, weight, bias, 1e-5)

    def eager(x, residual):
        summed = x if residual is None else x + residual
        return eager_norm(norm, summed, weight, bias), summed

    ours_bytes = memopt.saved_bytes(ours, x, residual, exclude=[weight, bias])
    eager_bytes = memopt.saved_bytes(eager, x, residual, exclude=[weight, bias])
    # The statistics, plus residual_out (what was normalised) when a residual was added.
    assert ours_bytes == stats_bytes(rows, norm) + (x_bytes if with_residual else 0)
    assert ours_bytes <= eager_bytes


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_linear_saves_exactly_the_norm_output_less(norm, with_residual):
    batch, seq, n, out_features = 2, 32, 256, 512
    x, residual, norm_weight, norm_bias = make_inputs((batch, seq, n), "cpu", torch.float32, "weight_bias",
                                                      with_residual, norm=norm)
    linear_weight = torch.randn(out_features, n, requires_grad=True)
    linear_bias = torch.randn(out_features, requires_grad=True)
    params = [p for p in (norm_weight, norm_bias, linear_weight, linear_bias) if p is not None]
    rows, y_bytes = batch * seq, batch * seq * n * 4

    def fused(x, residual):
        return memopt.norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, norm=norm, residual=residual)

    def eager(x, residual):
        normed = run_norm(norm, x, residual, norm_weight, norm_bias, 1e-5)
        return F.linear(normed[0], linear_weight, linear_bias)

    fused_bytes = memopt.saved_bytes(fused, x, residual, exclude=params)
    eager_bytes = memopt.saved_bytes(eager, x, residual, exclude=params)
    expected_fused = stats_bytes(rows, norm) + (y_bytes if with_residual else 0)
    assert fused_bytes == expected_fused
    assert eager_bytes - fused_bytes == y_bytes


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: memopt.layer_norm(t(4, 8, dtype=torch.float16)), "x is torch.float16 on CPU|x is Half"),
        (lambda: memopt.layer_norm(torch.ones(4, 8, dtype=torch.int64)), "x must be float32"),
        (lambda: memopt.layer_norm(t(4, 8), t(7)), r"weight must have shape \[8\]"),
        (lambda: memopt.rms_norm(t(4, 8), t(8, 1)), r"weight must have shape \[8\]"),
        (lambda: memopt.layer_norm(t(4, 8), t(8), t(9)), r"bias must have shape \[8\]"),
        (lambda: memopt.layer_norm(t(4, 8), t(8), residual=t(4, 9)), "residual must have the shape of x"),
        (lambda: memopt.rms_norm(t(4, 8), residual=t(8)), "residual must have the shape of x"),
        (lambda: memopt.layer_norm(t(4, 8), t(8, dtype=torch.float64)), "weight must have x's dtype"),
        (lambda: memopt.layer_norm(t(4, 8), t(8), t(8, dtype=torch.float64)), "bias must have x's dtype"),
        (lambda: memopt.rms_norm(t(4, 8), residual=t(4, 8, dtype=torch.float64)), "residual must have the dtype"),
        (lambda: memopt.layer_norm(t(4, 8), t(8).to("meta")), "weight must be on x's device"),
        (lambda: memopt.layer_norm(t(4, 8), eps=-1.0), "eps must be"),
        (lambda: memopt.layer_norm(t(4, 0)), "non-empty last dimension"),
        (lambda: torch.ops.memopt.layer_norm_fwd(t(8, 4).t(), None, None, None, 1e-5), "x must be contiguous"),
        (lambda: torch.ops.memopt.rms_norm_fwd(t(8, 4).t(), None, None, 1e-5), "x must be contiguous"),
        (lambda: torch.ops.memopt.rms_norm_bwd(t(4, 8), t(4, 8), None, t(5), None, False), "rstd must have shape"),
        (
            lambda: torch.ops.memopt.layer_norm_bwd(t(4, 8), t(4, 8), None, None, t(4, dtype=torch.float64), t(4),
                                                    None, False),
            "mean must be",
        ),
        (lambda: torch.ops.memopt.rms_norm_bwd(t(4, 9), t(4, 8), None, t(4), None, False), "grad_y must have the shape"),
        (
            lambda: torch.ops.memopt.rms_norm_bwd(t(4, 8), t(4, 8), None, t(4), t(8, 4).t(), False),
            "grad_x_extra must be contiguous",
        ),
        (lambda: memopt.norm_linear(t(4, 8), None, None, t(6, 9)), r"linear_weight must have shape \[out_features, 8\]"),
        (lambda: memopt.norm_linear(t(4, 8), None, None, t(6, 8), t(5)), r"linear_bias must have shape \[6\]"),
        (lambda: memopt.norm_linear(t(4, 8), t(8), t(8), t(6, 8), norm="rmsnorm"), "norm_bias must be None"),
        (lambda: memopt.norm_linear(t(4, 8), None, None, t(6, 8), norm="batchnorm"), "norm must be one of"),
        # The public op's name and argument names, not those of the norm op it runs.
        (lambda: memopt.norm_linear(t(4, 8), t(8, dtype=torch.float64), None, t(6, 8)),
         r"memopt\.norm_linear: norm_weight must have x's dtype"),
        (lambda: memopt.norm_linear(t(4, 8), None, t(8, dtype=torch.float64), t(6, 8)),
         r"memopt\.norm_linear: norm_bias must have x's dtype"),
        (lambda: memopt.norm_linear(t(4, 8), t(8, dtype=torch.float64), t(8), t(6, 8)),
         r"memopt\.norm_linear: norm_weight must have x's dtype"),
        (lambda: memopt.norm_linear(t(4, 8), None, None, t(6, 8), residual=t(4, 8, dtype=torch.float64)),
         r"memopt\.norm_linear: residual must have the dtype of x"),
        (lambda: memopt.norm_linear(t(4, 8, dtype=torch.bfloat16), None, None, t(6, 8, dtype=torch.bfloat16)),
         r"memopt\.norm_linear: x is torch\.bfloat16 on CPU"),
        (lambda: memopt.layer_norm(t(4, 8, dtype=torch.float64), t(8, dtype=torch.float64), t(8)),
         r"memopt\.layer_norm: bias must have x's dtype|bias must have the dtype of weight"),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        call()


@gpu
def test_mixed_devices_raise_at_the_op_level():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="weight must be on x's device"):
        torch.ops.memopt.layer_norm_fwd(x, None, torch.randn(8), None, 1e-5)
    with pytest.raises(RuntimeError, match="residual must be on x's device"):
        torch.ops.memopt.rms_norm_fwd(x, torch.randn(4, 8), None, 1e-5)
    with pytest.raises(ValueError, match="weight must be on x's device"):
        memopt.rms_norm(x, torch.randn(8))


@gpu
@pytest.mark.parametrize("n", [1, 97, 1025, 4099, 16384, 20000])
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_wide_and_odd_rows(norm, n):
    inputs = make_inputs((67, n), "cuda", torch.float32, "weight_bias", True, norm=norm)
    # Sums over up to 20000 elements: allow float32 reduction-order error.
    check_against_reference(norm, *inputs, {"atol": 1e-4, "rtol": 1e-4})


@gpu
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_matches_cpu_kernel(norm):
    inputs = make_inputs((123, 1025), "cpu", torch.float32, "weight_bias", True, norm=norm)
    cpu_outs = run_norm(norm, *inputs, 1e-5)
    cuda_inputs = [None if t is None else t.detach().cuda() for t in inputs]
    cuda_outs = run_norm(norm, *cuda_inputs, 1e-5)
    for a, b in zip(cpu_outs, cuda_outs):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)


@gpu
def test_cuda_runs_on_the_current_stream_and_device():
    x, residual, weight, bias = make_inputs((97, 1025), "cuda", torch.bfloat16, "weight_bias", True)
    expected = memopt.layer_norm(x, weight, bias, residual=residual)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = memopt.layer_norm(x, weight, bias, residual=residual)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


# A GPU run once died in the host process (SIGSEGV) inside layer_norm_bwd when handed the
# stride-0 gradient that `y.sum().backward()` produces; the CPU kernels raise the contiguity error.
# The call runs in a child process so that a crash fails this test instead of the whole session.
_STRIDE0_GRAD_SCRIPT = """
import torch, memopt
x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
b = torch.zeros(128, device="cuda", dtype=torch.bfloat16)
y, _, mean, rstd = torch.ops.memopt.layer_norm_fwd(x, None, w, b, 1e-5)
grad = torch.ones((), device="cuda", dtype=torch.bfloat16).expand_as(y)
try:
    torch.ops.memopt.layer_norm_bwd(grad, x, w, b, mean, rstd, None, True)
except RuntimeError as err:
    print("raised:", err)
"""


@gpu
def test_cuda_norm_bwd_rejects_stride0_gradient_without_crashing():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _STRIDE0_GRAD_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child process died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert "grad_y must be contiguous" in proc.stdout, proc.stdout + proc.stderr[-2000:]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [512, 4096, 16384])
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_vectorized_and_elementwise_kernels_agree(norm, dtype, n):
    # Rows of a multiple of 16 bytes with 16-byte aligned pointers take the vectorized kernels (the
    # row in registers, parameter gradients summed per thread); the same x one element into a
    # buffer is misaligned and takes the element-wise kernels, forward and backward. Both must match
    # the float64 reference and each other; 2000 rows is more than the grid holds, so CTAs sum
    # several rows.
    rows = 2000
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    aligned = make_inputs((rows, n), "cuda", dtype, "weight_bias", True, param_dtype=torch.float32, norm=norm)
    check_against_reference(norm, *aligned, tol)
    x, _, weight, bias = (None if t is None else t.detach() for t in aligned)
    buffer = torch.empty(rows * n + 1, device="cuda", dtype=dtype)
    x_shifted = buffer[1:].view(rows, n)
    x_shifted.copy_(x)
    assert x.data_ptr() % 16 == 0 and x_shifted.data_ptr() % 16 != 0
    grad_y = torch.randn_like(x)

    def run(x_in):
        leaves = [x_in.requires_grad_(), weight.clone().requires_grad_(), None if bias is None else bias.clone().requires_grad_()]
        (y,) = run_norm(norm, leaves[0], None, leaves[1], leaves[2], 1e-5)
        return [y] + [g for g in grads_of([y], leaves, [grad_y]) if g is not None]

    for a, b in zip(run(x.clone()), run(x_shifted)):
        torch.testing.assert_close(b, a, **tol)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_linear_with_a_frozen_linear_weight(norm, with_residual):
    """A frozen linear weight takes the backward that rebuilds no norm output: the other
    gradients are still the float64 reference's, and the weight gets none."""
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(3, 16, 64, dtype=torch.float64, requires_grad=True) if with_residual else None
    norm_weight = torch.randn(64, dtype=torch.float64, requires_grad=True)
    norm_bias = torch.randn(64, dtype=torch.float64, requires_grad=True) if norm == "layernorm" else None
    linear_weight = torch.randn(24, 64, dtype=torch.float64)
    leaves = [t for t in (x, residual, norm_weight, norm_bias) if t is not None]
    outs = as_tuple(
        memopt.norm_linear(x, norm_weight, norm_bias, linear_weight, norm=norm, eps=1e-5, residual=residual)
    )
    grads_out = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads_out)
    ref = {id(t): t.detach().clone().requires_grad_() for t in leaves}
    r = lambda t: None if t is None else ref[id(t)]  # noqa: E731
    want = as_tuple(norm_linear_ref(norm, r(x), r(residual), r(norm_weight), r(norm_bias), linear_weight, None, 1e-5))
    torch.autograd.backward(want, grads_out)
    assert linear_weight.grad is None
    for t in leaves:
        torch.testing.assert_close(t.grad, ref[id(t)].grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "norm_linear"])
def test_compile_with_dynamic_shapes_and_the_default_eps(name):
    # With dynamic=True dynamo traces the default eps as a symbolic float; the eps check used
    # math.isfinite, which it cannot trace.
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, dtype=torch.float64, requires_grad=True)
    linear = torch.randn(3, 7, dtype=torch.float64)
    calls = {
        "layer_norm": (lambda x, w: memopt.layer_norm(x, w), lambda x, w: layer_norm_ref(x, w, None, 1e-5)),
        "rms_norm": (lambda x, w: memopt.rms_norm(x, w), lambda x, w: rms_norm_ref(x, w, 1e-6)),
        "norm_linear": (
            lambda x, w: memopt.norm_linear(x, w, None, linear),
            lambda x, w: F.linear(layer_norm_ref(x, w, None, 1e-5), linear),
        ),
    }
    fn, ref_fn = calls[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    out = compiled(x, weight)
    grads = torch.autograd.grad(out.sum(), (x, weight))
    ref = ref_fn(x, weight)
    ref_grads = torch.autograd.grad(ref.sum(), (x, weight))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


def _param_views(kind, n):
    """(base leaf, its view) for a weight or bias of n elements: "expanded" (stride 0, one
    element broadcast, as tying the scale of every channel does), "strided" (every other element
    of a 2n vector), "contiguous"."""
    if kind == "expanded":
        base = (1 + 0.5 * torch.randn(1, dtype=torch.float64)).requires_grad_()
        return base, base.expand(n)
    if kind == "strided":
        base = (1 + 0.5 * torch.randn(2 * n, dtype=torch.float64)).requires_grad_()
        return base, base[::2]
    base = (1 + 0.5 * torch.randn(n, dtype=torch.float64)).requires_grad_()
    return base, base


# (op, weight, bias): RMSNorm has no bias, so its cases vary the weight alone.
_NON_CONTIGUOUS_PARAMS = [
    (op, weight_kind, bias_kind)
    for op in ("layer_norm", "rms_norm", "norm_linear_layernorm", "norm_linear_rmsnorm")
    for weight_kind, bias_kind in (("expanded", "contiguous"), ("contiguous", "expanded"), ("strided", "strided"),
                                   ("expanded", "strided"))
    if not (op.endswith(("rms_norm", "rmsnorm")) and weight_kind == "contiguous")
]


@pytest.mark.parametrize("op,weight_kind,bias_kind", _NON_CONTIGUOUS_PARAMS)
def test_non_contiguous_weight_and_bias(op, weight_kind, bias_kind):
    # F.layer_norm / F.rms_norm take an expanded or strided weight and bias; the ops did not (a C++
    # "weight must be contiguous" error, naming memopt.layer_norm for norm_linear). They copy them
    # in a recorded op, so the gradients reach the base tensors of the views.
    torch.manual_seed(0)
    n = 33
    rms = op.endswith(("rms_norm", "rmsnorm"))
    x = torch.randn(6, n, dtype=torch.float64, requires_grad=True)
    weight_base, weight = _param_views(weight_kind, n)
    bias_base, bias = (None, None) if rms else _param_views(bias_kind, n)
    linear_weight = torch.randn(5, n, dtype=torch.float64, requires_grad=True)
    if op == "layer_norm":
        out = memopt.layer_norm(x, weight, bias)
        ref = F.layer_norm(x, (n,), weight, bias)
    elif op == "rms_norm":
        out = memopt.rms_norm(x, weight)
        ref = F.rms_norm(x, (n,), weight, 1e-6)
    else:
        out = memopt.norm_linear(x, weight, bias, linear_weight, norm="rmsnorm" if rms else "layernorm")
        normed = F.rms_norm(x, (n,), weight, 1e-5) if rms else F.layer_norm(x, (n,), weight, bias)
        ref = F.linear(normed, linear_weight)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    leaves = [t for t in (x, weight_base, bias_base, linear_weight) if t is not None]
    if not op.startswith("norm_linear"):
        leaves.pop()
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    expected = torch.autograd.grad(ref, leaves, grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
    with torch.inference_mode():  # below autograd: the CompositeExplicitAutograd kernels
        if op == "layer_norm":
            below = memopt.layer_norm(x.detach(), weight.detach(), bias.detach())
        elif op == "rms_norm":
            below = memopt.rms_norm(x.detach(), weight.detach())
        else:
            below = memopt.norm_linear(x.detach(), weight.detach(), None if bias is None else bias.detach(),
                                       linear_weight.detach(), norm="rmsnorm" if rms else "layernorm")
    torch.testing.assert_close(below, ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", [(300, 7), (65536, 16), (262144, 8)], ids=lambda s: "x".join(map(str, s)))
def test_float32_parameter_gradients_over_many_rows_within_twice_eager(norm, shape):
    # A row block summed its rows' parameter gradients into one float32 running sum: rms_norm's
    # weight gradient was 5.5x F.rms_norm's error at 300 x 7, 7.7x at 65536 x 16, 12x at 1M x 8.
    torch.manual_seed(0)
    rows, n = shape
    x, w, b, g = torch.randn(rows, n), torch.randn(n), torch.randn(n), torch.randn(rows, n)
    rms = norm == "rmsnorm"

    def grads(fn, dtype):
        params = [w.to(dtype).requires_grad_()] + ([] if rms else [b.to(dtype).requires_grad_()])
        out = fn(x.to(dtype), *params)
        return torch.autograd.grad(out, params, g.to(dtype))

    if rms:
        ours, eager = (lambda t, w_: memopt.rms_norm(t, w_, 1e-5)), (lambda t, w_: F.rms_norm(t, (n,), w_, 1e-5))
    else:
        ours = lambda t, w_, b_: memopt.layer_norm(t, w_, b_, 1e-5)  # noqa: E731
        eager = lambda t, w_, b_: F.layer_norm(t, (n,), w_, b_, 1e-5)  # noqa: E731
    truth = grads(eager, torch.float64)
    for name, got, ref, exact in zip(["weight", "bias"], grads(ours, torch.float32), grads(eager, torch.float32), truth):
        err = (got.double() - exact).abs().max().item()
        eager_err = (ref.double() - exact).abs().max().item()
        assert err <= 2 * eager_err, (name, err, eager_err)
