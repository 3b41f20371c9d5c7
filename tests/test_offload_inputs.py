"""Offloaded layer inputs (issue 16 item 4): under ``policy="full", offload=...`` what a layer
keeps between its forward and its backward is its input, and the offload engine moves it to
host memory and brings it back a layer ahead. On CPU the engine copies for real
(``allow_cpu_source``): the bytes left on the source device after the forward do not grow with
depth, the host budget decides how many layers keep their input on the device, and gradients
are bit-identical to no offload."""

import copy

import pytest
import torch
from torch import nn

import memopt
from bench.memory import LiveTensorTracker
from memopt.ops.attention import cpu_backend

D_MODEL, N_HEADS, BATCH, SEQ = 64, 4, 2, 32
INPUT_BYTES = BATCH * SEQ * D_MODEL * 4  # one float32 layer input


@pytest.fixture(autouse=True)
def native_cpu_attention():
    with cpu_backend("native"):
        yield


def _engine(**kwargs):
    """An engine that copies CPU tensors as if they lived on a device; no coalescing, so every
    input is its own host block."""
    return memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True, coalesce_bytes=0, **kwargs)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.fc2 = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _Model(nn.Module):
    def __init__(self, n_layers):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stack(n_layers, off):
    torch.manual_seed(0)
    return memopt.FusedCheckpointStack(n_layers, D_MODEL, N_HEADS, 128, policy="full", offload=off, causal=True)


def _wrapped(n_layers, off):
    torch.manual_seed(0)
    model = _Model(n_layers)
    return memopt.wrap(model, policy="full", offload=off) if off else memopt.wrap(model, policy="full")


def _step(model, off):
    """(bytes the forward leaves on the source device, the engine's stats, loss and gradients).

    The source bytes are the live tensors the tracker saw minus the engine's host blocks (on
    CPU both are CPU memory)."""
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = list(model.parameters())
    with LiveTensorTracker(exclude=[*params, x]) as tracker:
        if off:
            with off:
                out = model(x)
        else:
            out = model(x)
        loss = out.pow(2).sum()
        stats = off.stats() if off else {}
        left = tracker.live_bytes("cpu") - stats.get("pool_bytes_held", 0)
    loss.backward()
    return left, (off.stats() if off else {}), [loss.detach(), x.grad, *[p.grad for p in params]]


def _assert_bit_identical(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("make", [_stack, _wrapped], ids=["FusedCheckpointStack", "wrapped"])
def test_source_bytes_after_forward_do_not_grow_with_depth(make):
    left = {}
    for n_layers in (4, 16):
        plain_left, _, want = _step(make(n_layers, False), False)
        off = _engine()
        left[n_layers], stats, got = _step(make(n_layers, off), off)
        _assert_bit_identical(got, want)
        # Every layer input but the first (the caller's leaf x, which it holds anyway) went to
        # the host and came back, a layer ahead (prefetch=1) except the first one restored.
        assert stats["tensors_offloaded"] == n_layers - 1
        assert stats["bytes_to_host"] == stats["bytes_to_device"] == (n_layers - 1) * INPUT_BYTES
        assert stats["prefetched_transfers"] == n_layers - 2 and stats["demand_transfers"] == 1
        # Without offload the device keeps one input per layer.
        assert plain_left >= n_layers * INPUT_BYTES
    assert left[16] == left[4]
    assert left[4] <= 3 * INPUT_BYTES  # the output, the loss's square and one input at most


def test_host_budget_decides_how_many_layers_keep_their_input_on_the_device():
    n_layers, on_host = 8, 3
    _, _, want = _step(_stack(n_layers, False), False)
    unlimited = _engine()
    free_left, stats, _ = _step(_stack(n_layers, unlimited), unlimited)
    block_bytes = stats["pool_bytes_held"] // stats["tensors_offloaded"]  # the pool's size class
    off = _engine(max_host_bytes=on_host * block_bytes)
    left, stats, got = _step(_stack(n_layers, off), off)
    _assert_bit_identical(got, want)
    # The first layers' inputs fill the budget; the later ones (whose backward comes first)
    # stay on the device.
    assert stats["tensors_offloaded"] == on_host
    assert stats["refused_tensors"] == n_layers - 1 - on_host
    assert left == free_left + (n_layers - 1 - on_host) * INPUT_BYTES


transformers = pytest.importorskip("transformers")


def _llama(n_layers):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=D_MODEL, intermediate_size=128, num_hidden_layers=n_layers, num_attention_heads=N_HEADS,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _llama_step(model, off):
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    with LiveTensorTracker(exclude=params) as tracker:
        if off:
            with off:
                loss = model(ids, labels=ids, use_cache=False).loss
        else:
            loss = model(ids, labels=ids, use_cache=False).loss
        left = tracker.live_bytes("cpu") - (off.stats()["pool_bytes_held"] if off else 0)
    loss.backward()
    return left, [loss.detach(), *[p.grad for p in params]]


def test_wrapped_hf_llama_source_bytes_do_not_grow_with_depth():
    left = {}
    for n_layers in (4, 16):
        base = _llama(n_layers)
        plain = memopt.wrap(copy.deepcopy(base), policy="full")
        _, want = _llama_step(plain, None)
        off = _engine()
        left[n_layers], got = _llama_step(memopt.wrap(base, policy="full", offload=off), off)
        _assert_bit_identical(got, want)
        assert off.stats()["tensors_offloaded"] >= n_layers - 1
    assert left[16] == left[4]
