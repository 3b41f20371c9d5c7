"""memopt.wrap / unwrap / plan on plain PyTorch models: equal results, reversibility, planning."""

import copy
import importlib
import itertools
import sys

import pytest
import torch
from torch import nn

import memopt

from helpers import gpu

# The functions memopt.wrap and memopt.checkpoint shadow their modules as attributes of memopt.
wrap_module = importlib.import_module("memopt.wrap")
plan_module = importlib.import_module("memopt.plan")

D_MODEL, HEADS, FFN, SEQ, BATCH = 32, 4, 64, 12, 3


def _encoder(num_layers=3, dropout=0.0, norm_first=False):
    # SiLU: a layer the fused block does not take, so memopt.wrap checkpoints it as it is (the
    # swapped layers are tests/test_wrap_swap.py's).
    layer = nn.TransformerEncoderLayer(
        D_MODEL, HEADS, FFN, dropout=dropout, activation=nn.SiLU(), batch_first=True, norm_first=norm_first
    )
    return nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)


def _step(model, x, seed=0, grads_of=None):
    """Output, input gradient and parameter gradients (of ``grads_of``, default ``model``)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    leaf = x.detach().clone().requires_grad_()
    out = model(leaf)
    (out.float().square().mean()).backward()
    grads_of = model if grads_of is None else grads_of
    return out.detach(), leaf.grad, {n: p.grad.clone() for n, p in grads_of.named_parameters()}


def _assert_same_step(a, b):
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], msg=lambda m: f"{name}: {m}")


def _counted_bytes(model, x):
    with memopt.SavedTensorCounter(exclude=list(model.parameters()) + list(model.buffers())) as counter:
        model(x)
    return counter.total_bytes


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _MoEBlock(nn.Module):
    """A block with more experts inside it than there are blocks: the blocks must still win."""

    def __init__(self, num_experts=4):
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.experts = nn.ModuleList(_Expert() for _ in range(num_experts))

    def forward(self, x):
        h = self.norm(x)
        return x + sum(expert(h) for expert in self.experts)


class _MoEModel(nn.Module):
    def __init__(self, num_blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(_MoEBlock() for _ in range(num_blocks))
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# -- finding layers -------------------------------------------------------------------------


def test_finds_transformer_encoder_layers():
    names = [name for name, _ in wrap_module.find_layers(_encoder(3))]
    assert names == ["layers.0", "layers.1", "layers.2"]


def test_finds_outer_blocks_not_more_numerous_inner_experts():
    found = wrap_module.find_layers(_MoEModel(num_blocks=2))
    assert [name for name, _ in found] == ["blocks.0", "blocks.1"]


class _DecoderLayer(_Expert):
    """A second layer class (an encoder-decoder's decoder layers)."""


class _EncoderDecoder(nn.Module):
    def __init__(self, encoder_layers=3, decoder_layers=2, head_width=1):
        super().__init__()
        self.encoder = nn.ModuleList(_Expert() for _ in range(encoder_layers))
        self.decoder = nn.ModuleList(_DecoderLayer() for _ in range(decoder_layers))
        self.heads = nn.ModuleList(nn.Linear(D_MODEL, head_width) for _ in range(2))


@pytest.mark.parametrize(
    "model,expected",
    [
        # Both stacks; the two small heads (a repeated class too) are not layers.
        (_EncoderDecoder(), ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1"]),
        # A stack with under a tenth of the main stack's parameters is left out.
        (_EncoderDecoder(encoder_layers=24), [f"encoder.{i}" for i in range(24)]),
        # Heads as large as a layer stack count as one.
        (_EncoderDecoder(decoder_layers=0, head_width=3 * D_MODEL),
         ["encoder.0", "encoder.1", "encoder.2", "heads.0", "heads.1"]),
    ],
    ids=["two-stacks", "small-second-stack", "large-heads"],
)
def test_default_layers_take_every_stack_of_comparable_size(model, expected):
    assert [name for name, _ in wrap_module.find_layers(model)] == expected


@pytest.mark.parametrize(
    "layers,expected",
    [
        (_Expert, [f"blocks.{b}.experts.{e}" for b in range(2) for e in range(4)]),
        ((_MoEBlock, _Expert), ["blocks.0", "blocks.1"]),
        (lambda m: isinstance(m, nn.LayerNorm), ["blocks.0.norm", "blocks.1.norm"]),
    ],
)
def test_layers_argument_selects(layers, expected):
    assert [name for name, _ in wrap_module.find_layers(_MoEModel(2), layers)] == expected


def test_layer_selection_errors():
    with pytest.raises(ValueError, match="no module class repeated"):
        wrap_module.find_layers(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="selects no submodule"):
        wrap_module.find_layers(_encoder(2), nn.GRU)
    with pytest.raises(TypeError, match="layers must be"):
        wrap_module.find_layers(_encoder(2), "layers")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        memopt.wrap(lambda x: x)


# -- equal results --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["selective", "full", "none", ["full", "selective", "none"], {0: "full", "layers.2": "selective"}])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("norm_first", [False, True])
def test_wrapped_encoder_matches_plain(policy, dropout, norm_first):
    model = _encoder(3, dropout=dropout, norm_first=norm_first)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    reference = _step(model, x, seed=4)
    memopt.wrap(model, policy=policy)
    _assert_same_step(_step(model, x, seed=4), reference)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_wrapped_matches_plain_across_device_and_autocast(device, autocast_dtype, policy):
    model = _encoder(2, dropout=0.1).to(device)
    x = torch.randn(BATCH, SEQ, D_MODEL, device=device)

    def step():
        with torch.autocast(device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            return _step(model, x, seed=3)

    reference = step()
    memopt.wrap(model, policy=policy)
    # Same ops on the same values in the same dtype: the recompute reproduces them exactly.
    _assert_same_step(step(), reference)


def test_wrapped_moe_model_matches_plain():
    model = _MoEModel(2)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    reference = _step(model, x)
    memopt.wrap(model, policy="selective")
    _assert_same_step(_step(model, x), reference)


def test_saved_bytes_fall_with_stronger_policies():
    model = _encoder(3)
    x = torch.randn(BATCH, SEQ, D_MODEL, requires_grad=True)
    counted = {}
    for policy in ["none", "selective", "full"]:
        memopt.wrap(model, policy=policy)
        counted[policy] = _counted_bytes(model, x)
        memopt.unwrap(model)
    assert counted["none"] == _counted_bytes(model, x)
    assert counted["full"] < counted["selective"] < counted["none"]
    # Under "full" each layer keeps only its input, a (batch, seq, d_model) fp32 tensor; the
    # first layer's input is x, which the counter sees too since x is not excluded here.
    assert counted["full"] == 3 * BATCH * SEQ * D_MODEL * 4


# -- unwrap ---------------------------------------------------------------------------------


def test_unwrap_restores_exactly():
    model = _encoder(3, dropout=0.1)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards_before = [layer.forward for layer in model.layers]
    reference = _step(model, x, seed=2)

    memopt.wrap(model, policy="selective")
    assert all("forward" in layer.__dict__ for layer in model.layers)
    assert wrap_module.wrapped_policies(model) == {f"layers.{i}": "selective" for i in range(3)}
    memopt.unwrap(model)

    assert all("forward" not in layer.__dict__ for layer in model.layers)
    assert [layer.forward for layer in model.layers] == forwards_before
    assert wrap_module.wrapped_policies(model) == {}
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[k], state_before[k]) for k in state_before)
    _assert_same_step(_step(model, x, seed=2), reference)


def test_deepcopy_of_wrapped_model_trains_the_copy():
    model = _encoder(2)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    memopt.wrap(model, policy="selective")
    clone = copy.deepcopy(model)
    reference = _step(model, x)
    model.zero_grad(set_to_none=True)
    _assert_same_step(_step(clone, x), reference)
    assert all(p.grad is None for p in model.parameters())
    memopt.unwrap(clone)
    assert all("forward" not in layer.__dict__ for layer in clone.layers)
    assert all("forward" in layer.__dict__ for layer in model.layers)


def test_unwrap_keeps_an_earlier_instance_forward():
    model = _encoder(2)
    patched = model.layers[0].forward
    model.layers[0].forward = patched
    memopt.wrap(model)
    memopt.unwrap(model)
    assert model.layers[0].__dict__["forward"] is patched


def test_wrap_twice_raises_and_wrap_unwrap_wrap_works():
    model = _encoder(2)
    memopt.wrap(model)
    with pytest.raises(RuntimeError, match="already wrapped"):
        memopt.wrap(model, policy="full")
    memopt.unwrap(model)
    with pytest.raises(ValueError, match="not wrapped"):
        memopt.unwrap(model)
    memopt.wrap(model, policy="full")
    assert wrap_module.wrapped_policies(model) == {"layers.0": "full", "layers.1": "full"}


def test_wrapping_a_model_holding_a_wrapped_module_raises():
    # Wrapping the same layers again from a parent used to be accepted; each layer's forward then
    # called the other without end (RecursionError at the first forward).
    inner = _encoder(2)
    outer = nn.Sequential(inner, nn.Linear(D_MODEL, 1))
    x = torch.randn(BATCH, SEQ, D_MODEL)
    reference = _step(outer, x)
    memopt.wrap(inner, policy="full")
    with pytest.raises(RuntimeError, match="already wrapped inside: '0' .* is wrapped"):
        memopt.wrap(outer, layers=nn.TransformerEncoderLayer)
    with pytest.raises(RuntimeError, match="wrapped inside: '0'"):
        memopt.plan(outer, (x,), 10**9, layers=nn.TransformerEncoderLayer, repeats=1)
    assert not wrap_module.is_wrapped(outer)
    _assert_same_step(_step(outer, x), reference)  # the first wrap, unchanged
    # The other order: the layers are checkpointed by a wrap of the parent.
    memopt.unwrap(inner)
    memopt.wrap(outer, layers=nn.TransformerEncoderLayer)
    with pytest.raises(RuntimeError, match="already wrapped inside: layer 'layers.0'"):
        memopt.wrap(inner)
    _assert_same_step(_step(outer, x), reference)
    memopt.unwrap(outer)
    assert all("forward" not in layer.__dict__ for layer in inner.layers)


@pytest.mark.parametrize(
    "policy,error,match",
    [
        ("fastest", ValueError, "must be one of"),
        (["full"], ValueError, "1 entries for 2 layers"),
        ({5: "full"}, ValueError, "policy keys must be"),
        (3, TypeError, "policy must be a string"),
    ],
)
def test_bad_policy_raises(policy, error, match):
    with pytest.raises(error, match=match):
        memopt.wrap(_encoder(2), policy=policy)


def test_dict_naming_a_layer_by_index_and_by_name_raises():
    model = _encoder(2)
    with pytest.raises(ValueError, match=r"policy names layer 'layers.1' twice, as index 1 \('full'\) and as name "
                                         r"'layers.1' \('none'\)"):
        memopt.wrap(model, policy={1: "full", "layers.1": "none"})
    with pytest.raises(ValueError, match="offload names layer 'layers.0' twice"):
        memopt.wrap(model, offload={0: True, "layers.0": False})
    with pytest.raises(ValueError, match="policy names layer '0' twice"):  # nn.Sequential: index 0 is named "0"
        memopt.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), layers=nn.Linear, policy={0: "full", "0": "none"})
    assert not wrap_module.is_wrapped(model)
    # An index and another layer's name are two layers.
    memopt.wrap(model, policy={0: "full", "layers.1": "selective"})
    assert wrap_module.wrapped_policies(model) == {"layers.0": "full", "layers.1": "selective"}


