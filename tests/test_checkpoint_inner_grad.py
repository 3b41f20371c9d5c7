"""A checkpointed function that itself calls ``torch.autograd.grad(create_graph=True)``.

Issue 15 item 12 and note [a backward inside the checkpointed forward] in memopt/checkpoint.py:
the inner backward makes torch recompute the start of the function during the forward. Under
``"selective"`` that recompute used to consume the selective cache ("backward an extra time" on
torch 2.14, "not found in storage" before); now every policy gives the plain gradients.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import memopt

POLICIES = ["selective", "full"]


def _assert_grads_equal(fn, inputs, policy, rtol=1e-12, atol=1e-12):
    """fn's gradients w.r.t. ``inputs``, checkpointed under ``policy``, equal the plain ones."""
    expected = torch.autograd.grad(fn(*inputs), inputs)
    got = torch.autograd.grad(memopt.checkpoint(fn, *inputs, policy=policy), inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


def _gradient_penalty(x, w):
    # The shape: a sine after a matmul, its input gradient taken inside the function.
    y = (x @ w).sin()
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return (gx.pow(2).sum(-1) - 1).pow(2).sum() + y.cos().sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_gradient_penalty_inside_the_checkpoint(policy):
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    _assert_grads_equal(_gradient_penalty, (x, w), policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_inner_grad_through_batched_matmuls_and_softmax(policy):
    """Attention-like: the inner grad runs bmm backward ops that "selective" saves too."""

    def fn(q, k, v):
        out = torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)
        (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return (out * gq).sum()

    inputs = [torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    _assert_grads_equal(fn, inputs, policy)


class _InnerStep(nn.Module):
    """MAML's inner step on a layer with dropout and BatchNorm: a gradient w.r.t. the weight,
    taken inside the forward, gives the adapted weight the output is computed with."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6, dtype=torch.float64)
        self.norm = nn.BatchNorm1d(6, dtype=torch.float64)

    def forward(self, x):
        hidden = F.dropout(self.norm(self.linear(x)), p=0.3, training=True)
        (gw,) = torch.autograd.grad(hidden.tanh().sum(), self.linear.weight, create_graph=True)
        return F.linear(x, self.linear.weight - 0.1 * gw, self.linear.bias).sin().sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_inner_step_with_dropout_and_batchnorm(policy):
    """Same gradients (dropout replayed) and BatchNorm statistics updated once, as plain."""
    torch.manual_seed(0)
    plain = _InnerStep().train()
    wrapped = copy.deepcopy(plain)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)

    torch.manual_seed(1)
    plain(x).backward()
    x_grad, x.grad = x.grad, None
    torch.manual_seed(1)
    memopt.checkpoint(wrapped, x, policy=policy).backward()

    torch.testing.assert_close(x.grad, x_grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    for (name, b), c in zip(plain.named_buffers(), wrapped.buffers()):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_selective_still_saves_the_matmul_outputs_only():
    """The fix recomputes plainly only during the forward: the backward still takes the matmul
    outputs from the selective cache (fewer matmuls rerun than under "full")."""
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    counts = {}
    for policy in POLICIES:
        out = memopt.checkpoint(_gradient_penalty, x, w, policy=policy)
        with FlopCounterMode(display=False) as flops:
            torch.autograd.grad(out, (x, w))
        counts[policy] = flops.get_total_flops()
    assert counts["selective"] < counts["full"]


class _ScaledInnerStep(nn.Module):
    """Reads a running scale, updates it in place, then takes an inner gradient: the recompute
    that the inner backward starts (during the forward) must read the scale as the forward
    started, as the backward's recompute must."""

    def __init__(self, big: bool):
        super().__init__()
        self.linear = nn.Linear(6, 6, dtype=torch.float64)
        # Large: watched for its first write rather than copied when the forward starts.
        self.register_buffer("scale", torch.rand(6, 30000 if big else 1, dtype=torch.float64) + 0.5)

    def forward(self, x):
        hidden = torch.tanh(self.linear(x) * self.scale[:, 0].clone())
        with torch.no_grad():
            self.scale.mul_(0.5).add_(x.abs().mean())
        (gw,) = torch.autograd.grad(hidden.square().sum(), self.linear.weight, create_graph=True)
        return F.linear(x, self.linear.weight - 0.1 * gw, self.linear.bias).sin().sum() + hidden.sum()


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_inner_step_reads_buffers_as_the_forward_started(policy, big):
    """Before: both recomputes read the scale after its update: gradients off, no error."""
    torch.manual_seed(0)
    plain = _ScaledInnerStep(big)
    wrapped = copy.deepcopy(plain)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    plain(x).backward()
    x_grad, x.grad = x.grad, None
    memopt.checkpoint(wrapped, x, policy=policy).backward()
    torch.testing.assert_close(x.grad, x_grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(wrapped.scale, plain.scale, rtol=0, atol=0)
