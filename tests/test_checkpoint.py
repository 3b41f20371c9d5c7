"""memopt.checkpoint: equal outputs and gradients, RNG replay, what each policy saves, errors."""

import contextlib
import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import memopt

from helpers import gpu, tolerances

# The function memopt.checkpoint shadows its module of the same name as an attribute of memopt.
ckpt = importlib.import_module("memopt.checkpoint")

POLICIES = ["none", "selective", "full"]


def _block(x, w1, w2, gamma, p=0.0, scale=1.0):
    """A pre-norm MLP block with dropout: norm, matmul, GELU, dropout, matmul, residual."""
    h = F.layer_norm(x, x.shape[-1:], gamma)
    h = F.gelu(h @ w1)
    h = F.dropout(h, p, training=p > 0)
    return x + scale * (h @ w2)


def _block_inputs(dtype, n=37, d=24, hidden=48):
    x = torch.randn(n, d, dtype=dtype, requires_grad=True)
    w1 = torch.randn(d, hidden, dtype=dtype, requires_grad=True)
    w2 = torch.randn(hidden, d, dtype=dtype, requires_grad=True)
    gamma = torch.randn(d, dtype=dtype, requires_grad=True)
    return x, w1, w2, gamma


def _grads(fn, inputs, seed, **kwargs):
    torch.manual_seed(seed)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, **kwargs)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves], torch.rand(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_outputs_and_gradients_match_plain_run(dtype, policy, p):
    inputs = _block_inputs(dtype)
    ref_out, ref_grads, ref_next = _grads(_block, inputs, seed=5, p=p)
    out, grads, next_random = _grads(
        lambda *a, **k: memopt.checkpoint(_block, *a, policy=policy, **k), inputs, seed=5, p=p
    )
    torch.testing.assert_close(out, ref_out, **tolerances(dtype))
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, **tolerances(dtype))
    # The recompute replays the RNG and leaves the caller's stream where a plain run leaves it.
    assert torch.equal(next_random, ref_next)


def test_dropout_actually_drops_so_replay_is_tested():
    inputs = _block_inputs(torch.float64)
    a, _, _ = _grads(_block, inputs, seed=1, p=0.3)
    b, _, _ = _grads(_block, inputs, seed=2, p=0.3)
    assert not torch.equal(a, b)


def test_saved_bytes_per_policy():
    n, d, hidden = 64, 32, 128
    x, w1, w2, gamma = _block_inputs(torch.float32, n, d, hidden)
    counted = {
        policy: memopt.saved_bytes(
            lambda *a: memopt.checkpoint(_block, *a, policy=policy), x, w1, w2, gamma
        )
        for policy in POLICIES
    }
    fp32 = 4
    # Selective keeps the two matmul outputs, (n, hidden) and (n, d), and nothing else.
    assert counted["selective"] == fp32 * (n * hidden + n * d)
    # Full keeps nothing but the inputs, which saved_bytes leaves out.
    assert counted["full"] == 0
    # No checkpoint keeps at least the norm output, the pre-GELU activation and its output.
    assert counted["none"] >= fp32 * (n * d + 2 * n * hidden)


def test_saved_bytes_leaves_out_tensor_arguments_inside_containers():
    # Tensors passed in a tuple or dict were counted (524,288 bytes for (a * b).sum()), where
    # the same tensors passed loose were not, as the docstring says.
    a, b = torch.randn(256, 256, requires_grad=True), torch.randn(256, 256, requires_grad=True)

    def product(x, y):
        return (x * y).sum()

    assert memopt.saved_bytes(product, a, b) == 0
    assert memopt.saved_bytes(lambda pair: product(*pair), (a, b)) == 0
    assert memopt.saved_bytes(lambda inputs: product(inputs["x"], inputs["y"]), {"x": a, "y": b}) == 0
    # What the function makes is still counted: a*b's operands are arguments, its tanh is not.
    assert memopt.saved_bytes(lambda pair: torch.tanh(pair[0] * pair[1]).sum(), [a, b]) == 256 * 256 * 4


def test_saved_tensors_reach_outer_hooks_on_torch_without_respect_argument(monkeypatch):
    """torch 2.11..2.13 lack respect_saved_tensors_hooks: the fallback packs the cached tensors."""
    inputs = _block_inputs(torch.float32, 64, 32, 128)
    with_argument = memopt.saved_bytes(lambda *a: memopt.checkpoint(_block, *a), *inputs)
    monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)
    with warnings.catch_warnings():
        # torch 2.14 warns that, asked nothing, it bypasses the hooks; the fallback covers that.
        warnings.simplefilter("ignore", FutureWarning)
        without_argument = memopt.saved_bytes(lambda *a: memopt.checkpoint(_block, *a), *inputs)
        out, grads, _ = _grads(lambda *a: memopt.checkpoint(_block, *a, p=0.2), inputs, seed=3)
    ref_out, ref_grads, _ = _grads(lambda *a: _block(*a, p=0.2), inputs, seed=3)
    assert without_argument == with_argument > 0
    torch.testing.assert_close(out, ref_out)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


