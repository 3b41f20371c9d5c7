"""memopt.checkpoint is exact where PyTorch's checkpointing is silently wrong or refuses.

Note [what a recompute may rely on] in memopt/checkpoint.py: in-place updates of saved matmul
outputs (also through ``torch.matmul``'s ``_unsafe_view``, whose version counter is its own), and
module buffers that a recompute would update a second time (BatchNorm).
"""

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt

ckpt = importlib.import_module("memopt.checkpoint")
offload_module = importlib.import_module("memopt.offload")
POLICIES = ["selective", "full"]


def _grads(fn, inputs, policy):
    if policy == "plain":
        out = fn(*inputs)
    else:
        out = memopt.checkpoint(fn, *inputs, policy=policy)
    return torch.autograd.grad(out.sum(), inputs)


def _assert_exact(fn, shapes, policies=POLICIES):
    torch.manual_seed(0)
    inputs = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]
    expected = _grads(fn, inputs, "plain")
    for policy in policies:
        for got, want in zip(_grads(fn, inputs, policy), expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{policy}: {m}")


def test_matmul_output_updated_in_place_through_unsafe_view():
    """The issue's minimal case: 3-D torch.matmul returns _unsafe_view(bmm(...)); before, the
    gradients under "selective" were off by about 10."""

    def fn(a, b, c):
        y = torch.matmul(a, b)
        y += torch.matmul(a, c)
        return y.sin()

    _assert_exact(fn, [(2, 3, 4), (2, 4, 5), (2, 4, 5)])


def test_attention_scores_divided_in_place():
    """Falcon's eager attention: scores /= sqrt(d) right after the matmul."""

    def fn(q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores /= q.shape[-1] ** 0.5
        return torch.matmul(scores.softmax(-1), v)

    _assert_exact(fn, [(2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)])


@pytest.mark.parametrize("rank", [2, 3])
def test_linear_followed_by_inplace_relu(rank):
    """Swin-v2's position-bias MLP: Linear then ReLU(inplace=True). Before: "Tensor cached during
    selective activation checkpoint has been mutated"."""
    lead = (3,) if rank == 2 else (2, 3)

    def fn(x, w, b):
        y = F.linear(x, w, b)
        F.relu(y, inplace=True)
        y = y * 3
        y.add_(1)
        return (y * 2).cos()

    _assert_exact(fn, [(*lead, 4), (6, 4), (6,)])


def test_cached_output_changed_after_the_forward_raises():
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        y = torch.matmul(x.unsqueeze(0), w.unsqueeze(0))  # _unsafe_view of a cached bmm
        return y, y.sin()

    y, z = memopt.checkpoint(fn, x, w, policy="selective")
    with torch.no_grad():
        y.mul_(2)  # after the forward: the recompute can no longer start from the saved value
    with pytest.raises(RuntimeError, match="changed in place after the checkpointed forward"):
        z.sum().backward()


def test_a_view_of_a_cached_output_changed_after_the_forward_raises():
    """The guard finds the aliases of a cached storage by their data pointers: a view into the
    middle of a cached matmul output is one of them."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        y = x @ w  # cached (mm)
        part = y[:, 3:5]  # a view starting inside y's storage
        return part, y.sin()

    part, z = memopt.checkpoint(fn, x, w, policy="selective")
    with torch.no_grad():
        part.add_(1)
    with pytest.raises(RuntimeError, match="changed in place after the checkpointed forward"):
        z.sum().backward()


def test_the_guards_add_no_dispatch_mode_of_their_own():
    """The guards run inside PyTorch's selective-checkpoint modes (a Python dispatch mode costs
    ~10 us an op): a guarded forward and recompute see as many modes as PyTorch's own selective
    checkpointing does."""
    import functools

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from memopt.policy import selective_checkpoint_policy

    depths = {"memopt": [], "torch": []}

    def fn(x, w, who):
        depths[who].append(len(_get_current_dispatch_mode_stack()))
        return (x @ w).relu().sum()

    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    memopt.checkpoint(fn, x, w, "memopt", policy="selective").backward()
    context_fn = functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy)
    checkpoint(fn, x, w, "torch", use_reentrant=False, context_fn=context_fn).backward()
    assert len(depths["memopt"]) == len(depths["torch"]) == 2  # forward and recompute
    assert depths["memopt"] == depths["torch"] and depths["torch"][0] >= 1


class _ConvBN(nn.Module):
    def __init__(self, channels_in: int):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(F.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["module", "wrap"])
def test_batchnorm_statistics_updated_once_per_step(policy, how):
    """Before: the recompute ran BatchNorm again, num_batches_tracked doubled and the running
    statistics drifted (ResNet, RegNet, MobileNetV2 under wrap)."""
    torch.manual_seed(0)
    plain = nn.Sequential(_ConvBN(3), _ConvBN(4)).double()
    wrapped = copy.deepcopy(plain)
    if how == "wrap":
        memopt.wrap(wrapped, layers=_ConvBN, policy=policy)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    for step in range(2):
        torch.manual_seed(step)
        plain(x).square().sum().backward()
        torch.manual_seed(step)
        if how == "wrap":
            out = wrapped(x)
        else:
            out = x
            for layer in wrapped:
                out = memopt.checkpoint(layer, out, policy=policy)
        out.square().sum().backward()
    for (name, a), b in zip(plain.named_buffers(), wrapped.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    plain.eval(), wrapped.eval()
    torch.testing.assert_close(wrapped(x), plain(x), rtol=1e-12, atol=1e-12)


def test_respect_saved_tensors_hooks_is_accepted():
    """Before: "got multiple values for keyword argument 'respect_saved_tensors_hooks'"."""
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    for respect in (True, False):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = memopt.checkpoint(lambda x, w: (x @ w).sin(), x, w, policy="selective", respect_saved_tensors_hooks=respect)
        (gx,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(gx, ((x @ w).cos() @ w.t()).detach())
        assert any(t.shape == (4, 3) for t in packed) == respect
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks"):
        memopt.checkpoint(torch.sin, x, respect_saved_tensors_hooks="yes")


def test_caller_context_fn_composes_with_selective():
    """Before: context_fn was refused under "selective". The caller's contexts run inside memopt's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {"forward": [], "recompute": []}

    class Record(TorchDispatchMode):
        def __init__(self, where):
            super().__init__()
            self.where = where

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[self.where].append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    out = memopt.checkpoint(
        lambda x, w: (x @ w).sin(), x, w, policy="selective", context_fn=lambda: (Record("forward"), Record("recompute"))
    )
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(gx, ((x @ w).cos() @ w.t()).detach())
    assert "mm.default" in seen["forward"] and "sin.default" in seen["forward"]
    assert "mm.default" in seen["recompute"]  # the recompute stops once sin's input is rebuilt


def test_global_checkpoint_debug_does_not_break_selective():
    """Before: torch.utils.checkpoint.set_checkpoint_debug_enabled(True) made every selective call raise."""
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        out = memopt.checkpoint(lambda x, w: (x @ w).sin(), x, w, policy="selective")
        (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(gx, ((x @ w).cos() @ w.t()).detach())


# Under a version-checking offload engine. The real engine (CPU tensors taken as device tensors)
# records the version of every tensor it packs and refuses to unpack one written into since, as
# autograd does. On torch 2.14 the selective cache goes through the engine when the op runs, so a
# cached output written into afterwards (ReLU(inplace=True)) used to make the backward raise
# "memopt.offload saved for backward, is at version 1; expected version 0": the cache entry was
# unpacked before the guard's copy from before the write replaced it.


def _version_checking_engine():
    return memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)


class _MatmulThenInPlace(nn.Module):
    """Linear then ReLU(inplace=True), and a matmul output scaled in place: both cached outputs
    are written into during the forward."""

    def __init__(self, d=8):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.act(self.up(x))
        return x + self.down(h).mul_(2).tanh()


def _param_and_input_grads(model, x, run):
    out = run(model, x)
    return torch.autograd.grad(out.square().sum(), [x, *model.parameters()])


@pytest.mark.parametrize("hooks_path", ["torch", "fallback"])
@pytest.mark.parametrize("how", ["offload=", "active engine"])
@pytest.mark.parametrize("rank", [2, 3])
def test_in_place_update_of_a_cached_output_is_exact_under_a_version_checking_offload(monkeypatch, hooks_path, how, rank):
    if hooks_path == "fallback":
        # The path of torch 2.11..2.13, which lack respect_saved_tensors_hooks.
        monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)
    torch.manual_seed(0)
    layer = _MatmulThenInPlace().double()
    x = torch.randn(*((5,) if rank == 2 else (2, 5)), 8, dtype=torch.float64, requires_grad=True)
    eager = _param_and_input_grads(layer, x, lambda m, t: m(t))
    no_offload = _param_and_input_grads(layer, x, lambda m, t: memopt.checkpoint(m, t, policy="selective"))
    engine = _version_checking_engine()

    def offloaded(m, t):
        if how == "offload=":
            return memopt.checkpoint(m, t, policy="selective", offload=engine)
        with engine:
            return memopt.checkpoint(m, t, policy="selective")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 asked nothing on the fallback path
        got = _param_and_input_grads(layer, x, offloaded)
    assert engine.stats()["copies_to_host"] > 0  # the cache really went through the engine
    for g, plain, e in zip(got, no_offload, eager):
        assert torch.equal(g, plain)  # offload is bit-identical to no offload
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_wrap_selective_with_offload_true_and_an_in_place_update(monkeypatch):
    engine = _version_checking_engine()
    monkeypatch.setattr(offload_module, "_DEFAULT", engine)  # what offload=True takes outside any engine
    torch.manual_seed(0)
    plain = nn.Sequential(*[_MatmulThenInPlace() for _ in range(3)]).double()
    wrapped = memopt.wrap(copy.deepcopy(plain), policy="selective", offload=True)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    expected = _param_and_input_grads(plain, x, lambda m, t: m(t))
    got = _param_and_input_grads(wrapped, x, lambda m, t: m(t))
    assert engine.stats()["copies_to_host"] > 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_the_engine_still_refuses_what_was_written_into_after_it_was_saved():
    """The fix hands the recompute the copy from before a write inside the forward; the engine's
    version check still stands for a tensor autograd saved, and for a cached output written into
    after the forward."""
    engine = _version_checking_engine()
    layer = _MatmulThenInPlace().double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    with engine:
        saved_by_exp = memopt.checkpoint(layer, x, policy="selective").exp()  # exp saves its result
    with torch.no_grad():
        saved_by_exp.add_(1)
    with pytest.raises(RuntimeError, match="memopt.offload saved for backward, is at version 1; expected version 0"):
        saved_by_exp.sum().backward()

    w = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y, z = memopt.checkpoint(lambda x, w: ((y := x @ w), y.sin()), x, w, policy="selective", offload=engine)
    with torch.no_grad():
        y.mul_(2)  # after the forward: the value at save time is gone
    with pytest.raises(RuntimeError, match="modified by an inplace operation|changed in place after the checkpointed"):
        z.sum().backward()


