"""Sequence-tiled FFN (memopt.tiled_ffn): FusedCheckpointBlock(ffn_chunk_tokens=), memopt.wrap(
ffn_chunk_tokens=) and memopt.tiled_ffn.tiled_ffn, against the untiled layer (float64, 1e-12),
with the same dropout masks; their working set does not grow with the number of tokens once the
chunk is fixed (counted with the live-tensor tracker on CPU, the sequence doubled)."""

import copy
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn
from torch.utils._pytree import tree_flatten

import memopt
from bench.memory import LiveTensorTracker
from memopt.block import saved_bytes_per_layer, saved_bytes_per_token
from memopt.ops.attention import cpu_backend
from memopt.tiled_ffn import tiled_ffn, tiled_ffn_ref, token_chunks

POLICIES = ["none", "selective", "full"]
D_MODEL, N_HEADS = 64, 4
BLOCK_CONFIGS = {
    "pre-ln-gelu": dict(d_ff=96, activation="gelu", norm="layernorm", norm_first=True),
    "post-rms-swiglu-causal": dict(d_ff=80, activation="swiglu", norm="rmsnorm", norm_first=False, causal=True),
    "pre-rms-relu-nobias-gqa": dict(d_ff=72, activation="relu", norm="rmsnorm", bias=False, n_kv_heads=2),
}


@pytest.fixture(autouse=True)
def native_cpu_attention():
    with cpu_backend("native"):
        yield


def _assert_exact(got, want, label=""):
    """float64 agreement at 1e-12 relative to each tensor's scale."""
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item() or 1.0
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"{label} [{i}]: {m}")


def _block_run(block, x, grad, seed=5):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = block(x)
    return (y.detach(), *torch.autograd.grad(y, (x, *block.parameters()), grad))


# -- the fused block ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", list(BLOCK_CONFIGS), ids=list(BLOCK_CONFIGS))
def test_block_tiled_equals_untiled_with_dropout(config, policy):
    block = memopt.FusedCheckpointBlock(
        D_MODEL, N_HEADS, policy=policy, dropout=0.1, dtype=torch.float64, **BLOCK_CONFIGS[config]
    ).train()
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)  # 26 tokens: chunks of 7, 7, 7, 5
    grad = torch.randn_like(x)
    want = _block_run(block, x, grad)
    block.ffn_chunk_tokens = 7
    got = _block_run(block, x, grad)
    _assert_exact(got, want, f"{config} {policy}")
    # The dropout is really active: another seed gives another output.
    assert not torch.allclose(_block_run(block, x, grad, seed=6)[0], got[0])


@pytest.mark.parametrize("chunk", [1, 26, 1000])
def test_block_chunk_of_one_token_and_of_the_whole_sequence(chunk):
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, 48, policy="selective", dropout=0.1, dtype=torch.float64)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    grad = torch.randn_like(x)
    want = _block_run(block, x, grad)
    block.ffn_chunk_tokens = chunk
    _assert_exact(_block_run(block, x, grad), want, f"chunk {chunk}")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", ["pre-ln-gelu", "post-rms-swiglu-causal"])
def test_block_saved_bytes_equal_formula(config, policy):
    kwargs = BLOCK_CONFIGS[config]
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy=policy, ffn_chunk_tokens=4, dtype=torch.float64, **kwargs)
    x = torch.randn(3, 10, D_MODEL, dtype=torch.float64, requires_grad=True)
    formula = {k: v for k, v in kwargs.items() if k in ("d_ff", "activation", "norm", "norm_first")}
    expected = saved_bytes_per_layer(policy, D_MODEL, N_HEADS, batch=3, seq=10, dtype=torch.float64, ffn_chunk_tokens=4, **formula)
    assert memopt.saved_bytes(block, x) == expected
    untiled = saved_bytes_per_token(policy, D_MODEL, N_HEADS, dtype=torch.float64, **formula)
    tiled = saved_bytes_per_token(policy, D_MODEL, N_HEADS, dtype=torch.float64, ffn_chunk_tokens=4, **formula)
    # The FFN half keeps at most its input h: nothing d_ff wide.
    assert tiled < untiled or policy == "full"
    assert untiled - tiled >= (0 if policy == "full" else 8 * kwargs["d_ff"])


