"""The block, the stack and wrap refuse bad values where they enter, and take an empty batch."""

import pytest
import torch
from torch import nn

import memopt


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: memopt.FusedCheckpointStack(True, 32, 2), ValueError, "n_layers must be a positive int"),
        (lambda: memopt.FusedCheckpointStack(2, 32, 2, policy=5), TypeError, "policy must be one value or a list"),
        (lambda: memopt.FusedCheckpointBlock(None, 2), ValueError, "d_model must be a positive int"),
        (lambda: memopt.FusedCheckpointBlock(32, 2, d_ff=True), ValueError, "d_ff must be a positive int"),
        (lambda: memopt.FusedCheckpointBlock(32, True), ValueError, "n_heads must be a positive int"),
    ],
)
def test_bad_constructor_values_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_bad_policy_list_leaves_the_stack_as_it_was():
    stack = memopt.FusedCheckpointStack(2, 32, 2, policy="selective")
    with pytest.raises(ValueError, match=r"policy\[1\]"):
        stack.policy = ["full", "bogus"]
    assert stack.policy == ["selective", "selective"]
    with pytest.raises(TypeError, match=r"offload\[0\]"):
        stack.offload = ["no", False]
    assert stack.offload == [False, False]


def test_wrap_refuses_a_bool_as_a_layer_index():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 3, enable_nested_tensor=False)
    with pytest.raises(ValueError, match="keys must be layer indices"):
        memopt.wrap(nn.Sequential(encoder), policy={True: "full"})


@pytest.mark.parametrize("batch_first", [True, False])
def test_empty_batch_gives_an_empty_result_and_zero_gradients(batch_first):
    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(32, 2, 64, batch_first=batch_first).double()
    eager = block.to_eager()
    shape = (0, 5, 32) if batch_first else (5, 0, 32)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y, y_ref = block(x), eager(x)
    assert y.shape == y_ref.shape == shape
    y.sum().backward()
    y_ref.sum().backward()
    for (name, p), q in zip(block.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
        assert not p.grad.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_first", [True, False])
def test_half_precision_activations_on_cpu_raise_naming_the_block(dtype, norm_first):
    """The CPU kernels take float32 / float64: a half-precision x (a block cast to bf16, a bf16
    input under CPU autocast) raised from memopt.layer_norm or memopt.dropout_add, ops the caller
    never called."""
    block = memopt.FusedCheckpointBlock(16, 2, 32, norm_first=norm_first)
    for x, model in ((torch.randn(1, 3, 16, dtype=dtype), block), (torch.randn(1, 3, 16, dtype=dtype), block.to(dtype))):
        with pytest.raises(ValueError, match=f"FusedCheckpointBlock: x is {dtype} on CPU.*float32 or float64"):
            model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 activations under autocast still run
        assert block.float()(torch.randn(1, 3, 16)).dtype == torch.float32
