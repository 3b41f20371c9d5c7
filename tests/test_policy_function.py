"""policy= as a PyTorch selective-checkpoint policy function: the same gradients as PyTorch's own
selective checkpointing with that function, the bytes it implies, its CPU-offload values through
memopt's engine, offload= on top, and memopt.wrap."""

import copy
import functools
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import memopt


ckpt = importlib.import_module("memopt.checkpoint")
offload_module = importlib.import_module("memopt.offload")
aten = torch.ops.aten
HAS_CPU_OFFLOAD = hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD")


def _block(x, w1, w2, gamma, p=0.2):
    """Norm, matmul, GELU, dropout, matmul, residual: dropout makes the recompute's RNG replay count."""
    h = F.layer_norm(x, x.shape[-1:], gamma)
    h = F.gelu(h @ w1)
    h = F.dropout(h, p, training=p > 0)
    return x + h @ w2


def _inputs(dtype=torch.float64, n=37, d=24, hidden=48):
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in ((n, d), (d, hidden), (hidden, d), (d,))]


def save_first_matmul_and_gelu(ctx, op, *args, **kwargs):
    """A user's policy, unlike memopt's "selective": the GELU output is kept, the second matmul
    (the 2-D ``x @ w`` is ``aten.mm``, the first call of it saved, the second recomputed) is not."""
    if op == aten.gelu.default:
        return CheckpointPolicy.MUST_SAVE
    if op == aten.mm.default:
        # args, not ctx.op_output: torch before 2.13 does not pass the output to the policy.
        return CheckpointPolicy.PREFER_SAVE if args[1].shape[-1] == 48 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _run(fn, inputs, seed):
    torch.manual_seed(seed)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _torch_sac(policy_fn):
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    return lambda *a: torch.utils.checkpoint.checkpoint(_block, *a, use_reentrant=False, context_fn=context_fn)


class _OutputsOfSavedOps(TorchDispatchMode):
    """Independent reference for the saved bytes: in a plain run, the storages of the outputs of
    the op calls ``policy_fn`` marks to save."""

    def __init__(self, policy_fn):
        super().__init__()
        self.policy_fn = policy_fn
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
        if self.policy_fn(ctx, func, *args, **(kwargs or {})) != CheckpointPolicy.PREFER_RECOMPUTE:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                self.storages[memopt.saved.storage_key(t)] = t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_equal_torch_selective_checkpointing_with_the_same_policy(dtype):
    inputs = _inputs(dtype)
    expected_out, expected = _run(_torch_sac(save_first_matmul_and_gelu), inputs, seed=3)
    plain_out, plain = _run(_block, inputs, seed=3)
    out, grads = _run(lambda *a: memopt.checkpoint(_block, *a, policy=save_first_matmul_and_gelu), inputs, seed=3)
    # Same ops in the same order: bit for bit PyTorch's result, and the plain run's within rounding.
    assert torch.equal(out, expected_out)
    for grad, ref, plain_grad in zip(grads, expected, plain):
        assert torch.equal(grad, ref)
        torch.testing.assert_close(grad, plain_grad)
    torch.testing.assert_close(out, plain_out)