class _Allocations(LiveTensorTracker):
    """The live-tensor tracker, also noting the largest row count of every op output that is
    ``width`` wide in its last dim."""

    def __init__(self, widths, **kwargs):
        super().__init__(**kwargs)
        self.widths = set(widths)
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.widths:
                self.rows = max(self.rows, t.numel() // t.shape[-1])
        return out


D_FF_WIDE = 2048  # 32x d_model: the FFN's intermediates dominate the layer


def _block_peak(policy, chunk, seq):
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, D_FF_WIDE, policy=policy, ffn_chunk_tokens=chunk, causal=True)
    x = torch.randn(1, seq, D_MODEL, requires_grad=True)
    with _Allocations({D_FF_WIDE}, exclude=[*block.parameters(), x]) as tracker:
        block(x).sum().backward()
    return tracker.peak_bytes(), tracker.rows


@pytest.mark.parametrize("policy", POLICIES)
def test_block_working_set_does_not_grow_with_tokens_at_fixed_chunk(policy):
    seq, chunk = 256, 32
    d_ff_bytes = seq * D_FF_WIDE * 4  # one (seq, d_ff) float32 tensor
    # ATen's flash kernels for the attention half (CPU "auto"), as a GPU runs a fused kernel: the
    # native path's (seq, key-chunk) score blocks are visible to the tracker (the block calls its
    # kernels directly) and grow with the sequence, which is the attention's business, not the FFN's.
    with cpu_backend("auto"):
        untiled = [_block_peak(policy, None, s) for s in (seq, 2 * seq)]
        tiled = [_block_peak(policy, chunk, s) for s in (seq, 2 * seq)]
    # Untiled: doubling the sequence adds several (seq, d_ff) intermediates to the peak.
    assert untiled[1][0] - untiled[0][0] > 2 * d_ff_bytes
    assert untiled[1][1] == 2 * seq
    # Tiled: the d_ff-wide tensors have at most one chunk of rows (d_model rows: the weight
    # gradient of fc2, d_model x d_ff), and the peak grows by d_model-wide tensors only.
    assert tiled[0][1] == tiled[1][1] == max(chunk, D_MODEL)
    assert tiled[1][0] - tiled[0][0] < d_ff_bytes / 2
    assert tiled[1][0] < untiled[0][0]


def test_block_tiled_under_bf16_autocast_matches_untiled():
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, 96, policy="selective")
    x = torch.randn(2, 12, D_MODEL)
    grad = torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _block_run(block, x, grad)
        block.ffn_chunk_tokens = 5
        got = _block_run(block, x, grad)
    # Same bf16 matmuls per row; only the weight gradients' chunk sums are added in another order.
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2 * (w.abs().max().item() or 1.0), rtol=2e-2)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)


def test_stack_passes_ffn_chunk_tokens():
    stack = memopt.FusedCheckpointStack(2, D_MODEL, N_HEADS, 48, policy=["full", "selective"], ffn_chunk_tokens=5, dropout=0.1)
    assert [layer.ffn_chunk_tokens for layer in stack.layers] == [5, 5]
    reference = copy.deepcopy(stack)
    for layer in reference.layers:
        layer.ffn_chunk_tokens = None
    x = torch.randn(2, 10, D_MODEL)
    grad = torch.randn_like(x)
    want = _block_run(reference, x, grad)
    got = _block_run(stack, x, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_tiled_block_compiles_fullgraph(compile_cache):
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, 48, policy="full", ffn_chunk_tokens=5, dropout=0.1)
    x = torch.randn(1, 10, D_MODEL)  # two chunks: a short trace
    grad = torch.randn_like(x)
    want = _block_run(block, x, grad)
    got = _block_run(torch.compile(block, fullgraph=True, backend="aot_eager"), x, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_bad_ffn_chunk_tokens_names_the_argument(bad):
    match = "ffn_chunk_tokens must be a positive int or None"
    with pytest.raises(ValueError, match=f"FusedCheckpointBlock: {match}"):
        memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, ffn_chunk_tokens=bad)
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS)
    with pytest.raises(ValueError, match=match):
        block.ffn_chunk_tokens = bad
    assert block.ffn_chunk_tokens is None
    with pytest.raises(ValueError, match=match):
        memopt.FusedCheckpointStack(2, D_MODEL, N_HEADS, ffn_chunk_tokens=bad)
    with pytest.raises(ValueError, match=f"memopt.wrap: {match}"):
        memopt.wrap(_PlainModel(), ffn_chunk_tokens=bad)
    with pytest.raises(ValueError, match=match):
        saved_bytes_per_token("full", D_MODEL, N_HEADS, ffn_chunk_tokens=bad)


