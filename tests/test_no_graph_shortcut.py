"""Calls that record no autograd graph skip the checkpoint (issue 14): memopt.wrap's layers on a
frozen model with gradients on, memopt.checkpoint under torch.no_grad / inference_mode, the
swapped encoder layer's torch-layer fallback. One rule decides: memopt._records_graph.records_graph.

Each test compares against the plain model (float64, bitwise where the same ops run) and detects
whether a checkpoint ran by counting calls of memopt.wrap's / torch's checkpoint.
"""

import copy
import dataclasses
import enum
import importlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import memopt
from memopt._records_graph import records_graph

wrap_module = importlib.import_module("memopt.wrap")
interop_module = importlib.import_module("memopt.torch_interop")

D_MODEL, HEADS, FFN, SEQ, BATCH = 16, 2, 32, 7, 3


def _encoder(num_layers=3, dropout=0.2):
    # SiLU: the fused block does not take it, so wrap checkpoints the torch layer as it is.
    layer = nn.TransformerEncoderLayer(
        D_MODEL, HEADS, FFN, dropout=dropout, activation=nn.SiLU(), batch_first=True, dtype=torch.float64
    )
    return nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)


def _x(requires_grad=False):
    return torch.randn(BATCH, SEQ, D_MODEL, dtype=torch.float64, requires_grad=requires_grad)


@pytest.fixture
def wrap_checkpoints(monkeypatch):
    """The calls memopt.wrap's layers make to memopt.checkpoint."""
    calls = []
    checkpoint = wrap_module.checkpoint
    monkeypatch.setattr(wrap_module, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    return calls


@pytest.fixture
def torch_checkpoints(monkeypatch):
    """The calls memopt.checkpoint makes to torch.utils.checkpoint.checkpoint."""
    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    return calls


def _torch_checkpoint_takes_forward_ad() -> bool:
    # torch 2.11's non-reentrant checkpoint saves its inputs through a Function without a jvp
    # (tests/test_storageless_tensors.py): forward-mode AD through it raises NotImplementedError.
    noop = getattr(torch.utils.checkpoint, "_NoopSaveInputs", None)
    return noop is None or "jvp" in vars(noop)


# -- the rule ---------------------------------------------------------------------------------


def test_records_graph_rule():
    layer = nn.Linear(4, 4)
    x, leaf = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    assert records_graph(((x,), {}), (layer,))  # a parameter requires grad
    assert records_graph(((x,), {"extra": [None, (leaf,)]}), ())  # a nested argument does
    assert records_graph(((x,), {}), None)  # what the call reads is unknown
    layer.requires_grad_(False)
    assert not records_graph(((x, 3, "s", None), {"m": {"k": x}}), (layer,))
    assert records_graph(((leaf,), {}), (layer,))
    assert records_graph(((x,), {}), (nn.Sequential(layer, nn.Linear(4, 4)),))  # a submodule's parameter
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert not records_graph(((leaf,), {}), None)
    with fwAD.dual_level():  # forward-mode AD takes the normal path, as the fused block's rule does
        assert records_graph(((x,), {}), (layer,))
        with torch.no_grad():
            assert records_graph(((x,), {}), (layer,))


@dataclasses.dataclass
class _State:
    """A layer's state in a plain dataclass: no pytree node, so the rule cannot see its tensors."""

    h: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass
class _RegisteredState:
    h: torch.Tensor
    scale: float


torch.utils._pytree.register_pytree_node(
    _RegisteredState, lambda s: ([s.h], s.scale), lambda leaves, scale: _RegisteredState(leaves[0], scale)
)


def test_records_graph_counts_an_object_it_cannot_see_into_as_recording():
    layer = nn.Linear(4, 4).requires_grad_(False)
    x, leaf = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    assert records_graph(((_State(leaf, x),), {}), (layer,))
    assert records_graph(((x,), {"state": _State(x, x)}), (layer,))  # its tensors are unseen
    assert records_graph(((x, lambda: leaf), {}), (layer,))  # a closure, likewise
    assert records_graph(((_RegisteredState(leaf, 2.0),), {}), (layer,))  # a pytree node is walked
    assert not records_graph(((_RegisteredState(x, 2.0),), {}), (layer,))
    plain_values = (None, True, 3, 2.5, 1j, "s", b"b", torch.float64, torch.device("cpu"), torch.strided,
                    torch.contiguous_format, torch.Size([2, 4]), enum.Enum("E", "A").A)  # fmt: skip
    assert not records_graph(((x, *plain_values), {"v": list(plain_values)}), (layer,))
    with torch.no_grad():
        assert not records_graph(((_State(leaf, x),), {}), (layer,))


# -- memopt.wrap ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["selective", "full"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_frozen_model_runs_its_layers_without_checkpoint(policy, training, wrap_checkpoints):
    # A frozen teacher: gradients on, nothing requires grad. Same seed -> same dropout masks.
    plain = _encoder().requires_grad_(False).train(training)
    model = memopt.wrap(copy.deepcopy(plain), policy=policy)
    x = _x()
    torch.manual_seed(1)
    got = model(x)
    torch.manual_seed(1)
    assert torch.equal(got, plain(x))
    assert not got.requires_grad
    assert not wrap_checkpoints
    packs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(t) or t, lambda t: t):
        model(x)
    assert not packs


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_frozen_model_with_an_input_that_requires_grad_is_checkpointed(policy, wrap_checkpoints):
    # Saliency through a frozen model: the layers record a graph, so they are checkpointed.
    plain = _encoder().requires_grad_(False)
    model = memopt.wrap(copy.deepcopy(plain), policy=policy)
    x = _x()
    grads = []
    for run in (model, plain):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(2)
        out = run(leaf)
        out.square().sum().backward()
        grads.append((out.detach(), leaf.grad))
    assert len(wrap_checkpoints) == 3
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_partly_frozen_model_checkpoints_the_layers_that_record_a_graph(wrap_checkpoints):
    # Fine-tuning the top layer: the frozen lower layers run plainly, the top one is checkpointed.
    plain = _encoder()
    for layer in plain.layers[:2]:
        layer.requires_grad_(False)
    model = memopt.wrap(copy.deepcopy(plain), policy="selective")
    x = _x()
    results = []
    for run in (model, plain):
        torch.manual_seed(3)
        out = run(x)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad for p in run.layers[2].parameters()]))
    assert len(wrap_checkpoints) == 1
    assert torch.equal(results[0][0], results[1][0])
    for got, want in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for layer in model.layers[:2] for p in layer.parameters())