def test_saved_bytes_are_what_the_policy_implies():
    inputs = _inputs(torch.float32, n=64, d=24, hidden=48)
    with _OutputsOfSavedOps(save_first_matmul_and_gelu) as reference:
        _block(*inputs)
    fp32 = 4
    # The first matmul's output (64, 48) and the GELU's (64, 48); the second matmul is recomputed.
    assert sum(reference.storages.values()) == 2 * 64 * 48 * fp32
    counted = memopt.saved_bytes(lambda *a: memopt.checkpoint(_block, *a, p=0.0, policy=save_first_matmul_and_gelu), *inputs)
    # Without dropout (its mask would be a third saved tensor, the reference above ran without it too).
    assert counted == sum(reference.storages.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        context_fn = functools.partial(create_selective_checkpoint_contexts, save_first_matmul_and_gelu)
        options = {"use_reentrant": False, "context_fn": context_fn}
        if ckpt._CHECKPOINT_RESPECTS_HOOKS:
            options["respect_saved_tensors_hooks"] = True
            torch_counted = memopt.saved_bytes(lambda *a: torch.utils.checkpoint.checkpoint(_block, *a, p=0.0, **options), *inputs)
            assert torch_counted == counted


def test_bool_answers_are_taken_as_pytorch_takes_them():
    inputs = _inputs()
    as_bool = lambda ctx, op, *a, **k: op == aten.mm.default  # noqa: E731
    expected_out, expected = _run(_torch_sac(as_bool), inputs, seed=1)
    out, grads = _run(lambda *a: memopt.checkpoint(_block, *a, policy=as_bool), inputs, seed=1)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_in_place_update_of_a_saved_output_is_exact():
    """The exactness guard of "selective" covers what a policy function saves."""
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def scaled_in_place(x, w):
        return (x @ w).mul_(2).sin()

    expected = torch.autograd.grad(scaled_in_place(x, w).sum(), (x, w))
    save_mm = lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE  # noqa: E731
    got = torch.autograd.grad(memopt.checkpoint(scaled_in_place, x, w, policy=save_mm).sum(), (x, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def _cpu_engine():
    # CPU tensors count as device tensors for this Offload, so the round trip really happens.
    return memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)


def _save_or_offload_matmuls(answer):
    def policy(ctx, op, *args, **kwargs):
        if op in (aten.mm.default, aten.addmm.default):
            return getattr(CheckpointPolicy, answer)
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize("hooks_path", ["torch", "fallback"])
@pytest.mark.parametrize("how", ["offload=", "active engine", "default engine"])
@pytest.mark.parametrize("answer", ["MUST_SAVE", "MUST_CPU_OFFLOAD"])
def test_in_place_update_of_a_saved_output_is_exact_under_a_version_checking_offload(monkeypatch, answer, how, hooks_path):
    """The real engine records the version of what it packs and refuses to unpack a tensor written
    into since. Before: a saved (or CPU-offloaded) addmm output that ReLU(inplace=True) then wrote
    into went through the engine at version 0, and the backward raised "memopt.offload saved for
    backward, is at version 1; expected version 0" (torch 2.14's path)."""
    if answer == "MUST_CPU_OFFLOAD" and not HAS_CPU_OFFLOAD:
        pytest.skip("this torch's CheckpointPolicy has no CPU-offload values")
    if answer == "MUST_SAVE" and how == "default engine":
        pytest.skip("a saved output goes to no engine unless one is around the call")
    if hooks_path == "fallback":
        # The path of torch 2.11..2.13, which lack respect_saved_tensors_hooks.
        monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)
    engine = _cpu_engine()
    monkeypatch.setattr(offload_module, "_DEFAULT", engine)  # what a CPU-offload answer takes outside any engine
    policy = _save_or_offload_matmuls(answer)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 16)).double()
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)

    def grads(out):
        return torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])

    expected = grads(layer(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 asked nothing on the fallback path
        if how == "offload=":
            out = memopt.checkpoint(layer, x, policy=policy, offload=engine)
        elif how == "active engine":
            with engine:
                out = memopt.checkpoint(layer, x, policy=policy)
        else:
            out = memopt.checkpoint(layer, x, policy=policy)
    # Both addmm outputs (20x32 and 20x16) are held by the engine, the first as the copy taken
    # before ReLU wrote into it. (torch 2.14 packs the first at op time too, before the write:
    # that handle is released when the copy takes its place.)
    assert engine.stats()["live_handles"] == 2
    assert engine.stats()["bytes_to_host"] >= (20 * 32 + 20 * 16) * 8
    got = grads(out)
    assert engine.stats()["live_handles"] == 0
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_offload_on_top_moves_what_the_policy_saves():
    inputs = _inputs(torch.float32, n=64)
    engine = _cpu_engine()
    out, grads = _run(lambda *a: memopt.checkpoint(_block, *a, p=0.0, policy=save_first_matmul_and_gelu, offload=engine), inputs, seed=2)
    expected_out, expected = _run(lambda *a: _block(*a, p=0.0), inputs, seed=2)
    # The two (64, 48) outputs the policy keeps, and the layer norm's statistics and the residual
    # input the backward of the recomputed ops needs are recomputed, not saved: only those two move.
    assert engine.stats()["bytes_to_host"] == 2 * 64 * 48 * 4
    torch.testing.assert_close(out, expected_out)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.skipif(not HAS_CPU_OFFLOAD, reason="this torch's CheckpointPolicy has no CPU-offload values")
@pytest.mark.parametrize("strength", ["MUST", "PREFER"])
@pytest.mark.parametrize("hooks_path", ["torch", "fallback"])
def test_cpu_offload_answers_go_through_memopts_engine(monkeypatch, strength, hooks_path):
    if hooks_path == "fallback":
        # The path of torch 2.11..2.13, which lack respect_saved_tensors_hooks.
        monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)
    engine = _cpu_engine()
    monkeypatch.setattr(offload_module, "_DEFAULT", engine)  # what offload=True takes outside any engine
    to_host = getattr(CheckpointPolicy, f"{strength}_CPU_OFFLOAD")

    def offload_gelu_save_matmuls(ctx, op, *args, **kwargs):
        if op == aten.gelu.default:
            return to_host
        return CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    inputs = _inputs(torch.float32, n=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with memopt.SavedTensorCounter(exclude=inputs) as counter:
            out = memopt.checkpoint(_block, *inputs, p=0.0, policy=offload_gelu_save_matmuls)
    # Only the GELU output (64, 48) went to the host; the two matmul outputs stayed.
    assert engine.stats()["bytes_to_host"] == 64 * 48 * 4
    assert not engine.active
    # The hooks around the call still see every tensor the policy keeps.
    assert counter.total_bytes == (64 * 48 + 64 * 48 + 64 * 24) * 4
    out.square().sum().backward()
    grads = [t.grad for t in inputs]
    expected_out, expected = _run(lambda *a: _block(*a, p=0.0), inputs, seed=0)
    assert engine.stats()["bytes_to_device"] == 64 * 48 * 4
    torch.testing.assert_close(out.detach(), expected_out)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


class _Layer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


def test_wrap_takes_a_policy_function_for_every_layer_or_some():
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Layer() for _ in range(3)])
    wrapped = memopt.wrap(
        copy.deepcopy(plain), policy={0: save_first_matmul_and_gelu, 2: "full"}
    )
    assert importlib.import_module("memopt.wrap").wrapped_policies(wrapped) == {"0": save_first_matmul_and_gelu, "1": "none", "2": "full"}
    x = torch.randn(4, 7, 16)
    results = []
    for model in (plain, wrapped):
        torch.manual_seed(4)
        model(x).square().sum().backward()
        results.append([p.grad for p in model.parameters()])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)
    torch_layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    second = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    model = memopt.wrap(nn.Sequential(torch_layer, second), policy=save_first_matmul_and_gelu)
    assert model[0] is torch_layer  # not swapped for a fused block: it runs the torch layer's own ops