def test_offload_as_a_policy_says_what_to_write_instead():
    with pytest.raises(ValueError, match="policy for layer 'layers.0'='offload' is not a policy"):
        memopt.wrap(_encoder(2), policy="offload")
    with pytest.raises(TypeError, match="offload for layer 'layers.1' must be False, True or a memopt.Offload"):
        memopt.wrap(_encoder(2), offload=[False, "yes"])
    with pytest.raises(ValueError, match="offload has 1 entries for 2 layers"):
        memopt.wrap(_encoder(2), offload=[True])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_offload_matches_plain(device):
    model = _encoder(2, dropout=0.1).to(device)
    x = torch.randn(BATCH, SEQ, D_MODEL, device=device)
    reference = _step(model, x, seed=8)
    memopt.wrap(model, policy=["none", "selective"], offload=[True, True])
    _assert_same_step(_step(model, x, seed=8), reference)


def test_wrapped_model_pickles_with_torch_save_and_stays_wrapped(tmp_path):
    model = _encoder(2)
    memopt.wrap(model, policy=["selective", "full"])
    x = torch.randn(BATCH, SEQ, D_MODEL)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert wrap_module.wrapped_policies(loaded) == {"layers.0": "selective", "layers.1": "full"}
    _assert_same_step(_step(loaded, x, seed=2), _step(model, x, seed=2))
    # The loaded layers' forwards are their own (checkpointed), not the original model's.
    assert loaded.layers[1].forward.layer is loaded.layers[1]
    assert _counted_bytes(loaded, x.clone().requires_grad_()) == _counted_bytes(model, x.clone().requires_grad_())
    memopt.unwrap(loaded)
    assert not wrap_module.wrapped_policies(loaded)


