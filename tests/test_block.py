"""FusedCheckpointBlock: against the eager reference block and nn.TransformerEncoderLayer, per
policy and configuration; saved bytes equal to the formula; determinism; interop; errors."""

import copy
import importlib

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, prune

import memopt
from memopt.ops.attention import cpu_backend
from memopt.block import EagerTransformerBlock, saved_bytes_per_layer, saved_bytes_per_token

from helpers import gpu, needs_triton_interpreter

POLICIES = ["none", "selective", "full"]

# Small shapes: attention may run in the Triton interpreter. Each config exercises a different
# corner: pre/post norm, both norms, every activation, GQA, causal, bias on and off.
CONFIGS = {
    "pre-ln-gelu": dict(d_ff=48, activation="gelu", norm="layernorm", norm_first=True),
    "post-ln-relu-causal": dict(d_ff=40, activation="relu", norm="layernorm", norm_first=False, causal=True),
    "pre-rms-swiglu-gqa-causal-nobias": dict(
        d_ff=40, n_kv_heads=2, activation="swiglu", norm="rmsnorm", causal=True, bias=False
    ),
    "post-rms-gelu_tanh-gqa": dict(d_ff=48, n_kv_heads=1, activation="gelu_tanh", norm="rmsnorm", norm_first=False),
    "pre-ln-silu-nobias-causal": dict(d_ff=32, activation="silu", bias=False, causal=True),
}
D_MODEL, N_HEADS = 64, 4  # head_dim 16, the smallest the attention kernels take

# float64 on CPU: attention keeps its log-sum-exp in the accumulation dtype (float64 here, since
# c3268fe), so the block agrees with the eager float64 reference to ~1e-14; these tolerances
# leave two orders of magnitude and still catch a float32 step (~1e-7) in a float64 path.
F64_TOL = {"atol": 1e-10, "rtol": 1e-9}


@pytest.fixture(autouse=True)
def native_cpu_attention():
    """float64 needs attention's native CPU path (the Triton interpreter takes float32 only);
    tests that exercise the Triton kernels in the interpreter switch back explicitly."""
    with cpu_backend("native"):
        yield


def _make(config, policy="selective", dtype=torch.float64, device="cpu", **overrides):
    kwargs = {**config, **overrides}
    return memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy=policy, dtype=dtype, device=device, **kwargs)


def _run(block, x, grad, *args, **kwargs):
    """Output, input gradient and parameter gradients (by name) of one forward + backward."""
    x = x.detach().clone().requires_grad_()
    out = block(x, *args, **kwargs)
    names, params = zip(*[(n, p) for n, p in block.named_parameters()])
    grads = torch.autograd.grad(out, (x, *params), grad)
    return out.detach(), grads[0], dict(zip(names, grads[1:]))


def _assert_runs_close(got, expected, **tol):
    out, grad_x, grads = got
    out_e, grad_x_e, grads_e = expected
    torch.testing.assert_close(out, out_e, **tol)
    torch.testing.assert_close(grad_x, grad_x_e, **tol)
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}  # torch.compile's prefix
    assert grads.keys() == grads_e.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_e[name], **tol, msg=lambda m: f"{name}: {m}")


def _assert_runs_equal(got, expected):
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    for name in got[2]:
        assert torch.equal(got[2][name], expected[2][name]), name
    assert got[2].keys() == expected[2].keys()