def test_bad_policy_functions_raise():
    x = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(TypeError, match="must return a torch.utils.checkpoint.CheckpointPolicy, got 'save'"):
        memopt.checkpoint(torch.sin, x, policy=lambda ctx, op, *a, **k: "save")
    with pytest.raises(ValueError, match="policy must be one of .* got the function"):
        memopt.FusedCheckpointBlock(32, 2, policy=save_first_matmul_and_gelu)


def test_compile_fullgraph_with_a_policy_function(compile_cache):
    inputs = _inputs(torch.float32)
    compiled = torch.compile(
        lambda *a: memopt.checkpoint(_block, *a, p=0.0, policy=save_first_matmul_and_gelu), backend="aot_eager", fullgraph=True
    )
    out, grads = _run(compiled, inputs, seed=0)
    expected_out, expected = _run(lambda *a: _block(*a, p=0.0), inputs, seed=0)
    torch.testing.assert_close(out, expected_out)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------------------------------------
# A policy that saves the output of a random op (note [what a recompute may rely on], 3 in
# memopt/checkpoint.py): the recompute takes the saved value without drawing, so every later
# random op of the recompute drew other numbers than the forward did.

W_RANDOM = [torch.randn(16, 16, dtype=torch.float64) for _ in range(2)]


def _two_dropouts(x, w1, w2):
    h = F.dropout(torch.tanh(x @ w1), 0.5, True)  # on CPU: empty_like, bernoulli_, div_ (in place), mul
    return F.dropout(torch.tanh(h @ w2), 0.5, True)


def _two_rands(x, w1, w2):
    return torch.tanh((x * torch.rand_like(x)) @ w1) * torch.rand_like(x) @ w2


def _rand_then_dropout(x, w1, w2):
    h = torch.tanh(x @ w1) * torch.bernoulli(torch.full_like(x, 0.7))
    return F.dropout(torch.tanh(h @ w2), 0.3, True) + torch.randn_like(x)


