"""`python -m bench.inference`: forward-only time and memory (evaluation, serving) of memopt against
the PyTorch it replaces.

The harness (``python -m bench``) times training steps; a model trained with memopt is also
evaluated and served. For each model mode (``eval``; ``train``: a validation loop that keeps
dropout, at ``--dropout``, 0.1 by default) and grad mode (``no_grad``, ``inference_mode``) this
times one forward of

* the harness's GPT stack (``bench.configs``, same weights, causal unless ``--no-causal``):
  ``eager-sdpa``, the reference of its group, and ``memopt-none`` / ``-selective`` / ``-full``
  (a ``FusedCheckpointBlock`` per layer);
* an ``nn.TransformerEncoder`` of the same shape (pre-norm, GELU, batch-first):
  ``torch-encoder``, the reference of its group (in eval, PyTorch's native fast path), and
  ``memopt-wrap``, ``memopt.wrap`` of one with the same weights, default policy (its layers run
  as fused blocks where dropout is 0, as checkpointed torch layers otherwise).

Eval rows build every model with dropout 0. Timing as the harness's on CPU: every model built and
warmed up, then interleaved rounds (the order alternating), each row's time over its reference's
paired by round. Rows carry the harness's columns (``mode`` is ``"inference"``, a step is one
forward) plus ``model_mode``, ``grad_mode``, ``time_reference`` and, in eval, the output's largest
difference from the reference's, relative to its largest value (``output_check``).
``step_peak_tracked_bytes`` is the peak of what ``bench.memory.LiveTensorTracker`` sees during one
forward: allocations inside one op (the encoder's fused fast-path layer) are not seen.

    python -m bench.inference --preset cpu
    python -m bench.inference --preset cpu-small --clock cpu
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import memopt
from bench._args import nonnegative_int, positive_int
from bench.compare import (
    DTYPES, PRESETS, RESULTS_DIR, OUT_HELP, ROW_COLUMNS, Settings, StepTimer, add_shape_arguments, cpu_threads,
    empty_row, environment, fastest_sdpa, preset_settings, quantile, resolve_device, run_header, save_run, time_ratio,
)  # fmt: skip
from bench.configs import BenchConfig, BuildContext, eager_stack, fused_stack
from bench.memory import LiveTensorTracker
from bench.model import make_reference_blocks
from memopt.policy import POLICIES

MODEL_MODES = ("eval", "train")
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
# The largest output difference from the reference, relative to the reference's largest value,
# that an eval row passes with (no dropout: the same function of the same weights).
OUTPUT_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
EXTRA_COLUMNS = ("model_mode", "grad_mode", "time_reference", "output_max_rel_diff", "output_check")


def _stack(ctx: BuildContext, causal: bool, policy: str | None) -> nn.Module:
    """The harness's GPT stack, eager (policy None) or fused, with ``causal`` attention."""
    model = eager_stack(ctx, "sdpa") if policy is None else fused_stack(ctx, policy)
    for block in model.layers:
        block.causal = causal
    return model


class _Encoder(nn.Module):
    """An ``nn.TransformerEncoder`` called as the stacks are, ``(B, S, D) -> (B, S, D)``."""

    def __init__(self, ctx: BuildContext, causal: bool, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same weights every time it is built
            torch.manual_seed(seed)
            layer = nn.TransformerEncoderLayer(
                ctx.d_model, ctx.n_heads, ctx.d_ff, dropout=ctx.dropout, activation="gelu", batch_first=True,
                norm_first=True, device=ctx.device, dtype=ctx.dtype,
            )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, len(ctx.reference_blocks), enable_nested_tensor=False)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype) if self.causal else None
        return self.encoder(x, mask=mask, is_causal=self.causal)