def test_token_chunks_start_on_philox_groups():
    assert list(token_chunks(10, 4, width=64)) == [(0, 4), (4, 8), (8, 10)]
    # An odd width: chunks are rounded up to 4 rows, so every chunk starts at an element index
    # divisible by 4 (element i draws word i % 4 of Philox counter i // 4).
    assert list(token_chunks(10, 3, width=5)) == [(0, 4), (4, 8), (8, 10)]
    assert list(token_chunks(10, 3, width=6)) == [(0, 4), (4, 8), (8, 10)]
    assert list(token_chunks(0, 3)) == []


# -- tiled_ffn on any token-wise module ----------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, d=16, d_ff=40, dropout=0.0):
        super().__init__()
        self.up = nn.Linear(d, d_ff)
        self.down = nn.Linear(d_ff, d)
        self.p = dropout

    def forward(self, x):
        # A functional dropout (no module to detect): the tiled backward must replay its draws.
        return self.down(F.dropout(F.gelu(self.up(x)), self.p, self.training))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(3, 7, 16), (11, 16)])
def test_tiled_ffn_function_against_untiled_and_reference(shape, dropout):
    mlp = _MLP(dropout=dropout).double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(*shape, dtype=torch.float64)
    params = list(mlp.parameters())

    def run(fn):
        torch.manual_seed(1)
        out = fn()
        return (out.detach(), *torch.autograd.grad(out, (x, *params), grad))

    got = run(lambda: tiled_ffn(mlp, x, 4, params))
    reference = run(lambda: tiled_ffn_ref(mlp, x, 4))  # same chunks, same draws, plain autograd
    _assert_exact(got, reference, "against tiled_ffn_ref")
    if dropout == 0.0:
        _assert_exact(got, run(lambda: mlp(x)), "against the untiled MLP")


def test_tiled_ffn_saves_only_its_input():
    mlp = _MLP(d=16, d_ff=256)
    x = torch.randn(64, 16, requires_grad=True)
    # Only x itself (excluded as the input): nothing of the 256-wide intermediates.
    assert memopt.saved_bytes(lambda t: tiled_ffn(mlp, t, 8, list(mlp.parameters())), x, exclude=mlp.parameters()) == 0
    assert memopt.saved_bytes(mlp, x) >= 64 * 256 * 4


def test_tiled_ffn_rejects_non_token_wise_output():
    with pytest.raises(TypeError, match="must return one tensor"):
        tiled_ffn(lambda t: (t, t), torch.randn(4, 3), 2)
    with pytest.raises(ValueError, match="token-wise"):
        tiled_ffn(lambda t: t.sum(0, keepdim=True), torch.randn(4, 3), 2)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        tiled_ffn(lambda t: t, torch.randn(4, 3), 0)


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("chunk", [64, 16], ids=["64-chunks", "256-chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_parameter_gradients_over_many_chunks_within_twice_eager_error(dtype, chunk):
    """A float16/bfloat16 MLP's parameter gradients are summed over the chunks in float32 and cast
    once. Summed in the parameters' dtype, each chunk added one rounding of the whole sum (bf16,
    4096 tokens: 2.4-4.3x eager's error at 64 chunks, 4.5-8.2x at 256)."""
    tokens, d = 4096, 64
    mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)).double()
    x = torch.randn(tokens, d, dtype=torch.float64)
    grad = torch.randn(tokens, d, dtype=torch.float64)

    def param_grads(dtype, chunk=None):
        module = copy.deepcopy(mlp).to(dtype)
        params = list(module.parameters())
        out = module(x.to(dtype)) if chunk is None else tiled_ffn(module, x.to(dtype), chunk, params)
        return torch.autograd.grad(out, params, grad.to(dtype))

    reference, eager, tiled = param_grads(torch.float64), param_grads(dtype), param_grads(dtype, chunk)
    for name, ours, theirs, ref in zip(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), tiled, eager, reference):
        assert ours.dtype == dtype
        error, eager_error = _relative_error(ours, ref), _relative_error(theirs, ref)
        assert error <= 2 * eager_error, f"{name}: relative error {error:.3g} > twice eager's {eager_error:.3g}"