# "auto" is what a user's block runs on CPU: the C++ flash kernels ("cpu_flash"), with or without a
# mask or dropout.
@pytest.mark.parametrize("attention_backend", ["native", "auto"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_eager_block_float64(config, policy, attention_backend):
    block = _make(config, policy)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    with cpu_backend(attention_backend):
        got = _run(block, x, grad)
    _assert_runs_close(got, _run(block.to_eager(), x, grad), **F64_TOL)


@needs_triton_interpreter
@pytest.mark.parametrize("policy", POLICIES)
def test_matches_eager_block_float32_triton_interpreter(policy):
    block = _make(CONFIGS["pre-rms-swiglu-gqa-causal-nobias"], policy, dtype=torch.float32)
    x = torch.randn(2, 11, D_MODEL)
    grad = torch.randn_like(x)
    expected = _run(block.to_eager(), x, grad)
    with cpu_backend("triton"):
        got = _run(block, x, grad)
    _assert_runs_close(got, expected, atol=1e-4, rtol=1e-4)


def test_parameter_names_and_shapes():
    block = memopt.FusedCheckpointBlock(128, 8, 96, n_kv_heads=2, activation="swiglu")
    shapes = {name: tuple(p.shape) for name, p in block.named_parameters()}
    assert shapes == {
        "norm1.weight": (128,), "norm1.bias": (128,), "qkv.weight": ((8 + 2 * 2) * 16, 128), "qkv.bias": (192,),
        "out_proj.weight": (128, 128), "out_proj.bias": (128,), "norm2.weight": (128,), "norm2.bias": (128,),
        "fc1.weight": (192, 128), "fc1.bias": (192,), "fc2.weight": (128, 96), "fc2.bias": (128,),
    }  # fmt: skip
    rms = memopt.FusedCheckpointBlock(64, 4, norm="rmsnorm", bias=False)
    assert [n for n, _ in rms.named_parameters()] == [
        "norm1.weight", "qkv.weight", "out_proj.weight", "norm2.weight", "fc1.weight", "fc2.weight"
    ]


# ----------------------------------------------------------------------------------------------
# Interop with nn.TransformerEncoderLayer and the eager block.


def _torch_layer_grads(layer):
    attn = layer.self_attn
    return {
        "qkv.weight": attn.in_proj_weight.grad, "qkv.bias": attn.in_proj_bias.grad,
        "out_proj.weight": attn.out_proj.weight.grad, "out_proj.bias": attn.out_proj.bias.grad,
        "fc1.weight": layer.linear1.weight.grad, "fc1.bias": layer.linear1.bias.grad,
        "fc2.weight": layer.linear2.weight.grad, "fc2.bias": layer.linear2.bias.grad,
        "norm1.weight": layer.norm1.weight.grad, "norm1.bias": layer.norm1.bias.grad,
        "norm2.weight": layer.norm2.weight.grad, "norm2.bias": layer.norm2.bias.grad,
    }  # fmt: skip


@pytest.mark.parametrize(
    "norm_first,batch_first,activation,causal",
    [(True, True, "gelu", False), (False, True, "relu", True), (False, False, "gelu", False), (True, False, "relu", True)],
)
def test_from_torch_matches_transformer_encoder_layer(norm_first, batch_first, activation, causal):
    layer = nn.TransformerEncoderLayer(
        D_MODEL, N_HEADS, 48, dropout=0.1, activation=activation, batch_first=batch_first,
        norm_first=norm_first, dtype=torch.float64,
    ).eval()  # fmt: skip
    block = memopt.FusedCheckpointBlock.from_torch(layer, policy="selective")
    assert not block.training and block.dropout == 0.1 and block.batch_first == batch_first
    seq, batch = 9, 3
    x = torch.randn((batch, seq, D_MODEL) if batch_first else (seq, batch, D_MODEL), dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=torch.float64) if causal else None

    x_torch = x.clone().requires_grad_()
    out_torch = layer(x_torch, src_mask=mask, is_causal=causal)
    grad = torch.randn_like(out_torch)
    out_torch.backward(grad)
    got = _run(block, x, grad, mask)
    _assert_runs_close(got, (out_torch.detach(), x_torch.grad, _torch_layer_grads(layer)), **F64_TOL)


def test_from_torch_rejects_unsupported_activation():
    layer = nn.TransformerEncoderLayer(D_MODEL, N_HEADS, 48, activation=nn.Tanh())
    with pytest.raises(ValueError, match="activation .* is not relu or gelu"):
        memopt.FusedCheckpointBlock.from_torch(layer)


def test_state_dict_round_trip_with_eager_block():
    config = CONFIGS["pre-rms-swiglu-gqa-causal-nobias"]
    eager = EagerTransformerBlock(D_MODEL, N_HEADS, dtype=torch.float64, **config)
    fused = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, dtype=torch.float64, policy="full", **config)
    fused.load_state_dict(eager.state_dict())
    back = fused.to_eager()
    assert back.state_dict().keys() == eager.state_dict().keys()
    for name, value in eager.state_dict().items():
        assert torch.equal(back.state_dict()[name], value)
        assert torch.equal(fused.state_dict()[name], value)
    x = torch.randn(2, 7, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(fused(x), eager(x), **F64_TOL)
    again = memopt.FusedCheckpointBlock.from_eager(back, policy="none")
    assert again.policy == "none" and torch.equal(again(x), fused(x))


def test_to_eager_and_from_eager_keep_frozen_parameters():
    block = _make(CONFIGS["pre-ln-gelu"])
    block.qkv.requires_grad_(False)
    block.norm2.weight.requires_grad_(False)
    frozen = {name for name, p in block.named_parameters() if not p.requires_grad}
    assert frozen == {"qkv.weight", "qkv.bias", "norm2.weight"}
    eager = block.to_eager()
    assert {name for name, p in eager.named_parameters() if not p.requires_grad} == frozen
    back = memopt.FusedCheckpointBlock.from_eager(eager)
    assert {name for name, p in back.named_parameters() if not p.requires_grad} == frozen


def test_conversions_keep_eval_mode():
    # to_fused() returned a training block from an eval one: dropout at inference (0.74 off).
    eager = EagerTransformerBlock(D_MODEL, N_HEADS, dropout=0.1, dtype=torch.float64).eval()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    for fused in (eager.to_fused(), memopt.FusedCheckpointBlock.from_eager(eager)):
        assert not fused.training
        torch.testing.assert_close(fused(x), eager(x), **F64_TOL)
    assert not fused.to_eager().training
    assert eager.train().to_fused().training


def test_conversions_of_a_parametrized_block_carry_the_computed_weight():
    # The forward runs a parametrized submodule (weight_norm on fc1); to_eager() raised
    # load_state_dict's missing / unexpected keys (fc1.parametrizations.weight.original0).
    block = _make(CONFIGS["pre-ln-gelu"])
    parametrizations.weight_norm(block.fc1)
    block.qkv.weight.requires_grad_(False)
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    eager = block.to_eager()
    assert eager.fc1.weight.requires_grad and not eager.qkv.weight.requires_grad
    torch.testing.assert_close(eager.fc1.weight, block.fc1.weight, atol=0, rtol=0)
    for module in (block, eager):
        module.qkv.weight.requires_grad_(True)
    expected = _run(block, x, grad)
    got = _run(eager, x, grad)
    torch.testing.assert_close(got[0], expected[0], **F64_TOL)
    torch.testing.assert_close(got[1], expected[1], **F64_TOL)  # the input's gradient
    parametrizations.weight_norm(eager.fc2)
    torch.testing.assert_close(eager.to_fused()(x), eager(x), **F64_TOL)


def test_hooks_on_submodules_raise_and_parametrizations_work():
    # The block reads its submodules' parameters without calling them: their hooks would not
    # run. torch.nn.utils.prune recomputes fc1.weight in a forward pre-hook; the eager block
    # (which calls fc1) is the reference for what the pruned block should compute.
    block = _make(CONFIGS["pre-ln-gelu"])
    eager = block.to_eager()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    for module in (block, eager):
        prune.l1_unstructured(module.fc1, "weight", 0.5)
        with torch.no_grad():
            module.fc1.weight_orig.mul_(3.0)  # an optimizer step: fc1.weight is stale until the hook runs
    with pytest.raises(RuntimeError, match="submodule 'fc1' has module hooks"):
        block(x)
    for module in (block, eager):
        prune.remove(module.fc1, "weight")  # bakes the mask into fc1.weight, drops the hook
    torch.testing.assert_close(block(x), eager(x), **F64_TOL)

    handle = block.norm2.register_forward_hook(lambda module, args, out: None)
    with pytest.raises(RuntimeError, match="submodule 'norm2' has module hooks"):
        block(x)
    handle.remove()

    # A parametrization works: getattr computes the weight, which the block reads.
    for module in (block, eager):
        parametrizations.weight_norm(module.fc2)
    grad = torch.randn_like(x)
    _assert_runs_close(_run(block, x, grad), _run(eager, x, grad), **F64_TOL)


def test_adapters_and_patched_forwards_on_submodules_raise():
    # A PEFT LoRA layer in place of fc1 keeps the base weight as .weight: read without calling
    # it, the adapter had no effect (same output with the adapter on and off, no lora gradient).
    peft = pytest.importorskip("peft")
    holder = nn.ModuleDict({"block": _make(CONFIGS["pre-ln-gelu"])})
    model = peft.get_peft_model(holder, peft.LoraConfig(target_modules=["fc1"], r=2, init_lora_weights=False))
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="submodule 'fc1' is a peft"):
        model.base_model.model["block"](x)

    block = _make(CONFIGS["pre-ln-gelu"])
    block.out_proj.forward = lambda t: 2 * t  # patched onto the instance: would not run either
    with pytest.raises(RuntimeError, match="submodule 'out_proj' is a torch.nn.modules.linear.Linear whose forward"):
        block(x)
    del block.out_proj.forward
    eager = block.to_eager()
    torch.testing.assert_close(block(x), eager(x), **F64_TOL)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_eps_set_on_the_submodules_is_used(norm):
    # norm1.eps is a plain attribute, as on any nn.LayerNorm: the fused block read its own copy
    # and ignored a new value (0.53 output difference at eps 1.0 on small inputs).
    block = _make(CONFIGS["pre-ln-gelu"], norm=norm)
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64) * 1e-2
    grad = torch.randn_like(x)
    block.norm1.eps = block.norm2.eps = 0.5
    eager = block.to_eager()
    assert (eager.norm1.eps, eager.norm2.eps, block.eps) == (0.5, 0.5, 0.5)
    _assert_runs_close(_run(block, x, grad), _run(eager, x, grad), **F64_TOL)
    block.eps = 1.0  # sets both
    assert (block.norm1.eps, block.norm2.eps) == (1.0, 1.0)
    eager.norm1.eps = eager.norm2.eps = 1.0
    _assert_runs_close(_run(block, x, grad), _run(eager, x, grad), **F64_TOL)

    # One eps runs both norms: norms that disagree are refused, not silently unified.
    block.norm2.eps = 0.1
    with pytest.raises(ValueError, match=r"norm1.eps \(1.0\) and norm2.eps \(0.1\)"):
        block(x)
    assert block.to_eager().norm2.eps == 0.1
    eager.norm2.eps = 0.1
    with pytest.raises(ValueError, match="norm2.eps"):
        eager.to_fused()
    with pytest.raises(ValueError, match="eps must be a non-negative finite float"):
        block.eps = float("nan")


