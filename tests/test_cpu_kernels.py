"""The CPU kernels are compiled once per instruction set (csrc/cpu_kernels.h: baseline, AVX2 + FMA,
AVX-512) and run the one ATen picks for itself. The other tests run this machine's best; these run
the baseline and the AVX2 builds in a subprocess with ``ATEN_CPU_CAPABILITY`` capping the choice
(on a CPU without AVX2 the cap changes nothing and the baseline build runs twice) and check them
against the float64 references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memopt.ops.activation import bias_act_ref, swiglu_ref
from memopt.ops.norm import layer_norm_ref, rms_norm_ref
from helpers import tolerances

REPO = Path(__file__).resolve().parents[1]

# Runs in the subprocess: forward + backward of every CPU op on odd shapes (tails shorter than a
# vector), float32 and float64, saved for the parent to compare.
WORKER = r"""
import sys
import torch
import memopt

torch.manual_seed(0)
results = {}
for dtype in (torch.float32, torch.float64):
    x = torch.randn(37, 67, dtype=dtype)
    bias = torch.randn(67, dtype=dtype)
    grad = torch.randn(37, 67, dtype=dtype)
    for activation in ("relu", "gelu", "gelu_tanh", "silu"):
        xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
        y = memopt.bias_act(xg, bg, activation)
        y.backward(grad)
        results[f"bias_act-{activation}-{dtype}"] = (y.detach(), xg.grad, bg.grad)
    x2 = torch.randn(37, 2 * 67, dtype=dtype)
    bias2 = torch.randn(2 * 67, dtype=dtype)
    xg, bg = x2.clone().requires_grad_(), bias2.clone().requires_grad_()
    y = memopt.swiglu(xg, bg)
    y.backward(grad)
    results[f"swiglu-{dtype}"] = (y.detach(), xg.grad, bg.grad)
    weight = 1 + 0.1 * torch.randn(67, dtype=dtype)
    xg, wg, bg = x.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
    y = memopt.layer_norm(xg, wg, bg)
    y.backward(grad)
    results[f"layer_norm-{dtype}"] = (y.detach(), xg.grad, wg.grad, bg.grad)
    xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = memopt.rms_norm(xg, wg)
    y.backward(grad)
    results[f"rms_norm-{dtype}"] = (y.detach(), xg.grad, wg.grad)
torch.save(results, sys.argv[1])
"""


def _reference(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Forward + backward of the plain-PyTorch reference in float64, on the worker's inputs."""
    torch.manual_seed(0)
    generated = {}
    for dt in (torch.float32, torch.float64):
        x, bias, grad = torch.randn(37, 67, dtype=dt), torch.randn(67, dtype=dt), torch.randn(37, 67, dtype=dt)
        x2, bias2 = torch.randn(37, 2 * 67, dtype=dt), torch.randn(2 * 67, dtype=dt)
        weight = 1 + 0.1 * torch.randn(67, dtype=dt)
        generated[dt] = (x, bias, grad, x2, bias2, weight)
    x, bias, grad, x2, bias2, weight = (t.double().requires_grad_() for t in generated[dtype])
    grad = grad.detach()
    op = name.split("-")[0]
    if op == "bias_act":
        y = bias_act_ref(x, bias, name.split("-")[1])
        inputs = (x, bias)
    elif op == "swiglu":
        y = swiglu_ref(x2, bias2)
        inputs = (x2, bias2)
    elif op == "layer_norm":
        y = layer_norm_ref(x, weight, bias)
        inputs = (x, weight, bias)
    else:
        y = rms_norm_ref(x, weight)
        inputs = (x, weight)
    y.backward(grad)
    return (y.detach(),) + tuple(t.grad for t in inputs)


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_capped_build_matches_reference(tmp_path, capability):
    out = tmp_path / "results.pt"
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", WORKER, str(out)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(out)
    assert len(results) == 2 * 7
    for key, tensors in results.items():
        dtype = torch.float32 if key.endswith("float32") else torch.float64
        name = key.rsplit("-", 1)[0]
        expected = _reference(name, dtype)
        # parameter gradients sum 37 rows: a row-reduction's tolerance, as tests/test_norm.py uses
        tol = tolerances(torch.float32 if dtype == torch.float64 else dtype)
        for i, (got, want) in enumerate(zip(tensors, expected)):
            torch.testing.assert_close(got.double(), want, **(tolerances(dtype) if i < 2 else tol),
                                       msg=lambda m: f"{key}, output {i}: {m}")