# -- torch.compile --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_wrapped_encoder_compiles_fullgraph(policy, compile_cache):
    model = _encoder(2, dropout=0.0)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    reference = _step(model, x)
    memopt.wrap(model, policy=policy)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _assert_same_step(_step(compiled, x, grads_of=model), reference)


# -- planning -------------------------------------------------------------------------------


def _plan_inputs():
    return (torch.randn(BATCH, SEQ, D_MODEL, requires_grad=True),)


class _GatedLayer(nn.Module):
    """Same class and shapes for every layer; ``extra`` switches on a branch that saves more."""

    def __init__(self, extra):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, D_MODEL)
        self.extra = extra

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return h * torch.sigmoid(h) if self.extra else h


def test_plan_times_layers_with_one_signature_once_and_a_differing_branch_apart(monkeypatch):
    model = nn.Sequential(*[_GatedLayer(extra=i == 2) for i in range(4)])
    timed = []
    monkeypatch.setattr(plan_module, "_step_seconds", lambda fn, *a, **k: timed.append(fn) or 0.0)
    plan = memopt.plan(model, _plan_inputs(), budget_bytes=10**9, choices=[N, F], repeats=1)
    # Layers 0, 1 and 3 share one timing; layer 2 saves more under "none" and is timed apart.
    assert len(timed) == 2 * 2
    saved = [cost.device_bytes[N] for cost in plan.layer_costs]
    assert saved[2] > saved[0] == saved[3]