def test_batch_first_false_takes_seq_first_input():
    block = _make(CONFIGS["pre-ln-gelu"], batch_first=False)
    reference = _make(CONFIGS["pre-ln-gelu"])
    reference.load_state_dict(block.state_dict())
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(block(x.transpose(0, 1)), reference(x).transpose(0, 1), **F64_TOL)


@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_causal_masks_match_causal_flag(mask_kind):
    block = _make(CONFIGS["pre-ln-gelu"])
    causal = _make(CONFIGS["pre-ln-gelu"], causal=True)
    causal.load_state_dict(block.state_dict())
    seq = 6
    mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=torch.float64)
    if mask_kind == "bool":
        mask = torch.isneginf(mask)
    x = torch.randn(2, seq, D_MODEL, dtype=torch.float64)
    expected = causal(x)
    assert torch.equal(block(x, mask), expected)
    assert torch.equal(block(x, mask, is_causal=True), expected)
    assert not torch.allclose(block(x), expected)


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention_backend", [pytest.param("triton", marks=needs_triton_interpreter), "native", "auto"])
@pytest.mark.parametrize("policy", POLICIES)
def test_head_dim_that_is_not_a_power_of_two_matches_eager_block(policy, attention_backend):
    # d_model 96 over 4 heads: head_dim 24, between the powers of two the Triton kernels tile (ViT-H's
    # 80 and Phi-3's 96 take the same paths), with grouped-query heads, a causal mask and dropout
    # 0 (the eager block draws its own mask).
    dtype, tol = (torch.float32, {"atol": 1e-4, "rtol": 1e-4}) if attention_backend == "triton" else (torch.float64, F64_TOL)
    config = CONFIGS["pre-rms-swiglu-gqa-causal-nobias"]
    block = memopt.FusedCheckpointBlock(96, 4, policy=policy, dtype=dtype, **config)
    x = torch.randn(2, 13, 96, dtype=dtype)
    grad = torch.randn_like(x)
    expected = _run(block.to_eager().double(), x.double(), grad.double())
    with cpu_backend(attention_backend):
        got = _run(block, x, grad)
    _assert_runs_close(tuple(_as_double(t) for t in got), expected, **tol)


