"""Attention kernel benchmark: every memopt backend against F.scaled_dot_product_attention and eager.

Times the forward and forward+backward of each provider: ``memopt:<backend>`` for ``"auto"`` and
every backend of ``memopt.ops.attention`` that runs the case on this device (``"triton"`` only on
CUDA: the interpreter would time Triton's Python emulation), ``sdpa`` (PyTorch's own choice) and on
CUDA ``sdpa:flash``, ``sdpa:cudnn``, ``sdpa:efficient`` (one SDPA backend forced), and ``eager``
(matmul + softmax + dropout + matmul). Reports achieved TFLOP/s (forward counts
``4 * B * H * Sq * Sk * D`` flops, backward 2.5 times that, both halved when causal), bytes saved
for backward, and on GPU the peak memory of one forward+backward. Rows (name, provider, mode,
metric, unit, x = sequence length, median, p20, p80, device, torch, triton, commit, date) go to
JSON under ``bench/results/``; a markdown table is printed, each time also as a multiple of
``sdpa``'s. q, k, v are views of one fused projection, as a transformer block passes them.

Each row is printed as it is measured and the JSON is rewritten after every (case, sequence
length), so a run cut by a time limit (SIGINT: exit 130) keeps what it measured. A provider that
raises gives an error row (metric ``error``, ``status`` ``"error (<exception>)"``, no numbers)
and the others still run; the script then exits 1 after writing everything.

    python -m bench.attention --preset cpu     # the block's head shape on the CPU, dropout 0 and 0.1
    python -m bench.attention --preset cpu-head-dims   # head_dim 40, 80, 96, 200 on the CPU, seq 256
    python -m bench.attention --preset cpu-gqa   # the CPU head shape with 4 query heads per kv head
    python -m bench.attention --preset h200    # bfloat16, seq 1k..16k, head_dim 64 and 128
    python -m bench.attention --preset h200-gqa   # Llama-3-8B's grouped-query attention, seq 4096
    python -m bench.attention --preset h200 --seqs 4096 --dropouts 0.1 --head-dims 128   # one slice
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import memopt
from bench._args import positive_ints, probabilities
from bench.compare import git_commit
from memopt.ops import attention as attention_ops


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    head_dim: int
    causal: bool
    seqs: tuple[int, ...]
    dropout: float = 0.0
    kv_heads: int = 0  # grouped-query heads for k and v; 0: as many as q's

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        kv = f" kv{self.kv}" if self.kv != self.heads else ""
        return f"attention b{self.batch} h{self.heads}{kv} d{self.head_dim} {mask} p{self.dropout:g}"


PRESETS = {
    # The head shape of the CPU block benchmark (d_model 512, 8 heads, batch 2), float32.
    "cpu": {
        "device": "cpu",
        "dtype": torch.float32,
        "cases": [Case(2, 8, 64, True, (256, 512), dropout) for dropout in (0.0, 0.1)],
    },
    # Head sizes that are not powers of two (ViT-H's 80, Phi-3's 96, ...), float32, no dropout:
    # "auto"'s CPU rule was measured at 64.
    "cpu-head-dims": {
        "device": "cpu",
        "dtype": torch.float32,
        "cases": [Case(2, 8, d, causal, (256,)) for d in (40, 80, 96, 200) for causal in (True, False)],
    },
    # Grouped-query heads (4 query heads per kv head), the block's CPU head shape otherwise.
    "cpu-gqa": {
        "device": "cpu",
        "dtype": torch.float32,
        "cases": [Case(2, 8, 64, True, (256,), dropout, kv_heads=2) for dropout in (0.0, 0.1)],
    },
    # Llama-3-8B's attention (32 query heads, 8 kv heads, head_dim 128), causal: "auto" runs
    # memopt's Triton kernels for grouped heads on CUDA; SDPA's own grouped-query path is the bar.
    "h200-gqa": {
        "device": "cuda",
        "dtype": torch.bfloat16,
        "cases": [Case(1, 32, 128, True, (4096,), dropout, kv_heads=8) for dropout in (0.0, 0.1)],
    },
    # 16k tokens-per-head sweep; heads x head_dim = 2048 (a 2k-wide model).
    "h200": {
        "device": "cuda",
        "dtype": torch.bfloat16,
        "cases": [
            Case(1, 2048 // d, d, causal, (1024, 2048, 4096, 8192, 16384), dropout)
            for d in (64, 128) for causal in (False, True) for dropout in (0.0, 0.1)
        ],
    },
}


def attention_flops(case: Case, seq: int, mode: str) -> float:
    forward = 4.0 * case.batch * case.heads * seq * seq * case.head_dim
    if case.causal:
        forward /= 2
    return forward * (3.5 if mode == "fwd_bwd" else 1.0)


def eager_attention(q, k, v, causal: bool, dropout: float = 0.0):
    if k.shape[1] != q.shape[1]:  # grouped-query heads: each kv head serves a group of q's
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout > 0.0:
        probs = F.dropout(probs, dropout)
    return torch.matmul(probs, v)


_SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def providers(case: Case, device: str, q, k, v) -> dict:
    """``{provider name: attention function (q, k, v) -> out}`` of those that run ``case`` here."""
    found = {}
    memopt_backends = ["auto", *(attention_ops.CUDA_BACKENDS if device == "cuda" else ("native", "cpu_flash", "aten_flash"))]
    for backend in memopt_backends:
        try:
            attention_ops.resolve_backend(backend, q, k, v, case.causal, case.dropout)
        except (ValueError, RuntimeError):
            continue
        found[f"memopt:{backend}"] = (
            lambda q, k, v, b=backend: memopt.attention(q, k, v, causal=case.causal, dropout_p=case.dropout, backend=b)
        )
    if device == "cuda" and case.kv != case.heads:
        # Grouped heads: ATen's kernels on k and v repeated per group (a copy, and the gradients'
        # group sums through autograd), the alternative to "auto"'s Triton kernels there.
        group = case.heads // case.kv
        expanded = k.repeat_interleave(group, dim=1)  # the shape ATen's kernels would see
        for backend in attention_ops.ATEN_CUDA_BACKENDS:
            try:
                attention_ops.resolve_backend(backend, q, expanded, expanded, case.causal, case.dropout)
            except (ValueError, RuntimeError):
                continue
            found[f"memopt:{backend}+repeat_kv"] = (
                lambda q, k, v, b=backend: memopt.attention(
                    q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                    causal=case.causal, dropout_p=case.dropout, backend=b,
                )
            )
    gqa = {"enable_gqa": True} if case.kv != case.heads else {}
    found["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=case.dropout, is_causal=case.causal, **gqa
    )
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, member in _SDPA_BACKENDS.items():
            if not hasattr(SDPBackend, member):
                continue

            def forced(q, k, v, backend=getattr(SDPBackend, member)):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=case.dropout, is_causal=case.causal, **gqa)

            try:
                forced(q, k, v)
            except RuntimeError:  # the forced backend does not take these inputs
                continue
            found[f"sdpa:{name}"] = forced
    found["eager"] = lambda q, k, v: eager_attention(q, k, v, case.causal, case.dropout)
    return found


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


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160]


def run(preset: str, cases: list[Case] | None = None, rows: list[dict] | None = None, on_row=None,
        on_case=None) -> list[dict]:
    """Measure ``cases`` (the preset's by default) into ``rows`` (appended to as measured, so a caller
    that passes its own list keeps what was measured when a case is interrupted).

    A provider that raises gives one error row (metric ``"error"``, ``status`` ``"error (...)"``, no
    numbers) and the next provider still runs; ``on_row(row)`` is called for every row as it is
    added and ``on_case(rows)`` after each (case, sequence length).
    """
    config = PRESETS[preset]
    device, dtype = config["device"], config["dtype"]
    cases = config["cases"] if cases is None else cases
    rows = [] if rows is None else rows
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
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

    def add(case, provider, mode, metric, unit, seq, median, p20, p80, **extra):
        row = {
            "name": case.name, "provider": provider, "mode": mode, "metric": metric, "unit": unit, "x": seq,
            "median": median, "p20": p20, "p80": p80, **common, **extra,
        }
        rows.append(row)
        if on_row is not None:
            on_row(row)

    def add_error(case, provider, mode, seq, exc):
        add(case, provider, mode, "error", "status", seq, None, None, None, status=f"error ({_error_text(exc)})")

    for case in cases:
        for seq in case.seqs:
            try:
                # q, k, v are views of one (B, S, H + 2 Hkv, D) projection, as in a transformer block.
                qkv = torch.randn(
                    case.batch, seq, case.heads + 2 * case.kv, case.head_dim, device=device, dtype=dtype, requires_grad=True
                )
                q, k, v = (t.transpose(1, 2) for t in qkv.split((case.heads, case.kv, case.kv), dim=2))
                grad = torch.randn(case.batch, case.heads, seq, case.head_dim, device=device, dtype=dtype)
                found = providers(case, device, q, k, v)
            except Exception as exc:  # noqa: BLE001 - one case's setup failing must not lose the others
                add_error(case, "*", "setup", seq, exc)
                if on_case is not None:
                    on_case(rows)
                continue
            for provider, attn in found.items():
                mode = "setup"
                try:
                    for mode in ("fwd", "fwd_bwd"):
                        if mode == "fwd":
                            def step():
                                with torch.no_grad():
                                    attn(q, k, v)
                        else:
                            def step():
                                attn(q, k, v).backward(grad)
                        median, p20, p80 = _time_ms(step, device, [qkv])
                        add(case, provider, mode, "time", "ms", seq, median, p20, p80)
                        flops = attention_flops(case, seq, mode)
                        # The slower quantile gives the lower throughput.
                        add(case, provider, mode, "throughput", "TFLOP/s", seq,
                            flops / median / 1e9, flops / p80 / 1e9, flops / p20 / 1e9)
                    with memopt.SavedTensorCounter(exclude=(qkv,)) as counter:
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
                except Exception as exc:  # noqa: BLE001 - recorded; the next provider still runs
                    add_error(case, provider, mode, seq, exc)
                finally:
                    qkv.grad = None
                    if device == "cuda":
                        try:
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                        except Exception:  # noqa: BLE001 - a broken context: the next provider says so
                            pass
            if on_case is not None:
                on_case(rows)
    return rows


TABLE_HEADER = "| case | seq | mode | provider | ms | TFLOP/s | x sdpa | saved MiB |"
TABLE_RULE = "|---|---:|---|---|---:|---:|---:|---:|"


def progress_line(row: dict) -> str | None:
    """The line printed as ``row`` is measured (time, OOM and error rows; the table comes at the end)."""
    head = f"| {row['name']} | {row['x']} | {row['mode']} | {row['provider']} |"
    if row["metric"] == "time":
        return f"{head} {row['median']:.3f} ms |"
    if row["metric"] == "oom":
        return f"{head} OOM |"
    if row["metric"] == "error":
        return f"{head} {row.get('status', 'error')} |"
    return None


def markdown(rows: list[dict]) -> str:
    """One line per (case, seq, mode, provider): median time, throughput, time / sdpa's, saved bytes."""
    cell = {(r["name"], r["x"], r["mode"], r["provider"], r["metric"]): r["median"] for r in rows}
    errors = {(r["name"], r["x"], r["mode"], r["provider"]): r.get("status", "error") for r in rows if r["metric"] == "error"}
    keys = []
    for r in rows:
        key = (r["name"], r["x"], r["mode"], r["provider"])
        if r["metric"] in ("time", "oom", "error") and key not in keys:
            keys.append(key)
    lines = [TABLE_HEADER, TABLE_RULE]
    for name, seq, mode, provider in keys:
        t = cell.get((name, seq, mode, provider, "time"))
        if t is None:
            what = errors.get((name, seq, mode, provider), "OOM").replace("|", "/")
            lines.append(f"| {name} | {seq} | {mode} | {provider} | {what} | | | |")
            continue
        tf = cell[(name, seq, mode, provider, "throughput")]
        base = cell.get((name, seq, mode, "sdpa", "time"))
        ratio = f"{t / base:.2f}" if base else ""
        saved = cell.get((name, seq, "fwd_bwd", provider, "saved_bytes"))
        saved_text = "" if saved is None or mode == "fwd" else f"{saved / 2**20:.2f}"
        lines.append(f"| {name} | {seq} | {mode} | {provider} | {t:.3f} | {tf:.2f} | {ratio} | {saved_text} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description="memopt.attention benchmark")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", default=None, help="JSON file, or an existing folder for attention_<preset>.json (default bench/results/)")
    parser.add_argument("--seqs", type=positive_ints, default=None, help="comma-separated sequence lengths replacing the preset's")
    parser.add_argument("--dropouts", type=probabilities, default=None, help="comma-separated dropout rates: only the preset's cases with these")
    parser.add_argument("--head-dims", type=positive_ints, default=None, help="comma-separated head dims: only the preset's cases with these")
    args = parser.parse_args(argv)
    cases = PRESETS[args.preset]["cases"]
    if args.seqs:
        cases = [replace(case, seqs=args.seqs) for case in cases]
    if args.dropouts:
        cases = [case for case in cases if case.dropout in set(args.dropouts)]
    if args.head_dims:
        cases = [case for case in cases if case.head_dim in set(args.head_dims)]
    if not cases:
        parser.error(f"no case of preset {args.preset!r} has these dropout rates and head dims")
    name = f"attention_{args.preset}.json"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    if os.path.isdir(out):
        out = os.path.join(out, name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(rows):  # after every case: a run cut by its time limit keeps what it measured
        tmp = f"{out}.tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, out)

    def show(row):
        line = progress_line(row)
        if line is not None:
            print(line, flush=True)

    rows: list[dict] = []
    interrupted = False
    try:
        run(args.preset, cases, rows, on_row=show, on_case=write)
    except KeyboardInterrupt:  # device_check.sh's time limit sends SIGINT
        interrupted = True
    finally:
        write(rows)
    print()
    print(markdown(rows))
    errors = sum(r["metric"] == "error" for r in rows)
    print(f"\n{len(rows)} rows written to {out}" + (f" ({errors} error rows)" if errors else ""))
    if interrupted:
        print("bench.attention: interrupted; the rows measured so far are written", flush=True)
        raise SystemExit(130)
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
