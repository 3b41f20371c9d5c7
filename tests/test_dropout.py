"""dropout_add: kernels against the Philox reference, replay, statistics, saved bytes, errors."""

import pytest
import torch

import memopt
from memopt.ops._philox import dropout_keep_mask, philox4x32_10
from memopt.ops._rng import rng_key
from memopt.ops.dropout import DropoutAddFunction, dropout_add_ref

from helpers import device_dtype_params, tolerances

SHAPES = [(1,), (3, 5), (97, 33), (4, 123, 7), (1025,)]


def test_philox_reference_known_answer():
    # Random123's published known-answer vector for philox4x32-10, counter 0, key 0.
    words = philox4x32_10(torch.tensor([0]), 0)[0].tolist()
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_forward_backward_match_reference(device, dtype, shape, with_residual, p):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    residual = torch.randn(shape, device=device, dtype=dtype, requires_grad=True) if with_residual else None
    key = rng_key(1234, 8)
    out = memopt.dropout_add(x, residual, p, rng_key=key)
    ref = dropout_add_ref(x.detach(), None if residual is None else residual.detach(), p, key, upcast=True)
    torch.testing.assert_close(out.double(), ref, **tolerances(dtype))

    grad = torch.randn_like(out)
    out.backward(grad)
    keep = dropout_keep_mask(shape, p, 1234, 8).to(device)
    expected_dx = torch.where(keep, grad.double() / (1 - p), torch.zeros_like(grad.double()))
    torch.testing.assert_close(x.grad.double(), expected_dx, **tolerances(dtype))
    if with_residual:
        torch.testing.assert_close(residual.grad, grad)


@pytest.mark.parametrize("device,dtype", device_dtype_params())
def test_same_key_same_mask_and_seed_controls_it(device, dtype):
    x = torch.randn(64, 257, device=device, dtype=dtype)
    key = rng_key(42)
    a = memopt.dropout_add(x, None, 0.3, rng_key=key)
    b = memopt.dropout_add(x, None, 0.3, rng_key=key)
    assert torch.equal(a, b)
    torch.manual_seed(7)
    c = memopt.dropout_add(x, None, 0.3)
    torch.manual_seed(7)
    d = memopt.dropout_add(x, None, 0.3)
    e = memopt.dropout_add(x, None, 0.3)
    assert torch.equal(c, d)
    assert not torch.equal(d, e)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scaling(p):
    n = 1 << 18
    out = memopt.dropout_add(torch.ones(n, dtype=torch.float64), None, p, rng_key=rng_key(3))
    kept = out != 0
    rate = kept.double().mean().item()
    # Binomial standard deviation is sqrt(p (1 - p) / n) < 1e-3; allow 5 sigma.
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))


def test_mask_is_independent_of_size_prefix():
    # A counter-based mask: element i's bit depends only on (seed, offset, i), not on numel.
    key = rng_key(99)
    long = memopt.dropout_add(torch.ones(1000, dtype=torch.float64), None, 0.5, rng_key=key)
    short = memopt.dropout_add(torch.ones(37, dtype=torch.float64), None, 0.5, rng_key=key)
    assert torch.equal(long[:37], short)


def test_eval_and_p_zero_are_identity():
    x, r = torch.randn(5, 6), torch.randn(5, 6)
    torch.testing.assert_close(memopt.dropout_add(x, r, 0.5, training=False), x + r)
    torch.testing.assert_close(memopt.dropout_add(x, r, 0.0), x + r)


def test_saves_no_mask():
    x = torch.randn(256, 1024, dtype=torch.float32, requires_grad=True)
    residual = torch.randn(256, 1024, requires_grad=True)
    # Only the key (2 x int64) is kept, whatever the size of x.
    assert memopt.saved_bytes(memopt.dropout_add, x, residual, 0.1) == 16
    assert memopt.saved_bytes(lambda a, b: torch.nn.functional.dropout(a, 0.1) + b, x, residual) >= x.numel()


def test_gradcheck_float64():
    x = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    r = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    key = rng_key(5)
    assert torch.autograd.gradcheck(lambda a, b: DropoutAddFunction.apply(a, b, 0.25, key), (x, r))


@pytest.mark.parametrize("with_residual", [False, True])
def test_opcheck(with_residual):
    x = torch.randn(4, 33, dtype=torch.float64)
    r = torch.randn(4, 33, dtype=torch.float64) if with_residual else None
    torch.library.opcheck(torch.ops.memopt.dropout_add_fwd.default, (x, r, 0.2, rng_key(1)))
    torch.library.opcheck(torch.ops.memopt.dropout_add_bwd.default, (x, 0.2, rng_key(1)))


def test_compile_fullgraph(compile_cache):
    x = torch.randn(8, 16, requires_grad=True)
    r = torch.randn(8, 16, requires_grad=True)
    key = rng_key(11)
    fn = torch.compile(lambda a, b: memopt.dropout_add(a, b, 0.5, rng_key=key), backend="aot_eager", fullgraph=True)
    out = fn(x, r)
    torch.testing.assert_close(out, memopt.dropout_add(x, r, 0.5, rng_key=key))
    out.sum().backward()
    assert x.grad is not None and r.grad is not None