def _as_double(t):
    return {k: v.double() for k, v in t.items()} if isinstance(t, dict) else t.double()


# Determinism and policy switching.


@pytest.mark.parametrize("attention_backend", [pytest.param("triton", marks=needs_triton_interpreter), "native", "auto"])
@pytest.mark.parametrize("config", [CONFIGS["pre-ln-gelu"], CONFIGS["post-rms-gelu_tanh-gqa"]], ids=["pre", "post"])
def test_same_seed_bit_identical_across_policies_with_dropout(config, attention_backend):
    block = _make(config, dtype=torch.float32, dropout=0.2, causal=True)
    x = torch.randn(2, 9, D_MODEL)
    grad = torch.randn_like(x)
    runs = {}
    # "triton": the kernels' own dropout masks, in the interpreter; "auto": the C++ flash kernels'.
    with cpu_backend(attention_backend):
        for policy in POLICIES:
            block.policy = policy
            torch.manual_seed(123)
            runs[policy] = _run(block, x, grad)
        torch.manual_seed(124)
        other_seed = _run(block, x, grad)
    for policy in POLICIES[1:]:
        _assert_runs_equal(runs[policy], runs["none"])
    assert not torch.equal(other_seed[0], runs["none"][0])
    block.eval()
    assert not torch.allclose(block(x), runs["none"][0])  # dropout was active in training


def test_eval_mode_draws_no_random_numbers():
    block = _make(CONFIGS["pre-ln-gelu"], dropout=0.3).eval()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    state = torch.get_rng_state()
    block(x)
    assert torch.equal(torch.get_rng_state(), state)


