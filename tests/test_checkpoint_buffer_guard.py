"""The buffer guard (note [what a recompute may rely on], 2, in memopt/checkpoint.py) where the
buffers come from elsewhere than the module's own attributes.

* ``torch.func.functional_call(model, {**params, **buffers}, x)``: the recompute runs after
  functional_call has put the model's own buffers back; it must read the buffers the forward ran
  on (before: gradients off by 0.54 on the input, 6.7 on a weight, no error).
* The recompute puts buffers back by writing into them; their version counters must go back to
  where the recompute found them, or a tensor saved elsewhere that is one of them fails
  autograd's version check where plain PyTorch runs (a constant buffer under an inner
  ``torch.autograd.grad``, a BatchNorm run once in eval mode and once checkpointed in training).

Every case is float64 against the same model run without checkpointing.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import memopt


def _save_mm(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = ["none", "selective", "full", _save_mm]
EXACT = dict(rtol=1e-12, atol=1e-12)


def _assert_same(got: dict, want: dict, exact: bool = False):
    assert got.keys() == want.keys()
    for name, value in want.items():
        tolerance = dict(rtol=0, atol=0) if exact else EXACT
        torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m: f"{name}: {m}")


# -- buffers passed to torch.func.functional_call ---------------------------------------------


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("scale", torch.ones(4, dtype=torch.float64))
        self.bn = nn.BatchNorm1d(4, dtype=torch.float64)

    def forward(self, x):
        return torch.tanh(self.bn(self.lin(x)) * self.scale)


class _Checkpointed(nn.Module):
    def __init__(self, policy):
        super().__init__()
        self.inner, self.policy = _Scaled(), policy

    def forward(self, x):
        if self.policy is None:
            return self.inner(x)
        return memopt.checkpoint(self.inner, x, policy=self.policy)


def _functional_call_step(policy, training: bool):
    torch.manual_seed(0)
    model = _Checkpointed(policy).train(training)
    own = {name: b.clone() for name, b in model.named_buffers()}
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    buffers["inner.scale"] = torch.linspace(0.2, 3.0, 4, dtype=torch.float64)
    buffers["inner.bn.running_mean"] = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    buffers["inner.bn.running_var"] = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
    params = dict(model.named_parameters())
    torch.func.functional_call(model, {**params, **buffers}, (x,)).pow(2).sum().backward()
    # The model's own buffers are left alone; the ones passed get the forward's update once.
    _assert_same(dict(model.named_buffers()), own, exact=True)
    grads = {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}
    return grads, buffers


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("policy", POLICIES)
def test_functional_call_buffers_are_read_by_the_recompute(policy, training):
    """BatchNorm in eval mode reads the running statistics passed; a constant scale is read in
    both modes. Before: x.grad off by 0.54 (train) and 0.47 (eval) under every checkpointing policy."""
    want_grads, want_buffers = _functional_call_step(None, training)
    grads, buffers = _functional_call_step(policy, training)
    _assert_same(grads, want_grads)
    _assert_same(buffers, want_buffers, exact=True)


# -- version counters of the buffers a recompute writes back ----------------------------------


class _InnerGrad(nn.Module):
    """Takes a gradient inside its forward (a gradient penalty): torch recomputes the start of
    the checkpointed function then, while the forward runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4, dtype=torch.float64))  # never written

    def forward(self, x):
        h = torch.tanh(self.lin(x) * self.scale)
        (g,) = torch.autograd.grad(h.pow(2).sum(), x, create_graph=True)
        return h + g


@pytest.mark.parametrize("policy", POLICIES)
def test_constant_buffer_saved_outside_the_checkpoint_under_an_inner_grad(policy):
    """The same buffer is saved by a mul outside the checkpoint. Before: "modified by an inplace
    operation" in the backward under every checkpointing policy."""
    torch.manual_seed(0)
    plain = _InnerGrad()
    layer = copy.deepcopy(plain)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    plain(x * plain.scale).sum().backward()
    want = {"x": x.grad, **{name: p.grad for name, p in plain.named_parameters()}}
    x.grad = None
    version = layer.scale._version  # as plain: no write into it, so no version bump
    out = memopt.checkpoint(layer, x * layer.scale, policy=policy)
    assert layer.scale._version == version
    out.sum().backward()
    assert layer.scale._version == version
    _assert_same({"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}, want)


def _eval_then_train(policy):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4, dtype=torch.float64)
    layer = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), bn)
    x1 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y2 = bn.eval()(x2)  # eval mode: saves running_mean and running_var for its backward
    bn.train()
    y1 = layer(x1) if policy is None else memopt.checkpoint(layer, x1, policy=policy)
    (y1.sin().sum() + y2.sin().sum()).backward()
    return {"x1": x1.grad, "x2": x2.grad, **{n: p.grad for n, p in layer.named_parameters()}}, dict(
        layer.named_buffers()
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_statistics_saved_in_eval_then_checkpointed_in_training(policy):
    """Before: the recompute's write-back of the statistics failed the eval-mode batch norm's
    version check under every checkpointing policy."""
    want_grads, want_buffers = _eval_then_train(None)
    grads, buffers = _eval_then_train(policy)
    _assert_same(grads, want_grads)
    _assert_same(buffers, want_buffers, exact=True)
