"""memopt.wrap swaps nn.TransformerEncoderLayer for a FusedTransformerEncoderLayer (running a
FusedCheckpointBlock) that shares its parameters: equal outputs and gradients, shared training, exact unwrap, fewer saved bytes, and
fallback to checkpointing for layers the block cannot reproduce."""

import copy
import importlib
import inspect

import pytest
import torch
from torch import nn

import memopt
from memopt.block import saved_bytes_per_layer
from memopt.ops.attention import cpu_backend
from memopt.torch_interop import FusedTransformerEncoderLayer

from helpers import gpu

wrap_module = importlib.import_module("memopt.wrap")

D_MODEL, HEADS, FFN, SEQ, BATCH = 64, 4, 128, 8, 2
# The fused attention keeps its log-sum-exp in float32 for every dtype, so float64 runs agree
# with torch's layer to about 1e-7, not to float64 rounding (as in tests/test_block.py).
F64_TOL = {"atol": 1e-6, "rtol": 1e-5}
# Block under autocast against the torch layer under autocast: both round matmuls to bfloat16.
BF16_TOL = {"atol": 5e-2, "rtol": 5e-2}


@pytest.fixture(autouse=True)
def native_cpu_attention():
    """float64 needs attention's native CPU path (the Triton interpreter takes float32 only)."""
    with cpu_backend("native"):
        yield


def _encoder(num_layers=2, *, batch_first=True, norm_first=False, activation="relu", dropout=0.0, d_model=D_MODEL, heads=HEADS):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model, heads, FFN, dropout=dropout, activation=activation,
        batch_first=batch_first, norm_first=norm_first, dtype=torch.float64,
    )  # fmt: skip
    return nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)


def _input(batch_first=True, d_model=D_MODEL):
    shape = (BATCH, SEQ, d_model) if batch_first else (SEQ, BATCH, d_model)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _step(model, x, layer_params, **kwargs):
    """Output, input gradient and the gradients of ``layer_params`` (name -> Parameter)."""
    for p in layer_params.values():
        p.grad = None
    leaf = x.detach().clone().requires_grad_()
    out = model(leaf, **kwargs)
    out.square().mean().backward()
    return out.detach(), leaf.grad, {name: p.grad.clone() for name, p in layer_params.items()}


def _assert_step_close(got, expected, **tol):
    torch.testing.assert_close(got[0], expected[0], **tol)
    torch.testing.assert_close(got[1], expected[1], **tol)
    assert got[2].keys() == expected[2].keys()
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], **tol, msg=lambda m: f"{name}: {m}")


def _assert_same_step(got, expected):
    _assert_step_close(got, expected, **F64_TOL)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_swapped_encoder_matches_plain(policy, batch_first, norm_first, activation):
    model = _encoder(batch_first=batch_first, norm_first=norm_first, activation=activation)
    plain = copy.deepcopy(model)
    x = _input(batch_first)
    expected = _step(plain, x, dict(plain.named_parameters()))
    # The original layers' parameters, under their torch names: the swapped blocks must share them.
    original_params = dict(model.named_parameters())

    memopt.wrap(model, policy=policy)
    assert all(type(layer) is FusedTransformerEncoderLayer for layer in model.layers)
    assert [layer.block.policy for layer in model.layers] == [policy] * 2
    assert wrap_module.wrapped_policies(model) == {"layers.0": policy, "layers.1": policy}
    _assert_same_step(_step(model, x, original_params), expected)


@pytest.mark.parametrize("d_model,heads", [(48, 4), (160, 2)], ids=["head_dim12", "head_dim80"])
def test_swapped_encoder_with_a_head_dim_that_is_not_a_power_of_two_matches_plain(d_model, heads):
    # ViT-H's head_dim is 80: such layers are swapped too, and match torch's layer exactly.
    model = _encoder(d_model=d_model, heads=heads)
    plain = copy.deepcopy(model)
    x = _input(d_model=d_model)
    expected = _step(plain, x, dict(plain.named_parameters()))
    original_params = dict(model.named_parameters())
    memopt.wrap(model, policy="selective")
    assert all(type(layer) is FusedTransformerEncoderLayer for layer in model.layers)
    _assert_same_step(_step(model, x, original_params), expected)