def test_plan_predicts_counted_bytes_for_every_policy_mix():
    model = _encoder(3)
    inputs = _plan_inputs()
    plan = memopt.plan(model, inputs, budget_bytes=10**9)
    assert plan.policies == ["none"] * 3 and plan.budget_bytes == 10**9
    for mix in [["none"] * 3, ["selective"] * 3, ["full"] * 3, ["full", "selective", "none"]]:
        plan.policies = list(mix)
        memopt.wrap(model, plan=plan)
        assert _counted_bytes(model, *inputs) == plan.predicted_bytes, mix
        memopt.unwrap(model)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
def test_plan_fits_budget_and_counts_agree(fraction):
    model = _encoder(3)
    inputs = _plan_inputs()
    full = memopt.plan(model, inputs, budget_bytes=10**9)
    full.policies = ["full"] * 3
    least = full.predicted_bytes
    full.policies = ["none"] * 3
    most = full.predicted_bytes
    budget = int(least + fraction * (most - least))
    plan = memopt.plan(model, inputs, budget_bytes=budget)
    assert plan.predicted_bytes <= budget
    memopt.wrap(model, plan=plan)
    assert _counted_bytes(model, *inputs) == plan.predicted_bytes <= budget
    if fraction == 1.0:
        assert plan.policies == ["none"] * 3 and plan.predicted_extra_seconds == 0
    if fraction == 0.0:
        assert plan.policies == ["full"] * 3
    assert "predicted" in str(plan)


def test_wrap_with_budget_applies_a_plan():
    model = _encoder(3)
    inputs = _plan_inputs()
    plan = memopt.plan(model, inputs, budget_bytes=10**9)
    plan.policies = ["full"] * 3
    budget = plan.predicted_bytes
    memopt.wrap(model, budget_bytes=budget, example_inputs=inputs)
    assert wrap_module.wrapped_policies(model) == {f"layers.{i}": "full" for i in range(3)}
    assert _counted_bytes(model, *inputs) <= budget


def test_plan_leaves_rng_and_model_untouched():
    model = _encoder(2, dropout=0.2)
    inputs = _plan_inputs()
    torch.manual_seed(9)
    memopt.plan(model, inputs, budget_bytes=10**9)
    after_plan = torch.rand(4)
    torch.manual_seed(9)
    assert torch.equal(torch.rand(4), after_plan)
    assert wrap_module.wrapped_policies(model) == {}
    assert all("forward" not in layer.__dict__ for layer in model.layers)