def test_a_snapshot_not_placed_in_the_cache_is_handed_out_by_the_recompute(monkeypatch):
    """Where the guard cannot find the cache entry in PyTorch's cache (a layout it does not know),
    the recompute swaps the copy in itself: still exact without offload."""
    monkeypatch.setattr(ckpt._CachedOutputGuard, "_cache_slot", lambda self, func, n, leaves: None)
    torch.manual_seed(0)
    layer = _MatmulThenInPlace().double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    expected = _param_and_input_grads(layer, x, lambda m, t: m(t))
    got = _param_and_input_grads(layer, x, lambda m, t: memopt.checkpoint(m, t, policy="selective"))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Buffers that the forward reads and updates (note [what a recompute may rely on], 2): the
# recompute must see them as the forward started, not as the forward left them.


class _RunningScale(nn.Module):
    """Scales by a running statistic it updates after using it: in place, or by reassigning it."""

    def __init__(self, d: int, reassign: bool = False):
        super().__init__()
        self.reassign = reassign
        self.register_buffer("scale", torch.ones(d, dtype=torch.float64))

    def forward(self, x):
        y = torch.tanh(x * self.scale.clone())  # autograd must not save the buffer it updates
        if self.training:
            with torch.no_grad():
                if self.reassign:
                    self.scale = 0.5 * self.scale + 0.5 * x.abs().mean(0)
                else:
                    self.scale.mul_(0.5).add_(0.5 * x.abs().mean(0))
        return y