def test_blocks_share_the_layers_parameters():
    model = _encoder()
    originals = list(model.layers)
    n_params = len(list(model.parameters()))
    memopt.wrap(model, policy="selective")
    for block, layer in zip((swapped.block for swapped in model.layers), originals):
        attn = layer.self_attn
        pairs = [
            (block.qkv.weight, attn.in_proj_weight), (block.qkv.bias, attn.in_proj_bias),
            (block.out_proj.weight, attn.out_proj.weight), (block.out_proj.bias, attn.out_proj.bias),
            (block.fc1.weight, layer.linear1.weight), (block.fc1.bias, layer.linear1.bias),
            (block.fc2.weight, layer.linear2.weight), (block.fc2.bias, layer.linear2.bias),
            (block.norm1.weight, layer.norm1.weight), (block.norm1.bias, layer.norm1.bias),
            (block.norm2.weight, layer.norm2.weight), (block.norm2.bias, layer.norm2.bias),
        ]  # fmt: skip
        assert all(a is b for a, b in pairs)
    assert len(list(model.parameters())) == n_params


@pytest.mark.parametrize("norm_first", [False, True])
def test_training_through_wrapped_model_trains_the_original_layers(norm_first):
    model = _encoder(norm_first=norm_first)
    plain = copy.deepcopy(model)
    originals = list(model.layers)
    x = _input()
    memopt.wrap(model, policy="selective")
    for m in (plain, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        m(x).square().mean().backward()
        optimizer.step()
    memopt.unwrap(model)
    assert all(a is b for a, b in zip(model.layers, originals))
    trained, reference = model.state_dict(), plain.state_dict()
    assert list(trained) == list(reference)
    for name in reference:
        torch.testing.assert_close(trained[name], reference[name], **F64_TOL, msg=lambda m: f"{name}: {m}")
    # The step moved the weights (so the comparison above is not of two untouched models).
    assert not torch.equal(trained["layers.0.linear1.weight"], _encoder(norm_first=norm_first).state_dict()["layers.0.linear1.weight"])


@pytest.mark.parametrize("bias", [True, False])
def test_checkpoint_saved_while_wrapped_loads_into_the_plain_model_and_back(bias):
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True, bias=bias, dtype=torch.float64),
        2, enable_nested_tensor=False,
    )  # fmt: skip
    plain = copy.deepcopy(model)
    memopt.wrap(model, policy="selective")
    assert isinstance(model.layers[0], FusedTransformerEncoderLayer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # "training" while wrapped
    saved = model.state_dict()
    assert list(saved) == list(plain.state_dict())
    plain.load_state_dict(saved)  # strict: every name matches
    x = _input()
    torch.testing.assert_close(plain(x), model(x), **F64_TOL)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    model.load_state_dict(plain.state_dict())  # and back into the wrapped model
    torch.testing.assert_close(model(x), plain(x), **F64_TOL)
    memopt.unwrap(model)
    torch.testing.assert_close(model(x), plain(x), **F64_TOL)


def test_wrapped_model_with_swapped_blocks_pickles(tmp_path):
    model = _encoder()
    plain = copy.deepcopy(model)
    memopt.wrap(model, policy="selective")
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded.layers[0], FusedTransformerEncoderLayer)
    assert list(loaded.state_dict()) == list(plain.state_dict())
    x = _input()
    torch.testing.assert_close(loaded(x), plain(x), **F64_TOL)
    memopt.unwrap(loaded)
    assert type(loaded.layers[0]) is nn.TransformerEncoderLayer
    torch.testing.assert_close(loaded(x), plain(x), atol=0, rtol=0)


def test_unwrap_restores_layers_and_state_dict():
    model = _encoder()
    plain = copy.deepcopy(model)
    originals = list(model.layers)
    memopt.wrap(model, policy="full")
    assert isinstance(model.layers[0], FusedTransformerEncoderLayer)
    assert list(model.state_dict()) == list(plain.state_dict())  # the layer's names, while wrapped too
    memopt.unwrap(model)
    assert all(a is b for a, b in zip(model.layers, originals))
    restored, reference = model.state_dict(), plain.state_dict()
    assert list(restored) == list(reference)
    for name in reference:
        assert torch.equal(restored[name], reference[name]), name
    x = _input()
    torch.testing.assert_close(model(x), plain(x), atol=0, rtol=0)


