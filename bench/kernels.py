"""`python -m bench.kernels`: memopt's ops against eager PyTorch and ``torch.compile``.

For each op family memopt exports (detected with ``hasattr``; missing ones are listed as not
available) and each provider (``memopt``, ``eager``, ``compile``), forward + backward is timed
(``triton.testing.do_bench`` on GPU, the median of ``perf_counter`` repeats on CPU) and the bytes
saved for backward are counted (``memopt.saved_bytes``, inputs and parameters excluded).
Memory-bound ops report GB/s of their ideal traffic (every input read once and every output
written once, forward and backward); attention reports TFLOP/s (causal, backward counted as 2.5
forwards).

Rows follow the house schema (``op, provider, mode, metric, unit, x, median, p20, p80`` plus
``status``), under an environment header, in ``bench/results/kernels-<preset>-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import memopt
from bench.compare import DTYPES, RESULTS_DIR, cpu_threads, environment, quantile, resolve_device, write_results

PROVIDERS = ("memopt", "eager", "compile")


@dataclass(frozen=True)
class KernelSettings:
    preset: str = "default"
    device: str = "auto"
    dtype: str = "float32"
    rows: int = 2048
    width: int = 1024
    batch: int = 1
    heads: int = 4
    seq: int = 256
    head_dim: int = 64
    dropout: float = 0.1
    repeats: int = 10
    compile: bool = False
    threads: int | None = 1


KERNEL_PRESETS = {
    "default": KernelSettings(),
    "tiny": KernelSettings(preset="tiny", rows=64, width=128, heads=2, seq=32, head_dim=16, repeats=3),
    "h200": KernelSettings(
        preset="h200", device="cuda", dtype="bfloat16", rows=16384, width=8192, batch=4, heads=16, seq=4096,
        head_dim=128, repeats=0, compile=True, threads=None,
    ),
}


@dataclass(frozen=True)
class OpSpec:
    """One op family: how to make inputs, call it per provider, and size its work.

    ``make_inputs`` returns ``(tensors needing grad, other args)``; ``memopt_fn`` and
    ``eager_fn`` take ``*tensors, *others``. ``work`` returns ``(amount, unit)``: bytes of ideal
    traffic (GB/s) or flops (TFLOP/s) for one forward + backward.
    """

    name: str
    memopt_attr: str
    make_inputs: Callable[[KernelSettings, torch.device, torch.dtype], tuple[list[torch.Tensor], list]]
    memopt_fn: Callable
    eager_fn: Callable
    work: Callable[[KernelSettings, torch.dtype], tuple[float, str]]


def _rows_inputs(n_tensors: int, width_factor: int = 1):
    def make(s: KernelSettings, device, dtype):
        tensors = [torch.randn(s.rows, s.width * width_factor, device=device, dtype=dtype) for _ in range(n_tensors)]
        return tensors, []

    return make


def _norm_inputs(with_bias: bool):
    def make(s: KernelSettings, device, dtype):
        x = torch.randn(s.rows, s.width, device=device, dtype=dtype)
        weight = 1 + 0.1 * torch.randn(s.width, device=device, dtype=dtype)
        bias = 0.1 * torch.randn(s.width, device=device, dtype=dtype)
        return ([x, weight, bias] if with_bias else [x, weight]), []

    return make


def _bias_inputs(s: KernelSettings, device, dtype):
    return [torch.randn(s.rows, s.width, device=device, dtype=dtype), torch.randn(s.width, device=device, dtype=dtype)], []


def _attention_inputs(s: KernelSettings, device, dtype):
    shape = (s.batch, s.heads, s.seq, s.head_dim)
    return [torch.randn(shape, device=device, dtype=dtype) for _ in range(3)], []


def _elementwise_bytes(elements_moved_per_row_width: int):
    def work(s: KernelSettings, dtype):
        return elements_moved_per_row_width * s.rows * s.width * dtype.itemsize, "GB/s"

    return work


def _attention_flops(s: KernelSettings, dtype):
    forward = 4 * s.batch * s.heads * s.seq * s.seq * s.head_dim / 2  # causal: half the scores
    return 3.5 * forward, "TFLOP/s"


def _rms_norm_eager(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight


def _swiglu_eager(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _attention_eager(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def op_specs(settings: KernelSettings) -> list[OpSpec]:
    p = settings.dropout
    return [
        OpSpec(
            "dropout_add", "dropout_add", _rows_inputs(2),
            lambda x, r: memopt.dropout_add(x, r, p), lambda x, r: F.dropout(x, p) + r,
            _elementwise_bytes(3 + 2),  # fwd: read x, r, write out; bwd: read grad, write grad_x
        ),
        OpSpec(
            "layer_norm", "layer_norm", _norm_inputs(True),
            lambda x, w, b: memopt.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
            _elementwise_bytes(2 + 3),  # fwd: read x, write y; bwd: read x, grad, write grad_x
        ),
        OpSpec(
            "rms_norm", "rms_norm", _norm_inputs(False),
            lambda x, w: memopt.rms_norm(x, w), _rms_norm_eager,
            _elementwise_bytes(2 + 3),
        ),
        OpSpec(
            "bias_gelu", "bias_act", _bias_inputs,
            lambda x, b: memopt.bias_act(x, b, "gelu"), lambda x, b: F.gelu(x + b),
            _elementwise_bytes(2 + 3),
        ),
        OpSpec(
            "swiglu", "swiglu", _rows_inputs(1, width_factor=2),
            lambda x: memopt.swiglu(x), _swiglu_eager,
            # per output element: fwd reads 2, writes 1; bwd reads 2 + grad, writes 2
            _elementwise_bytes(3 + 5),
        ),
        OpSpec(
            "attention", "attention", _attention_inputs,
            lambda q, k, v: memopt.attention(q, k, v, causal=True), _attention_eager,
            _attention_flops,
        ),
    ]


def time_fwd_bwd(fn: Callable, tensors: list[torch.Tensor], device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn(*tensors)`` forward + backward."""
    grad_out = None

    def step():
        nonlocal grad_out
        out = fn(*tensors)
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)

    step()  # warm-up (and compilation)
    if device.type == "cuda":
        from triton.testing import do_bench

        median, p20, p80 = do_bench(step, grad_to_none=tensors, quantiles=[0.5, 0.2, 0.8])
        return median, p20, p80
    times = []
    for _ in range(max(repeats, 1)):
        for t in tensors:
            t.grad = None
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return quantile(times, 0.5), quantile(times, 0.2), quantile(times, 0.8)