def test_compile_fullgraph_with_x_as_its_own_residual(compile_cache):
    # dropout_add(x, x): one tensor in two inputs of the Function, which dynamo refused to trace
    # (a graph break; fullgraph=True raised).
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    key = rng_key(12)
    fn = torch.compile(lambda a: memopt.dropout_add(a, a, 0.3, rng_key=key), backend="aot_eager", fullgraph=True)
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    reference = x.detach().clone().requires_grad_()
    expected = dropout_add_ref(reference, reference, 0.3, key)
    (expected_grad,) = torch.autograd.grad(expected, reference, torch.ones_like(expected))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: memopt.dropout_add(torch.randn(3), None, 1.0), "p must be"),
        (lambda: memopt.dropout_add(torch.randn(3), None, -0.1), "p must be"),
        (lambda: memopt.dropout_add(torch.randn(3), torch.randn(4), 0.1), "residual must have the shape"),
        (lambda: torch.ops.memopt.dropout_add_fwd(torch.randn(4, 4).t(), None, 0.1, rng_key(0)), "x must be contiguous"),
        (lambda: torch.ops.memopt.dropout_add_fwd(torch.randn(4), None, 0.1, torch.zeros(3, dtype=torch.long)), "rng_key"),
        (lambda: torch.ops.memopt.dropout_add_fwd(torch.randn(4, dtype=torch.float16), None, 0.1, rng_key(0)), "x is"),
        (
            lambda: torch.ops.memopt.dropout_add_fwd(torch.randn(4), torch.randn(4, dtype=torch.float64), 0.1, rng_key(0)),
            "residual must have the dtype",
        ),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        call()


# Keys that are not an int64 CPU tensor of shape [2] (memopt.attention's rule). A meta key beside CPU
# data sent the ops to their fake impls, which returned uninitialised memory as the result.
BAD_KEYS = {
    "meta": torch.tensor([1, 2], device="meta"),
    "int32": torch.tensor([1, 2], dtype=torch.int32),
    "float": torch.tensor([1.0, 2.0]),
    "3 elements": torch.tensor([1, 2, 3]),
    "shape [1, 2]": torch.tensor([[1, 2]]),
}


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
@pytest.mark.parametrize("training", [True, False])
def test_bad_rng_key_is_refused_by_name(key, training):
    with pytest.raises(ValueError, match=r"memopt\.dropout_add: rng_key must be an int64 CPU tensor \(seed, offset\) of shape \[2\]"):
        memopt.dropout_add(torch.ones(4096), None, 0.5, training=training, rng_key=key)


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_registered_ops_refuse_a_meta_key_beside_cpu_data(op):
    # The fake impls are also the ops' Meta kernels, where a meta key dispatches them.
    x, key = torch.ones(64), torch.tensor([1, 2], device="meta")
    call = (lambda: torch.ops.memopt.dropout_add_fwd(x, None, 0.5, key)) if op == "fwd" else (
        lambda: torch.ops.memopt.dropout_add_bwd(x, 0.5, key))
    with pytest.raises(ValueError, match=r"memopt\.dropout_add: rng_key must be an int64 CPU tensor"):
        call()


def test_key_is_drawn_on_the_host_under_a_meta_device_context():
    # new_rng_key inside `with torch.device("meta")` made a meta key, which the check refuses.
    with torch.device("meta"):
        out = memopt.dropout_add(torch.ones(8, 4), torch.ones(8, 4), 0.5)
    assert out.device.type == "meta" and out.shape == (8, 4)


@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("with_residual", [False, True])
def test_nan_and_inf_give_nan_at_dropped_positions_like_torch(device, dtype, with_residual):
    # torch's dropout is a product, x * mask / (1 - p): NaN * 0 and inf * 0 are NaN, so a NaN or
    # inf that is dropped comes out NaN; one that is kept comes out scaled (inf stays inf).
    shape, p, seed = (6, 41), 0.5, 2024
    key = rng_key(seed)
    keep = dropout_keep_mask(shape, p, seed, 0).to(device)
    x = torch.randn(shape, device=device, dtype=dtype)
    x[0], x[1], x[2, ::3] = float("nan"), float("inf"), float("-inf")
    residual = torch.randn(shape, device=device, dtype=dtype) if with_residual else None
    grad = torch.randn(shape, device=device, dtype=dtype)
    grad[3] = float("nan")
    factor = keep.double() / (1 - p)
    expected = x.double() * factor + (0 if residual is None else residual.double())

    xg = x.clone().requires_grad_()
    out = memopt.dropout_add(xg, residual, p, rng_key=key)
    out.backward(grad)
    assert (~keep[:3]).any() and keep[:3].any()
    torch.testing.assert_close(out.double(), expected, equal_nan=True, **tolerances(dtype))
    assert torch.isnan(out[:2][~keep[:2]]).all()
    assert torch.isinf(out[1][keep[1]]).all()
    torch.testing.assert_close(xg.grad.double(), grad.double() * factor, equal_nan=True, **tolerances(dtype))
    assert torch.isnan(xg.grad[3]).all()


def test_vector_blocks_and_tail_match_the_reference_mask():
    # The CPU kernel regenerates 8 Philox calls (32 elements) at a time and the last partial block
    # one call at a time; every element's keep bit must be philox.h's, whatever the offset.
    for numel, offset in ((32 * 37 + 13, 0), (32 * 5, 3), (31, 2**32 - 5)):
        key = torch.tensor([987654321987, offset], dtype=torch.int64)
        out = memopt.dropout_add(torch.ones(numel, dtype=torch.float64), None, 0.3, rng_key=key)
        keep = dropout_keep_mask((numel,), 0.3, 987654321987, offset)
        assert torch.equal(out != 0, keep)