def test_causal_mask_through_the_encoder():
    model = _encoder(norm_first=True)
    plain = copy.deepcopy(model)
    x = _input()
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ, dtype=torch.float64)
    expected = _step(plain, x, dict(plain.named_parameters()), mask=mask, is_causal=True)
    original_params = dict(model.named_parameters())
    memopt.wrap(model, policy="selective")
    _assert_same_step(_step(model, x, original_params, mask=mask, is_causal=True), expected)
    # Without the is_causal hint the encoder detects the causal mask itself.
    _assert_same_step(_step(model, x, original_params, mask=mask), expected)


def test_unbatched_input_matches_plain():
    for batch_first in (True, False):
        model = _encoder(batch_first=batch_first)
        plain = copy.deepcopy(model)
        x = _input()[0]
        memopt.wrap(model, policy="selective")
        torch.testing.assert_close(model(x), plain(x), **F64_TOL)


def test_padding_mask_and_other_masks_raise():
    model = memopt.wrap(_encoder(), policy="selective")
    x = _input()
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    with pytest.raises(ValueError, match="src_key_padding_mask"):
        model(x, src_key_padding_mask=padding)
    with pytest.raises(ValueError, match="attn_mask must be causal"):
        model(x, mask=torch.zeros(SEQ, SEQ, dtype=torch.bool).fill_diagonal_(True))
    # The swapped layer takes the torch layer's call: the second positional argument is src_mask.
    swapped = model.layers[0]
    parameters = inspect.signature(type(swapped).forward).parameters
    assert list(parameters) == list(inspect.signature(nn.TransformerEncoderLayer.forward).parameters)
    with pytest.raises(ValueError, match="attn_mask must be causal"):
        swapped(x, torch.zeros(SEQ, SEQ))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_padding_mask_in_inference_fast_path_raises():
    # An encoder built with nested tensors enabled converts src to a nested tensor in inference
    # when given a padding mask, reading layers[0]'s attention and linear weights first.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True, dtype=torch.float64)
    model = memopt.wrap(nn.TransformerEncoder(layer, 2), policy="selective").eval()
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[0, -2:] = True
    with torch.no_grad(), pytest.raises(ValueError, match="nested tensor.*src_key_padding_mask"):
        model(_input(), src_key_padding_mask=padding)


def test_selective_saves_fewer_bytes_than_plain():
    model = _encoder(3)
    x = _input()
    exclude = list(model.parameters()) + [x]

    def counted():
        with memopt.SavedTensorCounter(exclude=exclude) as counter:
            model(x)
        return counter.total_bytes

    plain_bytes = counted()
    memopt.wrap(model, policy="selective")
    wrapped_bytes = counted()
    # Each block saves its selective set plus its input; the first input is x (excluded), the
    # others are the previous block's outputs.
    per_layer = saved_bytes_per_layer(
        "selective", D_MODEL, HEADS, FFN, activation="relu", norm_first=False, dtype=torch.float64, batch=BATCH, seq=SEQ
    )
    assert wrapped_bytes == 3 * per_layer + 2 * BATCH * SEQ * D_MODEL * 8
    assert wrapped_bytes < plain_bytes


@pytest.mark.parametrize(
    "make_model,reason",
    [
        (lambda: _encoder(dropout=0.1), "dropout > 0"),
        (lambda: _encoder(d_model=600, heads=2), "head_dim 300 unsupported (above 256)"),
        (lambda: _encoder().half(), "float16 unsupported by CPU attention"),
    ],
    ids=["dropout", "head_dim", "dtype"],
)
def test_unsupported_layers_fall_back_to_checkpointing(make_model, reason):
    model = make_model()
    plain = copy.deepcopy(model)
    assert not memopt.FusedCheckpointBlock.supports(model.layers[0]), reason
    x = _input(d_model=model.layers[0].self_attn.embed_dim).to(model.layers[0].linear1.weight.dtype)
    torch.manual_seed(3)
    expected = _step(plain, x, dict(plain.named_parameters()))
    originals = list(model.layers)
    memopt.wrap(model, policy="selective")
    assert all(a is b for a, b in zip(model.layers, originals))
    assert all(isinstance(getattr(layer, "_memopt_wrap_layer", None), wrap_module._LayerWrap) for layer in model.layers)
    torch.manual_seed(3)
    got = _step(model, x, dict(model.named_parameters()))
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    memopt.unwrap(model)
    assert not any(hasattr(layer, "_memopt_wrap_layer") for layer in model.layers)