class _TiedLayer(nn.Module):
    """A layer that reads a tensor held as a plain attribute (not registered: no parameter of it)."""

    def __init__(self, tied):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, D_MODEL, dtype=torch.float64)
        self.__dict__["tied"] = tied

    def forward(self, x):
        return torch.tanh(torch.tanh(self.fc(x)) @ self.tied) @ self.tied


class _TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Parameter(torch.randn(D_MODEL, D_MODEL, dtype=torch.float64) / D_MODEL**0.5)
        self.layers = nn.ModuleList(_TiedLayer(self.shared) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_layer_reading_a_hidden_tensor_that_requires_grad_is_checkpointed_after_its_first_call(wrap_checkpoints):
    # The rule cannot see the plain attribute: the first call runs directly (exact, without the
    # memory saving), the output shows the graph, and later calls are checkpointed.
    plain = _TiedModel()
    for layer in plain.layers:
        layer.fc.requires_grad_(False)
    model = memopt.wrap(copy.deepcopy(plain), policy="full")
    for layer in model.layers:  # deepcopy copied the plain attribute: point it at the copy's parameter
        layer.__dict__["tied"] = model.shared
    x = _x()
    want = torch.autograd.grad(plain(x).square().sum(), plain.shared)[0]
    exclude = list(model.parameters())
    with pytest.warns(UserWarning, match="layer 'layers.0' .* returned a result that requires grad"):
        with memopt.SavedTensorCounter(exclude=exclude) as first:
            out = model(x)
    first_grad = torch.autograd.grad(out.square().sum(), model.shared)[0]
    assert len(wrap_checkpoints) == 1  # layer 1: its input requires grad now
    with memopt.SavedTensorCounter(exclude=exclude) as second:
        out = model(x)
    second_grad = torch.autograd.grad(out.square().sum(), model.shared)[0]
    assert len(wrap_checkpoints) == 3
    torch.testing.assert_close(first_grad, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second_grad, want, rtol=1e-12, atol=1e-12)
    assert second.total_bytes < first.total_bytes  # "full" keeps layer 0's input only


class _StateLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_MODEL, FFN, dtype=torch.float64)
        self.fc2 = nn.Linear(FFN, D_MODEL, dtype=torch.float64)

    def forward(self, state):
        return _State(state.h + self.fc2(torch.tanh(self.fc1(state.h))) * state.mask, state.mask)


