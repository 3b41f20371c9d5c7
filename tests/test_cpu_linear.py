"""The GEMM rule under memopt's own float32 CPU linears (memopt/ops/cpu_linear.py,
csrc/cpu_linear.cpp): both backends against float64 references, the host rule, the override, and
the ops that use it (norm_linear, act_linear) agreeing across backends."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt import _extension
from memopt.ops import cpu_linear

BACKENDS = ["aten", "onednn"]
# float32 matmuls of inputs scaled to O(1) outputs against float64: a few ulps of the sum.
FP32_GEMM = {"atol": 2e-5, "rtol": 2e-5}


def _current_rule() -> str:
    """The name that sets the rule in force back: oneDNN with a size floor is only ever "auto"'s."""
    if cpu_linear.backend() == "onednn" and cpu_linear.min_multiply_adds() > 0:
        return "auto"
    return cpu_linear.backend()


@pytest.fixture
def backend(request):
    before = _current_rule()
    _extension._C._set_cpu_linear_backend(request.param)
    yield cpu_linear.backend()
    _extension._C._set_cpu_linear_backend(before)


def _onednn_present() -> bool:
    return cpu_linear._ONEDNN_LINEAR is not None and torch.backends.mkldnn.is_available()


def _expected_auto() -> str:
    """The rule of csrc/cpu_linear.cpp, read independently from /proc/cpuinfo."""
    with open("/proc/cpuinfo") as f:
        text = f.read()
    vendor = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "onednn" if vendor == "AuthenticAMD" and "avx512f" in flags and _onednn_present() else "aten"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(37, 96, 40), (2, 5, 64, 130)], ids=["2d", "4d"])
def test_linear_matches_float64(backend, with_bias, shape):
    *lead, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(*lead, k)
    w = torch.randn(n, k) / math.sqrt(k)
    b = torch.randn(n) if with_bias else None
    out = cpu_linear.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, **FP32_GEMM)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("m,k,n", [(64, 48, 80), (1, 7, 3), (300, 257, 129)])
def test_mm_matches_float64(backend, m, k, n):
    torch.manual_seed(1)
    a = torch.randn(m, k)
    b = torch.randn(k, n) / math.sqrt(k)
    torch.testing.assert_close(cpu_linear.mm(a, b).double(), a.double() @ b.double(), **FP32_GEMM)
    # a transposed view of a weight, as the backward passes it
    w = torch.randn(n, k) / math.sqrt(k)
    torch.testing.assert_close(cpu_linear.mm(a, w.t()).double(), a.double() @ w.double().t(), **FP32_GEMM)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_addmm_matches_float64(backend):
    torch.manual_seed(4)
    a, b, c = torch.randn(50, 70), torch.randn(70, 30) / math.sqrt(70), torch.randn(50, 30)
    torch.testing.assert_close(cpu_linear.addmm(c, a, b).double(), c.double() + a.double() @ b.double(), **FP32_GEMM)
    w = torch.randn(30, 70) / math.sqrt(70)
    torch.testing.assert_close(cpu_linear.addmm(c, a, w.t()).double(), c.double() + a.double() @ w.double().t(),
                               **FP32_GEMM)


