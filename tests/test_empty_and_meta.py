"""Degenerate shapes and the meta device through the ops, against PyTorch's own ops.

Zero ``out_features`` and empty batches return empty results and the gradients PyTorch gives
(zeros where a parameter had no rows to learn from); a meta-device weight next to a CPU input is
refused by name, and all-meta inputs give meta outputs and gradients of the right shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.ops._rng import rng_key
from memopt.ops.dropout import dropout_add_ref

DT = torch.float64
N = 8

# name -> (memopt function, the same function in PyTorch ops), over (x, vector param, matrix param)
OPS = {
    "norm_linear": (
        lambda x, w, m: memopt.norm_linear(x, w, None, m),
        lambda x, w, m: F.linear(F.layer_norm(x, (N,), w, None, 1e-5), m),
    ),
    "norm_linear_rms_residual": (
        lambda x, w, m: torch.cat(memopt.norm_linear(x, w, None, m, norm="rmsnorm", eps=1e-6, residual=x.sin()), -1),
        lambda x, w, m: torch.cat([F.linear(F.rms_norm(x + x.sin(), (N,), w, 1e-6), m), x + x.sin()], -1),
    ),
    "act_linear_gelu": (
        lambda x, w, m: memopt.act_linear(x, w, m, activation="gelu"),
        lambda x, w, m: F.linear(F.gelu(x + w), m),
    ),
    "act_linear_swiglu": (
        lambda x, w, m: memopt.act_linear(x, w, m[:, : N // 2], activation="swiglu"),
        lambda x, w, m: F.linear(F.silu((x + w)[..., : N // 2]) * (x + w)[..., N // 2:], m[:, : N // 2]),
    ),
    "layer_norm": (
        lambda x, w, m: memopt.layer_norm(x, w, w),
        lambda x, w, m: F.layer_norm(x, (N,), w, w, 1e-5),
    ),
    "rms_norm": (
        lambda x, w, m: memopt.rms_norm(x, w),
        lambda x, w, m: F.rms_norm(x, (N,), w, 1e-6),
    ),
    "bias_act": (
        lambda x, w, m: memopt.bias_act(x, w, "silu"),
        lambda x, w, m: F.silu(x + w),
    ),
    "swiglu": (
        lambda x, w, m: memopt.swiglu(x, w),
        lambda x, w, m: F.silu((x + w)[..., : N // 2]) * (x + w)[..., N // 2:],
    ),
    "dropout_add": (
        lambda x, w, m: memopt.dropout_add(x, x * w, 0.5, rng_key=rng_key(5)),
        lambda x, w, m: dropout_add_ref(x, x * w, 0.5, rng_key(5)),
    ),
}
LINEAR_OPS = [name for name in OPS if "linear" in name]


def _run(fn, x_shape, out_features, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, dtype=DT, generator=gen).to(device).requires_grad_()
    w = torch.randn(N, dtype=DT, generator=gen).to(device).requires_grad_()
    m = torch.randn(out_features, N, dtype=DT, generator=gen).to(device).requires_grad_()
    out = fn(x, w, m)
    grad = torch.randn(out.shape, dtype=DT, generator=gen).to(device)
    out.backward(grad)
    return out, [t.grad for t in (x, w, m)]


def _assert_same(name, x_shape, out_features):
    fn, torch_fn = OPS[name]
    out, grads = _run(fn, x_shape, out_features)
    ref_out, ref_grads = _run(torch_fn, x_shape, out_features)
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None or not g.any()
            continue
        assert g is not None and g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", LINEAR_OPS)
@pytest.mark.parametrize("x_shape", [(3, N), (2, 3, N), (N,)])
def test_zero_out_features(name, x_shape):
    _assert_same(name, x_shape, 0)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("x_shape", [(0, N), (2, 0, N), (0, 3, N)])
def test_empty_batch(name, x_shape):
    _assert_same(name, x_shape, 5)


@pytest.mark.parametrize("name", LINEAR_OPS)
def test_zero_out_features_double_backward(name):
    fn, torch_fn = OPS[name]

    def second(f):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(3, N, dtype=DT, generator=gen).requires_grad_()
        w = torch.randn(N, dtype=DT, generator=gen).requires_grad_()
        m = torch.randn(0, N, dtype=DT).requires_grad_()
        out = f(x, w, m)
        (gx,) = torch.autograd.grad(out, x, torch.ones_like(out), create_graph=True)
        if not gx.requires_grad:  # no path from the second derivative back: it is zero
            return torch.zeros_like(w)
        (gw,) = torch.autograd.grad(gx.pow(2).sum(), w, allow_unused=True)
        return torch.zeros_like(w) if gw is None else gw

    torch.testing.assert_close(second(fn), second(torch_fn), rtol=1e-12, atol=1e-12)


def test_meta_weight_next_to_a_cpu_input_is_refused():
    x = torch.randn(3, N)
    with pytest.raises(ValueError, match="linear_weight must be on x's device"):
        memopt.norm_linear(x, None, None, torch.empty(4, N, device="meta"))
    with pytest.raises(ValueError, match="linear_weight must be on x's device"):
        memopt.act_linear(x, None, torch.empty(4, N, device="meta"))


@pytest.mark.parametrize("name", sorted(OPS))
def test_all_meta_inputs_give_meta_outputs_and_gradients(name):
    out, grads = _run(OPS[name][0], (3, N), 5, device="meta")
    ref_out, ref_grads = _run(OPS[name][1], (3, N), 5)
    assert out.device.type == "meta" and out.shape == ref_out.shape and out.dtype == ref_out.dtype
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            assert g.device.type == "meta" and g.shape == r.shape