def test_selective_saves_attention_output_not_probabilities():
    b, h, s, dh = 2, 2, 64, 16
    q, k, v = (torch.randn(b, h, s, dh, requires_grad=True) for _ in range(3))
    saved = memopt.saved_bytes(
        lambda q, k, v: memopt.checkpoint(F.scaled_dot_product_attention, q, k, v, policy="selective"), q, k, v
    )
    plain = memopt.saved_bytes(F.scaled_dot_product_attention, q, k, v)
    # The fused attention kernel's outputs are kept; no (s, s) probability matrix is.
    assert 0 < saved < 4 * b * h * s * s
    assert saved <= plain


def test_kwargs_nested_outputs_and_autograd_grad():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)

    def fn(x, *, weight, tag):
        return {"y": torch.tanh(x @ weight), "tag": tag}

    out = memopt.checkpoint(fn, x, weight=w, tag="kept")
    assert out["tag"] == "kept"
    gx, gw = torch.autograd.grad(out["y"].sum(), (x, w))
    ref_gx, ref_gw = torch.autograd.grad(torch.tanh(x @ w).sum(), (x, w))
    torch.testing.assert_close(gx, ref_gx)
    torch.testing.assert_close(gw, ref_gw)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_gradcheck_float64(policy):
    # gradcheck runs many backwards through one graph: under "selective" each after the first
    # recomputes plainly (note [a second backward] in memopt/checkpoint.py).
    inputs = _block_inputs(torch.float64, n=5, d=4, hidden=6)
    assert torch.autograd.gradcheck(lambda *a: memopt.checkpoint(_block, *a, policy=policy), inputs)


def test_no_grad_runs_plainly():
    inputs = _block_inputs(torch.float32)
    with torch.no_grad():
        out = memopt.checkpoint(_block, *inputs)
    torch.testing.assert_close(out, _block(*inputs).detach())


@pytest.mark.parametrize("policy", POLICIES)
def test_compile_fullgraph(policy, compile_cache):
    inputs = _block_inputs(torch.float32)
    compiled = torch.compile(
        lambda *a: memopt.checkpoint(_block, *a, policy=policy), backend="aot_eager", fullgraph=True
    )
    out, grads, _ = _grads(compiled, inputs, seed=0)
    ref_out, ref_grads, _ = _grads(_block, inputs, seed=0)
    torch.testing.assert_close(out, ref_out)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


def test_offload_as_a_policy_says_what_to_write_instead():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="write policy='selective', offload=True"):
        memopt.checkpoint(torch.sin, x, policy="offload")
    with pytest.raises(TypeError, match="offload must be False, True or a memopt.Offload"):
        memopt.checkpoint(torch.sin, x, policy="none", offload="yes")


def test_offload_inside_an_active_engine_marks_a_group_there():
    """One nesting rule: inside ``with off:``, offload=True and offload=off both take a new
    group of ``off`` (no second engine, no "already active"); outside, offload=off enters it."""
    off = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)
    leaf = torch.randn(8, 64, requires_grad=True)
    x = leaf * 1  # an activation: the engine moves it
    with off:
        first = off.engine.current_group()
        y = memopt.checkpoint(torch.tanh, x, policy="none", offload=True)
        y = memopt.checkpoint(torch.tanh, y, policy="none", offload=off)
        assert off.engine.current_group() == first + 2
    moved = off.stats()["bytes_to_host"]
    assert moved == 2 * 8 * 64 * 4  # each tanh saved its output: both went to this engine
    y.sum().backward()
    inner = torch.tanh(leaf.detach())
    torch.testing.assert_close(leaf.grad, (1 - torch.tanh(inner) ** 2) * (1 - inner**2))
    memopt.checkpoint(torch.tanh, x, policy="none", offload=off)
    assert not off.active and off.stats()["bytes_to_host"] > moved


@pytest.mark.parametrize(
    "policy,hooks_path",
    [("none", "torch"), ("selective", "torch"), ("selective", "fallback")],
    ids=["none", "selective", "selective-fallback"],
)
def test_offload_moves_saved_tensors_and_keeps_results(monkeypatch, policy, hooks_path):
    if hooks_path == "fallback":
        # The path of torch 2.11..2.13, which lack respect_saved_tensors_hooks.
        monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)
    # CPU tensors count as device tensors for this Offload, so the round trip really happens.
    off = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)
    inputs = _block_inputs(torch.float32)
    out, grads, _ = _grads(lambda *a: memopt.checkpoint(_block, *a, policy=policy, offload=off, p=0.2), inputs, seed=6)
    ref_out, ref_grads, _ = _grads(lambda *a: _block(*a, p=0.2), inputs, seed=6)
    assert off.stats()["copies_to_host"] > 0
    torch.testing.assert_close(out, ref_out)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