def test_offloading_layers_are_not_swapped():
    model = _encoder()
    plain = copy.deepcopy(model)
    x = _input()
    expected = _step(plain, x, dict(plain.named_parameters()))
    original_params = dict(model.named_parameters())
    memopt.wrap(model, policy="full", offload={0: True})
    assert type(model.layers[0]) is nn.TransformerEncoderLayer
    assert isinstance(model.layers[1], FusedTransformerEncoderLayer)
    _assert_same_step(_step(model, x, original_params), expected)


def _layer(heads=HEADS, dropout=0.0, d_model=D_MODEL, **kwargs):
    return nn.TransformerEncoderLayer(d_model, heads, FFN, dropout=dropout, **kwargs)


class _CustomLayer(nn.TransformerEncoderLayer):
    def forward(self, src, *args, **kwargs):
        return super().forward(src, *args, **kwargs) * 2


def test_supports_accepts_what_the_block_reproduces_and_rejects_the_rest():
    supports = memopt.FusedCheckpointBlock.supports
    assert supports(_layer())
    assert supports(_layer(activation=nn.GELU(), norm_first=True, batch_first=True))
    assert supports(_layer(bias=False))
    assert supports(_layer(heads=8))  # head_dim 8: any from 1 to 256
    hooked = _layer()
    hooked.register_forward_hook(lambda *args: None)
    odd_eps = _layer()
    odd_eps.norm2.eps = 1e-6
    fp_mixed = _layer()
    fp_mixed.linear2.double()
    attention_dropout_only = _layer()
    attention_dropout_only.self_attn.dropout = 0.1
    rejected = {
        "dropout": _layer(dropout=0.1),
        "attention dropout": attention_dropout_only,
        "silu": _layer(activation=nn.SiLU()),
        "head_dim 264": _layer(d_model=528, heads=2),
        "hook": hooked,
        "subclass forward": _CustomLayer(D_MODEL, HEADS, FFN, dropout=0.0),
        "eps": odd_eps,
        "dtypes": fp_mixed,
        "not a layer": nn.Linear(4, 4),
    }
    for name, layer in rejected.items():
        assert not supports(layer), name