class _Queue(nn.Module):
    """MoCo's negative queue: the logits read the queue, then the batch is enqueued in place. The
    queue is large (1.1 MiB) and written in place through a slice."""

    def __init__(self, d: int, size: int):
        super().__init__()
        self.register_buffer("queue", torch.randn(d, size, dtype=torch.float64))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        logits = x @ self.queue.clone()  # as MoCo: autograd must not save the buffer it updates
        if self.training:
            with torch.no_grad():
                n, start = x.shape[0], int(self.ptr)
                self.queue[:, start : start + n] = x.t()
                self.ptr.fill_((start + n) % self.queue.shape[1])
        return logits.softmax(-1)


class _PowerIteration(nn.Module):
    """A power iteration written with out=: the selective cache keeps ``mm.out``'s output, which
    is the buffer itself, and the recompute must see it written."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d, dtype=torch.float64))
        self.register_buffer("u", torch.randn(d, 1, dtype=torch.float64))
        self.register_buffer("v", torch.randn(d, 1, dtype=torch.float64))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                torch.mm(self.weight, self.v, out=self.u)  # "selective" saves mm.out: the buffer
                self.u.div_(self.u.norm())
                torch.mm(self.weight.t(), self.u, out=self.v)
        sigma = (self.u.t() @ self.weight @ self.v).squeeze() / self.v.norm()
        return x @ (self.weight / sigma)


class _SharedScale(nn.Module):
    """One buffer held by two submodules: updated by the first, read by both."""

    def __init__(self, d: int):
        super().__init__()
        self.first = _RunningScale(d)
        self.second = nn.Module()
        self.second.scale = self.first.scale  # the same tensor, a buffer of both

    def forward(self, x):
        return self.first(x) * self.second.scale


def _buffer_models():
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    d = 16
    return {
        "spectral_norm": nn.Sequential(spectral_norm(nn.Linear(d, d)), nn.Tanh(), nn.Linear(d, 4)),
        "running_scale": nn.Sequential(nn.Linear(d, d), _RunningScale(d), nn.Linear(d, 4)),
        "reassigned": nn.Sequential(nn.Linear(d, d), _RunningScale(d, reassign=True), nn.Linear(d, 4)),
        "shared": nn.Sequential(nn.Linear(d, d), _SharedScale(d), nn.Linear(d, 4)),
        "queue": nn.Sequential(nn.Linear(d, d), _Queue(d, 9000), nn.Linear(9000, 4)),
        "out_into_buffer": nn.Sequential(_PowerIteration(d), nn.Tanh(), nn.Linear(d, 4)),
    }


def _save_mm(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _step(model, x, policy, steps=2, **options):
    """Two training steps; the gradients of the last one, and the buffers after both."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = model(xx) if policy is None else memopt.checkpoint(model, xx, policy=policy, **options)
        out.square().sum().backward()
    grads = {"x": xx.grad, **{name: p.grad for name, p in model.named_parameters()}}
    return grads, dict(model.named_buffers())


