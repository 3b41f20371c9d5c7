"""`python -m bench`: train a GPT-style layer stack under every configuration and compare them.

For each configuration in ``bench.configs.default_configs()`` (eager, ``torch.utils.checkpoint``,
PyTorch selective checkpointing, ``torch.compile``, memopt's ``FusedCheckpointBlock`` policies
and ``memopt.wrap``), from the same initial weights and the same batch:

* step time (forward + backward + SGD step): median and p20/p80 over the timed steps after
  warm-up; CUDA events on GPU, ``time.perf_counter`` on CPU; tokens/s from the median. On CPU
  every configuration is built and warmed up first and the timed steps run in interleaved
  rounds (one step of each in turn), so that other jobs on a shared machine slow all rows alike;
  on GPU each configuration's steps run back to back (``--interleave`` / ``--no-interleave``);
* peak GPU memory of one step (``torch.cuda.max_memory_allocated``, GPU only);
* activation memory: bytes the forward leaves alive for the backward, tracked per storage by
  ``bench.memory.LiveTensorTracker`` (any device), and ``saved_bytes``, what autograd's
  saved-tensor hooks see (``memopt.SavedTensorCounter``); parameters and the input excluded;
* gradient sanity: the largest difference of every parameter gradient from the ``eager-math``
  configuration, computed with dropout 0 (dropout masks come from different RNG streams in
  different implementations) on the same weights and batch; beyond the dtype's tolerance the
  row says MISMATCH;
* time and memory as multiples of ``torch-checkpoint``.

The torch rows run ``F.scaled_dot_product_attention`` on the fastest backend the device has
(``sdpa_backends``: cuDNN first on Hopper), so the ratios are against the best PyTorch gives.
``--preset cpu`` and ``--preset cpu-dropout`` are the realistic shapes to iterate on here.

A markdown table goes to stdout, a JSON file and a PNG plot to ``bench/results/`` (the schema is
in bench/README.md). ``--sweep layers|seq`` repeats the comparison over a range and plots the
scaling curves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import memopt
from memopt.ops import cpu_linear
from bench._args import config_names, device_name, int_type, nonnegative_float, positive_ints, probability
from bench.configs import EAGER_REFERENCE, GRAD_REFERENCE, RATIO_REFERENCE, BenchConfig, BuildContext, default_configs, eager_stack
from bench.memory import LiveTensorTracker
from bench.model import make_reference_blocks

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Gradient tolerances on max|grad - grad_ref| / max|grad_ref| (largest over parameters).
# float32/float64 runs compare with eager-math in the same dtype; float32 leaves room for TF32 and
# reordered reductions on GPU.
GRAD_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}
# float16/bfloat16 runs compare with eager-math in float32, and allow twice the error that
# eager-math itself makes in the low dtype (the house rule), never less than these floors.
GRAD_RTOL_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LOW_PRECISION = tuple(GRAD_RTOL_FLOOR)


@dataclass(frozen=True)
class GradReference:
    """The gradients every configuration is checked against, and the tolerance."""

    name: str
    grads: dict
    rtol: float


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Settings:
    """Everything one comparison run depends on (stored in the JSON as its arguments)."""

    preset: str = "default"
    device: str = "auto"
    dtype: str = "float32"
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    seq: int = 128
    batch: int = 2
    layers: int = 4
    dropout: float = 0.1
    warmup: int = 2
    repeats: int = 5
    compile: bool = False
    max_config_seconds: float = 5.0
    seed: int = 0
    # CPU intra-op threads. One by default: on a shared machine a second OpenMP thread that gets
    # descheduled stalls every parallel region (measured here: 11 ms steps became 1100 ms).
    threads: int | None = 1
    # "wall" (perf_counter / CUDA events) or "cpu": the process's CPU time on a CPU run, which
    # other jobs on a shared machine do not inflate by descheduling it (use with one thread).
    clock: str = "wall"
    sweep: str | None = None
    sweep_values: tuple[int, ...] = ()
    # Time the configurations in interleaved rounds (None: on CPU only; see ``time_prepared``).
    interleave: bool | None = None


PRESETS: dict[str, Settings] = {
    "default": Settings(),
    "tiny": Settings(
        preset="tiny", d_model=32, n_heads=2, d_ff=64, seq=16, batch=2, layers=2, warmup=1, repeats=2,
        max_config_seconds=5.0,
    ),
    # Realistic proportions for iterating on this 2-core machine (issue 14): under a minute each.
    # Up to 12 interleaved rounds (5 left memopt-full / torch-checkpoint +-0.05 from run to run);
    # max_config_seconds keeps each under a minute: the cpu preset's ~0.3 s steps fit 12 rounds,
    # cpu-dropout's ~0.6 s steps about 6.
    "cpu": Settings(
        preset="cpu", d_model=512, n_heads=8, d_ff=2048, seq=256, batch=2, layers=4, dropout=0.0, threads=2,
        repeats=12, max_config_seconds=4.0,
    ),
    "cpu-dropout": Settings(
        preset="cpu-dropout", d_model=384, n_heads=6, d_ff=1536, seq=512, batch=2, layers=4, dropout=0.1, threads=2,
        repeats=12, max_config_seconds=4.0,
    ),
    # Below the presets above the block is host-bound (Python around its autograd nodes): the
    # shape where memopt's "none" crossed eager's step on this machine (d_model 128 x 128 tokens,
    # one thread), to track that overhead with the harness. Steps of ~10 ms: 40 rounds.
    "cpu-small": Settings(
        preset="cpu-small", d_model=128, n_heads=4, d_ff=512, seq=64, batch=2, layers=4, dropout=0.0, threads=1,
        repeats=40, max_config_seconds=3.0,
    ),
    "h200": Settings(
        preset="h200", device="cuda", dtype="bfloat16", d_model=2048, n_heads=16, d_ff=8192, seq=2048, batch=4,
        layers=4, warmup=3, repeats=10, compile=True, max_config_seconds=30.0, threads=None,
    ),
}

SWEEP_DEFAULTS = {
    "default": {"layers": (1, 2, 4, 8), "seq": (64, 128, 256)},
    "tiny": {"layers": (1, 2), "seq": (8, 16)},
    "cpu": {"layers": (2, 4, 8), "seq": (128, 256, 512)},
    "cpu-dropout": {"layers": (2, 4, 8), "seq": (256, 512, 1024)},
    "cpu-small": {"layers": (2, 4, 8), "seq": (16, 64, 256)},
    "h200": {"layers": (2, 4, 8), "seq": (1024, 2048, 4096)},
}


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a device with an explicit index on GPU, so that
    its string matches ``str(tensor.device)`` (``"cuda:0"``), which memory accounting keys on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"bench: --device {name} was asked for but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def git_commit() -> str:
    """The commit a result was measured at: ``MEMOPT_COMMIT`` when set, else ``git rev-parse HEAD``
    (``-dirty`` with uncommitted changes to tracked files), else ``"unknown"``.

    The variable comes first: the GPU machine gets a copy of the work tree whose ``.git``, where
    there is one, can be a stale copy from an earlier session (its results once named a commit
    two sessions old), and ``bench/device_check.sh`` is run with ``MEMOPT_COMMIT`` set.
    """
    given = os.environ.get("MEMOPT_COMMIT", "").strip()
    if given:
        return given
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_details() -> dict:
    """The CPU a result was measured on: its model name, the instruction set ATen's (and memopt's)
    CPU kernels run (``torch.backends.cpu.get_cpu_capability()``) and the per-level cache sizes
    (Linux's sysfs), since CPU ratios differ from one host to the next (AVX2 or AVX-512, L2 per
    core) and one results file should say which it was."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            caches[f"L{level}{'d' if kind == 'Data' else ''}"] = size
    return {"cpu_model": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_caches": caches}


def run_header(env: dict) -> str:
    """The first line a bench run prints: versions, device, commit (and on CPU the linears' GEMM)."""
    line = f"memopt {env['memopt']} | torch {env['torch']} | triton {env['triton']} | {env['device_name']} | commit {env['commit'][:12]}"
    return line + (f" | CPU linears on {env['cpu_linear']}" if "cpu_linear" in env else "")


def environment(device: torch.device, threads: int | None = None) -> dict:
    """Versions, device, commit and date: the header of every results file (on CPU also the CPU's
    model, instruction set and caches, :func:`cpu_details`)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {threads or torch.get_num_threads()} torch threads)"
    env = {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "memopt": memopt.__version__,
        "memopt_build": memopt.build_info(),
        "device": str(device),
        "device_name": device_name,
        "sdpa_backends": [backend.name for backend in sdpa_backends(device)],
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if device.type == "cpu":
        env.update(cpu_details())
        env["cpu_linear"] = cpu_linear.backend()  # the GEMM memopt's own linears run on (MEMOPT_CPU_LINEAR)
    return env


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


class StepTimer:
    """Times one callable: CUDA events on GPU (no host sync inside the step), perf_counter on CPU
    (``clock="cpu"``: the process's CPU time, ``time.process_time``)."""

    def __init__(self, device: torch.device, clock: str = "wall"):
        self.cuda = device.type == "cuda"
        self.clock = time.process_time if clock == "cpu" else time.perf_counter

    def __call__(self, fn: Callable[[], None]) -> float:
        """Seconds ``fn`` took."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = self.clock()
        fn()
        return self.clock() - t0


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def parameter_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of ``loss_fn(model(x))`` by parameter name, in float32."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def match_names(reference: list[str], names: list[str]) -> dict[str, str]:
    """Map each reference parameter name to the one name in ``names`` equal to it or ending in
    ``"." + it`` (wrappers add prefixes). Raises KeyError naming the first that has no unique match."""
    mapping = {}
    for ref in reference:
        hits = [n for n in names if n == ref or n.endswith("." + ref)]
        if len(hits) != 1:
            raise KeyError(f"parameter {ref!r}: {len(hits)} matching names in the configuration's model")
        mapping[ref] = hits[0]
    return mapping


def compare_grads(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max abs difference, max of per-parameter ``max|diff| / max|reference|``)."""
    mapping = match_names(list(reference), list(grads))
    max_abs, max_rel = 0.0, 0.0
    for ref_name, name in mapping.items():
        diff = (grads[name] - reference[ref_name]).abs().max().item()
        scale = reference[ref_name].abs().max().item()
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return max_abs, max_rel


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:160]


def empty_row(config: BenchConfig, settings: Settings, device: torch.device, status: str) -> dict:
    return {
        "config": config.name,
        "provider": config.provider,
        "description": config.description,
        "mode": "train",
        "status": status,
        "device": str(device),
        "dtype": settings.dtype,
        "sweep": settings.sweep,
        "x": getattr(settings, settings.sweep) if settings.sweep else None,
        "tokens_per_step": settings.batch * settings.seq,
        "steps_timed": 0,
        "first_step_s": None,
        "step_time_ms_median": None,
        "step_time_ms_p20": None,
        "step_time_ms_p80": None,
        "step_times_ms": None,
        "tokens_per_s": None,
        "peak_gpu_bytes": None,
        "activation_bytes": None,
        "activation_host_bytes": None,
        "step_peak_tracked_bytes": None,
        "saved_bytes": None,
        "grad_max_abs_diff": None,
        "grad_max_rel_diff": None,
        "grad_reference": None,
        "grad_rtol": None,
        "grad_check": "n/a",
        "time_vs_checkpoint": None,
        "time_vs_checkpoint_p20": None,
        "time_vs_checkpoint_p80": None,
        "time_vs_eager": None,
        "time_vs_eager_p20": None,
        "time_vs_eager_p80": None,
        "memory_vs_checkpoint": None,
    }


ROW_COLUMNS = tuple(empty_row(BenchConfig("x", "x", "x", lambda ctx: None), Settings(), torch.device("cpu"), "").keys())


@dataclass
class PreparedConfig:
    """One configuration built and warmed up, ready for its timed steps."""

    config: BenchConfig
    row: dict
    model: nn.Module | None = None
    step: Callable[[], None] | None = None
    warm_s: float = math.inf  # the fastest warm-up step (sizes the number of timed steps)
    times: list[float] | None = None


def _step_fn(model: nn.Module, batch: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(batch)).backward()
        optimizer.step()

    return step


def prepare_config(
    config: BenchConfig, ctx: BuildContext, settings: Settings, batch: torch.Tensor, tick: Callable[[], None]
) -> PreparedConfig:
    """Build ``config``'s model and run its first step and warm-up; never raises: failures
    become the row's status (and the result has no step)."""
    prepared = PreparedConfig(config, empty_row(config, settings, ctx.device, "ok"))
    reason = config.unavailable(ctx)
    if reason is not None:
        prepared.row["status"] = f"not available ({reason})"
        return prepared
    try:
        prepared.model = config.build(ctx)
        step = _step_fn(prepared.model, batch)
        timer = StepTimer(ctx.device, settings.clock)
        prepared.row["first_step_s"] = timer(step)
        tick()
        warm = [timer(step) for _ in range(max(settings.warmup - 1, 0))]
        for _ in warm:
            tick()
        prepared.warm_s = min(warm) if warm else prepared.row["first_step_s"]
        prepared.step = step
    except Exception as exc:  # a configuration that breaks is reported, not allowed to stop the run
        prepared.row["status"] = f"error ({_error_text(exc)})"
        prepared.model = None
    return prepared


def _timed_repeats(settings: Settings, step_s: float) -> int:
    return max(1, min(settings.repeats, int(settings.max_config_seconds / max(step_s, 1e-9))))


def time_prepared(prepared: list[PreparedConfig], settings: Settings, device: torch.device, tick: Callable[[], None]) -> None:
    """The timed steps of every prepared configuration, into each one's ``times``.

    Interleaved (``settings.interleave``, the default on CPU): one step of each configuration in
    turn per round, the order alternating between rounds, so that a busy spell on a shared machine
    slows every configuration alike and the ratios between rows stay meaningful. Otherwise (the
    default on GPU, whose timings other jobs do not disturb) each configuration's steps back to back.
    """
    timer = StepTimer(device, settings.clock)
    ready = [p for p in prepared if p.step is not None]
    for p in ready:
        p.times = []
    if not interleaved(settings, device):
        for p in ready:
            _time_steps(p, timer, _timed_repeats(settings, p.warm_s), tick)
        return
    # the rounds share the budget of ``max_config_seconds`` per configuration
    rounds = _timed_repeats(settings, sum(p.warm_s for p in ready) / max(len(ready), 1))
    for i in range(rounds):
        for p in ready if i % 2 == 0 else reversed(ready):
            _time_steps(p, timer, 1, tick)


def _time_steps(p: PreparedConfig, timer: StepTimer, count: int, tick: Callable[[], None]) -> None:
    if p.step is None:
        return
    try:
        for _ in range(count):
            p.times.append(timer(p.step))
            tick()
    except Exception as exc:
        p.row["status"] = f"error ({_error_text(exc)})"
        p.step = p.model = None


def interleaved(settings: Settings, device: torch.device) -> bool:
    return device.type == "cpu" if settings.interleave is None else settings.interleave


def finish_config(
    p: PreparedConfig, ctx: BuildContext, settings: Settings, batch: torch.Tensor, reference: GradReference | None
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Fill ``p``'s row from its timed steps, measure its memory and check its gradients; frees
    its model. Never raises."""
    device = ctx.device
    row = p.row
    if p.step is None:
        return row, None
    grads = None
    try:
        times = p.times
        row["steps_timed"] = len(times)
        row["step_time_ms_median"] = quantile(times, 0.5) * 1e3
        row["step_time_ms_p20"] = quantile(times, 0.2) * 1e3
        row["step_time_ms_p80"] = quantile(times, 0.8) * 1e3
        row["step_times_ms"] = [t * 1e3 for t in times]
        row["tokens_per_s"] = row["tokens_per_step"] / quantile(times, 0.5)
        model, step = p.model, p.step
        if device.type == "cuda":
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)

        if p.config.tracks_memory:
            model.zero_grad(set_to_none=True)
            excluded = [*model.parameters(), *model.buffers(), batch]
            with LiveTensorTracker(exclude=excluded) as tracker:
                with memopt.SavedTensorCounter(exclude=excluded) as counter:
                    out = model(batch)
                row["activation_bytes"] = tracker.live_bytes(str(device))
                row["activation_host_bytes"] = tracker.live_bytes("cpu") if device.type != "cpu" else 0
                row["saved_bytes"] = counter.total_bytes
                loss_fn(out).backward()
                del out
                row["step_peak_tracked_bytes"] = tracker.peak_bytes(str(device))
        p.model = p.step = None
        del model, step

        sanity_model = p.config.build(ctx.with_dropout(0.0))
        grads = parameter_grads(sanity_model, batch)
        if reference is not None:
            abs_diff, rel_diff = compare_grads(reference.grads, grads)
            row.update(grad_max_abs_diff=abs_diff, grad_max_rel_diff=rel_diff, grad_reference=reference.name, grad_rtol=reference.rtol)
            row["grad_check"] = "ok" if rel_diff <= reference.rtol else "MISMATCH"
        del sanity_model
    except Exception as exc:  # a configuration that breaks is reported, not allowed to stop the run
        row["status"] = f"error ({_error_text(exc)})"
        p.model = p.step = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, grads


def first_grad_reference(
    name: str, grads: dict[str, torch.Tensor], dtype: torch.dtype, fp32_grads: dict[str, torch.Tensor] | None
) -> GradReference:
    """The reference set by the first configuration that ran (``eager-math`` normally): its own
    gradients in float32/float64 runs; in float16/bfloat16 runs the float32 gradients, with twice
    its low-precision error as the tolerance."""
    if fp32_grads is None:
        return GradReference(name, grads, GRAD_RTOL[dtype])
    _, baseline_error = compare_grads(fp32_grads, grads)
    return GradReference(f"{name} in float32", fp32_grads, max(2 * baseline_error, GRAD_RTOL_FLOOR[dtype]))


def time_ratio(row: dict, ref: dict, paired: bool) -> tuple[float, float | None, float | None]:
    """``row``'s step time over ``ref``'s, as ``(ratio, p20, p80)``. ``paired`` (interleaved
    rounds, the CPU default): the median over rounds of the two steps timed in the same round, so
    that a slow spell of a shared machine divides out instead of landing on one row, with the 20th
    and 80th percentiles of those per-round ratios (how far one run can be trusted); otherwise the
    ratio of the medians, and no spread."""
    times, ref_times = row["step_times_ms"] or [], ref["step_times_ms"] or []
    if paired and times and len(times) == len(ref_times):
        ratios = [t / r for t, r in zip(times, ref_times)]
        return quantile(ratios, 0.5), quantile(ratios, 0.2), quantile(ratios, 0.8)
    return row["step_time_ms_median"] / ref["step_time_ms_median"], None, None


def add_ratios(rows: list[dict], paired: bool = False) -> None:
    """Time and memory of every row as multiples of the torch-checkpoint row (GPU peak memory on
    GPU, tracked activation bytes elsewhere), and time as a multiple of the eager-sdpa row's (the
    baseline of memopt "none" and "selective"); ``paired``: see :func:`time_ratio`."""
    eager = next((r for r in rows if r["config"] == EAGER_REFERENCE and r["step_time_ms_median"]), None)
    if eager is not None:
        for row in rows:
            if row["step_time_ms_median"]:
                row["time_vs_eager"], row["time_vs_eager_p20"], row["time_vs_eager_p80"] = time_ratio(row, eager, paired)
    ref = next((r for r in rows if r["config"] == RATIO_REFERENCE and r["step_time_ms_median"]), None)
    if ref is None:
        return
    memory_key = "peak_gpu_bytes" if ref["peak_gpu_bytes"] else "activation_bytes"
    for row in rows:
        if row["step_time_ms_median"]:
            row["time_vs_checkpoint"], row["time_vs_checkpoint_p20"], row["time_vs_checkpoint_p80"] = time_ratio(
                row, ref, paired
            )
        if row[memory_key] is not None and ref[memory_key]:
            row["memory_vs_checkpoint"] = row[memory_key] / ref[memory_key]


def run_comparison(
    settings: Settings,
    configs: list[BenchConfig] | None = None,
    progress: bool = True,
) -> list[dict]:
    """Measure every configuration once at ``settings``; one row each (see ``ROW_COLUMNS``).

    The first configuration that runs provides the gradient reference when ``eager-math`` is
    not among ``configs``.
    """
    with cpu_threads(settings.threads), fastest_sdpa(resolve_device(settings.device)):
        return _run_comparison(settings, default_configs() if configs is None else configs, progress)


def sdpa_backends(device: torch.device) -> list[SDPBackend]:
    """SDPA's backends in the order the torch rows try them, the fastest for the device first.

    On Hopper and later GPUs cuDNN's fused attention is the fastest SDPA kernel (about twice the
    default flash backend forward + backward at head_dim 128 on the H200), but torch does not try
    it first by default; elsewhere flash (on CPU: the CPU flash kernel), then memory-efficient,
    then math. A backend that cannot take a call (dtype, head_dim, dropout) passes it to the next.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if device.type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def fastest_sdpa(device: torch.device):
    """A context in which ``F.scaled_dot_product_attention`` tries :func:`sdpa_backends` in order
    (torch versions without ``set_priority`` only restrict the set: their own order applies)."""
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return sdpa_kernel(sdpa_backends(device), set_priority=True)
    return sdpa_kernel(sdpa_backends(device))