def _train(model, schedule, steps=4, seed=7):
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model.policy = schedule[step % len(schedule)]
        x = torch.randn(2, 8, D_MODEL)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def test_policy_switching_mid_training_gives_same_trajectory():
    torch.manual_seed(0)
    model = memopt.FusedCheckpointStack(2, D_MODEL, N_HEADS, 48, dropout=0.1, causal=True)
    steady = _train(copy.deepcopy(model), ["selective"])
    switched = _train(copy.deepcopy(model), ["selective", "full", "none", ["full", "none"]])
    for (name, a), (_, b) in zip(steady.named_parameters(), switched.named_parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(steady.layers[0].qkv.weight, model.layers[0].qkv.weight)


def test_stack_mixed_policies_and_sequential():
    torch.manual_seed(0)
    stack = memopt.FusedCheckpointStack(3, D_MODEL, N_HEADS, 48, policy=["full", "selective", "none"], dtype=torch.float64)
    assert stack.policy == ["full", "selective", "none"]
    eager_sequential = nn.Sequential(*[layer.to_eager() for layer in stack.layers])
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    got = _run(stack, x, grad)
    for reference in (nn.Sequential(*stack.layers), eager_sequential):
        expected = _run(reference, x, grad)
        torch.testing.assert_close(got[0], expected[0], **F64_TOL)
        torch.testing.assert_close(got[1], expected[1], **F64_TOL)
        for a, b in zip(got[2].values(), expected[2].values(), strict=True):
            torch.testing.assert_close(a, b, **F64_TOL)
    with pytest.raises(ValueError, match="policy must be one value or a list of 3"):
        stack.policy = ["full", "none"]


# ----------------------------------------------------------------------------------------------
# Saved bytes.

SAVED_CASES = [
    ("pre-ln-gelu", torch.float32, 0.0),
    ("post-ln-relu-causal", torch.float32, 0.1),
    ("pre-rms-swiglu-gqa-causal-nobias", torch.float64, 0.1),
    ("post-rms-gelu_tanh-gqa", torch.float64, 0.0),
]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,dtype,dropout", SAVED_CASES, ids=[c[0] for c in SAVED_CASES])
def test_saved_bytes_equal_formula(name, dtype, dropout, policy, batch_first):
    config = CONFIGS[name]
    block = _make(config, policy, dtype=dtype, dropout=dropout, batch_first=batch_first)
    batch, seq = 3, 10
    shape = (batch, seq, D_MODEL) if batch_first else (seq, batch, D_MODEL)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    counted = memopt.saved_bytes(block, x)
    formula_args = {k: v for k, v in config.items() if k in ("d_ff", "n_kv_heads", "activation", "norm", "norm_first")}
    expected = saved_bytes_per_layer(
        policy, D_MODEL, N_HEADS, batch=batch, seq=seq, dropout=dropout, dtype=dtype, batch_first=batch_first,
        **formula_args,
    )  # fmt: skip
    assert counted == expected


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("batch,seq", [(3, 10), (1, 10), (3, 1)])
def test_saved_bytes_formula_counts_the_seq_first_blocks_input_copy(batch, seq, policy):
    # batch_first=False: the block saves its batch-first copy of the input, d_model values per
    # token more than a batch-first block; none where batch or seq is 1 (the transpose is a view).
    block = _make(CONFIGS["pre-ln-gelu"], policy, batch_first=False)
    x = torch.randn(seq, batch, D_MODEL, dtype=torch.float64, requires_grad=True)
    formula = {"d_ff": 48, "dtype": torch.float64, "batch": batch, "seq": seq}
    copy_bytes = batch * seq * D_MODEL * 8 if batch > 1 and seq > 1 else 0
    counted = memopt.saved_bytes(block, x)
    assert counted == saved_bytes_per_layer(policy, D_MODEL, N_HEADS, batch_first=True, **formula) + copy_bytes
    assert counted == saved_bytes_per_layer(policy, D_MODEL, N_HEADS, batch_first=False, **formula)


def test_saved_bytes_formula_by_hand_and_ordering():
    # Pre-norm layernorm, d_model 2048, 16 heads, d_ff 8192, bf16: qkv 3*2048, attention out
    # 2048 and h 2048 values of 2 bytes, fc1 output 8192, lse 16 floats, 2 x (mean, rstd).
    kwargs = dict(d_ff=8192, dtype=torch.bfloat16)
    selective = saved_bytes_per_token("selective", 2048, 16, **kwargs)
    assert selective == 2 * (3 * 2048 + 2048 + 2048 + 8192) + 16 * 4 + 2 * 2 * 4
    assert saved_bytes_per_token("none", 2048, 16, **kwargs) == selective + 2 * (2048 + 2048 + 8192)
    assert saved_bytes_per_token("full", 2048, 16, **kwargs) == 0


def test_selective_saves_less_than_eager():
    # d_ff = 4 d_model. About 0.60x here; the 0.6x target is for the GPU at d_model 2048, where
    # the eager block's flash attention saves no probabilities but norm stats weigh less.
    block = memopt.FusedCheckpointBlock(64, 4, 256)
    x = torch.randn(2, 16, 64, requires_grad=True)
    fused = memopt.saved_bytes(block, x)
    eager = memopt.saved_bytes(block.to_eager(), x)
    assert 0 < fused < 0.62 * eager


# ----------------------------------------------------------------------------------------------
# autocast, torch.compile.


def test_autocast_bf16_cpu_matches_eager_under_autocast():
    block = _make(CONFIGS["pre-ln-gelu"], dtype=torch.float32)
    eager = block.to_eager()
    x = torch.randn(2, 8, D_MODEL)
    grad = torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(block, x, grad)
        expected = _run(eager, x, grad)
    assert got[0].dtype == expected[0].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in got[2].values())
    # Both round the matmul inputs and outputs to bf16 (8 mantissa bits): compare at bf16 scale.
    _assert_runs_close(got, expected, atol=5e-2, rtol=5e-2)
    full_precision = _run(block, x, grad)
    assert not torch.allclose(got[0], full_precision[0], atol=1e-4, rtol=0)  # matmuls really ran in bf16