def test_plan_errors():
    model = _encoder(2)
    with pytest.raises(ValueError, match="below the least"):
        memopt.plan(model, _plan_inputs(), budget_bytes=0)
    with pytest.raises(ValueError, match="budget_bytes must be"):
        memopt.plan(model, _plan_inputs(), budget_bytes=-1)
    with pytest.raises(ValueError, match="choices must include"):
        memopt.plan(model, _plan_inputs(), budget_bytes=10, choices=(F,))
    with pytest.raises(ValueError, match="write policy='selective', offload=True"):
        memopt.plan(model, _plan_inputs(), budget_bytes=10, choices=(N, ("offload", False)))
    with pytest.raises(ValueError, match="needs example_inputs"):
        memopt.wrap(model, budget_bytes=10)
    plan = memopt.plan(model, _plan_inputs(), budget_bytes=10**9)
    with pytest.raises(ValueError, match="plan is for layers"):
        memopt.wrap(_encoder(3), plan=plan)
    memopt.wrap(model)
    with pytest.raises(RuntimeError, match="is wrapped"):
        memopt.plan(model, _plan_inputs(), budget_bytes=10**9)


N, S, F, NO = ("none", False), ("selective", False), ("full", False), ("none", True)


def _choose(layer_bytes, layer_seconds, budget):
    """memopt.plan.choose on costs given as per-layer dicts choice -> bytes / seconds."""
    costs = [memopt.LayerCost(dict(b), {c: 0 for c in b}, dict(s)) for b, s in zip(layer_bytes, layer_seconds)]
    return plan_module.choose(costs, budget)


def _brute_force(layer_bytes, layer_seconds, budget):
    best = None
    for choice in itertools.product(*[list(b) for b in layer_bytes]):
        total = sum(b[c] for b, c in zip(layer_bytes, choice))
        cost = sum(s[c] for s, c in zip(layer_seconds, choice))
        if total <= budget and (best is None or cost < best[0]):
            best = (cost, choice)
    return best


@pytest.mark.parametrize("budget", [0, 29, 30, 150, 300, 420, 600, 900, 1000])
@pytest.mark.parametrize(
    "layer_bytes, layer_seconds",
    [
        # Identical layers: 300 bytes kept, 100 with selective (1 ms), 10 with full (3 ms).
        ([{N: 300, S: 100, F: 10}] * 3, [{N: 0.0, S: 1e-3, F: 3e-3}] * 3),
        # Different layers, offload among the options, a ratio-greedy order that overshoots.
        (
            [
                {N: 400, S: 400, F: 0, NO: 50},
                {N: 100, S: 0, F: 0, NO: 10},
                {N: 250, S: 120, F: 20, NO: 30},
            ],
            [
                {N: 0.0, S: 0.0, F: 1.0, NO: 0.9},
                {N: 0.0, S: 0.05, F: 0.06, NO: 0.2},
                {N: 0.0, S: 0.3, F: 0.5, NO: 0.1},
            ],
        ),
    ],
)
def test_choice_is_optimal(budget, layer_bytes, layer_seconds):
    chosen = _choose(layer_bytes, layer_seconds, budget)
    total = sum(b[c] for b, c in zip(layer_bytes, chosen))
    cost = sum(s[c] for s, c in zip(layer_seconds, chosen))
    optimum = _brute_force(layer_bytes, layer_seconds, budget)
    if optimum is None:
        # Nothing fits: the least bytes any choice saves, so plan() can say by how much.
        assert total == min(sum(min(b.values()) for b in layer_bytes), total)
        return
    assert total <= budget
    assert cost == pytest.approx(optimum[0], abs=1e-12)


def test_choice_ties_give_earlier_layers_the_stronger_policy():
    layer_bytes = [{N: 300, S: 100, F: 10}] * 3
    layer_seconds = [{N: 0.0, S: 1e-3, F: 3e-3}] * 3
    assert _choose(layer_bytes, layer_seconds, 500) == [S, S, N]
    assert _choose(layer_bytes, layer_seconds, 700) == [S, N, N]
    assert _choose(layer_bytes, layer_seconds, 10**6) == [N] * 3


def test_choice_takes_offload_when_it_frees_bytes_cheapest():
    layer_bytes = [{N: 300, S: 100, F: 10, NO: 20}] * 3
    layer_seconds = [{N: 0.0, S: 1e-3, F: 3e-3, NO: 2e-4}] * 3
    assert _choose(layer_bytes, layer_seconds, 3 * 20) == [NO] * 3
    # Below what offload keeps, part of the model must take "full".
    assert _choose(layer_bytes, layer_seconds, 3 * 10) == [F] * 3
    assert _choose(layer_bytes, layer_seconds, 50) == [F, NO, NO]


