"""memopt.wrap finds the layers that run: nested ModuleLists and hybrid stacks (issue 15 item 6).

Before, ``wrap`` patched Funnel's and PoolFormer's inner ``nn.ModuleList`` containers (never
called: the wrap changed nothing) and wrapped only the Mamba layers of Jamba and Zamba2 (their
attention and hybrid layers share the list). Now every layer class that runs is wrapped, the
gradients equal the plain model's (float64), and a wrap whose layers never run raises.
"""

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import memopt

transformers = pytest.importorskip("transformers")
wrap_module = importlib.import_module("memopt.wrap")

VOCAB = 100


def _funnel():
    config = transformers.FunnelConfig(
        vocab_size=VOCAB, block_sizes=[1, 1], num_decoder_layers=1, d_model=16, n_head=2, d_head=8, d_inner=32,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    return transformers.FunnelModel(config), {"input_ids": _ids()}


def _poolformer():
    config = transformers.PoolFormerConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[2, 2], num_encoder_blocks=2, patch_sizes=[7, 3],
        strides=[4, 2], padding=[2, 1], hidden_dropout_prob=0.0, drop_path_rate=0.0,
    )  # fmt: skip
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return transformers.PoolFormerModel(config), {"pixel_values": pixels}


def _jamba():
    config = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=4,
        mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4,
    )  # fmt: skip
    return transformers.JambaModel(config), {"input_ids": _ids(), "use_cache": False}


def _zamba2():
    config = transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, attention_head_dim=8, mamba_d_state=4, mamba_headdim=8, mamba_ngroups=1,
        n_mamba_heads=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
        use_mem_rope=False, chunk_size=8,
    )  # fmt: skip
    return transformers.Zamba2Model(config), {"input_ids": _ids(), "use_cache": False}


def _ids():
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


# Every layer that runs, by name and class: Funnel's layers inside its blocks (and its decoder's),
# PoolFormer's layers inside its stages (and its patch embeddings, a stack of their own), Jamba's
# attention layers beside its Mamba layers, Zamba2's hybrid layers (holding the shared
# transformer block) beside its Mamba layers.
MODELS = {
    "funnel": (_funnel, {"encoder.blocks.0.0": "FunnelLayer", "encoder.blocks.1.0": "FunnelLayer",
                         "decoder.layers.0": "FunnelLayer"}),
    "poolformer": (_poolformer, {**{f"encoder.patch_embeddings.{i}": "PoolFormerEmbeddings" for i in range(2)},
                                 **{f"encoder.block.{s}.{i}": "PoolFormerLayer" for s in range(2) for i in range(2)}}),
    "jamba": (_jamba, {"layers.0": "JambaMambaDecoderLayer", "layers.1": "JambaAttentionDecoderLayer",
                       "layers.2": "JambaMambaDecoderLayer", "layers.3": "JambaAttentionDecoderLayer"}),
    "zamba2": (_zamba2, {"layers.0": "Zamba2MambaDecoderLayer", "layers.1": "Zamba2HybridLayer",
                         "layers.2": "Zamba2MambaDecoderLayer", "layers.3": "Zamba2HybridLayer"}),
}  # fmt: skip


def _build(name):
    torch.manual_seed(0)
    make, _ = MODELS[name]
    model, inputs = make()
    return model.double().train(), inputs


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    model(**inputs).last_hidden_state.pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model, inputs):
    with memopt.SavedTensorCounter(exclude=list(model.parameters()) + list(model.buffers())) as counter:
        model(**inputs)
    return counter.total_bytes


@pytest.mark.parametrize("name", list(MODELS))
def test_default_layers_are_the_layers_that_run(name):
    model, inputs = _build(name)
    found = wrap_module.find_layers(model)
    assert {n: type(m).__name__ for n, m in found} == MODELS[name][1]
    calls = {n: 0 for n, _ in found}
    for n, layer in found:
        layer.register_forward_pre_hook(lambda *_, n=n: calls.__setitem__(n, calls[n] + 1))
    model(**inputs)
    assert all(count >= 1 for count in calls.values()), calls


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_wrapped_nested_and_hybrid_stacks_match_plain(name, policy):
    """Same gradients as the plain model, and the wrap changes what is saved (under "full" only
    the layer inputs and what lies between the layers are left)."""
    model, inputs = _build(name)
    plain = copy.deepcopy(model)
    expected = _step(plain, inputs)
    memopt.wrap(model, policy=policy)
    got = _step(model, inputs)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=lambda m: f"{key}: {m}")
    if policy == "full":
        assert _saved_bytes(model, inputs) * 4 < _saved_bytes(plain, inputs)


class _IteratedStages(nn.Module):
    """Stages as nn.Sequential that the forward iterates instead of calling (a wrap of the
    Sequential would change nothing); ``call_first`` calls the first stage as a module."""

    def __init__(self, call_first=False):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for _ in range(2))
        self.call_first = call_first

    def forward(self, x):
        for i, stage in enumerate(self.stages):
            if i == 0 and self.call_first:
                x = stage(x)
                continue
            for sub in stage:
                x = sub(x)
        return x


def test_a_wrap_whose_layers_never_run_raises_at_the_first_forward():
    model = memopt.wrap(_IteratedStages(), policy="full")
    assert list(wrap_module.wrapped_policies(model)) == ["stages.0", "stages.1"]
    with pytest.raises(RuntimeError, match=r"none of the wrapped layers of _IteratedStages ran.*stages\.0"):
        model(torch.randn(2, 4, requires_grad=True))
    # Without gradients nothing is checked (checkpointing does nothing there).
    with torch.no_grad():
        model(torch.randn(2, 4))


def test_layers_that_did_not_run_are_named_in_a_warning_once():
    model = memopt.wrap(_IteratedStages(call_first=True), policy="full")
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(UserWarning, match=r"wrapped layers \['stages\.1'\] of _IteratedStages did not run"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)
    memopt.unwrap(model)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_selecting_a_module_list_raises():
    model, _ = _build("funnel")
    with pytest.raises(ValueError, match=r"selects containers \['encoder\.blocks'.*has no forward"):
        memopt.wrap(model, layers=nn.ModuleList)
