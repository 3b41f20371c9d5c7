"""FusedCheckpointBlock under a plain FakeTensorMode (shape inference without torch.compile): the
forward and backward run on fake tensors, for each policy, with and without dropout, and give the
shapes and dtypes the real block gives; the real path keeps its module-level placeholder keys."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import memopt
from memopt import block_functions
from memopt.ops.attention import cpu_backend

D_MODEL, N_HEADS, BATCH, SEQ = 64, 4, 2, 16


def _check_fake_step(block: memopt.FusedCheckpointBlock, x: torch.Tensor, dtype: torch.dtype) -> None:
    """Forward + backward of ``block`` on the fake ``x``: fake output of x's shape and ``dtype``,
    a fake gradient of each parameter's shape and dtype, and of x's."""
    y = block(x)
    assert isinstance(y, FakeTensor)
    assert y.shape == (BATCH, SEQ, D_MODEL) and y.dtype == dtype
    y.sum().backward()
    assert isinstance(x.grad, FakeTensor) and x.grad.shape == x.shape and x.grad.dtype == dtype
    for name, param in block.named_parameters():
        assert isinstance(param.grad, FakeTensor), name
        assert param.grad.shape == param.shape and param.grad.dtype == param.dtype, name


@pytest.mark.parametrize("backend", ["auto", "native"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_block_built_and_run_under_fake_tensor_mode(policy, norm_first, dropout, backend):
    # Built inside the mode (its parameters are fake); dtype as a factory argument: a module's
    # .to() under FakeTensorMode can fail in torch itself (swap_tensors and the mode's weakrefs).
    with cpu_backend(backend), FakeTensorMode():
        block = memopt.FusedCheckpointBlock(
            D_MODEL, N_HEADS, dropout=dropout, norm_first=norm_first, causal=True, policy=policy, dtype=torch.float64
        ).train()
        x = torch.randn(BATCH, SEQ, D_MODEL, dtype=torch.float64, requires_grad=True)
        _check_fake_step(block, x, torch.float64)


def _made_fake(block: memopt.FusedCheckpointBlock, mode: FakeTensorMode) -> memopt.FusedCheckpointBlock:
    """``block`` with each parameter replaced by a fake one (``mode.from_tensor``)."""
    for name, param in list(block.named_parameters()):
        owner, _, attr = name.rpartition(".")
        setattr(block.get_submodule(owner), attr, torch.nn.Parameter(mode.from_tensor(param.detach())))
    return block


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_real_block_with_parameters_made_fake_by_from_tensor(policy, dropout):
    mode = FakeTensorMode()
    block = _made_fake(memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, dropout=dropout, policy=policy).train(), mode)
    x = mode.from_tensor(torch.randn(BATCH, SEQ, D_MODEL)).requires_grad_()
    with mode:
        _check_fake_step(block, x, torch.float32)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_fake_block_without_dropout_runs_outside_its_mode(policy):
    # Fake tensors carry their mode: without dropout (no key to draw) nothing real is made.
    mode = FakeTensorMode()
    block = _made_fake(memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy=policy), mode)
    _check_fake_step(block, mode.from_tensor(torch.randn(BATCH, SEQ, D_MODEL)).requires_grad_(), torch.float32)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_tiled_ffn_block_with_dropout_under_fake_tensor_mode(policy):
    with FakeTensorMode():
        block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, dropout=0.1, policy=policy, ffn_chunk_tokens=8).train()
        x = torch.randn(BATCH, SEQ, D_MODEL, requires_grad=True)
        _check_fake_step(block, x, torch.float32)


def test_real_tensors_keep_the_module_level_placeholder_keys():
    # The fast path: no tensor is built per call for real tensors; fake ones get their own.
    real = torch.zeros(2)
    assert block_functions._site_keys(None, real) is block_functions._NO_DROPOUT_KEYS
    assert block_functions._site_keys(None) is block_functions._NO_DROPOUT_KEYS
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        keys = block_functions._site_keys(None, fake)
        assert all(isinstance(k, FakeTensor) and k.shape == (2,) and k.dtype == torch.int64 for k in keys)
        site_keys = block_functions._site_keys(mode.from_tensor(torch.tensor([1, 2])), fake)
        assert all(isinstance(k, FakeTensor) and k.shape == (2,) for k in site_keys)