# -- memopt.wrap ----------------------------------------------------------------------------------


class _Layer(nn.Module):
    def __init__(self, d=16, with_mlp=True):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        if with_mlp:
            self.mlp = _MLP(d)
        else:
            self.proj = nn.Linear(d, d)

    def forward(self, x):
        return x + (self.mlp(self.norm(x)) if hasattr(self, "mlp") else self.proj(x))


class _PlainModel(nn.Module):
    def __init__(self, with_mlp=True):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(with_mlp=with_mlp) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(model, *args, params=None):
    """Loss and the gradients of ``params`` (default: the model's parameters now; a model wrap
    swaps layers in shares the original parameter objects)."""
    params = list(model.parameters()) if params is None else params
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = model(*args)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(4))
    loss = (out * weights).sum()
    loss.backward()
    return (loss.detach(), *[p.grad.clone() for p in params])


@pytest.mark.parametrize("policy", POLICIES)
def test_wrap_plain_model_equals_unwrapped_and_unwraps(policy):
    model = _PlainModel().double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    want = _grads(model, x)
    memopt.wrap(model, policy=policy, ffn_chunk_tokens=4)
    assert "forward" in model.layers[0].mlp.__dict__
    _assert_exact(_grads(model, x), want, policy)
    copied = copy.deepcopy(model)
    assert copied.layers[0].mlp.forward.owner is copied.layers[0].mlp
    _assert_exact(_grads(pickle.loads(pickle.dumps(model)), x), want, "pickled")
    memopt.unwrap(model)
    assert "forward" not in model.layers[0].mlp.__dict__


class _InPlaceLayer(_Layer):
    def forward(self, x):
        out = self.mlp(self.norm(x))
        out += x  # in place on the MLP's output, as Falcon's decoder layer adds its attention output
        return out


def test_wrap_a_layer_adding_into_the_tiled_output_in_place():
    # The Function returned a view of its own (tokens, D_out) buffer: autograd refuses an in-place
    # write to that ("Output 0 of TiledFFNFunction is a view and is being modified inplace").
    model = _PlainModel().double()
    model.layers = nn.ModuleList(_InPlaceLayer() for _ in range(2)).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    want = _grads(model, x)
    memopt.wrap(model, policy="selective", ffn_chunk_tokens=4)
    _assert_exact(_grads(model, x), want, "in place")
    y = tiled_ffn(_MLP().double(), x, 4)
    assert y._base is None and y.shape == x.shape


