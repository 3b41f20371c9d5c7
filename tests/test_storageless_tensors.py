"""Saved tensors without a storage of their own: the efficient zero tensor forward-mode AD's
``F.linear`` saves, sparse and nested tensors. The offload engine keeps them as they are (it
asked for their storage and raised: "invalid python storage"), and SavedTensorCounter counts
the storages they are made of (a zero tensor has none)."""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

import memopt


def _cpu_engine(coalesce_bytes=None):
    options = {} if coalesce_bytes is None else {"coalesce_bytes": coalesce_bytes}
    return memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True, **options)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16, dtype=torch.float64)
        self.fc1 = nn.Linear(16, 32, dtype=torch.float64)
        self.fc2 = nn.Linear(32, 16, dtype=torch.float64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _torch_checkpoint_takes_forward_ad() -> bool:
    """torch 2.11's non-reentrant checkpoint saves its inputs through an autograd.Function without
    a jvp (``_NoopSaveInputs``), so forward-mode AD through it raises NotImplementedError; later
    torch saves them otherwise. memopt's "selective" and "full" run on it."""
    noop = getattr(torch.utils.checkpoint, "_NoopSaveInputs", None)
    return noop is None or "jvp" in vars(noop)


@pytest.mark.parametrize("coalesce_bytes", [None, 0], ids=["coalesced", "one-by-one"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_forward_ad_through_an_offloaded_checkpoint(policy, coalesce_bytes):
    """The parameters require grad, so autograd saves tensors for a backward, among them the zero
    tangent of a parameter (an efficient zero tensor); then a backward on the same engine."""
    model = _MLP()
    x, tangent = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 5, 16, dtype=torch.float64)
    with fwAD.dual_level():
        want = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent))).tangent
    engine = _cpu_engine(coalesce_bytes)
    if policy != "none" and not _torch_checkpoint_takes_forward_ad():
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward mode AD"):
            memopt.checkpoint(model, fwAD.make_dual(x, tangent), policy=policy, offload=engine)
    else:
        with fwAD.dual_level():
            out = memopt.checkpoint(model, fwAD.make_dual(x, tangent), policy=policy, offload=engine)
            got = fwAD.unpack_dual(out).tangent
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    x.requires_grad_()
    want_grads = torch.autograd.grad(model(x).sum(), [x, model.fc1.weight])
    got_grads = torch.autograd.grad(memopt.checkpoint(model, x, policy=policy, offload=engine).sum(), [x, model.fc1.weight])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


class _SaveAsIs(torch.autograd.Function):
    """``x * 2`` that saves a given tensor, and checks it gets the same one back."""

    @staticmethod
    def forward(ctx, x, kept):
        ctx.save_for_backward(kept)
        ctx.expected = kept
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        assert kept.layout == ctx.expected.layout and kept.is_nested == ctx.expected.is_nested
        assert kept._is_zerotensor() == ctx.expected._is_zerotensor()
        return grad * 2, None


def _storageless():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        jagged = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    return {
        "zero": torch._efficientzerotensor(4, 5),
        "sparse_coo": torch.randn(4, 5).relu().to_sparse(),
        "sparse_csr": torch.randn(4, 5).relu().to_sparse_csr(),
        "jagged": jagged,
    }


@pytest.mark.parametrize("name", list(_storageless()))
def test_offload_keeps_a_tensor_without_storage_as_it_is(name):
    kept = _storageless()[name]
    x = torch.randn(8, requires_grad=True)
    with _cpu_engine():
        y = _SaveAsIs.apply(x, kept)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize("name", list(_storageless()))
def test_saved_tensor_counter_counts_the_storages_a_tensor_is_made_of(name):
    kept = _storageless()[name]
    if name == "zero":
        parts = []
    elif name == "sparse_coo":
        parts = [kept._indices(), kept._values()]
    elif name == "sparse_csr":
        parts = [kept.crow_indices(), kept.col_indices(), kept.values()]
    else:
        parts = [kept.values(), kept.offsets()]
    want = sum({part.untyped_storage().data_ptr(): part.untyped_storage().nbytes() for part in parts}.values())
    x = torch.randn(8, requires_grad=True)
    with memopt.SavedTensorCounter(exclude=[x]) as counter:
        _SaveAsIs.apply(x, kept)
    assert counter.total_bytes == want
    assert counter.num_tensors == 1
    with memopt.SavedTensorCounter(exclude=[x, kept]) as counter:
        _SaveAsIs.apply(x, kept)
    assert counter.total_bytes == 0


def _two_tensor():
    """A strided wrapper subclass, as DTensor and torchao's quantized tensors are: no storage of
    its own (asking raised 'invalid python storage'), its memory in the inner tensors."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.randn(4, 5), torch.randn(4, 5))


def test_saved_tensor_counter_counts_a_wrapper_subclass_by_its_inner_tensors():
    a = _two_tensor().requires_grad_()
    want = sum(inner.untyped_storage().nbytes() for inner in (a.a, a.b))
    with memopt.SavedTensorCounter() as counter:
        (a * a).sum()
    assert counter.total_bytes == want  # the two inner storages, counted once though saved twice
    assert memopt.saved.storage_key(a) is None
    assert not _cpu_engine().should_offload(a)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
def test_saved_tensor_counter_refuses_a_layout_it_cannot_count():
    """An mkldnn tensor has no storage to ask and no parts: counted as 0 bytes before."""
    kept = torch.randn(4, 5).to_mkldnn()
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(TypeError, match="layout torch._mkldnn"):
        with memopt.SavedTensorCounter(exclude=[x]):
            _SaveAsIs.apply(x, kept)


def test_offload_keeps_a_strided_nested_tensor():
    """(autograd.Function cannot save one; the engine raised 'NestedTensorImpl doesn't support
    sizes' when asked to copy one.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    assert not _cpu_engine().should_offload(nested)