def test_choice_scales_to_many_layers():
    # 96 distinct layers, 4 options: the frontier is bounded and the result still fits.
    generator = torch.Generator().manual_seed(0)
    layer_bytes, layer_seconds = [], []
    for _ in range(96):
        none = int(torch.randint(10**6, 10**7, (1,), generator=generator))
        fractions = torch.rand(3, generator=generator).tolist()
        layer_bytes.append({N: none, S: int(none * fractions[0]), F: int(none * 0.01), NO: int(none * 0.05)})
        costs = torch.rand(3, generator=generator).tolist()
        layer_seconds.append({N: 0.0, S: costs[0], F: 1.0 + costs[1], NO: costs[2]})
    budget = sum(b[N] for b in layer_bytes) // 4
    chosen = _choose(layer_bytes, layer_seconds, budget)
    assert sum(b[c] for b, c in zip(layer_bytes, chosen)) <= budget
    assert set(chosen) - {N}


def test_plan_times_identical_layers_once_and_leaves_grads_alone():
    model = _encoder(3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    plan = memopt.plan(model, _plan_inputs(), budget_bytes=10**9, repeats=2)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
    # Identical layers share one timing; "none" adds nothing and nothing is negative.
    seconds = [cost.seconds for cost in plan.layer_costs]
    assert seconds[0] == seconds[1] == seconds[2]
    assert seconds[0][N] == 0.0 and min(seconds[0].values()) >= 0.0
    # On CPU without an engine that takes CPU tensors, offloading would move nothing.
    assert set(plan.layer_costs[0].choices) == {N, S, F}


def _cpu_offload():
    return memopt.offload(min_bytes=1024, allow_cpu_source=True, pin_memory=False)


def test_plan_offload_predicts_what_the_engine_moves():
    model = _encoder(3, dropout=0.1)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    reference = _step(model, x, seed=3)
    off = _cpu_offload()
    plan = memopt.plan(model, (x.clone().requires_grad_(),), budget_bytes=10**9, offload=off, repeats=1)
    assert set(plan.layer_costs[0].choices) == {N, S, F, NO}
    for cost in plan.layer_costs:
        # Offload keeps only tensors under min_bytes on the device; what it takes is on the host.
        assert cost.device_bytes[NO] < cost.device_bytes[N] and cost.host_bytes[NO] > 0
        assert cost.host_bytes[N] == cost.host_bytes[S] == cost.host_bytes[F] == 0
    plan.choices = [NO, NO, N]
    before = off.stats()["bytes_to_host"]
    memopt.wrap(model, plan=plan, offload=off)
    _assert_same_step(_step(model, x, seed=3), reference)
    moved = off.stats()["bytes_to_host"] - before
    assert moved == plan.predicted_host_bytes == plan.layer_costs[0].host_bytes[NO] * 2
    assert plan.predicted_bytes < plan.other_bytes + plan.shared_bytes + 3 * plan.layer_costs[0].device_bytes[N]
    assert "host MiB" in str(plan)


def test_plan_with_budget_and_offload_fits_and_matches(monkeypatch):
    model = _encoder(3)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    reference = _step(model, x, seed=5)
    off = _cpu_offload()
    inputs = (x.clone().requires_grad_(),)
    probe = memopt.plan(model, inputs, budget_bytes=10**9, offload=off, repeats=1)
    # Make offload the cheapest way to free bytes, whatever this machine measured.
    probe_seconds = [{N: 0.0, S: 1.0, F: 2.0, NO: 1e-3} for _ in range(3)]
    monkeypatch.setattr(plan_module, "_step_seconds", lambda fn, *a, **k: 0.0)
    probe.choices = [NO] * 3
    budget = probe.predicted_bytes
    layer_bytes = [cost.device_bytes for cost in probe.layer_costs]
    chosen = _choose(layer_bytes, probe_seconds, budget - probe.other_bytes - probe.shared_bytes)
    assert chosen == [NO] * 3
    plan = memopt.plan(model, inputs, budget_bytes=budget, offload=off, repeats=1)
    assert plan.predicted_bytes <= budget
    memopt.wrap(model, plan=plan, offload=off)
    _assert_same_step(_step(model, x, seed=5), reference)


def test_plan_and_wrap_offload_errors():
    model = _encoder(2)
    with pytest.raises(TypeError, match="offload must be False, True or a memopt.Offload"):
        memopt.plan(model, _plan_inputs(), budget_bytes=10**9, offload="yes")
    with pytest.raises(TypeError, match="offload must be a bool, a memopt.Offload, a list or a dict"):
        memopt.wrap(model, offload="yes")
    with pytest.raises(ValueError, match="offload, but offload=False"):
        memopt.plan(model, _plan_inputs(), budget_bytes=10**9, choices=[N, NO], offload=False)
    with pytest.raises(ValueError, match="repeats must be"):
        memopt.plan(model, _plan_inputs(), budget_bytes=10**9, repeats=0)
    plan = memopt.plan(model, _plan_inputs(), budget_bytes=10**9, repeats=1)
    plan.choices = [NO, N]
    with pytest.raises(ValueError, match="choice \\('none', True\\) of layer 'layers.0' was not measured"):
        memopt.wrap(model, plan=plan)
    with pytest.raises(ValueError, match="was not measured"):
        plan.predicted_bytes


def _settled_requested_bytes() -> int:
    """Bytes the live CUDA tensors asked the allocator for, once queued work has finished.

    What the planner counts (storage bytes). ``memory_allocated`` counts whole blocks instead:
    sizes rounded up to 512 bytes, and a cached block up to 1 MiB larger than the request handed
    out unsplit, so it can exceed an exact budget with the plan right. Blocks freed while a side
    stream (offload's copies) still used them are retired at the next allocation: one is made.
    """
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


@gpu
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_plan_budget_holds_in_gpu_memory(fraction):
    """The planner's budget, checked by the CUDA allocator: bytes held at the end of the
    forward, less the output itself, stay within it (offload included when the plan takes it)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True, activation="gelu")
    # float32 on CUDA outside autocast: the swapped blocks run the torch layers, checkpointed.
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).cuda()
    x = torch.randn(8, 256, 256, device="cuda", requires_grad=True)
    probe = memopt.plan(model, (x,), budget_bytes=2**40, repeats=1)
    most = probe.predicted_bytes
    probe.policies = ["full"] * 6
    least = probe.predicted_bytes
    budget = int(least + fraction * (most - least))
    plan = memopt.plan(model, (x,), budget_bytes=budget, repeats=2)
    assert plan.predicted_bytes <= budget
    memopt.wrap(model, plan=plan)
    before = _settled_requested_bytes()
    out = model(x)
    held = _settled_requested_bytes() - before - out.untyped_storage().nbytes()
    assert held <= budget, (plan.policies, held, budget)
    out.float().square().mean().backward()


def test_plan_round_trips_through_json_and_can_be_edited():
    import json

    model = _encoder(3)
    inputs = _plan_inputs()
    plan = memopt.plan(model, inputs, budget_bytes=10**9, repeats=1)
    data = json.loads(json.dumps(plan.to_dict()))
    data["choices"] = [{"policy": p, "offload": False} for p in ("none", "full", "none")]
    loaded = memopt.Plan.from_dict(data)
    assert loaded.choices == [N, F, N] and loaded.layer_costs == plan.layer_costs
    memopt.wrap(model, plan=loaded)
    assert _counted_bytes(model, *inputs) == loaded.predicted_bytes
    data["choices"][0]["policy"] = "fastest"
    with pytest.raises(ValueError, match="layer 'layers.0': policy must be one of .* got 'fastest'"):
        memopt.Plan.from_dict(data)
    with pytest.raises(ValueError, match="lacks"):
        memopt.Plan.from_dict({"choices": []})


def test_choice_prefers_weaker_policies_when_times_tie():
    # A measured cost of 0 (noise, or a policy as fast as none) must not turn on checkpointing
    # that the budget does not need.
    layer_bytes = [{N: 300, S: 100, F: 10}] * 3
    layer_seconds = [{N: 0.0, S: 0.0, F: 0.0}] * 3
    assert _choose(layer_bytes, layer_seconds, 10**6) == [N] * 3
    assert _choose(layer_bytes, layer_seconds, 700) == [S, N, N]
    assert _choose(layer_bytes, layer_seconds, 610) == [F, N, N]


class _SharedInputLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, pos):
        return x + torch.tanh(self.lin(x + pos))


class _PositionModel(nn.Module):
    """Hands a learned parameter to every layer (a shared positional table, say)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8))
        self.layers = nn.ModuleList(_SharedInputLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.pos)
        return x