class _ConvMLP(nn.Module):
    def __init__(self, kernel, d=16):
        super().__init__()
        self.conv = nn.Conv1d(d, d, kernel, padding=kernel // 2)

    def forward(self, x):
        return self.conv(x.transpose(-1, -2)).transpose(-1, -2)


@pytest.mark.parametrize("kernel", [1, 3])
def test_wrap_refuses_an_mlp_that_mixes_tokens(kernel):
    # FastSpeech2-Conformer's feed_forward is a kernel-3 Conv1d: tiled, its output changed by 3.9.
    model = _PlainModel().double()
    for layer in model.layers:
        layer.mlp = _ConvMLP(kernel).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    if kernel == 3:
        with pytest.raises(ValueError, match=r"mixes tokens through \['conv \(Conv1d\)'\]"):
            memopt.wrap(model, ffn_chunk_tokens=4)
        return
    want = _grads(model, x)  # a kernel-1 convolution is token-wise: tiled as any MLP
    memopt.wrap(model, policy="full", ffn_chunk_tokens=4)
    _assert_exact(_grads(model, x), want, "kernel 1")


class _MaxoutMLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.pool = nn.MaxPool1d(2)  # over features, within a token

    def forward(self, x):
        return self.pool(self.up(x))


def test_wrap_tiles_pre_hooks_and_pooling_over_features_exactly():
    # A weight-rebuilding pre-hook (pruning) runs again in the recompute with gradients on, and
    # a maxout MLP pools within a token: both tile exactly, and neither is refused.
    model = _PlainModel().double()
    torch.nn.utils.prune.l1_unstructured(model.layers[0].mlp.up, "weight", 0.5)
    model.layers[1].mlp = _MaxoutMLP().double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    params = list(model.parameters())
    want = _grads(model, x, params=params)
    memopt.wrap(model, policy="selective", ffn_chunk_tokens=4)
    _assert_exact(_grads(model, x, params=params), want, "pre-hook and maxout")


def test_wrap_refuses_forward_hooks_inside_the_tiled_mlp():
    # What a hook inside keeps is computed without a graph: it would get no gradient.
    model = _PlainModel()
    kept = []
    model.layers[1].mlp.up.register_forward_hook(lambda module, args, out: kept.append(out))
    model.layers[0].mlp.register_forward_hook(lambda module, args, out: kept.append(out))  # outside: fine
    memopt.wrap(model, ffn_chunk_tokens=4)
    x = torch.randn(2, 9, 16)
    with pytest.raises(ValueError, match=r"runs _MLP.up \(Linear\), which has forward hooks"):
        model(x)
    with torch.no_grad():
        model(x)  # no gradient to lose


def test_wrap_layer_without_mlp_raises_before_changing_anything():
    model = _PlainModel(with_mlp=False)
    with pytest.raises(ValueError, match=r"layer 'layers.0' \(_Layer\) has no token-wise MLP submodule named one of"):
        memopt.wrap(model, ffn_chunk_tokens=4)
    assert not importlib.import_module("memopt.wrap").is_wrapped(model)
    assert "forward" not in model.layers[0].__dict__
    memopt.wrap(model)  # not half-wrapped: wrapping again works


def test_wrap_transformer_encoder_swapped_block_and_offloaded_layer():
    layer = nn.TransformerEncoderLayer(D_MODEL, N_HEADS, 96, dropout=0.0, batch_first=True, dtype=torch.float64)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    want = _grads(model, x)
    offloaded, swapped_untiled = copy.deepcopy(model), copy.deepcopy(model)
    params = list(model.parameters())
    memopt.wrap(model, ffn_chunk_tokens=4)
    assert [m.block.ffn_chunk_tokens for m in model.layers] == [4, 4]  # swapped for fused blocks
    # Against the same fused blocks untiled (the block's attention differs from torch's layer
    # at float32 rounding of its log-sum-exp).
    untiled_params = list(swapped_untiled.parameters())
    memopt.wrap(swapped_untiled)
    want_swapped = _grads(swapped_untiled, x, params=untiled_params)
    _assert_exact(_grads(model, x, params=params), want_swapped, "swapped")
    # An offloading layer is not swapped: its _ff_block is tiled.
    off = memopt.offload(min_bytes=0, allow_cpu_source=True, pin_memory=False)
    memopt.wrap(offloaded, policy="full", offload=off, ffn_chunk_tokens=4)
    assert "_ff_block" in offloaded.layers[0].__dict__
    _assert_exact(_grads(offloaded, x), want, "offloaded")
    memopt.unwrap(offloaded)
    assert "_ff_block" not in offloaded.layers[0].__dict__


transformers = pytest.importorskip("transformers")


def _llama(intermediate=128, hidden=64, heads=4):
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads // 2, vocab_size=128, max_position_embeddings=1024, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _gpt2(dropout):
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def _grads_lm(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return (loss.detach(), *[p.grad.clone() for p in model.parameters()])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_wrap_hf_model_equals_unwrapped(name, policy):
    model = (_llama() if name == "llama" else _gpt2(0.0)).double()
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    want = _grads_lm(model, ids)
    memopt.wrap(model, policy=policy, ffn_chunk_tokens=6, loss="plain")  # the loss as unwrapped
    _assert_exact(_grads_lm(model, ids), want, f"{name} {policy}")
    memopt.unwrap(model)
    _assert_exact(_grads_lm(model, ids), want, "unwrapped")


def _mixtral(output_router_logits):
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
        output_router_logits=output_router_logits,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()  # float32: its grouped matmul takes no float64


def test_wrap_moe_tiles_unless_router_logits_are_recorded():
    # transformers records router logits with forward hooks on each router (installed at the
    # first forward, idle unless output_router_logits=True). Recorded inside the tiled MLP they
    # had no gradient: the load-balancing loss's share of the router gradient was lost (100%).
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _mixtral(False)
    want = _grads_lm(model, ids)
    memopt.wrap(model, ffn_chunk_tokens=8, loss="plain")
    for got, expected in zip(_grads_lm(model, ids), want):  # float32, summed in another order
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    recording = memopt.wrap(_mixtral(True), ffn_chunk_tokens=8)
    with pytest.raises(ValueError, match="output_router_logits=True records"):
        recording(ids, labels=ids, use_cache=False)


def test_wrap_gpt2_with_active_mlp_dropout_raises_at_the_forward():
    model = memopt.wrap(_gpt2(0.1), ffn_chunk_tokens=6)
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ValueError, match="has active dropout"):
        model(ids, labels=ids, use_cache=False)
    model.eval()
    with torch.no_grad():
        model(ids, use_cache=False)  # no dropout in eval mode


def _hf_step_memory(policy, chunk, seq, intermediate=1024):
    torch.manual_seed(0)
    model = memopt.wrap(_llama(intermediate, hidden=32, heads=2), policy=policy, ffn_chunk_tokens=chunk, loss="plain")
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(0))
    with _Allocations({intermediate}, exclude=model.parameters()) as tracker:
        loss = model(ids, labels=ids, use_cache=False).loss
        held = tracker.live_bytes()
        loss.backward()
    return held, tracker.peak_bytes(), tracker.rows


