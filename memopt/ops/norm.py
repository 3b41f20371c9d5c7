"""layer_norm and rms_norm with an optional fused residual add, and the fused norm -> linear.

Layers: kernels in ``csrc/norm.cpp`` (CPU) and ``csrc/norm_cuda.cu`` (CUDA), registered as
``torch.ops.memopt.{layer_norm,rms_norm}_{fwd,bwd}`` (and ``_bwd_inplace``, which writes grad_x over
grad_y, for callers that made grad_y themselves: the norm_linear node, the block's backward);
the fake impls below let ``torch.compile`` trace them. The forward returns per-row statistics
(mean, rstd); the backward rebuilds the normalised input from the input and the statistics
instead of keeping it, and with ``return_y=True`` also rebuilds the normalised output.
:func:`layer_norm`, :func:`rms_norm` and :func:`norm_linear` call the differentiable ops
``torch.ops.memopt.{layer_norm,rms_norm,norm_linear}``, whose autograd nodes are C++
(``csrc/norm_autograd.cpp``: they save x or residual_out, the statistics and the parameters;
second derivatives exact), so no Python runs in their forward or backward. ``norm_linear``'s node
drops the normalised output that ``F.linear`` would otherwise keep for its weight gradient.
``layer_norm_ref`` / ``rms_norm_ref`` are the plain PyTorch references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memopt import _extension
from memopt.ops._common import call_unchecked, check_eps, check_fake_devices, check_float_x, check_linear, check_tensor

_NORMS = ("layernorm", "rmsnorm")


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _absent(x: torch.Tensor) -> torch.Tensor:
    """The empty tensor a kernel returns for an output that was not asked for."""
    return x.new_empty(0)


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_fake_devices(op: str, x, **others) -> None:
    check_fake_devices(op, "x", x, **others)


@torch.library.register_fake("memopt::layer_norm_fwd")
def _layer_norm_fwd_fake(x, residual, weight, bias, eps):
    _check_fake_devices("layer_norm", x, residual=residual, weight=weight, bias=bias)
    stat_shape, stat_dtype = x.shape[:-1], _stat_dtype(x)
    residual_out = _like(x) if residual is not None else _absent(x)
    return _like(x), residual_out, x.new_empty(stat_shape, dtype=stat_dtype), x.new_empty(stat_shape, dtype=stat_dtype)


@torch.library.register_fake("memopt::rms_norm_fwd")
def _rms_norm_fwd_fake(x, residual, weight, eps):
    _check_fake_devices("rms_norm", x, residual=residual, weight=weight)
    residual_out = _like(x) if residual is not None else _absent(x)
    return _like(x), residual_out, x.new_empty(x.shape[:-1], dtype=_stat_dtype(x))


def _param_grad_fake(x, param, wanted: bool):
    """A parameter's gradient: [n] in its dtype, or empty when the parameter is absent or its
    gradient was not asked for (return_grad_weight / return_grad_bias False)."""
    return x.new_empty(x.shape[-1], dtype=param.dtype) if param is not None and wanted else _absent(x)


@torch.library.register_fake("memopt::layer_norm_bwd")
def _layer_norm_bwd_fake(grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y, return_grad_weight=True,
                         return_grad_bias=True):
    _check_fake_devices("layer_norm", x, grad_y=grad_y, weight=weight, bias=bias, mean=mean, rstd=rstd,
                        grad_x_extra=grad_x_extra)
    y = _like(x) if return_y else _absent(x)
    return _like(x), _param_grad_fake(x, weight, return_grad_weight), _param_grad_fake(x, bias, return_grad_bias), y


@torch.library.register_fake("memopt::rms_norm_bwd")
def _rms_norm_bwd_fake(grad_y, x, weight, rstd, grad_x_extra, return_y, return_grad_weight=True):
    _check_fake_devices("rms_norm", x, grad_y=grad_y, weight=weight, rstd=rstd, grad_x_extra=grad_x_extra)
    y = _like(x) if return_y else _absent(x)
    return _like(x), _param_grad_fake(x, weight, return_grad_weight), y


@torch.library.register_fake("memopt::layer_norm_bwd_inplace")
def _layer_norm_bwd_inplace_fake(grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y,
                                 return_grad_weight=True, return_grad_bias=True):
    _check_fake_devices("layer_norm", x, grad_y=grad_y, weight=weight, bias=bias, mean=mean, rstd=rstd,
                        grad_x_extra=grad_x_extra)
    y = _like(x) if return_y else _absent(x)
    return _param_grad_fake(x, weight, return_grad_weight), _param_grad_fake(x, bias, return_grad_bias), y


@torch.library.register_fake("memopt::rms_norm_bwd_inplace")
def _rms_norm_bwd_inplace_fake(grad_y, x, weight, rstd, grad_x_extra, return_y, return_grad_weight=True):
    _check_fake_devices("rms_norm", x, grad_y=grad_y, weight=weight, rstd=rstd, grad_x_extra=grad_x_extra)
    y = _like(x) if return_y else _absent(x)
    return _param_grad_fake(x, weight, return_grad_weight), y


@torch.library.register_fake("memopt::layer_norm")
def _layer_norm_fake(x, residual, weight, bias, eps):
    _check_fake_devices("layer_norm", x, residual=residual, weight=weight, bias=bias)
    return _like(x), _like(x) if residual is not None else _absent(x)


@torch.library.register_fake("memopt::rms_norm")
def _rms_norm_fake(x, residual, weight, eps):
    _check_fake_devices("rms_norm", x, residual=residual, weight=weight)
    return _like(x), _like(x) if residual is not None else _absent(x)


@torch.library.register_fake("memopt::norm_linear")
def _norm_linear_fake(x, residual, norm_weight, norm_bias, linear_weight, linear_bias, rms, eps):
    _check_fake_devices("norm_linear", x, residual=residual, norm_weight=norm_weight, norm_bias=norm_bias,
                        linear_weight=linear_weight, linear_bias=linear_bias)
    # F.linear on fake tensors gives the dtype autocast would (the op runs its linear under it)
    out = F.linear(_like(x), linear_weight, linear_bias)
    return out, _like(x) if residual is not None else _absent(x)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _norm_fwd(is_rms: bool, x, residual, weight, bias, eps):
    """(y, residual_out or None, mean or None, rstd) from the registered forward op."""
    if is_rms:
        y, residual_out, rstd = torch.ops.memopt.rms_norm_fwd(x, residual, weight, eps)
        mean = None
    else:
        y, residual_out, mean, rstd = torch.ops.memopt.layer_norm_fwd(x, residual, weight, bias, eps)
    return y, (residual_out if residual is not None else None), mean, rstd


def _norm_bwd(is_rms: bool, grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y: bool,
              grad_y_is_scratch: bool = False, need_weight: bool = True, need_bias: bool = True):
    """(grad_x, grad_weight or None, grad_bias or None, y or None) from the registered backward op.

    ``grad_y_is_scratch``: the caller made ``grad_y`` (a matmul output) and needs it no more, so
    grad_x is written over it (``*_norm_bwd_inplace``) instead of into a new tensor.
    ``need_weight`` / ``need_bias`` False (a frozen parameter): that gradient is not computed, and
    is None.
    """
    grad_y, grad_x_extra = grad_y.contiguous(), _contiguous(grad_x_extra)
    need_weight, need_bias = need_weight and weight is not None, need_bias and bias is not None
    if grad_y_is_scratch:
        if is_rms:
            grad_weight, y = torch.ops.memopt.rms_norm_bwd_inplace(
                grad_y, x, weight, rstd, grad_x_extra, return_y, need_weight
            )
            grad_bias = None
        else:
            grad_weight, grad_bias, y = torch.ops.memopt.layer_norm_bwd_inplace(
                grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y, need_weight, need_bias
            )
        grad_x = grad_y
    elif is_rms:
        grad_x, grad_weight, y = torch.ops.memopt.rms_norm_bwd(
            grad_y, x, weight, rstd, grad_x_extra, return_y, need_weight
        )
        grad_bias = None
    else:
        grad_x, grad_weight, grad_bias, y = torch.ops.memopt.layer_norm_bwd(
            grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y, need_weight, need_bias
        )
    return (
        grad_x,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
        y if return_y else None,
    )


def _norm_differentiable(is_rms: bool, x, weight, bias, eps: float) -> torch.Tensor:
    """The norm in differentiable PyTorch ops, in the kernels' statistics dtype, returned in x's
    dtype: the graph a backward under ``create_graph=True`` differentiates."""
    compute = _stat_dtype(x)
    h = x.to(compute)
    if not is_rms:
        h = h - h.mean(-1, keepdim=True)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def _check_public(op: str, x, residual, weight, bias, weight_name: str = "weight", bias_name: str = "bias") -> None:
    check_tensor(op, "x", x)
    check_tensor(op, "residual", residual, optional=True)
    check_tensor(op, weight_name, weight, optional=True)
    check_tensor(op, bias_name, bias, optional=True)
    check_float_x(op, x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"memopt.{op}: x must have at least one dimension and a non-empty last dimension, got shape {list(x.shape)}"
        )
    n = x.shape[-1]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"memopt.{op}: residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.device != x.device:
            raise ValueError(f"memopt.{op}: residual must be on x's device ({x.device}), got {residual.device}")
        if residual.dtype != x.dtype:
            raise ValueError(f"memopt.{op}: residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
    for name, param in ((weight_name, weight), (bias_name, bias)):
        if param is None:
            continue
        if param.dim() != 1 or param.shape[0] != n:
            raise ValueError(f"memopt.{op}: {name} must have shape [{n}] (x.shape[-1]), got {list(param.shape)}")
        if param.device != x.device:
            raise ValueError(f"memopt.{op}: {name} must be on x's device ({x.device}), got {param.device}")
        if param.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"memopt.{op}: {name} must have x's dtype ({x.dtype}) or float32, got {param.dtype}")
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"memopt.{op}: {bias_name} must have the dtype of {weight_name} ({weight.dtype}), got {bias.dtype}")
    _extension.require_cuda_kernels(op, x)


# The public functions call the op before any check (_common.call_unchecked's Note), but for an
# eps that is not a float, which the op would take (True as 1.0): those get the checks first.
# Strided x and residual are not refused: the ops copy them (norm_autograd.cpp), since a raise
# and a retry cost ~80 us a call, more than the copy at 256 x 512; nor are strided or expanded
# weight and bias, which F.layer_norm takes too (copied the same way, so gradients reach the
# tensors they are views of).
_LAYER_NORM = torch.ops.memopt.layer_norm.default
_RMS_NORM = torch.ops.memopt.rms_norm.default
_NORM_LINEAR = torch.ops.memopt.norm_linear.default


def _call_unchecked(eps, op, *args):
    """``op(*args)`` before any Python check, or None when it raised, runs under torch.compile,
    or has an eps that is not a float."""
    return call_unchecked(op, *args) if type(eps) is float else None


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
):
    """LayerNorm over the last dimension, with an optional residual added first.

    Saves for backward only x (or ``residual_out``), a float32 mean and rstd per row and the
    parameters, like ``F.layer_norm``; with a residual the sum is made and normalised in one pass.

    Args:
        x: ``(*, n)`` float32/float64 on CPU, float32/float16/bfloat16 on CUDA.
        weight, bias: ``(n,)`` of x's dtype or float32, or None.
        eps: added to the variance.
        residual: ``(*, n)`` like x, or None.

    Returns:
        ``y`` ``(*, n)`` in x's dtype; ``(y, residual_out)`` with ``residual_out = x + residual``
        when a residual is given.
    """
    result = _call_unchecked(eps, _LAYER_NORM, x, residual, weight, bias, eps)
    if result is not None:
        return result[0] if residual is None else result
    _check_public("layer_norm", x, residual, weight, bias)
    eps = check_eps("layer_norm", eps)
    y, residual_out = _LAYER_NORM(x, residual, weight, bias, eps)
    return y if residual is None else (y, residual_out)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """RMSNorm over the last dimension, ``x / sqrt(mean(x^2) + eps) * weight``, residual optional.

    Saves for backward only x (or ``residual_out``), one float32 rstd per row and the weight.

    Args:
        x: ``(*, n)`` float32/float64 on CPU, float32/float16/bfloat16 on CUDA.
        weight: ``(n,)`` of x's dtype or float32, or None.
        eps: added to the mean square.
        residual: ``(*, n)`` like x, or None.

    Returns:
        ``y`` ``(*, n)`` in x's dtype; ``(y, residual_out)`` when a residual is given.
    """
    result = _call_unchecked(eps, _RMS_NORM, x, residual, weight, eps)
    if result is not None:
        return result[0] if residual is None else result
    _check_public("rms_norm", x, residual, weight, None)
    eps = check_eps("rms_norm", eps)
    y, residual_out = _RMS_NORM(x, residual, weight, eps)
    return y if residual is None else (y, residual_out)


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None = None,
    *,
    norm: str = "layernorm",
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
):
    """``F.linear(norm(x [+ residual]), linear_weight, linear_bias)``, keeping no norm output.

    Eager PyTorch keeps the normalised ``(*, n)`` tensor for the linear's weight gradient; this
    rebuilds it in the norm's backward kernel from x and the per-row statistics instead.

    Args:
        x: ``(*, n)``.
        norm_weight, norm_bias: ``(n,)`` or None (``norm_bias`` must be None for ``"rmsnorm"``).
        linear_weight: ``(m, n)``.
        linear_bias: ``(m,)`` or None.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        eps: the norm's epsilon.
        residual: ``(*, n)`` added to x before the norm, or None.

    Returns:
        ``(*, m)``, in the autocast dtype under ``torch.autocast``; ``(out, residual_out)`` when a
        residual is given.
    """
    if norm in _NORMS:
        result = _call_unchecked(eps, _NORM_LINEAR, x, residual, norm_weight, norm_bias, linear_weight, linear_bias,
                                 norm == "rmsnorm", eps)
        if result is not None:
            return result[0] if residual is None else result
    if norm not in _NORMS:
        raise ValueError(f"memopt.norm_linear: norm must be one of {_NORMS}, got {norm!r}")
    is_rms = norm == "rmsnorm"
    if is_rms and norm_bias is not None:
        raise ValueError("memopt.norm_linear: norm_bias must be None for norm='rmsnorm' (RMSNorm has no bias)")
    _check_public("norm_linear", x, residual, norm_weight, norm_bias, "norm_weight", "norm_bias")
    check_linear("norm_linear", x, x.shape[-1], linear_weight, linear_bias)
    eps = check_eps("norm_linear", eps)
    out, residual_out = _NORM_LINEAR(x, residual, norm_weight, norm_bias, linear_weight, linear_bias, is_rms, eps)
    return out if residual is None else (out, residual_out)


def _upcast(*tensors):
    return tuple(None if t is None else t.double() for t in tensors)


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    upcast: bool = False,
):
    """Plain PyTorch LayerNorm (eager elementwise ops, differentiable).

    ``residual_out = x + residual`` is made in x's dtype (as the kernels and eager PyTorch do);
    with ``upcast`` it and the parameters are then cast to float64 and the results are float64;
    otherwise the arithmetic runs in the inputs' dtypes. Returns like :func:`layer_norm`.
    """
    residual_out = x if residual is None else x + residual
    if upcast:
        residual_out, weight, bias = _upcast(residual_out, weight, bias)
    mean = residual_out.mean(-1, keepdim=True)
    centred = residual_out - mean
    y = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    y = y.to(residual_out.dtype)
    return y if residual is None else (y, residual_out)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    upcast: bool = False,
):
    """Plain PyTorch RMSNorm; ``upcast`` as in :func:`layer_norm_ref`. Returns like :func:`rms_norm`."""
    residual_out = x if residual is None else x + residual
    if upcast:
        residual_out, weight = _upcast(residual_out, weight)
    y = residual_out * torch.rsqrt(residual_out.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    y = y.to(residual_out.dtype)
    return y if residual is None else (y, residual_out)