@pytest.mark.parametrize("train_first", [False, True])
def test_evaluation_without_gradients_runs_with_inputs_that_require_grad(train_first):
    # The check for a model's own autograd.Function (Reformer) refused every call with gradients
    # off whose inputs require grad: a parameter handed to the layers, or a saliency input, made
    # torch.no_grad / inference_mode evaluation of the wrapped model raise.
    torch.manual_seed(0)
    model = _PositionModel().double()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 8, dtype=torch.float64)
    memopt.wrap(model, policy="full")
    if train_first:
        model(x).sum().backward()
    leaf = x.clone().requires_grad_()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for inputs in (x, leaf):
                torch.testing.assert_close(model(inputs), plain(inputs), atol=0, rtol=0)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_evaluation_without_gradients_runs_the_layers_unchecked(policy, monkeypatch):
    # Without gradients a checkpoint saves nothing and cost host time only: train-mode validation
    # of the wrapped encoder under torch.no_grad took 1.07-1.15x the plain encoder's forward.
    model = _encoder(3, dropout=0.2)
    plain = copy.deepcopy(model)
    x = torch.randn(BATCH, SEQ, D_MODEL)
    memopt.wrap(model, policy=policy)
    checkpoints = []
    checkpoint = wrap_module.checkpoint
    monkeypatch.setattr(wrap_module, "checkpoint", lambda *args, **kwargs: checkpoints.append(1) or checkpoint(*args, **kwargs))
    for mode in (torch.no_grad, torch.inference_mode):
        for training in (True, False):
            model.train(training), plain.train(training)
            with mode():
                torch.manual_seed(1)
                got = model(x)
                torch.manual_seed(1)  # the same dropout masks
                assert torch.equal(got, plain(x))
    assert not checkpoints
    model(x)
    assert checkpoints  # with gradients the layers are checkpointed