def _every_kernel_once(seed: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Outputs and gradients of the CPU ops at sizes that split over threads (rows past one
    task's grain, 64-row attention tiles over several heads)."""
    import memopt

    torch.manual_seed(seed)
    results = {}
    x = torch.randn(2048, 1024, requires_grad=True)
    w, b = torch.randn(1024, requires_grad=True), torch.randn(1024, requires_grad=True)
    grad = torch.randn(2048, 1024)
    y = memopt.layer_norm(x, w, b)
    results["layer_norm"] = (y, *torch.autograd.grad(y, (x, w, b), grad))
    y = memopt.bias_act(x, b, "gelu")
    results["bias_act"] = (y, *torch.autograd.grad(y, (x, b), grad))
    fused = torch.randn(2, 300, 3, 4, 64).requires_grad_()
    q, k, v = fused.permute(2, 0, 3, 1, 4).unbind(0)
    out = memopt.attention(q, k, v, causal=True, backend="cpu_flash")
    results["attention"] = (out, *torch.autograd.grad(out, fused, torch.randn_like(out)))
    return results


def test_results_do_not_depend_on_the_number_of_threads():
    # The kernels split rows (norm, activation), tiles (attention forward) or kv heads (attention
    # backward) over threads and add partial sums in a fixed order: bitwise the same on 1 and 2.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _every_kernel_once(0)
        torch.set_num_threads(2)
        two = _every_kernel_once(0)
    finally:
        torch.set_num_threads(threads)
    for name, tensors in one.items():
        for a, b in zip(tensors, two[name]):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("op", ["bias_act", "swiglu"])
def test_bias_gradient_over_many_row_chunks_is_accurate(op):
    # The backward sums each 32-row chunk's bias gradient into a partial, then adds the partials
    # (rows / 32 of them) up. 2^20 rows give 32768 partials: added in a float32 running sum, the
    # bias gradient was off by ~5e-6 relative (it grows with the number of partials: 1.2e-5 at 4M
    # rows; eager's pairwise sum ~3e-7). Positive addends (relu' is 0 or 1 and the gradient is
    # positive; swiglu's gate and up inputs are positive, so are both halves' gradients) keep the
    # sums far from zero, so the relative error is the summation's alone.
    import memopt

    torch.manual_seed(0)
    rows, cols = 1 << 20, 8
    if op == "bias_act":
        x = torch.randn(rows, cols, requires_grad=True)
        bias = torch.randn(cols, requires_grad=True)
        y = memopt.bias_act(x, bias, "relu")
    else:
        x = torch.rand(rows, 2 * cols, requires_grad=True)
        bias = (0.1 * torch.rand(2 * cols)).requires_grad_()
        y = memopt.swiglu(x, bias)
    grad_x, grad_bias = torch.autograd.grad(y, (x, bias), torch.rand(rows, cols))
    # The float64 reference: the kernel's own float32 per-row terms (grad_x is grad of x + bias,
    # the terms it adds up), summed in float64, so the comparison measures the reduction only (for
    # relu these terms are exact: this is the float64 bias gradient itself).
    ref = grad_x.double().sum(0)
    assert (ref > 0).all()
    rel = ((grad_bias.double() - ref).abs() / ref).max().item()
    # Bound: the final rounding to float32 (2^-24 ~ 6e-8) plus each chunk's 32-term float32 sum
    # (at most ~31 ulp of the chunk, but of either sign and independent across 32768 chunks, so
    # averaging to far below 1e-7 of the total): a float64 reduction of the partials stays under
    # ~1.2e-7 (measured 2.9e-8 / 3.7e-8), the float32 running sum over them measured 4.5e-6 /
    # 5.0e-6 here. 5e-7 sits ~4x above the one's bound and ~9x below the other.
    assert rel < 5e-7, f"{op}: relative error of the bias gradient {rel:.2e}"
