"""What is eating my memory? The allocator's view now, and an OOM explained with the estimator."""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import asdict, dataclass, field

import torch

from memopt.estimate import MICRO_BATCH_UPPER, ModelConfig, check_memory_bytes, choice_label, estimate, fit_choices
from memopt.estimate import fits, max_micro_batch

__all__ = ["MemoryReport", "OOMDiagnosis", "diagnose_oom", "memory_report"]

_GiB = 2**30


@dataclass
class MemoryReport:
    """Memory of one device, in bytes.

    On CUDA: ``allocated`` (live tensors), ``reserved`` (held by the caching allocator),
    ``peak_allocated`` (since the last ``torch.cuda.reset_peak_memory_stats``), ``fragmentation``
    (reserved but not allocated: cached blocks a new tensor may or may not fit in),
    ``largest_free_block`` (the largest cached free block: the biggest tensor that fits without
    asking the driver for more), ``total`` and ``free`` (the device's, from ``cudaMemGetInfo``).
    On CPU: ``allocated`` is the process's resident set size, ``peak_allocated`` its peak RSS;
    the allocator fields are ``None``.
    """

    device: str
    allocated: int
    peak_allocated: int
    reserved: int | None = None
    fragmentation: int | None = None
    largest_free_block: int | None = None
    total: int | None = None
    free: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        def gib(v):
            return "n/a" if v is None else f"{v / _GiB:.3f} GiB"

        if self.device == "cpu":
            lines = [f"device cpu (no CUDA allocator): process RSS {gib(self.allocated)}, "
                     f"peak RSS {gib(self.peak_allocated)}"]
        else:
            lines = [
                f"device {self.device}",
                f"  allocated           {gib(self.allocated)}",
                f"  reserved            {gib(self.reserved)}",
                f"  peak allocated      {gib(self.peak_allocated)}",
                f"  fragmentation       {gib(self.fragmentation)}  (reserved - allocated)",
                f"  largest free block  {gib(self.largest_free_block)}",
                f"  device free / total {gib(self.free)} / {gib(self.total)}",
            ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _current_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return _peak_rss()


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _largest_free_block(device: torch.device) -> int:
    largest = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != device.index:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                largest = max(largest, block.get("size", 0))
    return largest


def memory_report(device=None) -> MemoryReport:
    """The memory of ``device`` now (default: the current CUDA device, else the CPU process)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"memopt.memory_report: device must be a torch.device, a str or an int, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"memopt.memory_report: device must name a device ('cpu', 'cuda:0'), got {device!r}") from error
    if device.type == "cpu":
        rss = _current_rss()
        return MemoryReport(device="cpu", allocated=rss, peak_allocated=max(rss, _peak_rss()),
                            notes=["CPU tensors come from the system allocator: figures are the whole "
                                   "process's resident memory, not tensor bytes"])
    if device.type != "cuda":
        raise ValueError(f"memopt.memory_report: device must be a CUDA device or 'cpu', got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device} requested but torch.cuda.is_available() is False")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemoryReport(device=str(device), allocated=allocated, peak_allocated=torch.cuda.max_memory_allocated(device),
                        reserved=reserved, fragmentation=reserved - allocated,
                        largest_free_block=_largest_free_block(device), total=total, free=free)


# CUDA's caching allocator says "Tried to allocate 2.00 GiB", the CPU allocator "you tried to
# allocate 4503599627370496 bytes".
_SIZE = re.compile(r"[Tt]ried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB|bytes)\b")
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass
class OOMDiagnosis:
    """An out-of-memory error explained.

    Attributes:
        requested_bytes: the failed allocation, parsed from the message (``None`` if absent).
        memory_bytes: the memory the estimate was held against.
        estimated_bytes: the estimator's total for ``config``.
        largest: the three largest consumers ``(name, bytes)`` per the estimator.
        fits: ``{choice: largest micro-batch that fits}`` for every ``(policy, offload)`` of
            ``memopt.estimate.fit_choices()`` and the config's own, named by ``choice_label``
            (0: none fits; ``memopt.estimate.MICRO_BATCH_UPPER``: at least that many).
        suggestions: readable advice, largest saving first.
    """

    message: str
    requested_bytes: int | None = None
    memory_bytes: int | None = None
    estimated_bytes: int | None = None
    largest: list[tuple[str, int]] = field(default_factory=list)
    fits: dict[str, int] = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"out of memory: {self.message}"]
        if self.requested_bytes is not None:
            lines.append(f"  failed allocation: {self.requested_bytes / _GiB:.3f} GiB")
        if self.estimated_bytes is not None:
            lines.append(f"  estimated peak: {self.estimated_bytes / _GiB:.3f} GiB of "
                         f"{self.memory_bytes / _GiB:.3f} GiB")
            lines.append("  largest consumers: " + ", ".join(f"{k} {v / _GiB:.3f} GiB" for k, v in self.largest))
        lines += [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)


def diagnose_oom(exc: BaseException, config: ModelConfig | None = None, memory_bytes: int | None = None) -> OOMDiagnosis:
    """Explain ``exc`` (a ``torch.OutOfMemoryError``): what the estimator says takes the memory
    for ``config`` and which policy and micro-batch would fit in ``memory_bytes`` (default: the
    current CUDA device's total memory)."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"exc must be an exception, got {type(exc).__name__}")
    if config is not None and not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a memopt.ModelConfig or None, got {type(config).__name__}")
    if memory_bytes is not None:
        check_memory_bytes(memory_bytes)
    text = str(exc)
    match = _SIZE.search(text)
    diag = OOMDiagnosis(message=text.split("\n")[0],
                        requested_bytes=int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None)
    if config is None:
        diag.suggestions.append("pass config=memopt.ModelConfig(...) to see what takes the memory and what fits")
        return diag
    if memory_bytes is None:
        if not torch.cuda.is_available():
            raise ValueError("memory_bytes is required without a CUDA device")
        memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    est = estimate(config)
    diag.memory_bytes, diag.estimated_bytes = int(memory_bytes), est.total_bytes
    diag.largest = est.largest(3)
    # The config's own (policy, offload) too: "full" or "none" offloaded is not one of fit_choices().
    for policy, offload in dict.fromkeys([*fit_choices(), (config.policy, config.offload)]):
        diag.fits[choice_label(policy, offload)] = max_micro_batch(memory_bytes, config, policy=policy, offload=offload)
    current = config.micro_batch
    budget = config.host_memory_bytes
    if budget is not None and est.host_bytes > budget:  # the device total alone would read as fitting
        diag.suggestions.append(
            f"the offloaded activations need {est.host_bytes / _GiB:.2f} GiB of host memory, over the "
            f"host_memory_bytes budget of {budget / _GiB:.2f} GiB")
    fitting_now = [p for p, b in diag.fits.items() if b >= current]
    if fits(est, memory_bytes):  # the config itself, whether or not fit_choices() offers its (policy, offload)
        diag.suggestions.append(
            f"the estimate fits ({est.total_bytes / _GiB:.2f} GiB): look for memory outside the model "
            "(other processes, fragmentation: memopt.memory_report(), tensors kept across steps)")
    elif fitting_now:
        best = max(fitting_now, key=lambda p: diag.fits[p])
        most = diag.fits[best]
        diag.suggestions.append(f"policy {best!r} fits micro-batch {current} "
                                f"(up to {'at least ' if most >= MICRO_BATCH_UPPER else ''}{most})")
    for policy, b in sorted(diag.fits.items(), key=lambda kv: -kv[1]):
        if 0 < b < current:
            diag.suggestions.append(
                f"policy {policy!r}: micro-batch {b} fits; keep the batch with gradient accumulation "
                f"(memopt.AdaptiveBatch(micro_batch={b}))")
    if not any(diag.fits.values()):
        static = sum(v for k, v in est.breakdown.items()
                     if k in ("parameters", "gradients", "master_weights", "optimizer_state"))
        diag.suggestions.append(
            f"no policy fits micro-batch 1: weights, gradients and optimizer state alone take "
            f"{static / _GiB:.2f} GiB; shard them (FSDP/ZeRO), use a smaller optimizer state or a shorter sequence")
    return diag