def test_from_torch_copies_unless_sharing():
    layer = _layer(norm_first=True).double()
    copied = memopt.FusedCheckpointBlock.from_torch(layer, policy="full")
    shared = memopt.FusedCheckpointBlock.from_torch(layer, policy="full", share_parameters=True)
    assert copied.qkv.weight is not layer.self_attn.in_proj_weight
    assert shared.qkv.weight is layer.self_attn.in_proj_weight
    assert all(p.device.type == "cpu" for p in shared.parameters())
    x = torch.randn(SEQ, BATCH, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(copied(x), layer(x), **F64_TOL)
    torch.testing.assert_close(shared(x), layer(x), **F64_TOL)


def test_encoder_reads_from_the_swapped_layer():
    swapped = memopt.torch_interop.swap_for_fused_block(_layer(batch_first=True), "selective")
    block, attn = swapped.block, swapped.self_attn
    assert attn.batch_first and attn._qkv_same_embed_dim and attn.num_heads == HEADS and attn.embed_dim == D_MODEL
    assert attn.in_proj_weight is block.qkv.weight and attn.out_proj is block.out_proj
    assert swapped.linear1 is block.fc1 and swapped.linear2 is block.fc2 and swapped.activation_relu_or_gelu
    assert swapped.norm1 is block.norm1 and swapped.norm2 is block.norm2
    # The views register nothing: the parameters are the block's twelve own.
    assert len(dict(swapped.named_parameters())) == 12


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_swapped_encoder_compiles_fullgraph(policy, compile_cache):
    model = _encoder(norm_first=True)
    plain = copy.deepcopy(model)
    x = _input()
    expected = _step(plain, x, dict(plain.named_parameters()))
    original_params = dict(model.named_parameters())
    memopt.wrap(model, policy=policy)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _assert_same_step(_step(compiled, x, original_params), expected)


def test_plan_predicts_the_swapped_blocks_bytes():
    model = _encoder(3)
    x = _input()
    exclude = list(model.parameters())
    measured = {}
    for policy in ("none", "selective", "full"):
        memopt.wrap(model, policy=policy)
        assert all(type(layer) is FusedTransformerEncoderLayer for layer in model.layers)
        with memopt.SavedTensorCounter(exclude=exclude) as counter:
            model(x.clone().requires_grad_())
        measured[policy] = counter.total_bytes
        memopt.unwrap(model)
    plan = memopt.plan(model, (x.clone().requires_grad_(),), budget_bytes=10**9)
    for policy in ("none", "selective", "full"):
        plan.policies = [policy] * 3
        assert plan.predicted_bytes == measured[policy], policy
    assert measured["full"] < measured["selective"] < measured["none"]


@pytest.mark.parametrize("batch_first", [True, False])
def test_eval_inference_matches_plain(batch_first):
    # In eval mode without grad torch's layer takes its fused fast path; the block must agree.
    model = _encoder(batch_first=batch_first).eval()
    plain = copy.deepcopy(model)
    x = _input(batch_first)
    memopt.wrap(model, policy="selective")
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), **F64_TOL)


@pytest.fixture
def attention_takes_half_types_only(monkeypatch):
    """Make the block believe CPU attention takes only fp16/bf16, as CUDA's does, so the float32
    layer path (swapped, block under autocast, torch layer otherwise) runs here."""
    import types

    import memopt.torch_interop as torch_interop

    half_only = types.SimpleNamespace(supported_dtypes=lambda device: (torch.float16, torch.bfloat16))
    monkeypatch.setattr(torch_interop, "_attention_ops", half_only)


def _float32_encoder(norm_first=True):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _layer_params_by_plain_name(layers):
    # The swapped blocks share these Parameter objects; the plain encoder's names find them.
    return {f"layers.{i}.{name}": p for i, layer in enumerate(layers) for name, p in layer.named_parameters()}


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_model_cast_to_bfloat16_after_wrap_runs_the_torch_layer(policy):
    # model.bfloat16() after wrap: the block's CPU kernels take float32 / float64, and the
    # forward raised inside memopt.layer_norm. The torch layer runs instead, checkpointed, on
    # the same (shared, now bfloat16) parameters: the plain bfloat16 model's numbers exactly.
    model = _float32_encoder()
    plain = copy.deepcopy(model).bfloat16()
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = _step(plain, x, dict(plain.named_parameters()))
    originals = list(model.layers)
    memopt.wrap(model, policy=policy)
    model.bfloat16()
    got = _step(model, x, _layer_params_by_plain_name(originals))
    _assert_step_close(got, expected, atol=0, rtol=0)


def test_float32_layer_is_swapped_only_for_autocast(attention_takes_half_types_only):
    layer = _float32_encoder().layers[0]
    assert not memopt.FusedCheckpointBlock.supports(layer)
    assert memopt.FusedCheckpointBlock.supports(layer, allow_autocast=True)
    # float16 weights are not an autocast case: the block would not reproduce them.
    assert memopt.FusedCheckpointBlock.supports(layer.half(), allow_autocast=True)
    assert not memopt.FusedCheckpointBlock.supports(_layer().double(), allow_autocast=True)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_float32_swap_runs_the_torch_layer_outside_autocast(attention_takes_half_types_only, policy):
    model = _float32_encoder()
    plain = copy.deepcopy(model)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    expected = _step(plain, x, dict(plain.named_parameters()))
    originals = list(model.layers)
    memopt.wrap(model, policy=policy)
    assert all(isinstance(layer, FusedTransformerEncoderLayer) for layer in model.layers)
    # Outside autocast the block hands the call to the float32 torch layer, checkpointed:
    # bit-identical to the plain model, and saving less than it.
    got = _step(model, x, _layer_params_by_plain_name(originals))
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], atol=0, rtol=0)
    exclude = list(model.parameters())
    assert memopt.saved_bytes(model, x.clone().requires_grad_(), exclude=exclude) < memopt.saved_bytes(
        plain, x.clone().requires_grad_(), exclude=list(plain.parameters())
    )
    memopt.unwrap(model)
    assert all(a is b for a, b in zip(model.layers, originals))
    assert set(model.state_dict()) == set(plain.state_dict())