@pytest.mark.parametrize("policy", POLICIES)
def test_wrap_hf_working_set_does_not_grow_with_tokens_at_fixed_chunk(policy):
    seq, chunk, intermediate = 128, 32, 1024
    d_ff_bytes = seq * intermediate * 4
    untiled = [_hf_step_memory(policy, None, s) for s in (seq, 2 * seq)]
    tiled = [_hf_step_memory(policy, chunk, s) for s in (seq, 2 * seq)]
    assert untiled[1][1] - untiled[0][1] > 2 * d_ff_bytes
    assert untiled[1][2] == 2 * seq
    # Tiled: the intermediate-wide tensors hold one chunk of rows at most (hidden 32 rows: the
    # down projection's weight gradient), the peak grows by hidden-wide tensors only, and under
    # "selective" the checkpoint's cache holds none of the MLP's matmul outputs.
    assert tiled[0][2] == tiled[1][2] == chunk
    assert tiled[1][1] - tiled[0][1] < d_ff_bytes / 2
    if policy != "full":
        assert untiled[0][0] - tiled[0][0] >= 2 * d_ff_bytes  # gate and up projections no longer held


def test_wrap_tiled_recompute_keeps_the_forwards_autocast():
    """The backward runs outside the user's autocast context: the tiled MLP's and norms' recompute
    must run in the forward's dtypes again, or the gradient is that of another (float32) function
    (0.7% off on this model before the recompute restored autocast). One chunk of all the
    tokens computes what the untiled model does, so the gradients agree to float32 rounding."""
    torch.manual_seed(0)
    model = _llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = run()
    memopt.wrap(model, policy="none", ffn_chunk_tokens=24, loss="plain")
    for i, (got, ref) in enumerate(zip(run(), want)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"[{i}] {m}")
