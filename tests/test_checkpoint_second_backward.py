"""A second backward through a checkpointed region (memopt.checkpoint, note [a second backward]):
a gradient penalty or Hessian-vector product (``create_graph=True``, then a backward through
that graph) and a second backward through a retained graph. Under ``"selective"`` and policy
functions the first backward consumes the cache; PyTorch's selective checkpointing then raises
"backward an extra time", memopt recomputes plainly. Reference: the plain function, eager,
float64, with the same dropout masks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import memopt
from helpers import tiny_gpt2_float64, tiny_llama_float64

transformers = pytest.importorskip("transformers")


def _save_matmuls(ctx, op, *args, **kwargs):
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = ["selective", "full", _save_matmuls]
POLICY_IDS = ["selective", "full", "policy_fn"]


def _assert_close(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item() or 1.0
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"[{i}]: {m}")


class _Layer(nn.Module):
    """Norm, MLP with dropout, attention-like mixing of the tokens, residual (p05's module)."""

    def __init__(self, d=16, p=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d, dtype=torch.float64)
        self.fc1 = nn.Linear(d, 2 * d, dtype=torch.float64)
        self.fc2 = nn.Linear(2 * d, d, dtype=torch.float64)
        self.p = p

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc1(self.norm(x))), self.p, self.training)
        mixed = torch.softmax(h @ h.transpose(-1, -2) / 4, -1) @ h
        return x + self.fc2(mixed)


def _gradient_penalty_grads(run, model, x):
    """d/d(x, params) of |d loss / dx|^2: the first gradient built with create_graph=True."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    y = run(x)
    (gx,) = torch.autograd.grad((y.tanh() ** 2).sum(), x, create_graph=True)
    return torch.autograd.grad((gx**2).sum(), [x, *model.parameters()])


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_gradient_penalty_through_checkpoint(policy, offload):
    model = _Layer().train()
    engine = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True) if offload else False
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    want = _gradient_penalty_grads(model, model, x)
    got = _gradient_penalty_grads(lambda t: memopt.checkpoint(model, t, policy=policy, offload=engine), model, x)
    _assert_close(got, want)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_hessian_vector_product_through_checkpoint(policy):
    model = _Layer(p=0.0)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    params = list(model.parameters())
    vector = [torch.randn_like(p) for p in params]

    def hvp(run):
        grads = torch.autograd.grad((run(x) ** 3).sum(), params, create_graph=True)
        return torch.autograd.grad(grads, params, vector)

    _assert_close(hvp(lambda t: memopt.checkpoint(model, t, policy=policy)), hvp(model))


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_second_backward_through_a_retained_graph(policy):
    model = _Layer().train()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    want = torch.autograd.grad(model(x).pow(2).sum(), [x, *model.parameters()])
    torch.manual_seed(7)
    loss = memopt.checkpoint(model, x, policy=policy).pow(2).sum()
    first = torch.autograd.grad(loss, [x, *model.parameters()], retain_graph=True)
    second = torch.autograd.grad(loss, [x, *model.parameters()])
    _assert_close(first, want)
    _assert_close(second, want)


@pytest.mark.parametrize("make", [tiny_llama_float64, tiny_gpt2_float64], ids=["llama", "gpt2"])
def test_gradient_penalty_through_wrap_default_policy(make):
    """The norm of the loss's gradient with respect to the parameters, differentiated."""
    model = make()
    ids = torch.randint(40, (2, 9), generator=torch.Generator().manual_seed(1))

    def penalty_grads(m):
        params = [p for p in m.parameters()]
        torch.manual_seed(3)
        loss = m(ids, labels=ids, use_cache=False).loss
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum((g**2).sum() for g in grads)
        return torch.autograd.grad(penalty, params, allow_unused=True)

    want = penalty_grads(model)
    got = penalty_grads(memopt.wrap(copy.deepcopy(model), loss="plain"))
    assert [g is None for g in got] == [w is None for w in want]
    _assert_close([g for g in got if g is not None], [w for w in want if w is not None])