def test_offload_keeps_inputs_that_need_no_gradient_on_the_device():
    """A mask-like input the caller holds is saved by the function but not copied out (moving
    it would free nothing); an activation input and the function's own intermediates are."""
    off = memopt.offload(min_bytes=0, pin_memory=False, allow_cpu_source=True)
    weight = torch.randn(64, 64, requires_grad=True)
    scale = torch.rand(8, 64)  # no gradient, held by the caller
    x = torch.randn(8, 64, requires_grad=True) * 1  # an activation: not a leaf

    def fn(h, s):
        return torch.tanh(h @ weight) * s  # saves h (mm), the tanh output and s (mul)

    out = memopt.checkpoint(fn, x, scale, policy="none", offload=off)
    moved = off.stats()["bytes_to_host"]
    # h (8x64 float32) and the tanh output moved; s stayed: exactly two 2 KiB storages.
    assert moved == 2 * 8 * 64 * 4
    out.sum().backward()
    reference_x = x.detach().requires_grad_()
    reference_w = weight.detach().clone().requires_grad_()
    (torch.tanh(reference_x @ reference_w) * scale).sum().backward()
    torch.testing.assert_close(weight.grad, reference_w.grad)
    assert off._kept_storages == set()  # the exemption ends with the call


@pytest.mark.parametrize("hooks_path", ["torch", "fallback"])
def test_selective_cache_updated_in_place_is_exact_under_hooks(monkeypatch, hooks_path):
    """An in-place update of a cached matmul output is replayed from the value at save time, also
    when the cache goes through saved-tensors hooks (both ways torch versions do it)."""
    if hooks_path == "fallback":
        monkeypatch.setattr(ckpt, "_CHECKPOINT_RESPECTS_HOOKS", False)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def scaled_matmul_in_place(x, w):
        y = x @ w  # cached by "selective", then changed in place
        return y.mul_(2).sin()

    expected = torch.autograd.grad(scaled_matmul_in_place(x, w).sum(), (x, w))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = memopt.checkpoint(scaled_matmul_in_place, x, w, policy="selective")
    got = torch.autograd.grad(out.sum(), (x, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    # The copy taken before the update went through the hooks too (offload and counting see it).
    assert any(t.shape == (4, 3) for t in packed)


@pytest.mark.parametrize("layout", ["list", "dict"])
def test_fallback_packs_every_cached_tensor_in_both_cache_layouts(layout):
    """torch 2.11 keeps a list of cache entries per op, 2.13 a dict keyed by call index."""
    from torch.utils.checkpoint import _VersionWrapper

    first, second = torch.randn(3), torch.randn(2)
    entries = [(_VersionWrapper(first), _VersionWrapper(None)), _VersionWrapper(second)]

    class CachingMode:
        storage = {"op": entries if layout == "list" else dict(enumerate(entries))}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    packed = []

    def pack(t):
        packed.append(t)
        return len(packed) - 1

    mode = CachingMode()
    with ckpt._PackCachedWithHooks(mode, (pack, lambda index: packed[index] * 10)):
        pass
    per_op = mode.storage["op"]
    pair, single = per_op[0], per_op[1]
    assert len(packed) == 2 and packed[0] is first and packed[1] is second
    torch.testing.assert_close(pair[0].get_val(False), first * 10)
    assert pair[1].get_val(False) is None
    torch.testing.assert_close(single.get_val(False), second * 10)


@pytest.mark.parametrize("layout", ["list", "dict"])
def test_snapshot_finds_its_cache_entry_in_both_cache_layouts(layout):
    """The copy taken before a write into a cached output takes the place of the output's entry in
    PyTorch's cache: in torch 2.11's list of the saved calls of an op (the entry just appended,
    the cached tensor being the output itself) and 2.13's dict keyed by the call's index."""
    from torch.utils.checkpoint import _VersionWrapper

    out, other = torch.randn(3), torch.randn(3)
    entries = [_VersionWrapper(other), _VersionWrapper(out.detach())]
    cache = {"op": entries if layout == "list" else {0: entries[0], 4: entries[1]}}
    guard = ckpt._CachedOutputGuard(ckpt._SelectiveGuardState(None, lambda op, n: True, "'selective'"), cache)
    assert guard._cache_slot("op", 4, [out]) == (cache["op"], 1 if layout == "list" else 4)
    assert guard._cache_slot("missing", 0, [out]) is None
    assert guard._cache_slot("op", 4, [out, out]) is None  # not this call's outputs
    if layout == "list":
        assert guard._cache_slot("op", 4, [torch.randn(3)]) is None  # the last entry is another call's
    else:
        assert guard._cache_slot("op", 3, [out]) is None  # no entry for that call


@gpu
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_offload_true_on_cuda(policy):
    inputs = [t.detach().cuda().requires_grad_() for t in _block_inputs(torch.float32, n=1024, d=256, hidden=1024)]
    out, grads, _ = _grads(lambda *a: memopt.checkpoint(_block, *a, policy=policy, offload=True, p=0.2), inputs, seed=6)
    ref_out, ref_grads, _ = _grads(lambda *a: _block(*a, p=0.2), inputs, seed=6)
    assert importlib.import_module("memopt.offload").default_offload().stats()["copies_to_host"] > 0
    torch.testing.assert_close(out, ref_out)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"policy": "some"}, ValueError, "policy must be one of"),
        ({"policy": None}, ValueError, "policy must be one of"),
        ({"use_reentrant": True}, ValueError, "use_reentrant"),
        ({"policy": "none", "context_fn": lambda: (contextlib.nullcontext(), contextlib.nullcontext())},
         ValueError, "recomputes nothing"),
        ({"policy": "full", "context_fn": "not callable"}, TypeError, "context_fn must be callable"),
        ({"policy": "selective", "debug": True}, ValueError, "debug=True needs policy='full'"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        memopt.checkpoint(torch.sin, torch.randn(3, requires_grad=True), **kwargs)


def test_torch_checkpoint_keywords_are_taken_not_passed_to_fn():
    """Drop-in: ``debug``, ``context_fn`` and ``determinism_check`` go to the checkpoint (they
    would be a TypeError inside ``fn``), and ``context_fn`` runs under ``"full"``."""
    entered = []

    @contextlib.contextmanager
    def mark(name):
        entered.append(name)
        yield

    x = torch.randn(4, requires_grad=True)
    out = memopt.checkpoint(torch.sin, x, policy="full", determinism_check="none",
                            context_fn=lambda: (mark("forward"), mark("recompute")))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))
    assert entered == ["forward", "recompute"]
    y = x.detach().requires_grad_()
    memopt.checkpoint(torch.sin, y, policy="full", debug=True).sum().backward()
    torch.testing.assert_close(y.grad, torch.cos(x.detach()))


