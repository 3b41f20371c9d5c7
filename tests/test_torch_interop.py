"""memopt.torch_interop.from_torch: what it refuses (everything supports() refuses but dropout),
and the requires_grad of the parameters it copies or shares; nn.TransformerEncoderLayer in
float64 is the reference."""

import re

import pytest
import torch
from torch import nn

import memopt
from memopt.ops.attention import cpu_backend
from memopt.torch_interop import unsupported_reason

D_MODEL, HEADS, FFN = 32, 2, 48
F64_TOL = {"atol": 1e-6, "rtol": 1e-5}  # attention keeps its log-sum-exp in float32


@pytest.fixture(autouse=True)
def native_cpu_attention():
    with cpu_backend("native"):  # float64 attention
        yield


def _layer(**kwargs):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True, dtype=torch.float64, **kwargs)


def _set(layer, path, value):
    module, _, attr = path.rpartition(".")
    setattr(layer.get_submodule(module), attr, value)


def _eps(layer):
    layer.norm2.eps = 1e-1


def _hook(layer):
    layer.linear1.register_forward_hook(lambda module, args, out: out * 2)


@pytest.mark.parametrize(
    "change",
    [
        _eps,
        lambda layer: _set(layer, "linear1.bias", None),
        lambda layer: _set(layer, "self_attn.in_proj_bias", None),
        lambda layer: _set(layer, "norm2.bias", None),
        _hook,
    ],
    ids=["norm2-eps", "linear1-no-bias", "in_proj-no-bias", "norm2-no-bias", "hook"],
)
def test_from_torch_refuses_layers_that_supports_refuses(change):
    layer = _layer()
    change(layer)
    reason = unsupported_reason(layer)
    assert reason is not None and not memopt.FusedCheckpointBlock.supports(layer)
    with pytest.raises(ValueError, match=re.escape(reason)):
        memopt.FusedCheckpointBlock.from_torch(layer)
    with pytest.raises(ValueError, match=re.escape(reason)):
        memopt.FusedCheckpointBlock.from_torch(layer, share_parameters=True)


@pytest.mark.parametrize("kwargs", [dict(bias=False), dict(layer_norm_eps=1e-2)], ids=["no-bias", "eps"])
def test_from_torch_takes_layers_without_biases_or_with_another_eps(kwargs):
    # What the refusals above must not catch: biases nowhere, one eps on both norms.
    layer = _layer(**kwargs).train()
    block = memopt.FusedCheckpointBlock.from_torch(layer)
    x = torch.randn(2, 7, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(block(x), layer(x), **F64_TOL)


@pytest.mark.parametrize("share_parameters", [False, True])
def test_from_torch_keeps_frozen_parameters(share_parameters):
    layer = _layer().train()
    layer.self_attn.requires_grad_(False)  # fine-tuning the FFN and norms only
    layer.norm2.bias.requires_grad_(False)
    block = memopt.FusedCheckpointBlock.from_torch(layer, share_parameters=share_parameters)
    frozen = {"qkv.weight", "qkv.bias", "out_proj.weight", "out_proj.bias", "norm2.bias"}
    assert {name for name, p in block.named_parameters() if not p.requires_grad} == frozen
    # Gradients go where the layer's go, and only there.
    x = torch.randn(2, 7, D_MODEL, dtype=torch.float64)
    block(x).sin().sum().backward()
    layer(x).sin().sum().backward()
    layer_grads = {
        "qkv.weight": layer.self_attn.in_proj_weight.grad, "fc1.weight": layer.linear1.weight.grad,
        "norm2.bias": layer.norm2.bias.grad, "norm2.weight": layer.norm2.weight.grad,
    }  # fmt: skip
    for name, expected in layer_grads.items():
        got = block.get_parameter(name).grad
        if expected is None:
            assert got is None, name
        elif share_parameters:
            assert got is expected, name  # (the same parameter, accumulated twice)
        else:
            torch.testing.assert_close(got, expected, **F64_TOL, msg=name)


@pytest.mark.parametrize("targets", [["linear1"], ["out_proj"], ["linear2", "linear1"]])
def test_an_adapter_on_a_linear_is_not_swapped_away(targets):
    # PEFT's LoRA layer keeps the base weight as .weight: a block built from the weights would drop
    # the adapter (wrap's swap gave a 1.3 output difference). supports() refuses such a layer, and
    # wrap checkpoints it as it is instead.
    peft = pytest.importorskip("peft")
    encoder = nn.TransformerEncoder(_layer(norm_first=True), 2, enable_nested_tensor=False)
    model = peft.get_peft_model(nn.ModuleDict({"encoder": encoder}), peft.LoraConfig(target_modules=targets, r=2, init_lora_weights=False))
    inner = model.base_model.model["encoder"]
    assert not memopt.FusedCheckpointBlock.supports(inner.layers[0])
    assert re.search("not a plain nn.Linear", unsupported_reason(inner.layers[0]))
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    # (torch's MultiheadAttention reads out_proj.weight without calling out_proj: a LoRA there does
    # nothing in torch either, and its parameters get no gradient)
    expected = inner(x)
    used = expected.requires_grad  # False for out_proj alone (the base weights are frozen)
    expected_grads = torch.autograd.grad(expected, lora, grad, allow_unused=True) if used else [None] * len(lora)
    memopt.wrap(inner)
    try:
        assert all(type(layer) is nn.TransformerEncoderLayer for layer in inner.layers)
        actual = inner(x)
        assert actual.requires_grad == used
        actual_grads = torch.autograd.grad(actual, lora, grad, allow_unused=True) if used else [None] * len(lora)
    finally:
        memopt.unwrap(inner)
    torch.testing.assert_close(actual, expected, **F64_TOL)
    assert [a is None for a in actual_grads] == [e is None for e in expected_grads]
    for a, e in zip(actual_grads, expected_grads):
        if e is not None:
            torch.testing.assert_close(a, e, **F64_TOL)