class _ReversibleRun(torch.autograd.Function):
    """Runs layers with gradients off and computes its own backward, as Reformer does."""

    @staticmethod
    def forward(ctx, x, layers, *params):
        ctx.params = len(params)
        for layer in layers:
            x = x + layer(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + (None,) * ctx.params


class _ReversibleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return _ReversibleRun.apply(x, self.layers, *self.parameters())


def test_layers_run_inside_the_models_own_function_are_refused_under_compile_too():
    # Under torch.compile the run check's hooks step aside, so the model's grad mode is unknown:
    # it is checked as on (the gate that lets no_grad evaluation run must not open here).
    model = memopt.wrap(_ReversibleModel(), layers=nn.Linear)
    x = torch.randn(2, 8, requires_grad=True)
    for run in (model, torch.compile(model, backend="eager")):
        with pytest.raises(RuntimeError, match="ran with gradients off on inputs that require grad"):
            run(x)


class _LayerWithCheckpointNames(nn.Module):
    """A layer whose own keyword arguments are named like memopt.checkpoint's parameters."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, D_MODEL, dtype=torch.float64)

    def forward(self, x, scale=1.0, preserve_rng_state=None, policy=None, debug=None, fn=None, offload=None):
        for i, value in enumerate((preserve_rng_state, policy, debug, fn, offload)):
            if value is not None:
                x = x * (i + 2)  # the layer's own meaning
        return torch.tanh(self.fc(x)) * scale


class _ModelWithCheckpointNames(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.layers = nn.ModuleList(_LayerWithCheckpointNames() for _ in range(2))
        self.kwargs = kwargs

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, scale=0.5, **self.kwargs)
        return x


@pytest.mark.parametrize(
    "kwargs",
    [{"preserve_rng_state": False}, {"policy": "greedy"}, {"debug": True}, {"fn": "layer's"}, {"offload": True},
     {"policy": "greedy", "preserve_rng_state": False}],
    ids=str,
)  # fmt: skip
def test_layer_keyword_arguments_named_like_checkpoint_parameters_reach_the_layer(kwargs, monkeypatch):
    """They went to memopt.checkpoint: preserve_rng_state=False was taken by it (the output
    differed from the unwrapped model's), policy= raised TypeError (multiple values), debug=True
    turned on torch's debug mode. The layer's other keyword arguments still pass through the
    checkpoint (it must see a cache passed as past_key_values)."""
    torch.manual_seed(0)
    plain = _ModelWithCheckpointNames(**kwargs)
    model = memopt.wrap(copy.deepcopy(plain), layers=_LayerWithCheckpointNames, policy="full")
    passed = []
    checkpoint = wrap_module.checkpoint
    monkeypatch.setattr(
        wrap_module, "checkpoint", lambda *args, **kw: passed.append(sorted(kw)) or checkpoint(*args, **kw)
    )
    x = torch.randn(BATCH, SEQ, D_MODEL, dtype=torch.float64)
    got, want = _step(model, x), _step(plain, x)
    assert passed == [["offload", "policy", "scale"]] * 2
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