class _StateModel(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.layers = nn.ModuleList(_StateLayer() for _ in range(3))
        self.checkpointed = checkpointed

    def forward(self, x):
        state = _State(x, torch.ones(x.shape[:-1] + (1,), dtype=x.dtype))
        for layer in self.layers:
            if self.checkpointed:
                state = torch.utils.checkpoint.checkpoint(layer, state, use_reentrant=False)
            else:
                state = layer(state)
        return state.h


def _saved_bytes_and_input_grad(model, x):
    leaf = x.clone().requires_grad_()
    with memopt.SavedTensorCounter() as counter:
        out = model(leaf)
    return counter.total_bytes, out.detach(), torch.autograd.grad(out.square().sum(), leaf)[0]


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_frozen_model_passing_a_plain_dataclass_is_checkpointed(policy, wrap_checkpoints):
    # The gradient of the input through a frozen model whose layers pass a dataclass the rule
    # cannot see into: the layers record a graph, so they are checkpointed, as torch's are.
    plain = _StateModel().requires_grad_(False)
    model = memopt.wrap(copy.deepcopy(plain), layers=_StateLayer, policy=policy)
    torch_ckpt = copy.deepcopy(plain)
    torch_ckpt.checkpointed = True
    x = _x()
    plain_bytes, want_out, want_grad = _saved_bytes_and_input_grad(plain, x)
    torch_bytes, _, _ = _saved_bytes_and_input_grad(torch_ckpt, x)
    for step in range(2):
        got_bytes, got_out, got_grad = _saved_bytes_and_input_grad(model, x)
        assert len(wrap_checkpoints) == 3 * (step + 1)
        torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
        if policy == "full":
            assert got_bytes == torch_bytes
        assert got_bytes < plain_bytes


class _HiddenStateLayer(_TiedLayer):
    """A _TiedLayer returning its result in a dataclass the rule cannot see into."""

    def forward(self, x):
        return _State(super().forward(x), x)


class _HiddenStateModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Parameter(torch.randn(D_MODEL, D_MODEL, dtype=torch.float64) / D_MODEL**0.5)
        self.layer = _HiddenStateLayer(self.shared).requires_grad_(False)

    def forward(self, x):
        return self.layer(x).h


def test_a_layer_returning_an_object_the_rule_cannot_see_into_is_checkpointed_after_its_first_call(wrap_checkpoints):
    plain = _HiddenStateModel()
    model = memopt.wrap(copy.deepcopy(plain), layers=_HiddenStateLayer, policy="full")
    model.layer.__dict__["tied"] = model.shared
    x = _x()
    want = torch.autograd.grad(plain(x).square().sum(), plain.shared)[0]
    with pytest.warns(UserWarning, match="layer 'layer' .* an object memopt cannot look into"):
        first = torch.autograd.grad(model(x).square().sum(), model.shared)[0]
    assert not wrap_checkpoints
    second = torch.autograd.grad(model(x).square().sum(), model.shared)[0]
    assert len(wrap_checkpoints) == 1
    torch.testing.assert_close(first, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second, want, rtol=1e-12, atol=1e-12)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL, dtype=torch.float64)
        self.fc1 = nn.Linear(D_MODEL, FFN, dtype=torch.float64)
        self.fc2 = nn.Linear(FFN, D_MODEL, dtype=torch.float64)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def test_forward_ad_through_a_frozen_model_takes_the_normal_path(wrap_checkpoints):
    # (torch's CPU attention has no forward-mode derivative: residual MLP layers here)
    plain = nn.Sequential(_Residual(), _Residual(), _Residual()).requires_grad_(False)
    model = memopt.wrap(copy.deepcopy(plain), policy="full")
    x, tangent = _x(), _x()
    with fwAD.dual_level():
        want = fwAD.unpack_dual(plain(fwAD.make_dual(x, tangent))).tangent
    if not _torch_checkpoint_takes_forward_ad():
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward mode AD"):
            model(fwAD.make_dual(x, tangent))
    else:
        with fwAD.dual_level():
            got = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent))).tangent
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert wrap_checkpoints


def test_frozen_model_compiles_fullgraph(compile_cache, wrap_checkpoints):
    plain = _encoder(dropout=0.0).requires_grad_(False).float()
    model = memopt.wrap(copy.deepcopy(plain), policy="selective")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _x().float()
    torch.testing.assert_close(compiled(x), plain(x))
    leaf = x.clone().requires_grad_()  # recompiles: the layers are checkpointed now
    compiled(leaf).sum().backward()
    want = x.clone().requires_grad_()
    plain(want).sum().backward()
    torch.testing.assert_close(leaf.grad, want.grad)


# -- memopt.checkpoint ------------------------------------------------------------------------