def configs(causal: bool) -> list[tuple[BenchConfig, str]]:
    """``(configuration, the name of its group's reference)``, references first."""
    stack = [BenchConfig("eager-sdpa", "torch", "eager blocks, F.scaled_dot_product_attention", lambda ctx: _stack(ctx, causal, None))]
    stack += [
        BenchConfig(f"memopt-{policy}", "memopt", f"memopt.FusedCheckpointBlock per layer, policy={policy!r}",
                    lambda ctx, policy=policy: _stack(ctx, causal, policy))
        for policy in POLICIES
    ]  # fmt: skip
    wrap = [
        BenchConfig("torch-encoder", "torch", "nn.TransformerEncoder (its native fast path in eval)",
                    lambda ctx: _Encoder(ctx, causal)),
        BenchConfig("memopt-wrap", "memopt", "memopt.wrap of torch-encoder's model (default policy)",
                    lambda ctx: memopt.wrap(_Encoder(ctx, causal))),
    ]  # fmt: skip
    return [(c, "eager-sdpa") for c in stack] + [(c, "torch-encoder") for c in wrap]


def _forward(model: nn.Module, batch: torch.Tensor, grad_mode: str) -> Callable[[], torch.Tensor]:
    def forward():
        with GRAD_MODES[grad_mode]():
            return model(batch)

    return forward


def run_group(settings: Settings, model_mode: str, grad_mode: str, causal: bool, batch: torch.Tensor) -> list[dict]:
    """The rows of one (model mode, grad mode): every configuration built, warmed up, timed in
    interleaved rounds; its peak tracked bytes, saved bytes and (eval) output checked."""
    device, dtype = resolve_device(settings.device), DTYPES[settings.dtype]
    dropout = settings.dropout if model_mode == "train" else 0.0
    blocks = make_reference_blocks(settings.layers, settings.d_model, settings.n_heads, settings.d_ff, dropout, settings.seed)
    ctx = BuildContext(blocks, settings.d_model, settings.n_heads, settings.d_ff, dropout, device, dtype)
    timer = StepTimer(device, settings.clock)
    runs, rows = [], {}
    for config, reference in configs(causal):
        row = empty_row(config, replace(settings, dropout=dropout), device, "ok")
        row.update(mode="inference", model_mode=model_mode, grad_mode=grad_mode, time_reference=reference,
                   output_max_rel_diff=None, output_check="n/a", step_times_ms=[])  # fmt: skip
        rows[config.name] = row
        try:
            model = config.build(ctx).train(model_mode == "train")
            forward = _forward(model, batch, grad_mode)
            row["first_step_s"] = timer(forward)
            warm = [timer(forward) for _ in range(max(settings.warmup - 1, 0))] or [row["first_step_s"]]
            runs.append((config.name, model, forward, min(warm), reference))
        except Exception as exc:  # a configuration that breaks is reported, not allowed to stop the run
            row["status"] = f"error ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    mean_warm = sum(r[3] for r in runs) / max(len(runs), 1)
    rounds = max(1, min(settings.repeats, int(settings.max_config_seconds / max(mean_warm, 1e-9))))
    for i in range(rounds):
        for run in runs if i % 2 == 0 else reversed(runs):
            try:
                rows[run[0]]["step_times_ms"].append(timer(run[2]) * 1e3)
            except Exception as exc:
                rows[run[0]]["status"] = f"error ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    for name, row in rows.items():
        if row["status"] != "ok":
            row["step_times_ms"] = None
    runs = [run for run in runs if rows[run[0]]["status"] == "ok"]
    outputs = {}
    for name, model, forward, _, reference in runs:
        row = rows[name]
        times = row["step_times_ms"]
        row.update(steps_timed=len(times), step_time_ms_median=quantile(times, 0.5), step_time_ms_p20=quantile(times, 0.2),
                   step_time_ms_p80=quantile(times, 0.8))  # fmt: skip
        row["tokens_per_s"] = row["tokens_per_step"] / (row["step_time_ms_median"] / 1e3)
        excluded = [*model.parameters(), *model.buffers(), batch]
        with LiveTensorTracker(exclude=excluded) as tracker, memopt.SavedTensorCounter(exclude=excluded) as counter:
            outputs[name] = forward()
        row["step_peak_tracked_bytes"] = tracker.peak_bytes(str(device))
        row["saved_bytes"] = counter.total_bytes
        if rows[reference]["step_time_ms_median"]:
            row["time_vs_eager"], row["time_vs_eager_p20"], row["time_vs_eager_p80"] = time_ratio(row, rows[reference], paired=True)
        if model_mode == "eval" and reference in outputs:
            expected = outputs[reference].float()
            diff = (outputs[name].float() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
            row["output_max_rel_diff"] = diff
            row["output_check"] = "ok" if diff <= OUTPUT_RTOL[dtype] else "MISMATCH"
    return list(rows.values())


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| config | model mode | grad mode | forward ms (p20-p80) | time / reference | peak tracked MiB | saved MiB | output rel diff |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['model_mode']} | {r['grad_mode']} | {r['status']} | | | | |")
            continue
        ratio = f"{r['time_vs_eager']:.2f} ({r['time_vs_eager_p20']:.2f}-{r['time_vs_eager_p80']:.2f}) / {r['time_reference']}"
        check = "-" if r["output_max_rel_diff"] is None else f"{r['output_max_rel_diff']:.1e} {r['output_check']}"
        lines.append(
            f"| {r['config']} | {r['model_mode']} | {r['grad_mode']} "
            f"| {r['step_time_ms_median']:.2f} ({r['step_time_ms_p20']:.2f}-{r['step_time_ms_p80']:.2f}) | {ratio} "
            f"| {r['step_peak_tracked_bytes'] / 2**20:.2f} | {r['saved_bytes'] / 2**20:.2f} | {check} |"
        )
    return "\n".join(lines)


