"""Recomputes run on the parameters the forward ran on (memopt._parameters_as_called).

``torch.func.functional_call(model, fast_weights, x)`` puts the model's own parameters back when
it returns, before the backward, and a parameter can be assigned anew between forward and
backward: memopt.checkpoint's recompute, memopt.wrap's layers and the tiled FFN's backward must
still differentiate the forward's function. Reference: the same call on the plain model, eager,
float64."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import memopt
from helpers import tiny_gpt2_float64, tiny_llama_float64

transformers = pytest.importorskip("transformers")


def _assert_close(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, f"[{i}]: no gradient where eager has one"
        scale = w.abs().max().item() or 1.0
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"[{i}]: {m}")


def _save_matmuls(ctx, op, *args, **kwargs):
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


CHECKPOINT_POLICIES = ["selective", "full", _save_matmuls]


class _MLP(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d, dtype=torch.float64)
        self.fc2 = nn.Linear(2 * d, d, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d, dtype=torch.float64)
        self.mlp = _MLP(d)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Checkpointed(nn.Module):
    def __init__(self, inner, **options):
        super().__init__()
        self.inner, self.options = inner, options

    def forward(self, x):
        return memopt.checkpoint(self.inner, x, **self.options)


def _fast_weights(model):
    """MAML-style fast weights: new tensors, each its own leaf."""
    return {name: (p.detach() * 1.5).requires_grad_() for name, p in model.named_parameters()}


def _functional_call_grads(model, fast, x):
    x = x.detach().clone().requires_grad_()
    y = torch.func.functional_call(model, fast, (x,))
    return torch.autograd.grad((y**2).sum(), [x, *fast.values()])


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", CHECKPOINT_POLICIES, ids=["selective", "full", "policy_fn"])
def test_checkpoint_under_functional_call(policy, offload):
    layer = _Layer()
    engine = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True) if offload else False
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    fast = _fast_weights(layer)
    want = _functional_call_grads(layer, fast, x)
    wrapped = _Checkpointed(layer, policy=policy, offload=engine)
    got = _functional_call_grads(wrapped, {f"inner.{k}": v for k, v in fast.items()}, x)
    _assert_close(got, want)


@pytest.mark.parametrize("policy", CHECKPOINT_POLICIES, ids=["selective", "full", "policy_fn"])
def test_checkpoint_parameter_assigned_between_forward_and_backward(policy):
    layer = _Layer()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad((layer(x) ** 2).sum(), [x, layer.mlp.fc1.weight])
    old = layer.mlp.fc1.weight
    y = memopt.checkpoint(layer, x, policy=policy)
    layer.mlp.fc1.weight = nn.Parameter(old.detach() * 3)
    (y**2).sum().backward()
    _assert_close([x.grad, old.grad], want)
    assert layer.mlp.fc1.weight.grad is None  # the new one took no part in the forward
    assert layer.mlp.fc1.weight is not old  # and is the module's parameter after the backward


class _TiedPair(nn.Module):
    """Two linears sharing one weight, the second under weight_norm's parametrization."""

    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d, dtype=torch.float64)
        self.b = nn.Linear(d, d, dtype=torch.float64)
        self.b.weight = self.a.weight
        self.c = torch.nn.utils.parametrizations.weight_norm(nn.Linear(d, d, dtype=torch.float64))

    def forward(self, x):
        return self.c(torch.tanh(self.b(F.gelu(self.a(x)))))


@pytest.mark.parametrize("policy", CHECKPOINT_POLICIES, ids=["selective", "full", "policy_fn"])
def test_functional_call_on_tied_and_parametrized_weights(policy):
    """functional_call given one name of a tied pair replaces both; a parametrization rebuilds
    its weight in the recompute from its own (replaced) parameters."""
    model = _TiedPair()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    fast = _fast_weights(model)  # named_parameters names the shared weight once ("a.weight")
    assert "b.weight" not in fast and "c.parametrizations.weight.original0" in fast
    want = _functional_call_grads(model, fast, x)
    got = _functional_call_grads(_Checkpointed(model, policy=policy), {f"inner.{k}": v for k, v in fast.items()}, x)
    _assert_close(got, want)


@pytest.mark.parametrize("chunk", [None, 2], ids=["untiled", "tiled"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_wrap_under_functional_call(policy, chunk):
    model = nn.Sequential(_Layer(), _Layer(), _Layer())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    fast = _fast_weights(model)
    want = _functional_call_grads(model, fast, x)
    wrapped = memopt.wrap(copy.deepcopy(model), policy=policy, layers=_Layer, ffn_chunk_tokens=chunk)
    _assert_close(_functional_call_grads(wrapped, fast, x), want)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_tiled_ffn_parameter_assigned_between_forward_and_backward(policy):
    """The tiled FFN's backward asks for the gradients of the forward's parameters: it gave the
    replaced one None, silently."""
    model = nn.Sequential(_Layer(), _Layer())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    old = model[0].mlp.fc1.weight
    want = torch.autograd.grad((model(x) ** 2).sum(), [old, model[1].mlp.fc2.bias])
    memopt.wrap(model, policy=policy, layers=_Layer, ffn_chunk_tokens=2)
    loss = (model(x) ** 2).sum()
    model[0].mlp.fc1.weight = nn.Parameter(old.detach() * 3)
    loss.backward()
    _assert_close([old.grad, model[1].mlp.fc2.bias.grad], want)


@pytest.mark.parametrize(
    "make, chunk",
    [(tiny_llama_float64, None), (tiny_llama_float64, 4), (tiny_gpt2_float64, None)],
    ids=["llama", "llama-tiled", "gpt2"],
)
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_hugging_face_models_under_functional_call(make, chunk, policy):
    model = make()
    ids = torch.randint(40, (2, 9), generator=torch.Generator().manual_seed(1))
    fast = _fast_weights(model)

    def grads(m):
        torch.manual_seed(3)  # GPT-2's dropout draws the same masks in both runs
        loss = torch.func.functional_call(m, fast, (ids,), {"labels": ids, "use_cache": False}).loss
        return torch.autograd.grad(loss, list(fast.values()), allow_unused=True)

    want = grads(model)
    wrapped = memopt.wrap(copy.deepcopy(model), policy=policy, ffn_chunk_tokens=chunk, loss="plain")
    got = grads(wrapped)
    _assert_close(
        [g for g, w in zip(got, want) if w is not None],
        [w for w in want if w is not None],
    )
    assert [g is None for g in got] == [w is None for w in want]
