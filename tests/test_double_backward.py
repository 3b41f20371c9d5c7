"""Second-order gradients through the ops: ``create_graph=True`` then a second backward.

Three checks per op: ``torch.autograd.gradgradcheck`` in float64 (finite differences of the first
derivative), Hessian-vector products against the same function built from PyTorch's own ops
(``F.layer_norm``, ``F.rms_norm``, ``F.gelu``, ...), and the first derivative taken with
``create_graph=True`` equal to the one the kernels give in an ordinary backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.ops._philox import dropout_keep_mask
from memopt.ops._rng import rng_key

DT = torch.float64

_TORCH_ACT = {
    "relu": F.relu,
    "gelu": lambda h: F.gelu(h, approximate="none"),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "swiglu": lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1],
}


def _t(*shape, dtype=DT):
    return torch.randn(*shape, dtype=dtype)


def _dropout_torch(x, residual, p, key):
    keep = dropout_keep_mask(x.shape, p, *(int(v) for v in key.tolist()))
    out = x * keep.to(x.dtype) / (1.0 - p)
    return out if residual is None else out + residual


# name -> (memopt function, the same function in PyTorch's own ops, inputs builder)
def _cases():
    key = rng_key(1234)
    n, m = 8, 5
    cases = {
        "layer_norm": (
            lambda x, w, b: memopt.layer_norm(x, w, b),
            lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5),
            lambda: [_t(3, n), _t(n), _t(n)],
        ),
        "layer_norm_no_params": (
            lambda x: memopt.layer_norm(x),
            lambda x: F.layer_norm(x, (n,), eps=1e-5),
            lambda: [_t(2, 3, n)],
        ),
        "layer_norm_residual": (
            lambda x, w, b, r: torch.cat(memopt.layer_norm(x, w, b, residual=r), -1),
            lambda x, w, b, r: torch.cat([F.layer_norm(x + r, (n,), w, b, 1e-5), x + r], -1),
            lambda: [_t(3, n), _t(n), _t(n), _t(3, n)],
        ),
        "rms_norm": (
            lambda x, w: memopt.rms_norm(x, w),
            lambda x, w: F.rms_norm(x, (n,), w, 1e-6),
            lambda: [_t(3, n), _t(n)],
        ),
        "rms_norm_residual": (
            lambda x, w, r: torch.cat(memopt.rms_norm(x, w, residual=r), -1),
            lambda x, w, r: torch.cat([F.rms_norm(x + r, (n,), w, 1e-6), x + r], -1),
            lambda: [_t(3, n), _t(n), _t(3, n)],
        ),
        "norm_linear_layernorm": (
            lambda x, nw, nb, w, b: memopt.norm_linear(x, nw, nb, w, b),
            lambda x, nw, nb, w, b: F.linear(F.layer_norm(x, (n,), nw, nb, 1e-5), w, b),
            lambda: [_t(3, n), _t(n), _t(n), _t(m, n), _t(m)],
        ),
        "norm_linear_rmsnorm_residual": (
            lambda x, nw, w, r: torch.cat(memopt.norm_linear(x, nw, None, w, norm="rmsnorm", eps=1e-6, residual=r), -1),
            lambda x, nw, w, r: torch.cat([F.linear(F.rms_norm(x + r, (n,), nw, 1e-6), w), x + r], -1),
            lambda: [_t(3, n), _t(n), _t(m, n), _t(3, n)],
        ),
        "swiglu": (
            lambda x, b: memopt.swiglu(x, b),
            lambda x, b: _TORCH_ACT["swiglu"](x + b),
            lambda: [_t(3, n), _t(n)],
        ),
        "dropout_add": (
            lambda x, r: memopt.dropout_add(x, r, 0.3, rng_key=key),
            lambda x, r: _dropout_torch(x, r, 0.3, key),
            lambda: [_t(4, n), _t(4, n)],
        ),
        "dropout_add_no_residual": (
            lambda x: memopt.dropout_add(x, None, 0.5, rng_key=key),
            lambda x: _dropout_torch(x, None, 0.5, key),
            lambda: [_t(5, n)],
        ),
    }
    for act in memopt.ops.activation.ACTIVATIONS:
        cases[f"bias_act_{act}"] = (
            lambda x, b, act=act: memopt.bias_act(x, b, act),
            lambda x, b, act=act: _TORCH_ACT[act](x + b),
            lambda: [_t(3, n), _t(n)],
        )
    for act in memopt.ops.activation.ACT_LINEAR_ACTIVATIONS:
        k = n // 2 if act == "swiglu" else n
        cases[f"act_linear_{act}"] = (
            lambda x, b, w, lb, act=act: memopt.act_linear(x, b, w, lb, activation=act),
            lambda x, b, w, lb, act=act: F.linear(_TORCH_ACT[act](x + b), w, lb),
            lambda k=k: [_t(3, n), _t(n), _t(m, k), _t(m)],
        )
    return cases


CASES = _cases()


def _inputs(name):
    torch.manual_seed(0)
    return [t.requires_grad_() for t in CASES[name][2]()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradgradcheck(name):
    fn = CASES[name][0]
    assert torch.autograd.gradgradcheck(fn, _inputs(name), atol=1e-6, rtol=1e-5)


def _hessian_vector(fn, inputs, seed):
    """d/d(inputs) <v_in, d<v_out, fn(inputs)>/d(inputs)>: one Hessian-vector product of the
    scalar <v_out, fn>, plus its derivative with respect to the first-order output weights."""
    gen = torch.Generator().manual_seed(seed)
    out = fn(*inputs)
    v_out = torch.randn(out.shape, dtype=out.dtype, generator=gen).requires_grad_()
    grads = torch.autograd.grad(out, inputs, v_out, create_graph=True)
    v_in = [torch.randn(g.shape, dtype=g.dtype, generator=gen) for g in grads]
    inner = sum((g * v).sum() for g, v in zip(grads, v_in))
    return [g.detach() for g in grads], torch.autograd.grad(inner, [*inputs, v_out], allow_unused=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_second_derivatives_match_torch_ops(name):
    fn, torch_fn, _ = CASES[name]
    first, second = _hessian_vector(fn, _inputs(name), seed=7)
    ref_first, ref_second = _hessian_vector(torch_fn, _inputs(name), seed=7)
    for g, r in zip(first, ref_first):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    nonzero = False
    for g, r in zip(second, ref_second):
        if r is None:
            assert g is None or g.abs().max() == 0
            continue
        assert g is not None, f"{name}: a second derivative is missing (torch gives {r.abs().max():.3g})"
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
        nonzero |= bool(r.abs().max() > 0)
    assert nonzero  # the comparison saw real second derivatives, not zeros on both sides


@pytest.mark.parametrize("name", sorted(CASES))
def test_create_graph_first_derivative_equals_kernel_backward(name):
    fn = CASES[name][0]
    inputs = _inputs(name)
    out = fn(*inputs)
    v = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    kernel = torch.autograd.grad(out, inputs, v, retain_graph=True)
    graph = torch.autograd.grad(out, inputs, v, create_graph=True)
    for a, b in zip(kernel, graph):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)


def test_dropout_double_backward_replays_the_mask():
    key, p = rng_key(99), 0.4
    x = _t(6, 16).requires_grad_()
    out = memopt.dropout_add(x, None, p, rng_key=key)
    v = _t(6, 16).requires_grad_()
    (grad_x,) = torch.autograd.grad(out, x, v, create_graph=True)
    w = _t(6, 16)
    (grad_v,) = torch.autograd.grad(grad_x, v, w)
    keep = dropout_keep_mask(x.shape, p, 99, 0)
    torch.testing.assert_close(grad_v, torch.where(keep, w / (1 - p), torch.zeros_like(w)), rtol=0, atol=0)


def test_gradient_penalty_float32_matches_torch():
    """A gradient penalty ||d loss / d x||^2 through norm_linear and act_linear in float32, its
    parameter gradients against the same model in PyTorch ops (float64 reference)."""
    torch.manual_seed(0)
    n, h = 16, 32
    params = [torch.randn(n), torch.randn(n), torch.randn(h, n) / 4, torch.randn(h), torch.randn(n, h) / 4]

    def penalty(fn_norm_linear, fn_act_linear, dtype):
        ps = [p.to(dtype).requires_grad_() for p in params]
        x = torch.randn(4, 7, n, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        y = fn_act_linear(fn_norm_linear(x, ps[0], ps[1], ps[2], ps[3]), ps[4])
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), ps)

    ours = penalty(lambda x, nw, nb, w, b: memopt.norm_linear(x, nw, nb, w, b),
                   lambda x, w: memopt.act_linear(x, None, w, activation="gelu"), torch.float32)
    ref = penalty(lambda x, nw, nb, w, b: F.linear(F.layer_norm(x, (n,), nw, nb, 1e-5), w, b),
                  lambda x, w: F.linear(F.gelu(x), w), torch.float64)
    for a, r in zip(ours, ref):
        assert r.abs().max() > 0
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-4 * r.abs().max().item())


def test_double_backward_under_autocast_matches_eager():
    """bf16 autocast on CPU: the double backward repeats the forward's casts, as eager does."""
    torch.manual_seed(0)
    n, m = 16, 8
    x0, nw0, w0, w20 = torch.randn(5, n), torch.randn(n), torch.randn(m, n), torch.randn(n, m)

    def run(norm_linear, act_linear):
        x, nw, w, w2 = (t.clone().requires_grad_() for t in (x0, nw0, w0, w20))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = act_linear(norm_linear(x, nw, w).float(), w2)  # the CPU kernels take float32
            (gx,) = torch.autograd.grad(out.float().pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), (nw, w, w2))

    ours = run(lambda x, nw, w: memopt.norm_linear(x, nw, None, w, norm="rmsnorm", eps=1e-6),
               lambda h, w2: memopt.act_linear(h, None, w2, activation="silu"))
    eager = run(lambda x, nw, w: F.linear(F.rms_norm(x, (n,), nw, 1e-6), w),
                lambda h, w2: F.linear(F.silu(h), w2))
    for a, e in zip(ours, eager):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=5e-2, atol=5e-2 * e.abs().max().item())


