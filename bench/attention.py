"""Attention kernel benchmark: memopt.attention against F.scaled_dot_product_attention and eager.

Times the forward and forward+backward of three providers (``memopt``, ``sdpa``: the flash backend
on GPU, ``eager``: matmul + softmax + matmul), reports achieved TFLOP/s (forward counts
``4 * B * H * Sq * Sk * D`` flops, backward 2.5 times that, both halved when causal), bytes saved
for backward, and on GPU the peak memory of one forward+backward. Rows (name, provider, mode,
metric, unit, x = sequence length, median, p20, p80, device, torch, triton, commit, date) go to
JSON under ``bench/results/``; a markdown table is printed.

    python -m bench.attention --preset cpu     # seconds, plain PyTorch path on the CPU
    python -m bench.attention --preset h200    # bfloat16, seq 1k..16k, head_dim 64 and 128
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import memopt

PROVIDERS = ("memopt", "sdpa", "eager")


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    head_dim: int
    causal: bool
    seqs: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"attention b{self.batch} h{self.heads} d{self.head_dim} {'causal' if self.causal else 'full'}"


PRESETS = {
    # Tiny shapes on the CPU: the native path, float32, wall-clock timing.
    "cpu": {
        "device": "cpu",
        "dtype": torch.float32,
        "cases": [Case(1, 2, 64, causal, (64, 128)) for causal in (False, True)],
    },
    # 16k tokens-per-head sweep; heads x head_dim = 2048 (a 2k-wide model).
    "h200": {
        "device": "cuda",
        "dtype": torch.bfloat16,
        "cases": [
            Case(1, 2048 // d, d, causal, (1024, 2048, 4096, 8192, 16384)) for d in (64, 128) for causal in (False, True)
        ],
    },
}


def attention_flops(case: Case, seq: int, mode: str) -> float:
    forward = 4.0 * case.batch * case.heads * seq * seq * case.head_dim
    if case.causal:
        forward /= 2
    return forward * (3.5 if mode == "fwd_bwd" else 1.0)


def eager_attention(q, k, v, causal: bool):
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _provider_fn(provider: str, causal: bool, device: str):
    if provider == "memopt":
        return lambda q, k, v: memopt.attention(q, k, v, causal=causal)
    if provider == "eager":
        return lambda q, k, v: eager_attention(q, k, v, causal)
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return flash
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _quantiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), cuts[1], cuts[7]


def _time_ms(fn, device: str, grad_to_none) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds."""
    if device == "cuda":
        import triton

        median, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return median, p20, p80
    fn()
    samples = []
    for _ in range(5):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return _quantiles(samples)


def _commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(preset: str) -> list[dict]:
    config = PRESETS[preset]
    device, dtype = config["device"], config["dtype"]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench.attention: preset {preset!r} needs a CUDA device")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    common = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []

    def add(case, provider, mode, metric, unit, seq, median, p20, p80):
        rows.append({
            "name": case.name, "provider": provider, "mode": mode, "metric": metric, "unit": unit, "x": seq,
            "median": median, "p20": p20, "p80": p80, **common,
        })

    for case in config["cases"]:
        for seq in case.seqs:
            shape = (case.batch, case.heads, seq, case.head_dim)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(shape, device=device, dtype=dtype)
            for provider in PROVIDERS:
                attn = _provider_fn(provider, case.causal, device)
                try:
                    for mode in ("fwd", "fwd_bwd"):
                        if mode == "fwd":
                            def step():
                                with torch.no_grad():
                                    attn(q, k, v)
                        else:
                            def step():
                                attn(q, k, v).backward(grad)
                        median, p20, p80 = _time_ms(step, device, [q, k, v])
                        add(case, provider, mode, "time", "ms", seq, median, p20, p80)
                        flops = attention_flops(case, seq, mode)
                        # The slower quantile gives the lower throughput.
                        add(case, provider, mode, "throughput", "TFLOP/s", seq,
                            flops / median / 1e9, flops / p80 / 1e9, flops / p20 / 1e9)
                    with memopt.SavedTensorCounter(exclude=(q, k, v)) as counter:
                        out = attn(q, k, v)
                    del out
                    add(case, provider, "fwd_bwd", "saved_bytes", "bytes", seq, *(counter.total_bytes,) * 3)
                    if device == "cuda":
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        attn(q, k, v).backward(grad)
                        torch.cuda.synchronize()
                        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                        add(case, provider, "fwd_bwd", "peak_memory", "MiB", seq, peak, peak, peak)
                except torch.OutOfMemoryError:
                    add(case, provider, "fwd_bwd", "oom", "bool", seq, 1, 1, 1)
                finally:
                    q.grad = k.grad = v.grad = None
                    if device == "cuda":
                        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per (case, seq, mode): each provider's median time and throughput, saved bytes."""
    cell = {(r["name"], r["x"], r["mode"], r["provider"], r["metric"]): r["median"] for r in rows}
    keys = sorted({(r["name"], r["x"], r["mode"]) for r in rows if r["metric"] == "time"})
    lines = [
        "| case | seq | mode | " + " | ".join(f"{p} ms (TFLOP/s)" for p in PROVIDERS) + " | "
        + " | ".join(f"{p} saved MiB" for p in PROVIDERS) + " |",
        "|---|---:|---|" + "---:|" * (2 * len(PROVIDERS)),
    ]
    for name, seq, mode in keys:
        timing = []
        for p in PROVIDERS:
            t = cell.get((name, seq, mode, p, "time"))
            tf = cell.get((name, seq, mode, p, "throughput"))
            timing.append("OOM" if t is None else f"{t:.3f} ({tf:.1f})")
        saved = []
        for p in PROVIDERS:
            b = cell.get((name, seq, "fwd_bwd", p, "saved_bytes"))
            saved.append("" if b is None or mode == "fwd" else f"{b / 2**20:.2f}")
        lines.append(f"| {name} | {seq} | {mode} | " + " | ".join(timing) + " | " + " | ".join(saved) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="memopt.attention benchmark")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/attention_<preset>.json)")
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths replacing the preset's")
    args = parser.parse_args(argv)
    if args.seqs:
        seqs = tuple(int(s) for s in args.seqs.split(","))
        PRESETS[args.preset]["cases"] = [replace(case, seqs=seqs) for case in PRESETS[args.preset]["cases"]]
    rows = run(args.preset)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"attention_{args.preset}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(markdown(rows))
    print(f"\n{len(rows)} rows written to {out}")


if __name__ == "__main__":
    main()