def test_float32_swap_runs_the_block_under_autocast(attention_takes_half_types_only):
    model = _float32_encoder()
    plain = copy.deepcopy(model)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _step(plain, x, dict(plain.named_parameters()))
    originals = list(model.layers)
    memopt.wrap(model, policy="selective")
    calls = []
    model.layers[0].block.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    fallback = model.layers[0].torch_layer
    fallback.register_forward_pre_hook(lambda module, args: calls.append("torch layer"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _step(model, x, _layer_params_by_plain_name(originals))
    # The fused block ran, not the torch layer; results agree to bfloat16 rounding.
    assert calls == ["FusedCheckpointBlock"]
    _assert_step_close(got, expected, **BF16_TOL)


def test_float32_swap_survives_deepcopy(attention_takes_half_types_only):
    model = memopt.wrap(_float32_encoder(), policy="full")
    twin = copy.deepcopy(model)
    swapped, twin_swapped = model.layers[0], twin.layers[0]
    # The copy's fallback layer shares the copy's parameters, not the original's.
    assert twin_swapped.torch_layer is not swapped.torch_layer
    assert twin_swapped.torch_layer.linear1.weight is twin_swapped.block.fc1.weight
    assert twin_swapped.block.fc1.weight is not swapped.block.fc1.weight
    x = torch.randn(BATCH, SEQ, D_MODEL)
    torch.testing.assert_close(twin(x), model(x), atol=0, rtol=0)


@gpu
def test_gpu_float32_encoder_swapped_runs_fused_under_autocast_and_torch_outside():
    model = _float32_encoder().cuda()
    plain = copy.deepcopy(model)
    originals = list(model.layers)
    x = torch.randn(BATCH, 128, D_MODEL, device="cuda")
    expected_fp32 = _step(plain, x, dict(plain.named_parameters()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected_bf16 = _step(plain, x, dict(plain.named_parameters()))
    memopt.wrap(model, policy="selective")
    assert all(isinstance(layer, FusedTransformerEncoderLayer) for layer in model.layers)
    params = _layer_params_by_plain_name(originals)
    got_fp32 = _step(model, x, params)
    # The torch layer ran: the same forward ops, exactly; gradients to the tolerance of CUDA's
    # attention backward, which may accumulate in another order.
    torch.testing.assert_close(got_fp32[0], expected_fp32[0], atol=0, rtol=0)
    torch.testing.assert_close(got_fp32[1], expected_fp32[1], atol=1e-5, rtol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got_bf16 = _step(model, x, params)
    _assert_step_close(got_bf16, expected_bf16, **BF16_TOL)


def test_float32_fallback_uses_the_blocks_current_parameters(attention_takes_half_types_only):
    # FSDP2 (and other wrappers) replace a module's parameters: the torch layer must run on the
    # block's current ones, and gradients must reach them.
    model = memopt.wrap(_float32_encoder(), policy="full")
    reference = copy.deepcopy(model)
    swapped = model.layers[0]
    replaced = nn.Parameter(swapped.block.fc1.weight.detach() * 2)
    swapped.block.fc1.weight = replaced
    with torch.no_grad():
        reference.layers[0].block.fc1.weight.mul_(2)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    out = model(x)
    torch.testing.assert_close(out, reference(x), atol=0, rtol=0)
    out.square().mean().backward()
    assert replaced.grad is not None and replaced.grad.abs().sum() > 0
    assert swapped.torch_layer.linear1.weight.grad is None
