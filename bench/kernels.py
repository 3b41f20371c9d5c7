"""`python -m bench.kernels`: memopt's ops against eager PyTorch and ``torch.compile``.

For each op (dropout_add, layer_norm, rms_norm, norm_linear, bias_act with each activation,
swiglu, act_linear, attention; missing ones are listed as not available), each shape of the
preset (rows x width: a block's 512 tokens x d_model 512 and x d_ff 2048, then larger ones) and
each provider (``memopt``, ``eager``: PyTorch's fastest eager way to do the same job, e.g.
``F.layer_norm``, ``F.rms_norm``, ``F.gelu(x + b)``, ``r + F.dropout(x)``; ``compile``: that eager
code under ``torch.compile``), forward + backward is timed (``triton.testing.do_bench`` on GPU; on
CPU the providers run in turn within each repeat, and the median is reported) and the bytes saved
for backward are counted (``memopt.saved_bytes``, inputs and parameters excluded). Memory-bound
ops report GB/s of their ideal traffic (every input read once and every output written once,
forward and backward); norm_linear, act_linear and attention report TFLOP/s (attention causal,
backward counted as 2.5 forwards). ``time_vs_eager`` is memopt's (or compile's) time over eager's:
on CPU the median (p20, p80) of the per-round ratios (both timed in the same interleaved round),
on GPU the ratio of the medians. On CPU each provider's rows also count the minor page faults of
a timed step (``page_faults``): fresh buffers fault their pages in one by one, which can decide a
ratio near 1.00.

Rows follow the house schema (``op, provider, mode, metric, unit, x, median, p20, p80`` plus
``width`` and ``status``; ``x`` is the rows, for attention the sequence length), under an
environment header, in ``bench/results/kernels-<preset>-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

try:
    import resource  # getrusage: the minor page faults of a timed step (POSIX)
except ImportError:  # Windows: no fault counts
    resource = None

import torch
import torch.nn.functional as F

import memopt
from bench._args import device_name, nonnegative_int, positive_int
from bench.compare import DTYPES, OUT_HELP, RESULTS_DIR, cpu_threads, environment, quantile, resolve_device, run_header, save_run

PROVIDERS = ("memopt", "eager", "compile")


@dataclass(frozen=True)
class KernelSettings:
    preset: str = "default"
    device: str = "auto"
    dtype: str = "float32"
    # (rows, width) of the norm / activation / dropout ops: rows x d_model and rows x d_ff of a
    # block (512 tokens, d_model 512, d_ff 2048), a mid-size and a large one
    shapes: tuple[tuple[int, int], ...] = ((512, 512), (512, 2048), (2048, 1024), (4096, 4096))
    # out_features of norm_linear / act_linear (a d_model-sized projection)
    linear_out: int = 512
    batch: int = 1
    heads: int = 4
    seq: int = 256
    head_dim: int = 64
    dropout: float = 0.1
    repeats: int = 10
    # CPU: seconds of timed rounds a case may take when its steps are fast (see _rounds_within_budget)
    round_budget_s: float = 0.5
    compile: bool = False
    threads: int | None = 1
    # Only an op's first input (the activation) requires grad: its parameters (norm weight and
    # bias, activation bias, the linear's weight and bias) are frozen, as under LoRA / PEFT
    # fine-tuning, and no provider should spend time on their gradients. Attention's q, k and v
    # are all activations and keep theirs.
    frozen_params: bool = False


KERNEL_PRESETS = {
    "default": KernelSettings(),
    "tiny": KernelSettings(preset="tiny", shapes=((64, 128),), linear_out=32, heads=2, seq=32, head_dim=16, repeats=3,
        round_budget_s=0.0),
    "h200": KernelSettings(
        preset="h200", device="cuda", dtype="bfloat16", shapes=((16384, 8192), (8192, 4096)), linear_out=4096, batch=4,
        heads=16, seq=4096,
        head_dim=128, repeats=0, compile=True, threads=None,
    ),
}


Shape = tuple[int, int]  # (rows, width); attention ignores it


@dataclass(frozen=True)
class OpSpec:
    """One op: how to make inputs, call it per provider, and size its work.

    ``make_inputs(settings, shape, device, dtype)`` returns the tensors that need grad;
    ``memopt_fn`` and ``eager_fn`` take them (``eager_fn`` is PyTorch's fastest eager way to do
    the same job). ``work(settings, shape, dtype)`` returns ``(amount, unit)``: bytes of ideal
    traffic (GB/s) or flops (TFLOP/s) for one forward + backward. ``per_shape`` is False for
    attention, which runs once at its own shape.
    """

    name: str
    memopt_attr: str
    make_inputs: Callable[[KernelSettings, Shape, torch.device, torch.dtype], list[torch.Tensor]]
    memopt_fn: Callable
    eager_fn: Callable
    work: Callable[[KernelSettings, Shape, torch.dtype], tuple[float, str]]
    per_shape: bool = True


def _rows_inputs(n_tensors: int, width_factor: int = 1):
    def make(s: KernelSettings, shape: Shape, device, dtype):
        rows, width = shape
        return [torch.randn(rows, width * width_factor, device=device, dtype=dtype) for _ in range(n_tensors)]

    return make


def _norm_inputs(with_bias: bool, linear: bool = False):
    def make(s: KernelSettings, shape: Shape, device, dtype):
        rows, width = shape
        x = torch.randn(rows, width, device=device, dtype=dtype)
        weight = 1 + 0.1 * torch.randn(width, device=device, dtype=dtype)
        tensors = [x, weight] + ([0.1 * torch.randn(width, device=device, dtype=dtype)] if with_bias else [])
        if linear:
            tensors += _linear_params(s.linear_out, width, device, dtype)
        return tensors

    return make


def _linear_params(out_features: int, in_features: int, device, dtype) -> list[torch.Tensor]:
    return [
        torch.randn(out_features, in_features, device=device, dtype=dtype) / in_features**0.5,
        0.1 * torch.randn(out_features, device=device, dtype=dtype),
    ]


def _bias_inputs(linear: bool = False, width_factor: int = 1):
    def make(s: KernelSettings, shape: Shape, device, dtype):
        rows, width = shape
        tensors = [
            torch.randn(rows, width * width_factor, device=device, dtype=dtype),
            torch.randn(width * width_factor, device=device, dtype=dtype),
        ]
        if linear:
            tensors += _linear_params(s.linear_out, width, device, dtype)
        return tensors

    return make


def _attention_inputs(s: KernelSettings, shape: Shape, device, dtype):
    return [torch.randn((s.batch, s.heads, s.seq, s.head_dim), device=device, dtype=dtype) for _ in range(3)]


def _elementwise_bytes(elements_moved_per_row_width: int):
    def work(s: KernelSettings, shape: Shape, dtype):
        return elements_moved_per_row_width * shape[0] * shape[1] * dtype.itemsize, "GB/s"

    return work


def _linear_flops(s: KernelSettings, shape: Shape, dtype):
    return 3 * 2 * shape[0] * shape[1] * s.linear_out, "TFLOP/s"  # the forward matmul and two backward ones


def _attention_flops(s: KernelSettings, shape: Shape, dtype):
    forward = 4 * s.batch * s.heads * s.seq * s.seq * s.head_dim / 2  # causal: half the scores
    return 3.5 * forward, "TFLOP/s"


def _swiglu_eager(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _attention_eager(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# memopt's activation name -> the eager function it replaces
EAGER_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}


def _bias_act_spec(activation: str) -> OpSpec:
    eager_act = EAGER_ACTIVATIONS[activation]
    return OpSpec(
        f"bias_{activation}", "bias_act", _bias_inputs(),
        lambda x, b: memopt.bias_act(x, b, activation), lambda x, b: eager_act(x + b),
        _elementwise_bytes(2 + 3),  # fwd: read x, write y; bwd: read x, grad, write grad_x
    )


def op_specs(settings: KernelSettings) -> list[OpSpec]:
    p = settings.dropout
    return [
        OpSpec(
            "dropout_add", "dropout_add", _rows_inputs(2),
            lambda x, r: memopt.dropout_add(x, r, p), lambda x, r: r + F.dropout(x, p),
            _elementwise_bytes(3 + 2),  # fwd: read x, r, write out; bwd: read grad, write grad_x
        ),
        OpSpec(
            "layer_norm", "layer_norm", _norm_inputs(True),
            lambda x, w, b: memopt.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
            _elementwise_bytes(2 + 3),  # fwd: read x, write y; bwd: read x, grad, write grad_x
        ),
        OpSpec(
            "rms_norm", "rms_norm", _norm_inputs(False),
            lambda x, w: memopt.rms_norm(x, w), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6),
            _elementwise_bytes(2 + 3),
        ),
        OpSpec(
            "norm_linear", "norm_linear", _norm_inputs(True, linear=True),
            lambda x, w, b, lw, lb: memopt.norm_linear(x, w, b, lw, lb),
            lambda x, w, b, lw, lb: F.linear(F.layer_norm(x, x.shape[-1:], w, b), lw, lb),
            _linear_flops,
        ),
        *(_bias_act_spec(a) for a in EAGER_ACTIVATIONS),
        OpSpec(
            "swiglu", "swiglu", _rows_inputs(1, width_factor=2),
            lambda x: memopt.swiglu(x), _swiglu_eager,
            # per output element: fwd reads 2, writes 1; bwd reads 2 + grad, writes 2
            _elementwise_bytes(3 + 5),
        ),
        OpSpec(
            "act_linear_gelu", "act_linear", _bias_inputs(linear=True),
            lambda x, b, lw, lb: memopt.act_linear(x, b, lw, lb, activation="gelu"),
            lambda x, b, lw, lb: F.linear(F.gelu(x + b), lw, lb),
            _linear_flops,
        ),
        OpSpec(
            "act_linear_swiglu", "act_linear", _bias_inputs(linear=True, width_factor=2),
            lambda x, b, lw, lb: memopt.act_linear(x, b, lw, lb, activation="swiglu"),
            lambda x, b, lw, lb: F.linear(_swiglu_eager(x + b), lw, lb),
            _linear_flops,
        ),
        OpSpec(
            "attention", "attention", _attention_inputs,
            lambda q, k, v: memopt.attention(q, k, v, causal=True), _attention_eager,
            _attention_flops, per_shape=False,
        ),
    ]


def _fwd_bwd_step(fn: Callable, tensors: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward of ``fn(*tensors)`` against a fixed random output gradient (the
    gradients of those tensors that require one)."""
    grad_out = None

    def step():
        nonlocal grad_out
        for t in tensors:
            t.grad = None
        out = fn(*tensors)
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)

    return step