def _provider_fn(spec: OpSpec, provider: str, settings: KernelSettings) -> tuple[Callable | None, str | None]:
    if provider == "memopt":
        if not hasattr(memopt, spec.memopt_attr):
            return None, f"memopt.{spec.memopt_attr} is not in this build of memopt yet"
        return spec.memopt_fn, None
    if provider == "eager":
        return spec.eager_fn, None
    if not settings.compile:
        return None, "torch.compile not requested (pass --compile)"
    return torch.compile(spec.eager_fn), None


def bench_op(spec: OpSpec, provider: str, settings: KernelSettings, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The rows of one (op, provider): time, GB/s or TFLOP/s, saved bytes; or one status row."""
    base = {"op": spec.name, "provider": provider, "mode": "fwd_bwd", "x": settings.rows, "device": str(device), "dtype": settings.dtype}
    fn, reason = _provider_fn(spec, provider, settings)
    if fn is None:
        return [{**base, "metric": "time_fwd_bwd", "unit": "ms", "median": None, "p20": None, "p80": None, "status": f"not available ({reason})"}]
    torch.manual_seed(0)
    tensors, others = spec.make_inputs(settings, device, dtype)
    for t in tensors:
        t.requires_grad_(True)
    call = (lambda *ts: fn(*ts, *others)) if others else fn
    try:
        median, p20, p80 = time_fwd_bwd(call, tensors, device, settings.repeats)
        saved = None if provider == "compile" else memopt.saved_bytes(call, *tensors)
    except Exception as exc:  # reported in the table, never allowed to stop the run
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        return [{**base, "metric": "time_fwd_bwd", "unit": "ms", "median": None, "p20": None, "p80": None, "status": f"error ({text})"}]
    amount, unit = spec.work(settings, dtype)
    scale = 1e9 if unit == "GB/s" else 1e12
    rate = {"metric": "bandwidth" if unit == "GB/s" else "throughput", "unit": unit}
    return [
        {**base, "metric": "time_fwd_bwd", "unit": "ms", "median": median, "p20": p20, "p80": p80, "status": "ok"},
        {**base, **rate, "median": amount / (median / 1e3) / scale, "p20": amount / (p80 / 1e3) / scale, "p80": amount / (p20 / 1e3) / scale, "status": "ok"},
        {**base, "metric": "saved_bytes", "unit": "bytes", "median": saved, "p20": saved, "p80": saved, "status": "ok" if saved is not None else "n/a (compiled)"},
    ]


def run_kernels(settings: KernelSettings, ops: list[str] | None = None, progress: bool = True) -> dict:
    device = resolve_device(settings.device)
    dtype = DTYPES[settings.dtype]
    specs = [s for s in op_specs(settings) if ops is None or s.name in ops]
    jobs = [(spec, provider) for spec in specs for provider in PROVIDERS]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="kernels", file=sys.stderr, leave=False)
    rows = []
    with cpu_threads(settings.threads):
        env = environment(device, settings.threads)
        for spec, provider in jobs:
            if bar is not None:
                bar.set_postfix_str(f"{spec.name}/{provider}")
            rows += bench_op(spec, provider, settings, device, dtype)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    for row in rows:
        row["versions"] = {"torch": env["torch"], "triton": env["triton"], "memopt": env["memopt"]}
        row["commit"], row["date"] = env["commit"], env["date"]
    return {"kind": "kernels", "schema": "memopt-bench/1", "environment": env, "arguments": vars(settings).copy(), "rows": rows}


def bytes_text(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 2**20:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / 2**20:.2f} MiB"


def markdown_table(rows: list[dict]) -> str:
    """One line per (op, provider): time, rate, saved bytes, or why it did not run."""
    lines = ["| op | provider | fwd+bwd ms (p20-p80) | rate | saved for backward |", "|---|---|---:|---:|---:|"]
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["provider"]), {})[r["metric"]] = r
    for (op, provider), metrics in groups.items():
        timing = metrics["time_fwd_bwd"]
        if timing["status"] != "ok":
            lines.append(f"| {op} | {provider} | {timing['status']} | | |")
            continue
        rate = metrics.get("bandwidth") or metrics.get("throughput")
        saved_text = bytes_text(metrics["saved_bytes"]["median"])
        lines.append(
            f"| {op} | {provider} | {timing['median']:.3f} ({timing['p20']:.3f}-{timing['p80']:.3f}) "
            f"| {rate['median']:.3g} {rate['unit']} | {saved_text} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description="Micro-benchmarks of memopt's ops against eager PyTorch and torch.compile.")
    parser.add_argument("--preset", choices=sorted(KERNEL_PRESETS), default="default")
    parser.add_argument("--device")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    settings = KERNEL_PRESETS[args.preset]
    settings = replace(settings, **{k: getattr(args, k) for k in ("device", "dtype", "compile") if getattr(args, k) is not None})
    known = [s.name for s in op_specs(settings)]
    ops = None
    if args.ops:
        ops = [o.strip() for o in args.ops.split(",")]
        unknown = [o for o in ops if o not in known]
        if unknown:
            raise SystemExit(f"bench.kernels: --ops has unknown names {unknown}; known: {known}")
    result = run_kernels(settings, ops, progress=not args.no_progress)
    env = result["environment"]
    print(f"memopt {env['memopt']} | torch {env['torch']} | triton {env['triton']} | {env['device_name']} | commit {env['commit'][:12]}")
    print(f"rows x width {settings.rows} x {settings.width}; attention {settings.batch}x{settings.heads}x{settings.seq}x{settings.head_dim} causal; {settings.dtype}\n")
    print(markdown_table(result["rows"]))
    stamp = env["date"].replace("-", "").replace(":", "")
    path = write_results(result, args.out, f"kernels-{settings.preset}-{resolve_device(settings.device).type}-{stamp}")
    print(f"\nresults: {path}")
    if not args.no_plot:
        from bench.plot import plot_file

        for png in plot_file(path):
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
