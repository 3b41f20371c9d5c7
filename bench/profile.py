"""`python -m bench.profile`: where a training step's time goes, per configuration.

The harness (``python -m bench``) says *how long* a step of each configuration takes; this says
*where*: one ``torch.profiler`` run over a few steps of each configuration (same models, weights
and batch as the harness), with the time of every kernel (on GPU: device time of CUDA kernels;
on CPU: self time of the operators) summed by name and by category (matmul, attention, norm,
activation, dropout, softmax/mask, autograd, copy, optimizer, reduce, elementwise, other). The
categories are the first thing to compare: on the H200 the fused block under ``"none"`` took
24.0 ms where the eager block took 19.8 ms (bench/results/h200-20261130); this table shows which
kind of kernel pays for the difference.

    python -m bench.profile --preset h200 --out bench/results/profile-h200.json
    python -m bench.profile --preset tiny --configs eager-sdpa,memopt-selective

Writes one JSON (environment, settings, per configuration: milliseconds per step by category
and the top kernels) and prints a markdown table of the categories.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench._args import config_names, nonnegative_int, positive_int
from bench.compare import (
    DTYPES, PRESETS, RESULTS_DIR, add_shape_arguments, configs_by_name, cpu_threads, environment,
    fastest_sdpa, loss_fn, preset_settings, resolve_device,
)  # fmt: skip
from bench.configs import BuildContext
from bench.model import make_reference_blocks

DEFAULT_CONFIGS = ("eager-sdpa", "torch-checkpoint", "memopt-none", "memopt-selective", "memopt-full")

# First match wins: attention before matmul (attention kernels multiply too), norm and activation
# before elementwise (fused kernels are named after what they compute).
CATEGORIES = (
    ("attention", r"flash|attn|attention|sdpa|scaled_dot_product|fmha"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|matmul|aten::(add|b)?mm\b|aten::linear|_linear_pointwise"),
    ("norm", r"norm"),
    ("activation", r"gelu|silu|relu|swiglu|bias_act|act_linear|tanh"),
    ("dropout", r"dropout|philox|bernoulli"),
    ("softmax/mask", r"softmax|aten::exp\b|aten::where\b|masked_fill|isneginf"),
    ("autograd", r"backward0|autograd::|TransformerBlockFunction|Block(Attention|FFN|FFNIn|FFNOut)Function"),
    ("copy", r"copy|memcpy|memset|contiguous|clone|aten::cat\b|catarraybatched|transpose"),
    ("optimizer", r"foreach|sgd|adam"),
    ("reduce", r"reduce|aten::sum\b|aten::mean\b"),
    ("elementwise", r"elementwise|vectorized|aten::(add|mul|div|sub|fill_|zero_|pow|neg)_?\b"),
)
_CATEGORY_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES]


def category(kernel_name: str) -> str:
    """The category of a kernel or operator name (``"other"`` when no pattern matches)."""
    for name, pattern in _CATEGORY_PATTERNS:
        if pattern.search(kernel_name):
            return name
    return "other"


def _self_time_us(event, device: bool) -> float:
    # torch renamed *_cuda_time_* to *_device_time_* (2.4); accept either.
    if device:
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(event, attr):
                return float(getattr(event, attr))
        return 0.0
    return float(event.self_cpu_time_total)


def kernel_times(prof, on_cuda: bool) -> dict[str, tuple[int, float]]:
    """Name -> (calls, total microseconds): CUDA kernels' device time on GPU, operators' self CPU
    time on CPU (self time, so nested operators are not counted twice)."""
    times: dict[str, tuple[int, float]] = {}
    for event in prof.key_averages():
        if on_cuda:
            if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
        elif event.key.startswith("ProfilerStep") or event.key.startswith("## "):
            continue
        us = _self_time_us(event, on_cuda)
        if us > 0:
            calls, total = times.get(event.key, (0, 0.0))
            times[event.key] = (calls + event.count, total + us)
    return times


def profile_config(config, ctx: BuildContext, batch: torch.Tensor, steps: int, warmup: int, top: int) -> dict:
    """Milliseconds per step by category and the ``top`` kernels of one configuration."""
    reason = config.unavailable(ctx)
    if reason is not None:
        return {"status": f"not available ({reason})"}
    model = config.build(ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    on_cuda = ctx.device.type == "cuda"

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(batch)).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(ctx.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if on_cuda:
            torch.cuda.synchronize(ctx.device)
    times = kernel_times(prof, on_cuda)
    del model, optimizer
    if on_cuda:
        torch.cuda.empty_cache()
    by_category: dict[str, float] = {}
    for name, (_, us) in times.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + us / 1e3 / steps
    total_ms = sum(by_category.values())
    ranked = sorted(times.items(), key=lambda item: -item[1][1])[:top]
    return {
        "status": "ok",
        "timed": "CUDA kernel device time" if on_cuda else "operator self CPU time",
        "total_ms_per_step": total_ms,
        "ms_per_step_by_category": dict(sorted(by_category.items(), key=lambda item: -item[1])),
        "top": [
            {
                "name": name,
                "category": category(name),
                "calls_per_step": calls / steps,
                "ms_per_step": us / 1e3 / steps,
                "share": us / 1e3 / steps / total_ms if total_ms else 0.0,
            }
            for name, (calls, us) in ranked
        ],
    }


def markdown_table(results: dict[str, dict]) -> str:
    """Categories as rows, configurations as columns, milliseconds per step."""
    names = [n for n, r in results.items() if r["status"] == "ok"]
    if not names:
        return "(no configuration ran)"
    categories = sorted({c for n in names for c in results[n]["ms_per_step_by_category"]},
                        key=lambda c: -max(results[n]["ms_per_step_by_category"].get(c, 0.0) for n in names))
    lines = ["| ms per step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for cat in categories:
        cells = [f"{results[n]['ms_per_step_by_category'].get(cat, 0.0):.3f}" for n in names]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(f"**{results[n]['total_ms_per_step']:.3f}**" for n in names) + " |")
    skipped = [f"{n}: {r['status']}" for n, r in results.items() if r["status"] != "ok"]
    return "\n".join(lines + ([""] + skipped if skipped else []))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--configs", type=config_names, default=",".join(DEFAULT_CONFIGS), help="comma-separated harness configurations")
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=positive_int, default=3, help="profiled steps per configuration")
    parser.add_argument("--warmup", type=nonnegative_int, default=2)
    parser.add_argument("--top", type=positive_int, default=25, help="kernels listed per configuration")
    parser.add_argument("--out", type=Path, help="the JSON file (default: bench/results/profile-<preset>-<device>.json)")
    args = parser.parse_args(argv)
    return preset_settings(args), args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    known = configs_by_name(args.configs, "bench.profile")
    wanted = list(known)
    device = resolve_device(settings.device)
    dtype = DTYPES[settings.dtype]
    blocks = make_reference_blocks(settings.layers, settings.d_model, settings.n_heads, settings.d_ff, settings.dropout, settings.seed)
    # torch.compile's own kernels would need their own warm-up budget: profiled without it.
    ctx = BuildContext(blocks, settings.d_model, settings.n_heads, settings.d_ff, settings.dropout, device, dtype, False)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    batch = torch.randn(settings.batch, settings.seq, settings.d_model, generator=generator).to(device=device, dtype=dtype)
    results = {}
    with cpu_threads(settings.threads), fastest_sdpa(device):
        for name in wanted:
            try:
                results[name] = profile_config(known[name], ctx, batch, args.steps, args.warmup, args.top)
            except Exception as exc:  # one configuration that breaks must not hide the others
                results[name] = {"status": f"error ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"}
    out = args.out or RESULTS_DIR / f"profile-{settings.preset}-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "kind": "profile",
        "environment": environment(device, settings.threads),
        "arguments": {**asdict(settings), "steps": args.steps, "warmup": args.warmup},
        "configs": results,
    }
    out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(
        f"{settings.layers} layers, d_model {settings.d_model}, {settings.n_heads} heads, d_ff {settings.d_ff}, "
        f"batch {settings.batch} x seq {settings.seq}, {settings.dtype}, dropout {settings.dropout}, "
        f"{args.steps} profiled steps on {device}"
    )
    print(markdown_table(results))
    print(f"wrote {out}")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not available") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