# -- the fused block and the tiled FFN: a backward under create_graph=True runs them again as
# differentiable ops (the same dropout masks) and differentiates that.


def _block(policy, dropout=0.0, **kwargs):
    torch.manual_seed(0)
    return memopt.FusedCheckpointBlock(32, 2, 64, causal=True, policy=policy, dropout=dropout, dtype=DT, **kwargs)


BLOCK_VARIANTS = {
    "none": ("none", {}),
    "selective": ("selective", {}),
    "full": ("full", {}),
    "post-norm-selective": ("selective", {"norm_first": False}),
    "post-norm-full": ("full", {"norm_first": False}),
    "tiled-ffn": ("selective", {"ffn_chunk_tokens": 3}),
    "rmsnorm-swiglu-gqa": ("none", {"norm": "rmsnorm", "activation": "swiglu", "n_kv_heads": 1}),
}


@pytest.mark.parametrize("variant", list(BLOCK_VARIANTS))
def test_block_second_derivatives_match_its_eager_twin(variant):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    policy, kwargs = BLOCK_VARIANTS[variant]
    block = _block(policy, **kwargs)
    eager = block.to_eager()
    x = _t(2, 4, 32).requires_grad_()

    def hessian_vector(module):
        (grad,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
        return grad, torch.autograd.grad(grad.square().sum(), (x, *module.parameters()))

    grad, second = hessian_vector(block)
    with sdpa_kernel(SDPBackend.MATH):  # the one SDPA backend with a double backward on CPU
        grad_eager, second_eager = hessian_vector(eager)
    torch.testing.assert_close(grad, grad_eager, atol=1e-12, rtol=1e-10)
    assert max(s.abs().max() for s in second_eager) > 0
    for got, want in zip(second, second_eager):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-9)
    # The first derivative taken with create_graph=True is the one the kernels give.
    (plain,) = torch.autograd.grad(block(x).square().sum(), x)
    torch.testing.assert_close(grad, plain, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_block_gradgradcheck_with_dropout(policy):
    # Dropout 0.2 on the attention probabilities and both residual branches: the same seed before
    # each call makes the block one deterministic function (its masks come from the RNG key drawn
    # in the forward), whose second derivative the differentiable replay must give exactly.
    block = _block(policy, dropout=0.2)

    def fn(x):
        torch.manual_seed(7)
        return block(x)

    x = _t(1, 3, 32).requires_grad_()
    assert torch.autograd.gradgradcheck(fn, (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_tiled_ffn_second_derivatives_match_the_untiled_mlp():
    from memopt.tiled_ffn import tiled_ffn

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()
    x = _t(2, 5, 8).requires_grad_()
    params = list(mlp.parameters())

    def hessian_vector(fn):
        (grad,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
        return grad, torch.autograd.grad(grad.square().sum(), (x, *params))

    grad, second = hessian_vector(lambda t: tiled_ffn(mlp, t, 3, params))
    grad_ref, second_ref = hessian_vector(mlp)
    torch.testing.assert_close(grad, grad_ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(second, second_ref):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