def _bn_mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
    ).double()


def _torch_debug_options(monkeypatch):
    """The debug option of each call memopt.checkpoint makes to torch's checkpoint."""
    seen = []
    torch_checkpoint = torch.utils.checkpoint.checkpoint

    def record(*args, **kwargs):
        seen.append(kwargs["debug"])
        return torch_checkpoint(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", record)
    return seen


@pytest.mark.parametrize("case", ["buffers", "context_fn", "wrap"])
def test_global_checkpoint_debug_runs_full_calls_it_cannot_trace_without_it(case):
    """torch.utils.checkpoint.set_checkpoint_debug_enabled(True) is not debug=True: a 'full' call
    on modules with buffers (BatchNorm) or with a context_fn runs without debug, as
    torch.utils.checkpoint runs; it raised "debug=True needs policy='full'" before."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_bn_mlp(), _bn_mlp())
    model = copy.deepcopy(plain)
    x = torch.randn(5, 4, dtype=torch.float64)
    context_fn = (lambda: (contextlib.nullcontext(), contextlib.nullcontext())) if case == "context_fn" else None
    if case == "wrap":
        blocks = list(model)
        memopt.wrap(model, layers=lambda m: any(m is b for b in blocks), policy="full")
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):  # torch's checkpoint runs
        torch.utils.checkpoint.checkpoint(copy.deepcopy(plain), x.clone().requires_grad_(), use_reentrant=False)
    results = []
    for run in ("memopt", "plain"):
        m = model if run == "memopt" else plain
        leaf = x.clone().requires_grad_()
        with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
            if run == "plain":
                out = m(leaf)  # the reference: BatchNorm's running statistics updated once
            elif case == "wrap":
                out = m(leaf)
            else:
                out = memopt.checkpoint(m, leaf, policy="full", context_fn=context_fn)
            grads = torch.autograd.grad(out.square().sum(), [leaf, *m.parameters()])
        results.append((out.detach(), grads, [b.clone() for b in m.buffers()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-12)


def test_global_checkpoint_debug_applies_where_debug_runs_and_debug_true_still_refuses(monkeypatch):
    seen = _torch_debug_options(monkeypatch)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        memopt.checkpoint(torch.sin, x, policy="full").sum().backward()
        memopt.checkpoint(_bn_mlp(), x, policy="full").sum().backward()
    assert seen == [True, False]
    with pytest.raises(ValueError, match="debug=True needs policy='full'"):
        memopt.checkpoint(_bn_mlp(), x, policy="full", debug=True)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        memopt.checkpoint(3, torch.randn(3))
