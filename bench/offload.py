"""Activation offload benchmark: step time, peak memory and bytes moved over depth.

A GPT-style stack (pre-norm ``nn.TransformerEncoderLayer`` with a causal mask, GELU) is trained
for a few steps with and without :func:`memopt.offload`, at several depths. Each measurement is
one JSON row (config, provider, metric, unit, value, device, torch, commit, date) in
``bench/results/offload-<preset>-<date>.json`` (or ``--out``).

Providers: ``none`` (plain autograd) and ``offload`` (prefetch 1), plus ``offload-prefetch0``
(restore on demand) on GPU. Metrics: ``step_time`` (median ms of the timed steps),
``peak_memory`` (``torch.cuda.max_memory_allocated`` above the parameters, GPU only),
``bytes_to_host``/``bytes_to_device`` per step, ``wait_time`` (ms per step the compute stream
waited on a restore) and ``pool_bytes_held``.

Presets: ``cpu`` (tiny; runs anywhere, the CPU path copies pageable memory with
``allow_cpu_source=True``) and ``h200`` (d_model 2048, seq 2048, 4..24 layers, bf16).

    python -m bench.offload --preset h200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
from torch import nn

import memopt
from bench.compare import git_commit

PRESETS = {
    "cpu": dict(device="cpu", dtype="float32", d_model=64, heads=2, seq=32, batch=2, depths=[2, 4], steps=3, warmup=1,
                min_bytes=0, providers=["none", "offload"]),
    "h200": dict(device="cuda", dtype="bfloat16", d_model=2048, heads=16, seq=2048, batch=1, depths=[4, 8, 16, 24],
                 steps=5, warmup=2, min_bytes=2**20, providers=["none", "offload", "offload-prefetch0"]),
}


def gpt_stack(depth: int, cfg: dict) -> nn.ModuleList:
    dtype = getattr(torch, cfg["dtype"])
    # Built on the device: initialising billions of parameters on the host first takes minutes.
    return nn.ModuleList(
        nn.TransformerEncoderLayer(cfg["d_model"], cfg["heads"], dim_feedforward=4 * cfg["d_model"], dropout=0.0,
                                   activation="gelu", batch_first=True, norm_first=True, device=cfg["device"],
                                   dtype=dtype)
        for _ in range(depth))


def forward(layers: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x, src_mask=mask, is_causal=True)
    return x


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(depth: int, provider: str, cfg: dict) -> dict:
    """One (depth, provider) run: medians over cfg['steps'] timed steps after cfg['warmup']."""
    device, dtype = cfg["device"], getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    layers = gpt_stack(depth, cfg)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=device, dtype=dtype, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(cfg["seq"], device=device, dtype=dtype)
    off = None
    if provider != "none":
        off = memopt.offload(min_bytes=cfg["min_bytes"], prefetch=0 if provider.endswith("prefetch0") else 1,
                             pin_memory=device == "cuda", allow_cpu_source=device == "cpu")
        memopt.offload_module_groups(off, layers)
    param_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    times, peaks = [], []
    before = off.stats() if off else None
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"] and off is not None:
            before = off.stats()
        layers.zero_grad(set_to_none=True)
        x.grad = None
        _sync(device)
        if device == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if off is None:
            out = forward(layers, x, mask)
        else:
            with off:
                out = forward(layers, x, mask)
        out.float().square().mean().backward()
        _sync(device)
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
            if device == "cuda":
                peaks.append(torch.cuda.max_memory_allocated() - base - param_bytes)
        del out
    result = {"step_time": ("ms", 1e3 * statistics.median(times))}
    if peaks:
        result["peak_memory"] = ("bytes", max(peaks))
    if off is not None:
        after = off.stats()
        n = cfg["steps"]
        result["bytes_to_host"] = ("bytes/step", (after["bytes_to_host"] - before["bytes_to_host"]) / n)
        result["bytes_to_device"] = ("bytes/step", (after["bytes_to_device"] - before["bytes_to_device"]) / n)
        result["wait_time"] = ("ms/step", 1e3 * (after["wait_seconds"] - before["wait_seconds"]) / n)
        result["pool_bytes_held"] = ("bytes", after["pool_bytes_held"])
        result["refused_tensors"] = ("tensors/step", (after["refused_tensors"] - before["refused_tensors"]) / n)
    return result


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", default=None, help="JSON file for the rows, or an existing folder for offload-<preset>-<date>.json (default bench/results/)")
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset]
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench.offload: preset {args.preset!r} needs a CUDA device")
    device_name = torch.cuda.get_device_name() if cfg["device"] == "cuda" else "cpu"
    now = datetime.datetime.now(datetime.timezone.utc)
    common = {"device": device_name, "torch": torch.__version__, "commit": git_commit(),
              "date": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    rows = []
    for depth in cfg["depths"]:
        config = (f"gpt layers={depth} d_model={cfg['d_model']} heads={cfg['heads']} seq={cfg['seq']} "
                  f"batch={cfg['batch']} {cfg['dtype']}")
        for provider in cfg["providers"]:
            for metric, (unit, value) in measure(depth, provider, cfg).items():
                rows.append({"config": config, "layers": depth, "provider": provider, "metric": metric,
                             "unit": unit, "value": value, **common})
                print(f"{config:60s} {provider:18s} {metric:16s} {value:14.3f} {unit}")
    name = f"offload-{args.preset}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    if os.path.isdir(out):
        out = os.path.join(out, name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {len(rows)} rows to {out}")
    return out


if __name__ == "__main__":
    main()