def test_float64_block_under_cpu_autocast_stays_float64():
    # torch's autocast casts float32/16/bf16 tensors only: a float64 block (eager reference, or
    # nn.TransformerEncoderLayer) computes the same under autocast as without.
    block = _make(CONFIGS["post-ln-relu-causal"])
    eager = block.to_eager()
    x = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    without = _run(block, x, grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(block, x, grad)
        expected = _run(eager, x, grad)
    _assert_runs_close(got, without, atol=1e-12, rtol=1e-12)  # bf16 matmuls are off by ~1e-2
    _assert_runs_close(got, expected, **F64_TOL)


def _assert_compiled_matches_eager(module, x, backend, **tol):
    """Forward + backward of ``torch.compile(module, fullgraph=True)`` against ``module``, with
    the same seed (so the same dropout bits)."""
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    grad = torch.randn_like(x)
    torch.manual_seed(5)
    expected = _run(module, x, grad)
    torch.manual_seed(5)
    got = _run(compiled, x, grad)
    _assert_runs_close(got, expected, **tol)


def test_torch_compile_fullgraph_aot_eager(compile_cache):
    block = _make(CONFIGS["pre-rms-swiglu-gqa-causal-nobias"], dtype=torch.float32, dropout=0.1, policy="full")
    _assert_compiled_matches_eager(block, torch.randn(2, 8, D_MODEL), "aot_eager", atol=1e-6, rtol=1e-6)


def test_torch_compile_fullgraph_with_a_mask_needs_is_causal(compile_cache):
    # Checking a mask reads its values on the host, which a full graph cannot: a clear error
    # (not dynamo's "Data dependent operator") says to vouch with is_causal=True, which compiles.
    block = _make(CONFIGS["pre-ln-gelu"], dtype=torch.float32)
    x = torch.randn(2, 8, D_MODEL)
    mask = nn.Transformer.generate_square_subsequent_mask(8)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="pass is_causal=True"):
        compiled(x, mask)
    torch.testing.assert_close(compiled(x, mask, is_causal=True), block.to_eager()(x, mask), atol=1e-5, rtol=1e-5)


def _stack(device="cpu", dtype=torch.float32, dropout=0.1):
    torch.manual_seed(0)
    return memopt.FusedCheckpointStack(
        3, D_MODEL, N_HEADS, policy=["selective", "full", "none"], dropout=dropout, device=device, dtype=dtype,
        **CONFIGS["pre-rms-swiglu-gqa-causal-nobias"],
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_stack_compiles_fullgraph_on_cpu(backend, compile_cache):
    # Same ops on the same values; inductor may fuse the surrounding elementwise ops.
    _assert_compiled_matches_eager(_stack(), torch.randn(2, 8, D_MODEL), backend, atol=1e-5, rtol=1e-5)


def _activation_bytes(module, x) -> int:
    """Bytes of the distinct storages saved for backward, the parameters and the input aside."""
    skip = {t.untyped_storage().data_ptr() for t in (x, *module.parameters())}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_stack_saves_what_the_eager_stack_saves(backend, policy, compile_cache):
    # AOT autograd merges equal nodes of the joint forward + backward graph (CSE): merged with the
    # forward's, a backward's recompute became "save the forward's intermediates" (a 2-layer
    # "full" stack saved 16x its eager bytes, "selective" 1.4x, with equal numerics). The
    # backwards read their saved activations through memopt::recompute_barrier under compile.
    torch.manual_seed(0)
    stack = memopt.FusedCheckpointStack(2, D_MODEL, N_HEADS, d_ff=128, causal=True, dropout=0.1, policy=policy)
    x = torch.randn(2, 24, D_MODEL, requires_grad=True)
    compiled = torch.compile(stack, backend=backend)
    compiled(x)
    # (+64 bytes at most: compiled, each RNG key saved is a view of a layer's 48-byte site-key table)
    assert 0 <= _activation_bytes(compiled, x) - _activation_bytes(stack, x) <= 64


def test_recompute_barrier_op():
    from memopt.ops._common import recompute_barrier

    t = torch.randn(3, 5)
    got = recompute_barrier(t, torch.zeros(1))
    assert torch.equal(got, t) and got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    torch.library.opcheck(torch.ops.memopt.recompute_barrier, (t, torch.zeros(2)))


@gpu
def test_gpu_stack_compiles_fullgraph_with_inductor(compile_cache):
    x = torch.randn(2, 128, D_MODEL, device="cuda", dtype=torch.bfloat16)
    # The same kernels and dropout bits; inductor's fused elementwise ops round differently in bf16.
    _assert_compiled_matches_eager(_stack(device="cuda", dtype=torch.bfloat16), x, "inductor", atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(d_model=62, n_heads=4), "d_model \\(62\\) must be divisible by n_heads \\(4\\)"),
        (dict(n_kv_heads=3), "n_heads \\(4\\) must be divisible by n_kv_heads \\(3\\)"),
        (dict(policy="sometimes"), "policy must be one of \\['none', 'selective', 'full'\\]"),
        (dict(policy="offload"), "write policy='selective', offload=True"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(dropout=1.0), "dropout must be a float in \\[0, 1\\)"),
        (dict(d_model=600, n_heads=2), "head_dim = d_model / n_heads = 300 must be between 1 and 256"),
    ],
)
def test_bad_configuration_raises(kwargs, match):
    args = {"d_model": D_MODEL, "n_heads": N_HEADS, **kwargs}
    with pytest.raises(ValueError, match=match):
        memopt.FusedCheckpointBlock(args.pop("d_model"), args.pop("n_heads"), **args)