@pytest.mark.parametrize("backend", ["onednn"], indirect=True)
def test_other_dtypes_and_graphs_take_aten(backend):
    x = torch.randn(8, 16, dtype=torch.float64)
    w = torch.randn(4, 16, dtype=torch.float64)
    assert not cpu_linear._onednn(8 * 16 * 4, x, w)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=0, atol=0)
    # A graph being built: the result must carry ATen's derivative.
    xf = torch.randn(8, 16, requires_grad=True)
    wf = torch.randn(4, 16, requires_grad=True)
    out = cpu_linear.linear(xf, wf)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(xf.grad, wf.sum(0).expand(8, 16), **FP32_GEMM)
    # Under autocast the result is in the autocast dtype, as F.linear's.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_linear.linear(xf.detach(), wf.detach()).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_mm_in_new_buffer_only_below_heap_size_on_onednn(backend):
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    small = torch.empty(64, 48)
    expected = backend == "onednn" and _onednn_present()
    assert cpu_linear.mm_in_new_buffer(a, b, small) is expected
    assert cpu_linear._HEAP_BYTES == 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
    big = torch.empty(0).new_empty_strided((cpu_linear._HEAP_BYTES // 4,), (1,))
    assert cpu_linear.mm_in_new_buffer(a, b, big) is False
    assert cpu_linear.mm_in_new_buffer(a.double(), b.double(), small.double()) is False


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="the rule reads x86 CPU identification; /proc/cpuinfo on Linux")
@pytest.mark.parametrize("backend", ["auto"], indirect=True)
def test_auto_follows_the_host_rule(backend):
    assert backend == _expected_auto()


def _linear_ops_run(fn) -> set[str]:
    """The GEMM ops ``fn`` dispatches (the C++ ones inside memopt's ops included)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    names = {e.name for e in prof.function_events}
    return names & {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear"}


@pytest.mark.parametrize("backend", ["auto", "onednn"], indirect=True)
def test_auto_keeps_small_products_on_aten(backend, request):
    # oneDNN's fixed cost per call outweighs its faster loop below 2^24 multiply-adds (measured in
    # csrc/cpu_linear.cpp): "auto" sends those to ATen; a forced "onednn" takes every product.
    if backend != "onednn" or not _onednn_present():
        pytest.skip("the host rule chose ATen for every product here")
    forced = request.node.callspec.params["backend"] == "onednn"
    assert cpu_linear.min_multiply_adds() == (0 if forced else 1 << 24)
    small_x, small_w = torch.randn(32, 64), torch.randn(192, 64)  # 393,216 multiply-adds
    big_x, big_w = torch.randn(512, 256), torch.randn(256, 256)  # 2^25
    small_ln = (torch.randn(32, 64), torch.ones(64), torch.zeros(64), small_w, torch.zeros(192))
    big_ln = (big_x, torch.ones(256), torch.zeros(256), big_w, torch.zeros(256))
    small_runs = [
        _linear_ops_run(lambda: cpu_linear.linear(small_x, small_w)),
        _linear_ops_run(lambda: cpu_linear.mm(small_x, small_w.t())),
        _linear_ops_run(lambda: cpu_linear.addmm(torch.zeros(32, 192), small_x, small_w.t())),
        _linear_ops_run(lambda: memopt.norm_linear(*small_ln)),  # the C++ rule
    ]
    big_runs = [
        _linear_ops_run(lambda: cpu_linear.linear(big_x, big_w)),
        _linear_ops_run(lambda: cpu_linear.mm(big_x, big_w.t())),
        _linear_ops_run(lambda: cpu_linear.addmm(torch.zeros(512, 256), big_x, big_w.t())),
        _linear_ops_run(lambda: memopt.norm_linear(*big_ln)),
    ]
    for ops in big_runs:
        assert "mkldnn::_linear_pointwise" in ops, ops
    for ops in small_runs:
        assert ("mkldnn::_linear_pointwise" in ops) is forced, ops
    a, b = torch.randn(32, 64), torch.randn(64, 192)
    assert cpu_linear.mm_in_new_buffer(a, b, torch.empty(32, 192)) is forced


def test_bad_backend_name_is_refused():
    with pytest.raises(ValueError, match="'auto', 'onednn' or 'aten', got 'mkl'"):
        _extension._C._set_cpu_linear_backend("mkl")


def _run(env_value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEMOPT_CPU_LINEAR=env_value)
    code = "from memopt.ops import cpu_linear; print(cpu_linear.backend())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_variable_overrides_and_is_checked():
    done = _run("aten")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "aten"
    bad = _run("fast")
    assert bad.returncode == 1  # a Python exception, not an abort
    assert "ValueError: memopt: MEMOPT_CPU_LINEAR must be 'auto', 'onednn' or 'aten', got 'fast'" in bad.stderr


def _norm_linear_grads(x, nw, nb, lw, lb):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, nw, nb, lw, lb)]
    out = memopt.norm_linear(*leaves)
    out.backward(torch.ones_like(out) * 0.5 + torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


def _act_linear_grads(x, b, lw, lb, activation):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, b, lw, lb)]
    out = memopt.act_linear(*leaves, activation=activation)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_norm_linear_matches_float64_and_repeats_bit_for_bit(backend):
    torch.manual_seed(2)
    n, m = 96, 72
    args = [torch.randn(3, 50, n), torch.rand(n) + 0.5, torch.randn(n) * 0.1, torch.randn(m, n) / math.sqrt(n),
            torch.randn(m)]
    got = _norm_linear_grads(*args)
    ref = _norm_linear_ref_grads(*[a.double() for a in args])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
    again = _norm_linear_grads(*args)
    for g, h in zip(got, again):
        assert torch.equal(g, h)


def _norm_linear_ref_grads(x, nw, nb, lw, lb):
    leaves = [t.clone().requires_grad_(True) for t in (x, nw, nb, lw, lb)]
    out = F.linear(F.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2]), leaves[3], leaves[4])
    out.backward(torch.ones_like(out) * 0.5 + torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_act_linear_matches_float64(backend, activation):
    torch.manual_seed(3)
    width, m = 128, 40
    d = width // 2 if activation == "swiglu" else width
    args = [torch.randn(70, width), torch.randn(width) * 0.1, torch.randn(m, d) / math.sqrt(d), torch.randn(m)]
    got = _act_linear_grads(*args, activation)
    leaves = [a.double().requires_grad_(True) for a in args]
    h = leaves[0] + leaves[1]
    act = F.silu(h[:, :d]) * h[:, d:] if activation == "swiglu" else F.gelu(h)
    out = F.linear(act, leaves[2], leaves[3])
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    for g, r in zip(got, [out.detach()] + [t.grad for t in leaves]):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)
