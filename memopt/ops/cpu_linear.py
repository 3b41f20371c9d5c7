"""The GEMM under the float32 CPU linears memopt runs itself: ATen's (MKL) or oneDNN's.

Note:
    memopt never runs a kernel slower than the fastest one PyTorch offers for the same job. For
    a float32 linear on CPU PyTorch offers two: ``F.linear`` / ``torch.mm`` (MKL's sgemm) and
    oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, what torch.compile's CPU
    backend fuses linears into). Which is faster depends on the host; the rule, its measurements
    and the ``MEMOPT_CPU_LINEAR`` override live in ``csrc/cpu_linear.cpp``, which also serves
    the C++ nodes of ``memopt.norm_linear`` and ``memopt.act_linear``. This module applies the
    same answer (``backend()``) to the linears memopt runs from Python: the block's, with its size
    floor (oneDNN only for
    products of ``min_multiply_adds()`` multiply-adds and up, its per-call cost outweighs it below).
    The rule depends on the host and the product's shape only,
    never on timing, so a process computes the same bits in every step and under every policy
    (a forward and its recompute take the same kernel). Under ``torch.compile``, for other
    dtypes and devices, and for tensor subclasses, these are the plain ATen calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memopt import _extension

try:
    _ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default
    _ONEDNN_LINEAR_ADD = torch.ops.mkldnn._linear_pointwise.binary
except (AttributeError, RuntimeError):  # a torch build without oneDNN
    _ONEDNN_LINEAR = _ONEDNN_LINEAR_ADD = None

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# glibc's largest dynamic mmap threshold on 64-bit hosts: a freed buffer below it comes straight
# back from the heap; above it a fresh one is mapped anew and page-faulted (kFreshMappingBytes in
# csrc/new_output.h, the one definition).
_HEAP_BYTES = _extension._C.FRESH_MAPPING_BYTES


def backend() -> str:
    """``"onednn"`` or ``"aten"``: what memopt's own float32 CPU linears run on in this process."""
    return _extension._C.cpu_linear_backend()


def min_multiply_adds() -> int:
    """The fewest multiply-adds (``m * k * n``) of a product that runs on oneDNN where
    :func:`backend` is ``"onednn"``: 2^24 under the host rule, 0 when ``MEMOPT_CPU_LINEAR=onednn``
    forces it for every product."""
    return _extension._C.cpu_linear_min_multiply_adds()


def _onednn(multiply_adds: int, *tensors: torch.Tensor) -> bool:
    """Whether a product of ``multiply_adds`` multiply-adds over ``tensors`` runs on oneDNN."""
    if _ONEDNN_LINEAR is None or torch.compiler.is_compiling() or backend() != "onednn":
        return False
    if multiply_adds < min_multiply_adds():
        return False
    if torch.is_autocast_enabled("cpu"):  # F.linear casts under autocast; the oneDNN op would not
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # the oneDNN op has no derivative: a graph being built takes ATen's
    if not torch.backends.mkldnn.is_available() or not torch._C._get_mkldnn_enabled():
        return False
    return all(
        type(t) in _PLAIN and t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() > 0 for t in tensors
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: a new tensor."""
    multiply_adds = x.numel() // max(x.shape[-1], 1) * weight.numel() if x.dim() > 0 else 0
    if _onednn(multiply_adds, x, weight, *(() if bias is None else (bias,))) and (bias is None or bias.is_contiguous()):
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], None)
    return F.linear(x, weight, bias)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` (m, k) and ``b`` (k, n): a new tensor (oneDNN reads ``b.t()``'s
    strides, no copy)."""
    if a.dim() == 2 and b.dim() == 2 and _onednn(a.shape[0] * b.numel(), a, b):
        return _ONEDNN_LINEAR(a, b.t(), None, "none", [], None)
    return a @ b


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + a @ b`` (``torch.addmm(c, a, b)``) for 2-D ``a``, ``b`` and ``c`` of the product's
    shape: a new tensor (oneDNN adds ``c`` as the product is written)."""
    if (a.dim() == 2 and b.dim() == 2 and c.shape == (a.shape[0], b.shape[1]) and c.is_contiguous()
            and _onednn(a.shape[0] * b.numel(), a, b, c)):
        return _ONEDNN_LINEAR_ADD(a, c, b.t(), None, "add")
    return torch.addmm(c, a, b)


def mm_in_new_buffer(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> bool:
    """Whether ``a @ b`` should go to ``mm``'s new tensor rather than ``torch.mm(.., out=scratch)``,
    for a caller that owns ``scratch`` (of the product's size) and needs it no more: it then drops
    every reference to ``scratch`` first, so one such buffer lives at a time either way."""
    return a.dim() == 2 and b.dim() == 2 and _onednn(a.shape[0] * b.numel(), a, b) and scratch.nbytes < _HEAP_BYTES