@pytest.mark.parametrize("policy", ["selective", "full", "function", "nested", "offload", "offload-fallback"])
@pytest.mark.parametrize("name", ["spectral_norm", "running_scale", "reassigned", "shared", "queue", "out_into_buffer"])
def test_recompute_reads_buffers_as_the_forward_started(monkeypatch, name, policy):
    """Before: the recompute read the buffers as the forward left them (spectral norm's _u/_v
    after its power iteration, a running scale after its update), so the recomputed
    activations differed from the forward's: gradients off by 2.3e-5 (spectral norm, float64)
    to 0.46 (running scale), with no error; torch.utils.checkpoint does the same."""
    base = _buffer_models()[name].double().train()
    x = torch.randn(8, 16, dtype=torch.float64)
    expected_grads, expected_buffers = _step(copy.deepcopy(base), x, None)
    model = copy.deepcopy(base)
    if policy == "nested":
        inner = model[1] if name not in ("spectral_norm", "out_into_buffer") else model[0]
        forward = inner.forward
        inner.forward = lambda t: memopt.checkpoint(forward, t, policy="selective")
        got_grads, got_buffers = _step(model, x, "full")
    elif policy.startswith("offload"):
        if policy == "offload-fallback":
            monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)  # torch 2.11..2.13's path
        engine = _version_checking_engine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 asked nothing on the fallback path
            got_grads, got_buffers = _step(model, x, "selective", offload=engine)
        assert engine.stats()["copies_to_host"] > 0
    else:
        got_grads, got_buffers = _step(model, x, _save_mm if policy == "function" else policy)
    for key, want in expected_grads.items():
        torch.testing.assert_close(got_grads[key], want, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad {key}: {m}")
    assert got_buffers.keys() == expected_buffers.keys()
    for key, want in expected_buffers.items():
        torch.testing.assert_close(got_buffers[key], want, rtol=1e-12, atol=1e-12, msg=lambda m: f"buffer {key}: {m}")


def test_reassigned_buffer_is_back_after_the_recompute():
    """The recompute runs with the buffer the forward started from, and the module holds the
    forward's new one again after it (the tensor object, not only its value)."""
    model = nn.Sequential(nn.Linear(4, 4), _RunningScale(4, reassign=True)).double().train()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    before = model[1].scale
    out = memopt.checkpoint(model, x, policy="full")
    after = model[1].scale
    assert after is not before
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(m.scale))
    out.sum().backward()
    assert seen[0] is before  # the recompute's
    assert model[1].scale is after