def _mlp():
    return nn.Sequential(
        nn.Linear(D_MODEL, FFN, dtype=torch.float64),
        nn.GELU(),
        nn.Dropout(0.3),
        nn.Linear(FFN, D_MODEL, dtype=torch.float64),
    )


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize(
    "options", [{"policy": "selective"}, {"policy": "full"}, {"policy": "selective", "offload": True}], ids=str
)
def test_checkpoint_without_gradients_calls_fn_directly(mode, options, torch_checkpoints):
    mlp, x = _mlp(), _x(requires_grad=True)
    with mode():
        torch.manual_seed(4)
        got = memopt.checkpoint(mlp, x, **options)
        torch.manual_seed(4)
        assert torch.equal(got, mlp(x))
    assert not torch_checkpoints
    memopt.checkpoint(mlp, x, **options)
    assert torch_checkpoints


def test_checkpoint_without_gradients_still_refuses_bad_arguments():
    with torch.no_grad(), pytest.raises(ValueError, match="debug=True needs policy='full'"):
        memopt.checkpoint(torch.sin, torch.randn(3), policy="selective", debug=True)


def test_checkpoint_with_gradients_on_keeps_closures_checkpointed(torch_checkpoints):
    # Nothing among the arguments requires grad, but the closure reads a model that does: the
    # rule cannot see it, so the checkpoint stays (and keeps saving nothing but the input).
    mlp, x = _mlp(), _x()
    with memopt.SavedTensorCounter(exclude=list(mlp.parameters())) as counter:
        out = memopt.checkpoint(lambda t: mlp(t), x, policy="full")
    assert torch_checkpoints and counter.total_bytes == x.numel() * x.element_size()
    out.sum().backward()
    assert mlp[0].weight.grad is not None


def test_fn_turning_gradients_on_under_no_grad_keeps_no_more_than_torchs_checkpoint():
    # torch.utils.checkpoint runs fn plainly when gradients are off as it starts: the graph fn
    # records inside keeps what fn saves, under torch's checkpoint and memopt's alike.
    w = torch.randn(D_MODEL, D_MODEL, dtype=torch.float64, requires_grad=True)

    def fn(x):
        with torch.enable_grad():
            return torch.tanh(torch.tanh(x @ w) @ w)

    x = _x()
    results = []
    for run in (
        lambda: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False),
        lambda: memopt.checkpoint(fn, x, policy="full"),
        lambda: memopt.checkpoint(fn, x, policy="selective"),
    ):
        with memopt.SavedTensorCounter(exclude=[w]) as counter, torch.no_grad():
            out = run()
        results.append((counter.total_bytes, torch.autograd.grad(out.sum(), w)[0]))
    torch_bytes, torch_grad = results[0]
    for saved, grad in results[1:]:
        assert saved <= torch_bytes
        assert torch.equal(grad, torch_grad)


def test_checkpoint_under_forward_ad_takes_the_normal_path(torch_checkpoints):
    mlp, x, tangent = _mlp().eval(), _x(), _x()
    with fwAD.dual_level():
        want = fwAD.unpack_dual(mlp(fwAD.make_dual(x, tangent))).tangent
    for mode in (torch.enable_grad, torch.no_grad):
        if _torch_checkpoint_takes_forward_ad():
            with fwAD.dual_level(), mode():
                got = fwAD.unpack_dual(memopt.checkpoint(mlp, fwAD.make_dual(x, tangent), policy="full")).tangent
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        else:
            with fwAD.dual_level(), mode(), pytest.raises(NotImplementedError, match="forward mode AD"):
                memopt.checkpoint(mlp, fwAD.make_dual(x, tangent), policy="full")
    assert len(torch_checkpoints) == 2


def test_checkpoint_without_gradients_compiles_fullgraph(compile_cache):
    mlp = _mlp().eval().float()
    x = _x().float()
    compiled = torch.compile(
        lambda t: memopt.checkpoint(mlp, t, policy="selective"), backend="aot_eager", fullgraph=True
    )
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mlp(x))


# -- the swapped encoder layer's torch-layer fallback ----------------------------------------


def test_swapped_layer_fallback_of_a_frozen_model_runs_without_checkpoint(monkeypatch):
    # A model cast to bfloat16 after wrap runs the torch layer (the CPU kernels take float32 /
    # float64); frozen, with gradients on, it records no graph.
    calls = []
    checkpoint = interop_module.checkpoint
    monkeypatch.setattr(interop_module, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
    plain = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).bfloat16().requires_grad_(False)
    model = memopt.wrap(copy.deepcopy(plain).float(), policy="selective").bfloat16().requires_grad_(False)
    assert isinstance(model.layers[0], interop_module.FusedTransformerEncoderLayer)
    x = torch.randn(BATCH, SEQ, D_MODEL, dtype=torch.bfloat16)
    assert torch.equal(model(x), plain(x))
    assert not calls
    leaf = x.clone().requires_grad_()
    model(leaf).float().sum().backward()
    assert len(calls) == 2 and leaf.grad is not None