def comma_choices(choices) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(","))
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {list(choices)}, got {text!r}")
        return values

    parse.__name__ = "names"
    return parse


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    add_shape_arguments(parser)
    parser.add_argument("--model-modes", type=comma_choices(MODEL_MODES), default=MODEL_MODES, help="eval, train (default both)")
    parser.add_argument("--grad-modes", type=comma_choices(GRAD_MODES), default=tuple(GRAD_MODES), help="no_grad, inference_mode (default both)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention (default, as the harness)")
    parser.add_argument("--warmup", type=nonnegative_int)
    parser.add_argument("--repeats", type=positive_int, help="timed rounds at most (default: the preset's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), help="CPU runs: wall-clock time (default) or the process's CPU time (with --threads 1)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=OUT_HELP.format(kind="inference"))
    args = parser.parse_args(argv)
    fixed = {k: getattr(args, k) for k in ("warmup", "repeats", "clock") if getattr(args, k) is not None}
    if args.dropout is None:
        fixed["dropout"] = 0.1  # the train rows' dropout: a validation loop that keeps it
    return preset_settings(args, **fixed), args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    device = resolve_device(settings.device)
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(settings.seed + 1)
    batch = torch.randn(settings.batch, settings.seq, settings.d_model, generator=generator)
    batch = batch.to(device=device, dtype=DTYPES[settings.dtype])
    rows = []
    with cpu_threads(settings.threads), fastest_sdpa(device):
        for model_mode in args.model_modes:
            for grad_mode in args.grad_modes:
                rows += run_group(settings, model_mode, grad_mode, args.causal, batch)
    result = {
        "kind": "inference",
        "schema": "memopt-bench/1",
        "environment": environment(device, settings.threads),
        "arguments": {**asdict(settings), "model_modes": args.model_modes, "grad_modes": args.grad_modes, "causal": args.causal},
        "columns": [*ROW_COLUMNS, *EXTRA_COLUMNS],
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    print(run_header(result["environment"]))
    print(
        f"{settings.layers} layers, d_model {settings.d_model}, {settings.n_heads} heads, d_ff {settings.d_ff}, batch "
        f"{settings.batch} x seq {settings.seq}, {settings.dtype}, {'causal' if args.causal else 'not causal'}, train-mode "
        f"dropout {settings.dropout}; forward only, up to {settings.repeats} interleaved rounds\n"
    )
    print(markdown_table(rows))
    save_run(result, args.out, "inference", settings.preset, settings.device, plot=False)
    return 0 if all(r["status"] == "ok" and r["output_check"] != "MISMATCH" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