def test_bad_policy_assignment_raises():
    block = _make(CONFIGS["pre-ln-gelu"])
    with pytest.raises(ValueError, match="policy must be one of"):
        block.policy = "most"
    assert block.policy == "selective"


def test_unsupported_masks_and_inputs_raise():
    block = _make(CONFIGS["pre-ln-gelu"])
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    with pytest.raises(ValueError, match="attn_mask must be causal"):
        block(x, torch.zeros(5, 5, dtype=torch.bool).fill_diagonal_(True))
    with pytest.raises(ValueError, match="attn_mask must be a \\(5, 5\\) causal mask"):
        block(x, torch.zeros(2, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_causal=True needs"):
        block(x, is_causal=True)
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None, got list"):
        block(x, [[0.0] * 5] * 5)
    with pytest.raises(ValueError, match="x must be \\(batch, seq, d_model\\) with d_model=64"):
        block(torch.randn(2, 5, 16, dtype=torch.float64))


def _cpu_offloader():
    """An offloader that copies CPU tensors as if they were on a device (no GPU needed)."""
    return memopt.Offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)


def test_offload_matches_selective_and_moves_saved_tensors():
    config = CONFIGS["post-ln-relu-causal"]
    block = _make(config, "selective", dtype=torch.float32, dropout=0.1)
    batch, seq = 2, 8
    x = torch.randn(batch, seq, D_MODEL)
    grad = torch.randn_like(x)
    torch.manual_seed(3)
    expected = _run(block, x, grad)
    # CPU stands in for the device here: the engine copies CPU tensors like device ones.
    block.offload = _cpu_offloader()
    torch.manual_seed(3)
    got = _run(block, x, grad)
    _assert_runs_equal(got, expected)
    stats = block.offload.stats()
    formula_args = {k: v for k, v in config.items() if k in ("d_ff", "activation", "norm", "norm_first")}
    selective = saved_bytes_per_layer(
        "selective", D_MODEL, N_HEADS, batch=batch, seq=seq, dropout=0.1, dtype=torch.float32, **formula_args
    )
    assert stats["bytes_to_host"] >= selective and stats["bytes_to_device"] >= selective
    assert stats["refused_tensors"] == 0


def test_offload_true_uses_the_default_engine_which_leaves_cpu_tensors_alone():
    block = _make(CONFIGS["pre-ln-gelu"], "selective")
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    expected = _run(block, x, grad)
    block.offload = True
    _assert_runs_equal(_run(block, x, grad), expected)
    default = importlib.import_module("memopt.offload").default_offload()
    assert default.stats()["tensors_offloaded"] == 0


def test_bad_offload_raises():
    with pytest.raises(TypeError, match="offload must be False, True or a memopt.Offload"):
        _make(CONFIGS["pre-ln-gelu"]).offload = "host"
    with pytest.raises(ValueError, match="offload must be one value or a list of 2"):
        memopt.FusedCheckpointStack(2, D_MODEL, N_HEADS, 48, offload=[True], dtype=torch.float64)


def test_offload_inside_an_active_engine_marks_groups():
    offloader = _cpu_offloader()
    stack = memopt.FusedCheckpointStack(2, D_MODEL, N_HEADS, 48, offload=True, dtype=torch.float64)
    assert stack.policy == ["selective"] * 2 and stack.offload == [True, True]
    reference = copy.deepcopy(stack)
    reference.offload = False
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    with offloader:
        first_group = offloader.engine.current_group()
        out = stack(x.requires_grad_())
        assert offloader.engine.current_group() == first_group + 2
    out.backward(grad)
    expected = _run(reference, x.detach(), grad)
    assert torch.equal(out.detach(), expected[0]) and torch.equal(x.grad, expected[1])


# ----------------------------------------------------------------------------------------------
# GPU: low precision against a float32 reference, GradScaler.


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", [CONFIGS["pre-ln-gelu"], CONFIGS["post-rms-gelu_tanh-gqa"]], ids=["pre", "post"])
def test_gpu_low_precision_matches_float32_reference(config, policy, dtype):
    block = memopt.FusedCheckpointBlock(64, 4, policy=policy, device="cuda", dtype=dtype, **config)
    reference = block.to_eager().float()
    x = torch.randn(2, 128, 64, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)
    got = _run(block, x, grad)
    expected = _run(reference, x.float(), grad.float())
    low = _run(block.to_eager(), x, grad)  # plain PyTorch in the same precision
    for a, e, l in [(got[0], expected[0], low[0]), (got[1], expected[1], low[1])] + [
        (got[2][n], expected[2][n], low[2][n]) for n in got[2]
    ]:
        torch_error = (l.float() - e).abs().max().item()
        assert (a.float() - e).abs().max().item() <= 2 * torch_error + 1e-3


def _runs_by_policy(block, x, grad, seed):
    """``_run`` of ``block`` under each policy, each from ``torch.manual_seed(seed)``."""
    runs = {}
    for policy in POLICIES:
        block.policy = policy
        torch.manual_seed(seed)
        runs[policy] = _run(block, x, grad)
    return runs


@gpu
def test_gpu_same_seed_bit_identical_across_policies_with_dropout():
    block = memopt.FusedCheckpointBlock(128, 4, n_kv_heads=2, dropout=0.2, causal=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 200, 128, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    runs = _runs_by_policy(block, x, grad, seed=11)
    for policy in POLICIES[1:]:
        _assert_runs_equal(runs[policy], runs["none"])


@gpu
def test_gpu_same_seed_same_result_across_policies_with_atens_dropout_attention():
    # Without grouped-query heads "auto" runs ATen's fused dropout attention, its mask replayed from
    # the key: the outputs are bit-identical across policies. ATen's flash backward accumulates dq
    # with atomics, so the gradients are compared at bf16 rounding (another mask would be far off).
    from memopt.ops import attention as attention_ops

    block = memopt.FusedCheckpointBlock(128, 4, dropout=0.2, causal=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    heads = torch.empty(2, 4, 256, 32, device="cuda", dtype=torch.bfloat16)
    assert attention_ops.resolve_backend("auto", heads, heads, heads, True, 0.2) in attention_ops.ATEN_CUDA_BACKENDS
    grad = torch.randn_like(x)
    runs = _runs_by_policy(block, x, grad, seed=11)
    for policy in POLICIES[1:]:
        assert torch.equal(runs[policy][0], runs["none"][0]), policy
        _assert_runs_close(runs[policy], runs["none"], atol=2e-2, rtol=2e-2)
    torch.manual_seed(12)
    assert not torch.equal(_run(block, x, grad)[0], runs["none"][0])


@gpu
def test_gpu_autocast_bf16_matches_eager_under_autocast():
    block = memopt.FusedCheckpointBlock(128, 4, 256, norm="rmsnorm", activation="swiglu", device="cuda")
    x = torch.randn(2, 96, 128, device="cuda")
    grad = torch.randn_like(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _run(block, x, grad)
        expected = _run(block.to_eager(), x, grad)
    assert got[0].dtype == expected[0].dtype == torch.float32
    _assert_runs_close(got, expected, atol=5e-2, rtol=5e-2)


@gpu
def test_gpu_autocast_fp16_with_grad_scaler():
    block = memopt.FusedCheckpointBlock(64, 4, 128, device="cuda", dropout=0.1, causal=True)
    optimizer = torch.optim.SGD(block.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(2, 64, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = block(x).float().square().mean()
    scaler.scale(loss).backward()
    grads = [p.grad.clone() for p in block.parameters()]
    assert all(torch.isfinite(g).all() and g.dtype == torch.float32 for g in grads)
    scaler.step(optimizer)
    scaler.update()
    block.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        torch.testing.assert_close(block(x), block.to_eager()(x), atol=2e-2, rtol=2e-2)


@gpu
def test_gpu_offload_frees_device_memory():
    # Six layers: the engine may keep the last two groups on the device until their copies out
    # complete (double buffering), so offload must hold well under half of what selective holds.
    stack = memopt.FusedCheckpointStack(6, 1024, 16, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def held_after_forward(offload):
        stack.offload = offload
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = stack(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.float().sum().backward()
        return held

    held_after_forward(True)  # warm the host pool
    selective, offloaded = held_after_forward(False), held_after_forward(True)
    per_layer = saved_bytes_per_layer("selective", 1024, 16, batch=4, seq=1024, dtype=torch.bfloat16)
    assert selective >= 6 * per_layer
    assert offloaded < 0.5 * selective