class _SaveRandomOps:
    """Save the ``which`` calls of random ops (0-based, counted over all random ops), recompute the rest."""

    def __init__(self, which):
        self.which = which
        self.calls = {False: 0, True: 0}

    def __call__(self, ctx, op, *args, **kwargs):
        if torch.Tag.nondeterministic_seeded in op.tags:
            n = self.calls[ctx.is_recompute]
            self.calls[ctx.is_recompute] += 1
            if self.which == "all" or n in self.which:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _random_run(fn, checkpointed, **options):
    torch.manual_seed(3)
    leaves = [torch.randn(8, 16, dtype=torch.float64)] + [w.clone() for w in W_RANDOM]
    leaves = [t.requires_grad_() for t in leaves]
    out = checkpointed(fn, *leaves, **options) if checkpointed else fn(*leaves)
    out.square().sum().backward()
    return [out.detach()] + [t.grad for t in leaves], torch.get_rng_state()


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("which", [(0,), (1,), (0, 2), "all"])
@pytest.mark.parametrize("fn", [_two_dropouts, _two_rands, _rand_then_dropout], ids=lambda f: f.__name__)
def test_a_policy_that_saves_random_ops_is_exact(fn, which, offload):
    """Before: saving the first of two F.dropout calls gave gradients off by 30.6 (PyTorch's own
    selective checkpointing raises there: dropout divides its mask in place), the first of two
    rand_like calls 1.68 (PyTorch too), with no error."""
    expected, expected_rng = _random_run(fn, None)
    engine = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True) if offload else False
    got, rng = _random_run(fn, memopt.checkpoint, policy=_SaveRandomOps(which), offload=engine)
    if offload:
        assert engine.stats()["copies_to_host"] > 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert torch.equal(rng, expected_rng)  # the recompute's draws and memopt's RNG moves stay inside it


def test_every_random_op_saved_needs_no_rng_replay():
    """Without preserve_rng_state the recompute draws afresh: exact when the policy saves every
    random op (the in-place mask of CPU dropout included), and memopt moves no generator."""
    expected, expected_rng = _random_run(_two_dropouts, None)
    got, _ = _random_run(_two_dropouts, memopt.checkpoint, policy=_SaveRandomOps("all"), preserve_rng_state=False)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_selective_with_a_saved_random_op_is_exact(monkeypatch):
    """"selective" saves the attention kernels, which draw their dropout mask from the generator
    on GPU (SDPA with dropout_p > 0): a later dropout must draw what it drew in the forward.
    Simulated on CPU with rand_like as a saved op."""
    policy_module = importlib.import_module("memopt.policy")
    saved = policy_module.SELECTIVE_SAVED_OPS | {aten.rand_like.default}
    monkeypatch.setattr(policy_module, "SELECTIVE_SAVED_OPS", saved)
    monkeypatch.setattr(policy_module, "_SAVED_BY_ID", {})

    def fn(x, w1, w2):
        h = torch.tanh(x @ w1) * torch.rand_like(x)  # saved, as a GPU attention kernel with dropout
        return F.dropout(torch.tanh(h @ w2), 0.3, True)

    expected, expected_rng = _random_run(fn, None)
    got, rng = _random_run(fn, memopt.checkpoint, policy="selective")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert torch.equal(rng, expected_rng)


def test_which_calls_draw_from_the_default_generator():
    q = torch.randn(1, 2, 4, 8)
    draws = ckpt._draws_from_default_generator
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not draws(flash, (q, q, q), {})  # no dropout: "selective" keeps it at no cost
    assert not draws(flash, (q, q, q, 0.0), {})
    assert draws(flash, (q, q, q, 0.1), {})
    assert draws(aten.rand_like.default, (q,), {})
    assert not draws(aten.rand_like.generator, (q,), {"generator": torch.Generator()})
    assert draws(aten.bernoulli_.float, (q, 0.5), {})
    assert not draws(aten.mm.default, (q[0, 0], q[0, 0].t()), {})


def test_a_saved_in_place_op_writes_its_argument_in_the_recompute():
    """The cache hands out a saved call's result without running the op: an in-place op whose
    result the code ignores (``h.add_(b)``) left the recompute's ``h`` unwritten."""

    def fn(x, w, b):
        h = x @ w
        h.add_(b)  # the result is not used: h is
        return torch.tanh(h)

    def save_add(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == aten.add_.Tensor else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    inputs = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((5, 4), (4, 3), (3,))]
    expected = torch.autograd.grad(fn(*inputs).square().sum(), inputs)
    got = torch.autograd.grad(memopt.checkpoint(fn, *inputs, policy=save_add).square().sum(), inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
