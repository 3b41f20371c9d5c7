"""Batched gradients through memopt: ``torch.autograd.grad(..., is_grads_batched=True)`` and
``torch.autograd.functional.jacobian(..., vectorize=True)`` run every backward on a batched
gradient (legacy vmap). Each case is checked against the same Jacobian built row by row from
ordinary backwards, and against plain PyTorch's Jacobian where there is a plain reference, in
float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt

DTYPE = torch.float64
_KEY = memopt.ops._rng.new_rng_key(torch.Generator().manual_seed(7))


def _batched_and_looped(fn, inputs):
    """(batched, row-by-row) vector-Jacobian products of ``fn(*inputs)`` for every basis vector of
    its output: each a tuple with one (outputs.numel(), *input.shape) tensor per input."""
    out = fn(*inputs)
    basis = torch.eye(out.numel(), dtype=out.dtype).view(-1, *out.shape)
    batched = torch.autograd.grad(out, inputs, basis, is_grads_batched=True)
    rows = [torch.autograd.grad(fn(*inputs), inputs, v) for v in basis]
    looped = tuple(torch.stack([row[i] for row in rows]) for i in range(len(inputs)))
    return batched, looped


def _assert_all_close(got, want, atol=1e-12, rtol=1e-10):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def _leaf(*shape, seed):
    return torch.randn(*shape, dtype=DTYPE, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("norm_first", [True, False])
def test_block_batched_grads_equal_row_by_row(policy, dropout, norm_first):
    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(8, 2, 16, policy=policy, dropout=dropout, norm_first=norm_first).to(DTYPE)
    x = _leaf(1, 3, 8, seed=1)
    params = tuple(block.parameters())

    def fn(x, *params):
        torch.manual_seed(5)  # the same dropout masks in every call
        return block(x)

    batched, looped = _batched_and_looped(fn, (x, *params))
    _assert_all_close(batched, looped)
    if dropout == 0.0:  # the eager block is the independent reference
        eager = block.to_eager()
        reference = torch.autograd.functional.jacobian(eager, x)  # (1, 3, 8, 1, 3, 8)
        torch.testing.assert_close(batched[0].reshape(24, 24), reference.reshape(24, 24), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_sequence_tiled_block_batched_grads_equal_row_by_row(policy):
    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(8, 2, 16, policy=policy, dropout=0.2, ffn_chunk_tokens=2).to(DTYPE)
    x = _leaf(1, 3, 8, seed=1)

    def fn(x, *params):
        torch.manual_seed(5)
        return block(x)

    batched, looped = _batched_and_looped(fn, (x, *block.parameters()))
    _assert_all_close(batched, looped)


def test_jacobian_vectorize_of_a_wrapped_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True).to(DTYPE)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = _leaf(1, 3, 8, seed=2)
    want = torch.autograd.functional.jacobian(model, x)
    memopt.wrap(model, policy="none")
    got = torch.autograd.functional.jacobian(model, x, vectorize=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def _ops_cases():
    w8 = lambda s: _leaf(8, seed=s)  # noqa: E731
    return {
        "layer_norm": (lambda x, w, b: memopt.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (8,), w, b),
                       lambda: (_leaf(3, 8, seed=1), w8(2), w8(3))),
        "rms_norm": (lambda x, w: memopt.rms_norm(x, w), lambda x, w: F.rms_norm(x, (8,), w, 1e-6),
                     lambda: (_leaf(3, 8, seed=1), w8(2))),
        "bias_act": (lambda x, b: memopt.bias_act(x, b, "gelu"), lambda x, b: F.gelu(x + b),
                     lambda: (_leaf(3, 8, seed=1), w8(2))),
        "swiglu": (lambda x, b: memopt.swiglu(x, b), lambda x, b: F.silu((x + b)[:, :4]) * (x + b)[:, 4:],
                   lambda: (_leaf(3, 8, seed=1), w8(2))),
        "act_linear": (lambda x, b, w: memopt.act_linear(x, b, w), lambda x, b, w: F.linear(F.gelu(x + b), w),
                       lambda: (_leaf(3, 8, seed=1), w8(2), _leaf(5, 8, seed=3))),
        "norm_linear": (lambda x, nw, w: memopt.norm_linear(x, nw, None, w),
                        lambda x, nw, w: F.linear(F.layer_norm(x, (8,), nw), w),
                        lambda: (_leaf(3, 8, seed=1), w8(2), _leaf(5, 8, seed=3))),
        "attention": (lambda q, k, v: memopt.attention(q, k, v, causal=True),
                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      lambda: tuple(_leaf(1, 2, 3, 4, seed=s) for s in (1, 2, 3))),
        "dropout_add": (
            lambda x, r: memopt.dropout_add(x, r, p=0.3, rng_key=_KEY),
            lambda x, r: x * memopt.dropout_add(torch.ones_like(x), None, p=0.3, rng_key=_KEY).detach() + r,
            lambda: (_leaf(3, 8, seed=1), _leaf(3, 8, seed=2)),
        ),
        "linear_cross_entropy": (
            lambda h, w: memopt.linear_cross_entropy(h, w, torch.tensor([1, 4, -100]), reduction="none"),
            lambda h, w: F.cross_entropy(F.linear(h, w), torch.tensor([1, 4, -100]), reduction="none"),
            lambda: (_leaf(3, 8, seed=1), _leaf(6, 8, seed=2)),
        ),
    }


@pytest.mark.parametrize("name", sorted(_ops_cases()))
def test_op_batched_grads_equal_plain_pytorch(name):
    fn, reference, make = _ops_cases()[name]
    inputs = make()
    batched, looped = _batched_and_looped(fn, inputs)
    _assert_all_close(batched, looped)
    want, _ = _batched_and_looped(reference, inputs)
    _assert_all_close(batched, want, atol=1e-10, rtol=1e-8)


def test_attention_with_dropout_batched_grads_equal_row_by_row():
    q, k, v = (_leaf(1, 2, 3, 4, seed=s) for s in (1, 2, 3))
    batched, looped = _batched_and_looped(lambda q, k, v: memopt.attention(q, k, v, dropout_p=0.3, rng_key=_KEY), (q, k, v))
    _assert_all_close(batched, looped)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_checkpoint_batched_grads(policy):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to(DTYPE)
    x = _leaf(3, 8, seed=1)
    batched, looped = _batched_and_looped(lambda x: memopt.checkpoint(mlp, x, policy=policy), (x,))
    _assert_all_close(batched, looped)
    want, _ = _batched_and_looped(mlp, (x,))
    _assert_all_close(batched, want)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_checkpoint_of_torch_dropout_refuses_batched_grads_as_torch_does(policy):
    """A recompute that draws from torch's RNG (nn.Dropout) runs inside the batched backward,
    where vmap refuses random ops: torch.utils.checkpoint raises the same error."""
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 8)).to(DTYPE)
    x = _leaf(3, 8, seed=1)
    basis = torch.eye(24, dtype=DTYPE).view(24, 3, 8)
    with pytest.raises(RuntimeError, match="random operations inside of vmap"):
        torch.autograd.grad(torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False), x, basis, is_grads_batched=True)
    with pytest.raises(RuntimeError, match="random operations inside of vmap"):
        torch.autograd.grad(memopt.checkpoint(mlp, x, policy=policy), x, basis, is_grads_batched=True)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_hessian_vectorize_of_the_block_equals_the_eager_blocks(policy):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(8, 2, 16, policy=policy).to(DTYPE)
    eager = block.to_eager()
    x = torch.randn(1, 3, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.functional.hessian(lambda x: block(x).square().sum(), x, vectorize=True)
    with sdpa_kernel(SDPBackend.MATH):  # SDPA's CPU flash kernel has no double backward
        want = torch.autograd.functional.hessian(lambda x: eager(x).square().sum(), x)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
