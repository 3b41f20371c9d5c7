"""FusedCheckpointBlock's forward where no graph is recorded (evaluation and serving:
``torch.no_grad``, ``torch.inference_mode``, a frozen model): the training path's bits (the same
dropout masks from the same seed), the eager block's numbers, no autograd node, no more memory than
the eager block, and forward-mode AD still refused rather than answered without tangents."""

import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import memopt
import memopt.block
from bench.memory import LiveTensorTracker
from helpers import gpu

POLICIES = ["none", "selective", "full"]
D_MODEL, N_HEADS = 32, 2
CONFIGS = {
    "pre-ln-gelu-causal": dict(d_ff=48, activation="gelu", norm="layernorm", causal=True),
    "post-ln-relu": dict(d_ff=40, activation="relu", norm="layernorm", norm_first=False),
    "pre-rms-swiglu-gqa-nobias": dict(d_ff=40, n_kv_heads=1, activation="swiglu", norm="rmsnorm", bias=False),
    "post-rms-gelu_tanh-causal": dict(d_ff=48, activation="gelu_tanh", norm="rmsnorm", norm_first=False, causal=True),
    "pre-ln-silu-tiled": dict(d_ff=48, activation="silu", ffn_chunk_tokens=7),
}
# Against the eager block in float64: float64 differs by reduction order only; float32 by its
# rounding (plain PyTorch float32 against float64 is off by ~1e-6 here).
TOLERANCES = {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=2e-5, rtol=2e-5)}


def _no_graph(mode: str, block):
    """A context in which the block's forward records no graph, and the input to give it."""
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference_mode":
        return torch.inference_mode()
    block.requires_grad_(False)  # "frozen": gradients on, nothing requires one
    return contextlib.nullcontext()


def _assert_training_paths_bits(block, x, no_graph=torch.no_grad):
    """``block(x)`` inside ``no_graph()`` (a context in which it records no graph) is the training
    path's output bit for bit: the same seed before each call, so in train mode the same dropout
    masks."""
    torch.manual_seed(1)
    expected = block(x.clone().requires_grad_())
    assert expected.grad_fn is not None  # the training path: the autograd Functions
    torch.manual_seed(1)
    with no_graph():
        got = block(x)
    assert got.grad_fn is None
    assert torch.equal(got, expected.detach())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-dropout"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("policy", POLICIES)
def test_output_is_the_training_paths_bits(policy, config, training, mode):
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy=policy, dropout=0.1, **config).train(training)
    _assert_training_paths_bits(block, torch.randn(2, 9, D_MODEL), no_graph=lambda: _no_graph(mode, block))


# Without grouped-query heads, which run memopt's Triton kernels on CUDA (compiling them would
# take most of a device check's test budget; test_block checks them).
_GPU_CONFIGS = {name: config for name, config in CONFIGS.items() if "n_kv_heads" not in config}


@gpu
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-dropout"])
@pytest.mark.parametrize("config", _GPU_CONFIGS.values(), ids=_GPU_CONFIGS.keys())
@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_output_is_the_training_paths_bits(policy, config, training, dtype=torch.bfloat16):
    """On CUDA the forward without a graph runs the CUDA kernels, bias_act_fwd_inplace's among
    them, and the attention backend "auto" picks: the training path's bits all the same."""
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy=policy, dropout=0.1, **config)
    block = block.to(device="cuda", dtype=dtype).train(training)
    _assert_training_paths_bits(block, torch.randn(2, 9, D_MODEL, device="cuda", dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("policy", POLICIES)
def test_matches_the_eager_block(policy, config, dtype):
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy=policy, dtype=dtype, **config).eval()
    eager = block.to_eager().double().eval()
    x = torch.randn(3, 11, D_MODEL, dtype=dtype)
    with torch.inference_mode():
        got = block(x)
        expected = eager(x.double())
    torch.testing.assert_close(got.double(), expected, **TOLERANCES[dtype])


def test_runs_no_autograd_function(monkeypatch):
    """The Functions' Python (their records, contexts and saved lists) is host time a forward that
    records no graph does not pay: a small block's forward was 1.06-1.10x the eager block's."""

    def refuse(*args):
        raise AssertionError("apply_block ran under torch.no_grad")

    monkeypatch.setattr(memopt.block, "apply_block", refuse)
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy="selective").eval()
    with torch.no_grad():
        block(torch.randn(2, 5, D_MODEL))


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("policy", POLICIES)
def test_peak_memory_at_most_the_eager_blocks(policy, norm_first):
    """The one-node "full" block (and post-norm "selective") kept the attention half's qkv,
    attention output and norm output alive through the FFN half: 1.5x the eager block's peak."""
    block = memopt.FusedCheckpointBlock(64, 4, 256, policy=policy, norm_first=norm_first, causal=True).eval()
    eager = block.to_eager().eval()
    x = torch.randn(2, 64, 64)

    def peak(model):
        with torch.no_grad(), LiveTensorTracker(exclude=[*model.parameters(), x]) as tracker:
            model(x)
        return tracker.peak_bytes("cpu")

    assert peak(block) <= peak(eager)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("policy", POLICIES)
def test_ffn_activation_written_over_fc1_output(policy, norm_first):
    """The activation is written over fc1's output (bias_act_fwd_inplace), as torch's encoder fast
    path does: the FFN holds one (tokens, d_ff) buffer where the eager block holds two. Before,
    the peak was the eager block's less one d_model-wide buffer (1056 KiB against 1120 here)."""
    tokens, d_ff = 128, 1024
    block = memopt.FusedCheckpointBlock(64, 4, d_ff, policy=policy, norm_first=norm_first, causal=True).eval()
    eager = block.to_eager().eval()
    x = torch.randn(2, tokens // 2, 64)

    def peak(model):
        with torch.no_grad(), LiveTensorTracker(exclude=[*model.parameters(), x]) as tracker:
            model(x)
        return tracker.peak_bytes("cpu")

    assert peak(block) <= peak(eager) - tokens * d_ff * x.element_size()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_cpu_autocast_output_is_the_training_paths_bits(config):
    """Under CPU autocast the FFN's bfloat16 fc1 output is upcast for the activation kernel, whose
    float32 copy the activation is written over: the training path's bits still."""
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, dropout=0.1, **config).train()
    x = torch.randn(2, 9, D_MODEL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_training_paths_bits(block, x)


@pytest.mark.parametrize("config", ["pre-ln-gelu-causal", "post-ln-relu"])
def test_compiles_fullgraph_without_a_graph(config, compile_cache):
    """torch.compile traces the forward without a graph, its in-place activation included
    (functionalized): the eager call's bits."""
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, policy="selective", **CONFIGS[config]).eval()
    x = torch.randn(2, 9, D_MODEL)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), block(x))


@pytest.mark.parametrize("grad_enabled", [False, True])
def test_forward_mode_ad_still_refused(grad_enabled):
    """A dual input under torch.no_grad: the ops would pass the residual's tangent and drop the
    rest (a silently wrong jvp); the autograd Functions refuse forward-mode AD by name."""
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, dtype=torch.float64).eval()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    with torch.set_grad_enabled(grad_enabled), fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="jvp"):
            block(fwAD.make_dual(x, torch.randn_like(x)))
    with torch.set_grad_enabled(grad_enabled), pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.jvp(block, (x,), (torch.randn_like(x),))
