"""`python -m bench.cross_entropy`: memopt.linear_cross_entropy against plain PyTorch.

For each token count and provider (``memopt``: the chunked op; ``eager``: ``F.linear`` then
``F.cross_entropy``, the logits materialised; ``compile``: the eager code under ``torch.compile``
when ``--compile`` is given) one forward + backward of the LM-head loss is timed (``do_bench`` on
GPU, the median of ``perf_counter`` repeats on CPU) and its memory measured: the peak of the
tracked live bytes (``bench.memory.LiveTensorTracker``, inputs and weight excluded) on every
device (inside memopt's op bodies too, ``ChunkAwareTracker``), the allocator's peak above the inputs on GPU, and the bytes saved for backward
(``memopt.saved_bytes``). With ``--frozen-weight`` the LM head's weight does not require grad
(LoRA / PEFT fine-tuning): both sides compute only ``grad_hidden``, and memopt forms it in the
forward (note [a frozen LM head] in ``memopt/ops/cross_entropy.py``).

Rows follow the house schema (``op, provider, mode, metric, unit, x, median, p20, p80`` plus
``status``) under an environment header, in
``bench/results/cross_entropy-<preset>-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import memopt
from bench._args import device_name, positive_int, positive_ints
from bench.compare import DTYPES, OUT_HELP, RESULTS_DIR, cpu_threads, environment, resolve_device, save_run
from bench.kernels import bytes_text, time_fwd_bwd
from bench.memory import LiveTensorTracker
from memopt.ops.cross_entropy import IMPLEMENTATIONS, default_chunk_tokens, linear_cross_entropy_ref

PROVIDERS = ("memopt", "eager", "compile")


@dataclass(frozen=True)
class CrossEntropySettings:
    preset: str = "default"
    device: str = "auto"
    dtype: str = "float32"
    autocast: str | None = None  # autocast dtype name, or None for none
    tokens: tuple[int, ...] = (256, 1024, 2048)
    dim: int = 256
    vocab: int = 32000
    chunk_tokens: int | None = None
    repeats: int = 3
    compile: bool = False
    threads: int | None = 1
    # The LM head's weight frozen (LoRA / PEFT fine-tuning): only hidden needs a gradient.
    frozen_weight: bool = False


PRESETS = {
    "default": CrossEntropySettings(),
    "tiny": CrossEntropySettings(preset="tiny", tokens=(64, 97), dim=16, vocab=1003, chunk_tokens=16, repeats=1),
    "h200": CrossEntropySettings(
        preset="h200", device="cuda", dtype="float32", autocast="bfloat16", tokens=(4096, 16384, 32768),
        dim=4096, vocab=128256, repeats=0, compile=True, threads=None,
    ),
}


def _loss_fn(provider: str, settings: CrossEntropySettings, device: torch.device):
    autocast_dtype = DTYPES[settings.autocast] if settings.autocast else None

    def memopt_loss(hidden, weight, target):
        return memopt.linear_cross_entropy(hidden, weight, target, chunk_tokens=settings.chunk_tokens)

    def eager_loss(hidden, weight, target):
        return linear_cross_entropy_ref(hidden, weight, target)

    fn = memopt_loss if provider == "memopt" else eager_loss
    if provider == "compile":
        fn = torch.compile(eager_loss)

    def call(hidden, weight, target):
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            return fn(hidden, weight, target)

    return call


class ChunkAwareTracker(LiveTensorTracker):
    """``LiveTensorTracker`` that also sees inside memopt's cross-entropy ops: a dispatch mode
    sees only a custom op's outputs, so their Python bodies run under the tracker instead."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = IMPLEMENTATIONS.get(func._opname) if func.namespace == "memopt" else None
        if body is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        with self:
            return body(*args, **(kwargs or {}))


def _peaks(call, hidden, weight, target, device: torch.device) -> tuple[int, int | None]:
    """(peak tracked live bytes, allocator peak above the inputs on GPU or None) of one step."""
    hidden.grad = weight.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with ChunkAwareTracker(exclude=[hidden, weight, target]) as tracker:
        call(hidden, weight, target).backward()
    allocator = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        allocator = torch.cuda.max_memory_allocated(device) - base
    hidden.grad = weight.grad = None
    return tracker.peak_bytes(), allocator