def time_interleaved(steps: dict[str, Callable[[], None]], device: torch.device, repeats: int) -> dict[str, tuple[float, float, float]]:
    """(median, p20, p80) milliseconds per step, the steps timed in turn within each repeat (the
    order alternating), so that a busy spell on a shared machine slows all of them alike."""
    return {name: _quantiles(ts) for name, ts in interleaved_samples(steps, device, repeats).items()}


def _quantiles(samples: list[float] | tuple[float, float, float]) -> tuple[float, float, float]:
    """(median, p20, p80) of timed samples (already those on CUDA)."""
    if isinstance(samples, tuple):
        return samples
    return quantile(samples, 0.5), quantile(samples, 0.2), quantile(samples, 0.8)


def minor_faults() -> int:
    """The process's minor page faults so far (POSIX only: callers check ``resource``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved_samples(steps: dict[str, Callable[[], None]], device: torch.device, repeats: int,
                        budget_s: float = 0.0, faults: dict[str, list[int]] | None = None):
    """Per step name, the milliseconds of each repeat (repeat ``i`` of every step in the same
    round); on CUDA ``triton.testing.do_bench``'s (median, p20, p80) instead. On CPU, ``faults``
    (when given) receives each timed step's minor page faults per step name."""
    for step in steps.values():
        step()  # warm-up (and compilation)
    if device.type == "cuda":
        from triton.testing import do_bench

        return {name: tuple(do_bench(step, quantiles=[0.5, 0.2, 0.8])) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(_rounds_within_budget(steps, repeats, budget_s)):
        for name in names if i % 2 == 0 else reversed(names):
            f0 = minor_faults() if faults is not None else 0
            t0 = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
            if faults is not None:
                faults.setdefault(name, []).append(minor_faults() - f0)
    return times


# CPU: a case whose steps are fast gets more rounds, up to ``budget_s`` seconds of timed steps
# (KernelSettings.round_budget_s) and at most MAX_ROUND_FACTOR times the requested repeats. One
# forward + backward of a 512 x 512 norm varies by +-30% from round to round on a shared 2-core
# machine, so 20 rounds left the median ratio to eager +-5% off from one run to the next; 0.5 s
# buys a few hundred rounds there.
MAX_ROUND_FACTOR = 20


def _rounds_within_budget(steps: dict[str, Callable[[], None]], repeats: int, budget_s: float) -> int:
    """``repeats`` rounds, or more when one round of every step (timed once, after the warm-up)
    fits ``budget_s`` that many times over."""
    repeats = max(repeats, 1)
    if budget_s <= 0:
        return repeats
    t0 = time.perf_counter()
    for step in steps.values():
        step()
    round_s = max(time.perf_counter() - t0, 1e-9)
    return max(repeats, min(MAX_ROUND_FACTOR * repeats, int(budget_s / round_s)))


def paired_ratio(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) over rounds of ``numerator[i] / denominator[i]``: the two timed in the
    same round, so a slow spell of the machine divides out instead of landing on one side."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return quantile(ratios, 0.5), quantile(ratios, 0.2), quantile(ratios, 0.8)


def time_fwd_bwd(fn: Callable, tensors: list[torch.Tensor], device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of one forward + backward of ``fn(*tensors)`` (for the other
    bench modules that time one op alone)."""
    return time_interleaved({"step": _fwd_bwd_step(fn, tensors)}, device, repeats)["step"]


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


def _repeats(settings: KernelSettings, shape: Shape) -> int:
    """Fewer repeats for the large shapes (each step there takes a good part of a second on CPU)."""
    return settings.repeats if shape[0] * shape[1] <= 4 * 2**20 else max(3, settings.repeats // 2)


def _error_row(base: dict, provider: str, exc: Exception) -> dict:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return {**base, "provider": provider, "metric": "time_fwd_bwd", "unit": "ms", "median": None, "p20": None,
            "p80": None, "status": f"error ({text})"}


def bench_op(spec: OpSpec, shape: Shape, settings: KernelSettings, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The rows of one (op, shape), every provider: time, GB/s or TFLOP/s, saved bytes, and
    memopt's time over eager's; or one status row for a provider that did not run."""
    rows_, width = shape
    base = {"op": spec.name, "mode": "fwd_bwd", "x": rows_, "width": width, "device": str(device), "dtype": settings.dtype}
    if not spec.per_shape:
        base.update(x=settings.seq, width=settings.head_dim)
    unavailable = []
    calls, tensors = {}, {}
    for provider in PROVIDERS:
        fn, reason = _provider_fn(spec, provider, settings)
        if fn is None:
            unavailable.append({**base, "provider": provider, "metric": "time_fwd_bwd", "unit": "ms", "median": None,
                             "p20": None, "p80": None, "status": f"not available ({reason})"})
            continue
        torch.manual_seed(0)
        inputs = spec.make_inputs(settings, shape, device, dtype)
        frozen = settings.frozen_params and spec.per_shape
        tensors[provider] = [t.requires_grad_(i == 0 or not frozen) for i, t in enumerate(inputs)]
        calls[provider] = fn
    steps, failed = {}, []
    for provider, fn in calls.items():
        step = _fwd_bwd_step(fn, tensors[provider])
        try:
            step()  # a case one provider does not take (bf16 on memopt's CPU kernels) fails here, alone
        except Exception as exc:  # reported in the table, never allowed to stop the run
            failed.append(_error_row(base, provider, exc))
            continue
        steps[provider] = step
    try:
        faults: dict[str, list[int]] = {}  # stays empty on CUDA (do_bench) and without getrusage
        samples = interleaved_samples(steps, device, _repeats(settings, shape), settings.round_budget_s,
                                      faults if resource is not None else None)
        timings = {p: _quantiles(ts) for p, ts in samples.items()}
        saved = {p: None if p == "compile" else memopt.saved_bytes(calls[p], *tensors[p]) for p in steps}
    except Exception as exc:  # reported in the table, never allowed to stop the run
        rows = [_error_row(base, p, exc) for p in steps] + failed + unavailable
        return sorted(rows, key=lambda r: PROVIDERS.index(r["provider"]))
    amount, unit = spec.work(settings, shape, dtype)
    scale = 1e9 if unit == "GB/s" else 1e12
    rate = {"metric": "bandwidth" if unit == "GB/s" else "throughput", "unit": unit}
    out_rows = []
    for provider, (median, p20, p80) in timings.items():
        row = {**base, "provider": provider}
        out_rows += [
            {**row, "metric": "time_fwd_bwd", "unit": "ms", "median": median, "p20": p20, "p80": p80, "status": "ok"},
            {**row, **rate, "median": amount / (median / 1e3) / scale, "p20": amount / (p80 / 1e3) / scale,
             "p80": amount / (p20 / 1e3) / scale, "status": "ok"},
            {**row, "metric": "saved_bytes", "unit": "bytes", "median": saved[provider], "p20": saved[provider],
             "p80": saved[provider], "status": "ok" if saved[provider] is not None else "n/a (compiled)"},
        ]
        if provider in faults:
            # A fresh buffer's pages fault in one by one (glibc gives large freed blocks back to the
            # kernel): at ~1 us a fault that can decide a ratio near 1.00, so the rows show it.
            counts = faults[provider]
            out_rows.append({**row, "metric": "page_faults", "unit": "faults/step", "median": quantile(counts, 0.5),
                             "p20": quantile(counts, 0.2), "p80": quantile(counts, 0.8), "status": "ok"})
        if provider != "eager" and "eager" in timings:
            if isinstance(samples[provider], list):
                ratio, ratio_p20, ratio_p80 = paired_ratio(samples[provider], samples["eager"])
            else:
                ratio = ratio_p20 = ratio_p80 = median / timings["eager"][0]
            out_rows.append({**row, "metric": "time_vs_eager", "unit": "x", "median": ratio, "p20": ratio_p20,
                             "p80": ratio_p80, "status": "ok"})
    return sorted(out_rows + failed + unavailable, key=lambda r: PROVIDERS.index(r["provider"]))  # stable


def run_kernels(settings: KernelSettings, ops: list[str] | None = None, progress: bool = True) -> dict:
    device = resolve_device(settings.device)
    dtype = DTYPES[settings.dtype]
    specs = [s for s in op_specs(settings) if ops is None or s.name in ops]
    jobs = [(spec, shape) for spec in specs for shape in (settings.shapes if spec.per_shape else settings.shapes[:1])]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="kernels", file=sys.stderr, leave=False)
    rows = []
    with cpu_threads(settings.threads):
        env = environment(device, settings.threads)
        for spec, shape in jobs:
            if bar is not None:
                bar.set_postfix_str(f"{spec.name} {shape[0]}x{shape[1]}")
            rows += bench_op(spec, shape, settings, device, dtype)
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
    """One line per (op, shape, provider): time, rate, saved bytes, memopt's time over eager's,
    or why it did not run."""
    lines = ["| op | rows x width | provider | fwd+bwd ms (p20-p80) | vs eager | rate | saved for backward "
             "| page faults / step |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["x"], r["width"], r["provider"]), {})[r["metric"]] = r
    for (op, rows_, width, provider), metrics in groups.items():
        timing = metrics["time_fwd_bwd"]
        if timing["status"] != "ok":
            lines.append(f"| {op} | {rows_} x {width} | {provider} | {timing['status']} | | | | |")
            continue
        rate = metrics.get("bandwidth") or metrics.get("throughput")
        saved_text = bytes_text(metrics["saved_bytes"]["median"])
        ratio = metrics.get("time_vs_eager")
        ratio_text = f"{ratio['median']:.2f}x" if ratio else ""
        faults = metrics.get("page_faults")
        faults_text = f"{faults['median']:.0f}" if faults else "-"
        lines.append(
            f"| {op} | {rows_} x {width} | {provider} | {timing['median']:.3f} ({timing['p20']:.3f}-{timing['p80']:.3f}) "
            f"| {ratio_text} | {rate['median']:.3g} {rate['unit']} | {saved_text} | {faults_text} |"
        )
    return "\n".join(lines)


def ratio_table(rows: list[dict], provider: str = "memopt") -> str:
    """memopt's forward + backward time over eager's, one line per op, one column per shape."""
    ratios = {(r["op"], (r["x"], r["width"])): r["median"] for r in rows
              if r["metric"] == "time_vs_eager" and r["provider"] == provider}
    if not ratios:
        return f"(no ratios: {provider} or eager did not run any case)"
    ops = list(dict.fromkeys(op for op, _ in ratios))
    shapes = list(dict.fromkeys(shape for _, shape in ratios))
    lines = ["| op | " + " | ".join(f"{r} x {w}" for r, w in shapes) + " |", "|---|" + "---:|" * len(shapes)]
    for op in ops:
        cells = [f"{ratios[(op, s)]:.2f}" if (op, s) in ratios else "" for s in shapes]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description="Micro-benchmarks of memopt's ops against eager PyTorch and torch.compile.")
    parser.add_argument("--preset", choices=sorted(KERNEL_PRESETS), default="default")
    parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--shapes", help="comma-separated ROWSxWIDTH (default: the preset's), e.g. 512x512,4096x4096")
    parser.add_argument("--repeats", type=positive_int, help="timed repeats per case on CPU (default: the preset's)")
    parser.add_argument("--threads", type=nonnegative_int, help="torch intra-op threads on CPU (default: the preset's, 1; 0: torch's own count)")
    parser.add_argument("--frozen-params", action="store_true",
                        help="only each op's input requires grad, its parameters are frozen (LoRA / PEFT); attention unchanged")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=OUT_HELP.format(kind="kernels"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    settings = KERNEL_PRESETS[args.preset]
    settings = replace(settings, **{k: getattr(args, k) for k in ("device", "dtype", "compile", "repeats", "threads")
                                    if getattr(args, k) is not None})
    if args.frozen_params:
        settings = replace(settings, frozen_params=True)
    if args.shapes:
        try:
            shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(","))
        except ValueError:
            shapes = ()
        if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
            parser.error(f"--shapes must be comma-separated ROWSxWIDTH, got {args.shapes!r}")
        settings = replace(settings, shapes=shapes)
    known = [s.name for s in op_specs(settings)]
    ops = None
    if args.ops:
        ops = [o.strip() for o in args.ops.split(",")]
        unknown = [o for o in ops if o not in known]
        if unknown:
            parser.error(f"--ops has unknown names {unknown}; known: {known}")
    result = run_kernels(settings, ops, progress=not args.no_progress)
    env = result["environment"]
    print(run_header(env))
    shapes = ", ".join(f"{r} x {w}" for r, w in settings.shapes)
    print(f"rows x width {shapes}; linear out_features {settings.linear_out}; attention "
          f"{settings.batch}x{settings.heads}x{settings.seq}x{settings.head_dim} causal (x = seq, width = head_dim); "
          f"{settings.dtype}; {settings.threads or 'all'} torch threads"
          f"{'; parameters frozen (only the input requires grad)' if settings.frozen_params else ''}\n")
    print(markdown_table(result["rows"]))
    print(f"\nmemopt forward + backward time / eager's (median of at least {settings.repeats} interleaved repeats):\n")
    print(ratio_table(result["rows"]))
    save_run(result, args.out, "kernels", settings.preset, settings.device, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