@contextlib.contextmanager
def cpu_threads(threads: int | None):
    """Run with ``threads`` torch intra-op threads (unchanged when None), then restore."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_comparison(settings: Settings, configs: list[BenchConfig], progress: bool) -> list[dict]:
    device = resolve_device(settings.device)
    dtype = DTYPES[settings.dtype]
    blocks = make_reference_blocks(settings.layers, settings.d_model, settings.n_heads, settings.d_ff, settings.dropout, settings.seed)
    ctx = BuildContext(blocks, settings.d_model, settings.n_heads, settings.d_ff, settings.dropout, device, dtype, settings.compile)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    batch = torch.randn(settings.batch, settings.seq, settings.d_model, generator=generator).to(device=device, dtype=dtype)

    ordered = sorted(configs, key=lambda c: c.name != GRAD_REFERENCE)
    steps_per_config = settings.warmup + settings.repeats
    bar = None
    if progress:
        from tqdm import tqdm

        label = f"{settings.sweep}={getattr(settings, settings.sweep)}" if settings.sweep else "bench"
        bar = tqdm(total=steps_per_config * len(ordered), desc=label, file=sys.stderr, leave=False)
    fp32_grads = None
    if dtype in LOW_PRECISION:
        fp32_grads = parameter_grads(eager_stack(replace(ctx, dtype=torch.float32, dropout=0.0), "math"), batch.float())
    tick = bar.update if bar is not None else (lambda *_: None)
    rows_by_name = {}
    reference = None
    if interleaved(settings, device):
        # every model built and warmed up first, then the timed rounds across all of them
        prepared = []
        for config in ordered:
            if bar is not None:
                bar.set_postfix_str(config.name)
            prepared.append(prepare_config(config, ctx, settings, batch, tick))
        if bar is not None:
            bar.set_postfix_str("timed rounds")
        time_prepared(prepared, settings, device, tick)
    for i, config in enumerate(ordered):
        if not interleaved(settings, device):
            if bar is not None:
                bar.set_postfix_str(config.name)
            one = prepare_config(config, ctx, settings, batch, tick)
            time_prepared([one], settings, device, tick)
        else:
            one = prepared[i]
        row, grads = finish_config(one, ctx, settings, batch, reference)
        if reference is None and grads is not None:
            reference = first_grad_reference(config.name, grads, dtype, fp32_grads)
            abs_diff, rel_diff = compare_grads(reference.grads, grads)
            row.update(grad_max_abs_diff=abs_diff, grad_max_rel_diff=rel_diff, grad_reference=reference.name, grad_rtol=reference.rtol)
            row["grad_check"] = "reference"
        rows_by_name[config.name] = row
    if bar is not None:
        bar.close()
    rows = [rows_by_name[c.name] for c in configs]
    add_ratios(rows, paired=interleaved(settings, device))
    return rows


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio_cell(row: dict, key: str) -> str:
    """``0.94 (0.91-0.97)``: the ratio and, from interleaved rounds, the p20-p80 of the per-round
    ratios (a reference row's own ratio is exactly 1 and has no spread to show)."""
    low, high = row.get(f"{key}_p20"), row.get(f"{key}_p80")
    if low is None or high is None or low == high:
        return _num(row[key], ".2f")
    return f"{row[key]:.2f} ({low:.2f}-{high:.2f})"


def markdown_table(rows: list[dict]) -> str:
    """The comparison as a markdown table (one line per configuration, unavailable ones too)."""
    header = (
        "| config | step ms (p20-p80) | tokens/s | peak GPU MiB | activations MiB | saved (hooks) MiB "
        "| grad rel diff | grad check | time / eager | time / ckpt | memory / ckpt |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['status']} | | | | | | | | | |")
            continue
        act = _mib(r["activation_bytes"])
        if r["activation_host_bytes"]:
            act += f" (+{_mib(r['activation_host_bytes'])} host)"
        time_cell = f"{r['step_time_ms_median']:.1f} ({r['step_time_ms_p20']:.1f}-{r['step_time_ms_p80']:.1f})"
        lines.append(
            f"| {r['config']} | {time_cell} | {r['tokens_per_s']:,.0f} | {_mib(r['peak_gpu_bytes'])} | {act} "
            f"| {_mib(r['saved_bytes'])} | {_num(r['grad_max_rel_diff'], '.1e')} | {r['grad_check']} "
            f"| {_ratio_cell(r, 'time_vs_eager')} | {_ratio_cell(r, 'time_vs_checkpoint')} "
            f"| {_num(r['memory_vs_checkpoint'], '.2f')} |"
        )
    return "\n".join(lines)


def write_results(result: dict, out: Path, stem: str) -> Path:
    """Write ``result`` to ``out`` when it names a ``.json`` file, else as ``<stem>.json`` in the
    folder ``out``; returns the file's path."""
    out = Path(out)
    path = out if out.suffix == ".json" else out / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def save_run(result: dict, out_dir: Path, kind: str, preset: str, device: str, plot: bool) -> Path:
    """Write ``result`` as ``<kind>-<preset>-<device type>-<date>.json`` in ``out_dir`` (or to
    ``out_dir`` itself when it names a ``.json`` file), print its path and, with ``plot``, the
    plots ``bench.plot`` draws from it; returns the JSON's path."""
    stamp = result["environment"]["date"].replace("-", "").replace(":", "")
    path = write_results(result, out_dir, f"{kind}-{preset}-{resolve_device(device).type}-{stamp}")
    print(f"\nresults: {path}")
    if plot:
        from bench.plot import plot_file

        for png in plot_file(path):
            print(f"plot: {png}")
    return path


OUT_HELP = "JSON file, or a folder for {kind}-<preset>-<device>-<date>.json and its plot (default bench/results/)"


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Compare memory saved against time paid for memopt and PyTorch's checkpointing on a GPT-style layer stack.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default", help="sizes and repeats (default: a CPU run of about 25 s on 2 cores)")
    parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    for name in ("d_model", "n_heads", "d_ff", "seq", "batch", "layers", "warmup", "repeats", "seed", "threads"):
        parser.add_argument("--" + name.replace("_", "-"), type=int_type(name), dest=name)
    parser.add_argument("--dropout", type=probability)
    parser.add_argument("--clock", choices=("wall", "cpu"), help="CPU runs: wall-clock time (default) or the process's CPU time, robust to other jobs on a shared machine (with --threads 1)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None, help="time the configurations in interleaved rounds (default: on CPU, where other jobs share the machine)")
    parser.add_argument("--max-config-seconds", type=nonnegative_float, dest="max_config_seconds", help="fewer timed steps for slower configurations")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="include torch.compile (default: on in the h200 preset)")
    parser.add_argument("--configs", type=config_names, help="comma-separated configuration names to run (default: all)")
    parser.add_argument("--sweep", choices=("layers", "seq"), help="repeat the comparison over a range of depths or sequence lengths")
    parser.add_argument("--sweep-values", type=positive_ints, help="comma-separated values for --sweep (default: from the preset)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=OUT_HELP.format(kind="compare"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    settings = PRESETS[args.preset]
    overrides = {
        k: getattr(args, k)
        for k in ("device", "dtype", "d_model", "n_heads", "d_ff", "seq", "batch", "layers", "warmup", "repeats", "seed", "threads", "dropout", "clock", "max_config_seconds", "compile", "sweep", "interleave")
        if getattr(args, k) is not None
    }
    settings = replace(settings, **overrides)
    if args.sweep_values and not settings.sweep:
        parser.error("--sweep-values needs --sweep layers or --sweep seq")
    if settings.sweep:
        values = args.sweep_values or SWEEP_DEFAULTS[settings.preset][settings.sweep]
        settings = replace(settings, sweep_values=values)
    return settings, args


SHAPE_ARGUMENTS = ("dtype", "d_model", "n_heads", "d_ff", "seq", "batch", "layers", "threads", "dropout")


def add_shape_arguments(parser, device: bool = True) -> None:
    """The harness's shape options (``--dtype``, ``--d-model``, ..., ``--dropout``, and
    ``--device``) for the tools that run its configurations on a preset (profile, census)."""
    if device:
        parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    for name in SHAPE_ARGUMENTS[1:-1]:
        parser.add_argument("--" + name.replace("_", "-"), type=int_type(name), dest=name)
    parser.add_argument("--dropout", type=probability)


def preset_settings(args, **fixed) -> Settings:
    """``args.preset``'s settings with the shape options ``args`` sets, and ``fixed`` on top."""
    names = SHAPE_ARGUMENTS + (("device",) if hasattr(args, "device") else ())
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    return replace(PRESETS[args.preset], **{**overrides, **fixed})


def configs_by_name(names: str, tool: str) -> dict[str, BenchConfig]:
    """The harness configurations ``names`` (comma-separated) lists, in that order; exits naming
    the unknown ones."""
    known = {c.name: c for c in default_configs()}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"{tool}: --configs has unknown names {unknown}; known: {sorted(known)}")
    return {n: known[n] for n in wanted}


def select_configs(names: str | None) -> list[BenchConfig]:
    configs = default_configs()
    if not names:
        return configs
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {c.name for c in configs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"bench: --configs has unknown names {unknown}; known: {sorted(known)}")
    return [c for c in configs if c.name in wanted]


def run(settings: Settings, configs: list[BenchConfig] | None = None, progress: bool = True) -> dict:
    """The whole run (one comparison, or one per sweep value) as the JSON-ready result."""
    device = resolve_device(settings.device)
    env = environment(device, settings.threads)
    if settings.sweep:
        rows = []
        for value in settings.sweep_values:
            rows += run_comparison(replace(settings, **{settings.sweep: value}), configs, progress)
    else:
        rows = run_comparison(settings, configs, progress)
    return {
        "kind": f"sweep-{settings.sweep}" if settings.sweep else "compare",
        "schema": "memopt-bench/1",
        "environment": env,
        "arguments": asdict(settings),
        "columns": list(ROW_COLUMNS),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    configs = select_configs(args.configs)
    t0 = time.perf_counter()
    result = run(settings, configs, progress=not args.no_progress)
    result["wall_s"] = time.perf_counter() - t0
    env = result["environment"]
    print(run_header(env))
    print(
        f"GPT stack: {settings.layers} layers, d_model {settings.d_model}, {settings.n_heads} heads, d_ff {settings.d_ff}, "
        f"batch {settings.batch} x seq {settings.seq}, {settings.dtype}, dropout {settings.dropout}; "
        f"{settings.warmup} warm-up + up to {settings.repeats} timed steps per configuration"
    )
    if settings.sweep:
        for value in settings.sweep_values:
            print(f"\n### {settings.sweep} = {value}\n")
            print(markdown_table([r for r in result["rows"] if r["x"] == value]))
    else:
        print()
        print(markdown_table(result["rows"]))
    save_run(result, args.out, result["kind"], settings.preset, settings.device, plot=not args.no_plot)
    print(f"total {result['wall_s']:.1f} s")
    return 0