def bench_point(provider: str, tokens: int, settings: CrossEntropySettings, device: torch.device) -> list[dict]:
    """The rows of one (provider, token count): time, peak bytes, saved bytes; or one status row."""
    base = {"op": "linear_cross_entropy", "provider": provider, "mode": "fwd_bwd", "x": tokens, "device": str(device),
            "dtype": settings.dtype, "autocast": settings.autocast, "frozen_weight": settings.frozen_weight}
    if provider == "compile" and not settings.compile:
        return [{**base, "metric": "time_fwd_bwd", "unit": "ms", "median": None, "p20": None, "p80": None,
                 "status": "not available (torch.compile not requested: pass --compile)"}]
    dtype = DTYPES[settings.dtype]
    torch.manual_seed(0)
    hidden = torch.randn(tokens, settings.dim, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(settings.vocab, settings.dim, device=device, dtype=dtype) / settings.dim**0.5).requires_grad_(
        not settings.frozen_weight
    )
    target = torch.randint(0, settings.vocab, (tokens,), device=device)
    call = _loss_fn(provider, settings, device)
    try:
        median, p20, p80 = time_fwd_bwd(lambda h, w: call(h, w, target), [hidden, weight], device, settings.repeats)
        tracked, allocator = _peaks(call, hidden, weight, target, device)
        saved = None if provider == "compile" else memopt.saved_bytes(call, hidden, weight, target)
    except Exception as exc:  # reported in the table, never allowed to stop the run
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        return [{**base, "metric": "time_fwd_bwd", "unit": "ms", "median": None, "p20": None, "p80": None, "status": f"error ({text})"}]

    def row(metric, unit, value, status="ok"):
        return {**base, "metric": metric, "unit": unit, "median": value, "p20": value, "p80": value, "status": status}

    rows = [
        {**base, "metric": "time_fwd_bwd", "unit": "ms", "median": median, "p20": p20, "p80": p80, "status": "ok"},
        row("peak_tracked_bytes", "bytes", tracked if provider != "compile" else None,
            "ok" if provider != "compile" else "n/a (compiled code allocates outside the dispatcher)"),
        row("saved_bytes", "bytes", saved, "ok" if saved is not None else "n/a (compiled)"),
        row("logits_bytes", "bytes", tokens * settings.vocab * 4),  # one float32 (tokens x vocab) tensor, for scale
    ]
    if allocator is not None:
        rows.append(row("peak_gpu_bytes", "bytes", allocator))
    return rows


def run_cross_entropy(settings: CrossEntropySettings) -> dict:
    device = resolve_device(settings.device)
    rows = []
    with cpu_threads(settings.threads):
        env = environment(device, settings.threads)
        for tokens in settings.tokens:
            for provider in PROVIDERS:
                rows += bench_point(provider, tokens, settings, device)
    for row in rows:
        row["versions"] = {"torch": env["torch"], "triton": env["triton"], "memopt": env["memopt"]}
        row["commit"], row["date"] = env["commit"], env["date"]
    arguments = vars(settings).copy()
    arguments["chunk_tokens_used"] = settings.chunk_tokens or default_chunk_tokens(settings.vocab)
    return {"kind": "cross_entropy", "schema": "memopt-bench/1", "environment": env, "arguments": arguments, "rows": rows}


def markdown_table(rows: list[dict]) -> str:
    """One line per (tokens, provider): time, peak tracked (and GPU) bytes, saved bytes."""
    lines = ["| tokens | provider | fwd+bwd ms (p20-p80) | peak tracked | peak GPU | saved for backward |",
             "|---:|---|---:|---:|---:|---:|"]
    groups: dict[tuple[int, str], dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["x"], r["provider"]), {})[r["metric"]] = r
    for (tokens, provider), metrics in groups.items():
        timing = metrics["time_fwd_bwd"]
        if timing["status"] != "ok":
            lines.append(f"| {tokens} | {provider} | {timing['status']} | | | |")
            continue
        gpu = metrics.get("peak_gpu_bytes", {}).get("median")
        lines.append(
            f"| {tokens} | {provider} | {timing['median']:.2f} ({timing['p20']:.2f}-{timing['p80']:.2f}) "
            f"| {bytes_text(metrics['peak_tracked_bytes']['median'])} | {bytes_text(gpu)} "
            f"| {bytes_text(metrics['saved_bytes']['median'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cross_entropy",
                                     description="memopt.linear_cross_entropy against F.linear + F.cross_entropy: time and peak memory.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--autocast", choices=sorted(DTYPES), help="run under torch.autocast with this dtype")
    parser.add_argument("--tokens", type=positive_ints, help="comma-separated token counts")
    parser.add_argument("--dim", type=positive_int)
    parser.add_argument("--vocab", type=positive_int)
    parser.add_argument("--chunk-tokens", type=positive_int, dest="chunk_tokens")
    parser.add_argument("--repeats", type=positive_int, help="timed repeats on CPU")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--frozen-weight", action="store_true", default=None, dest="frozen_weight",
                        help="freeze the LM head's weight (LoRA / PEFT): only hidden gets a gradient")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=OUT_HELP.format(kind="cross_entropy"))
    args = parser.parse_args(argv)
    settings = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("device", "dtype", "autocast", "tokens", "dim", "vocab", "chunk_tokens", "repeats", "compile", "frozen_weight")
                 if getattr(args, k) is not None}
    settings = replace(settings, **overrides)
    result = run_cross_entropy(settings)
    env = result["environment"]
    print(f"memopt {env['memopt']} | torch {env['torch']} | {env['device_name']} | commit {env['commit'][:12]}")
    print(f"d {settings.dim}, vocab {settings.vocab}, {settings.dtype}"
          f"{', autocast ' + settings.autocast if settings.autocast else ''}"
          f"{', frozen weight' if settings.frozen_weight else ''}, chunk {result['arguments']['chunk_tokens_used']} tokens\n")
    print(markdown_table(result["rows"]))
    save_run(result, args.out, "cross_entropy", settings.preset, settings.device, plot=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