def test_constant_buffers_cost_no_copy_kept_past_the_forward():
    """A buffer the forward only reads (a rotary table, a mask) keeps no copy in the guard."""
    model = nn.Sequential(_ConvBN(3), _ConvBN(4)).double()
    rotary = nn.Module()
    rotary.register_buffer("table", torch.randn(6, 6, dtype=torch.float64))
    fn = lambda x: model(x) * rotary.table  # noqa: E731
    guard = ckpt._BufferGuard(ckpt.submodules([model, rotary]))
    with guard.forward():
        fn(torch.randn(2, 3, 6, 6, dtype=torch.float64))
    assert guard._start == {}  # BatchNorm's statistics are read by nothing in training but their update


class _PowerIterationWrittenTwice(nn.Module):
    """u = W v written with out= (a cached matmul under "selective"), then normalised in place:
    two writes into the buffer in one forward, the recompute reads u."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.register_buffer("u", torch.randn(5, 1))
        self.register_buffer("v", torch.randn(5, 1))

    def forward(self, x):
        with torch.no_grad():
            torch.mm(self.lin.weight, self.v, out=self.u)
            self.u.div_(self.u.norm())
        return torch.tanh(x * self.lin.bias * self.u.t().clone()).sum()


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_cached_output_in_a_buffer_written_twice(policy):
    # The guard's end-of-forward copy of cached outputs in written buffers was skipped once the
    # second write had taken the only cached entry: the recompute's restore of u then looked like
    # a write after the forward, and raised.
    torch.manual_seed(0)
    model = _PowerIterationWrittenTwice().double()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(model(x), x)
    model.load_state_dict(state)
    (got,) = torch.autograd.grad(memopt.checkpoint(model, x, policy=policy), x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_full_policy_runs_higher_order_ops_with_buffers():
    # "full" watched large buffers for writes with a dispatch mode of memopt's own, in which
    # torch.cond and flex_attention raised; it now copies buffers up front and runs no mode.
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("table", torch.ones((65 << 20) // 8))  # above the 64 MiB it watched from

        def forward(self, x):
            y = self.lin(x) * self.table[:4]
            return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (y,)).sum()

    torch.manual_seed(0)
    model = Branching().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(model(x), x)
    (got,) = torch.autograd.grad(memopt.checkpoint(model, x, policy="full"), x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


class _InnerWrittenInPlace(nn.Module):
    """A matmul output changed in place after another matmul: both are cached, and a write into
    the second must snapshot it alone."""

    def __init__(self, d, mid):
        super().__init__()
        self.a = nn.Linear(d, mid)
        self.b = nn.Linear(mid, d)

    def forward(self, h):
        y = self.b(torch.tanh(self.a(h)))
        y += 1
        return y


@pytest.mark.parametrize("hooks_path", ["torch", "fallback"])
@pytest.mark.parametrize("inner_policy", ["selective", "function"])
@pytest.mark.parametrize("mid", [6, 5])  # same shapes (wrong gradients), different (torch's CheckpointError)
def test_nested_selective_under_a_coalescing_cpu_offload_is_exact(monkeypatch, hooks_path, inner_policy, mid):
    # Note [a snapshot per overlapping output] and [the hooks memopt packs with]: the outer
    # recompute hands the inner call its cached outputs unpacked from one coalesced storage, and
    # the inner guard copied both (the forward copied one) and packed the copies with the outer
    # checkpoint's own hooks, shifting the outer recompute's position-matched tensors: the inner
    # backward got a.out where b.out was due.
    if hooks_path == "fallback":
        monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)  # torch 2.11..2.13's path
    torch.manual_seed(0)
    d = 6
    first = nn.Linear(d, d).double()
    inner = _InnerWrittenInPlace(d, mid).double()
    policy = "selective" if inner_policy == "selective" else _save_mm

    def outer(x):
        return memopt.checkpoint(inner, torch.relu(first(x)), policy=policy) * x

    x = torch.randn(4, d, dtype=torch.float64, requires_grad=True)
    params = [x, *first.parameters(), *inner.parameters()]
    want_out = inner(torch.relu(first(x))) * x
    want = torch.autograd.grad(want_out.square().sum(), params)
    # Default coalesce_bytes: the small saved tensors of a group are unpacked into one storage.
    engine = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)
    assert offload_module.DEFAULT_COALESCE_BYTES > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 asked nothing on the fallback path
        out = memopt.checkpoint(outer, x, policy="selective", offload=engine)
        got = torch.autograd.grad(out.square().sum(), params)
    assert engine.stats()["copies_to_host"] > 0
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
