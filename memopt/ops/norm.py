"""layer_norm and rms_norm with an optional fused residual add, and the fused norm -> linear.

Layers: kernels in ``csrc/norm.cpp`` (CPU) and ``csrc/norm_cuda.cu`` (CUDA), registered as
``torch.ops.memopt.{layer_norm,rms_norm}_{fwd,bwd}`` (and ``_bwd_inplace``, which writes grad_x over
grad_y, for callers that made grad_y themselves: ``NormLinearFunction``, the block's backward);
the fake impls below let ``torch.compile`` trace them. The forward returns per-row statistics (mean, rstd); the backward rebuilds the
normalised input from the input and the statistics instead of keeping it, and with
``return_y=True`` also rebuilds the normalised output. :func:`layer_norm` and :func:`rms_norm`
call the differentiable ops ``torch.ops.memopt.{layer_norm,rms_norm}``, whose autograd node is
C++ (``csrc/norm_autograd.cpp``: saves x or residual_out, the statistics and the parameters;
second derivatives exact), so no Python runs in their forward or backward. ``NormLinearFunction`` uses that to drop
the normalised output that ``F.linear`` would otherwise keep for its weight gradient.
``layer_norm_ref`` / ``rms_norm_ref`` are the plain PyTorch references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memopt import _extension
from memopt.ops._common import (
    autocast_as, building_graph, check_eps, check_linear, check_tensor, grads_with_graph,
)

_NORMS = ("layernorm", "rmsnorm")


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _absent(x: torch.Tensor) -> torch.Tensor:
    """The empty tensor a kernel returns for an output that was not asked for."""
    return x.new_empty(0)


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("memopt::layer_norm_fwd")
def _layer_norm_fwd_fake(x, residual, weight, bias, eps):
    stat_shape, stat_dtype = x.shape[:-1], _stat_dtype(x)
    residual_out = _like(x) if residual is not None else _absent(x)
    return _like(x), residual_out, x.new_empty(stat_shape, dtype=stat_dtype), x.new_empty(stat_shape, dtype=stat_dtype)


@torch.library.register_fake("memopt::rms_norm_fwd")
def _rms_norm_fwd_fake(x, residual, weight, eps):
    residual_out = _like(x) if residual is not None else _absent(x)
    return _like(x), residual_out, x.new_empty(x.shape[:-1], dtype=_stat_dtype(x))


def _param_grad_fake(x, param):
    return x.new_empty(x.shape[-1], dtype=param.dtype) if param is not None else _absent(x)


@torch.library.register_fake("memopt::layer_norm_bwd")
def _layer_norm_bwd_fake(grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y):
    y = _like(x) if return_y else _absent(x)
    return _like(x), _param_grad_fake(x, weight), _param_grad_fake(x, bias), y


@torch.library.register_fake("memopt::rms_norm_bwd")
def _rms_norm_bwd_fake(grad_y, x, weight, rstd, grad_x_extra, return_y):
    y = _like(x) if return_y else _absent(x)
    return _like(x), _param_grad_fake(x, weight), y


@torch.library.register_fake("memopt::layer_norm_bwd_inplace")
def _layer_norm_bwd_inplace_fake(grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y):
    y = _like(x) if return_y else _absent(x)
    return _param_grad_fake(x, weight), _param_grad_fake(x, bias), y


@torch.library.register_fake("memopt::rms_norm_bwd_inplace")
def _rms_norm_bwd_inplace_fake(grad_y, x, weight, rstd, grad_x_extra, return_y):
    y = _like(x) if return_y else _absent(x)
    return _param_grad_fake(x, weight), y


@torch.library.register_fake("memopt::layer_norm")
def _layer_norm_fake(x, residual, weight, bias, eps):
    return _like(x), _like(x) if residual is not None else _absent(x)


@torch.library.register_fake("memopt::rms_norm")
def _rms_norm_fake(x, residual, weight, eps):
    return _like(x), _like(x) if residual is not None else _absent(x)


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
              grad_y_is_scratch: bool = False):
    """(grad_x, grad_weight or None, grad_bias or None, y or None) from the registered backward op.

    ``grad_y_is_scratch``: the caller made ``grad_y`` (a matmul output) and needs it no more, so
    grad_x is written over it (``*_norm_bwd_inplace``) instead of into a new tensor.
    """
    grad_y, grad_x_extra = grad_y.contiguous(), _contiguous(grad_x_extra)
    if grad_y_is_scratch:
        if is_rms:
            grad_weight, y = torch.ops.memopt.rms_norm_bwd_inplace(grad_y, x, weight, rstd, grad_x_extra, return_y)
            grad_bias = None
        else:
            grad_weight, grad_bias, y = torch.ops.memopt.layer_norm_bwd_inplace(
                grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y
            )
        grad_x = grad_y
    elif is_rms:
        grad_x, grad_weight, y = torch.ops.memopt.rms_norm_bwd(grad_y, x, weight, rstd, grad_x_extra, return_y)
        grad_bias = None
    else:
        grad_x, grad_weight, grad_bias, y = torch.ops.memopt.layer_norm_bwd(
            grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y
        )
    return (
        grad_x,
        grad_weight if weight is not None else None,
        grad_bias if bias is not None else None,
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
    n = x.shape[-1] if x.dim() > 0 else None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"memopt.{op}: residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.device != x.device:
            raise ValueError(f"memopt.{op}: residual must be on x's device ({x.device}), got {residual.device}")
    for name, param in ((weight_name, weight), (bias_name, bias)):
        if param is None:
            continue
        if param.dim() != 1 or param.shape[0] != n:
            raise ValueError(f"memopt.{op}: {name} must have shape [{n}] (x.shape[-1]), got {list(param.shape)}")
        if param.device != x.device:
            raise ValueError(f"memopt.{op}: {name} must be on x's device ({x.device}), got {param.device}")
    _extension.require_cuda_kernels(op, x)


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
    _check_public("layer_norm", x, residual, weight, bias)
    eps = check_eps("layer_norm", eps)
    y, residual_out = torch.ops.memopt.layer_norm(x.contiguous(), _contiguous(residual), weight, bias, eps)
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
    _check_public("rms_norm", x, residual, weight, None)
    eps = check_eps("rms_norm", eps)
    y, residual_out = torch.ops.memopt.rms_norm(x.contiguous(), _contiguous(residual), weight, eps)
    return y if residual is None else (y, residual_out)


class NormLinearFunction(torch.autograd.Function):
    """``F.linear(norm(x [+ residual]), linear_weight, linear_bias)`` without keeping norm(x).

    ``apply(x, residual, norm_weight, norm_bias, linear_weight, linear_bias, is_rms, eps)``.
    Saves x (or residual_out), the norm statistics and the parameters. The backward gets
    ``grad_y = grad_out @ W``, then one norm-backward kernel returns grad_x and the rebuilt y,
    and ``grad_W = grad_out^T @ y``.

    The linear runs in the dtype ``F.linear`` picks (the autocast dtype under ``torch.autocast``,
    where the parameters are cast as autocast would cast them); the backward repeats those casts,
    so gradients match the eager norm followed by ``F.linear`` under the same autocast.
    """

    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, linear_weight, linear_bias, is_rms, eps):
        y, residual_out, mean, rstd = _norm_fwd(is_rms, x, residual, norm_weight, norm_bias, eps)
        out = F.linear(y, linear_weight, linear_bias)
        ctx.is_rms = is_rms
        ctx.eps = eps
        ctx.has_residual = residual is not None
        ctx.linear_bias_dtype = None if linear_bias is None else linear_bias.dtype
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(residual_out if residual is not None else x, norm_weight, norm_bias, linear_weight, mean, rstd)
        return out if residual is None else (out, residual_out)

    @staticmethod
    def backward(ctx, grad_out, grad_residual_out=None):
        if building_graph():
            return NormLinearFunction._double_backward(ctx, grad_out, grad_residual_out)
        x, norm_weight, norm_bias, linear_weight, mean, rstd = ctx.saved_tensors
        n, out_features = x.shape[-1], linear_weight.shape[0]
        rows = x.shape[:-1].numel()
        if grad_out is None:
            grad_out = x.new_zeros(*x.shape[:-1], out_features)
        compute_dtype = grad_out.dtype
        # The casts below are the ones autocast made in the forward; nothing else may recast.
        with autocast_as((x.device.type, False, None)):
            grad_out_2d = grad_out.reshape(rows, out_features)
            weight_c = linear_weight.to(compute_dtype)
            grad_y = (grad_out_2d @ weight_c).to(x.dtype).reshape(x.shape)  # a new tensor: grad_x goes over it
            need_linear_weight_grad = ctx.needs_input_grad[4]
            grad_x, grad_norm_weight, grad_norm_bias, y = _norm_bwd(
                ctx.is_rms, grad_y, x, norm_weight, norm_bias, mean, rstd, grad_residual_out,
                return_y=need_linear_weight_grad, grad_y_is_scratch=True,
            )
            grad_linear_weight = None
            if need_linear_weight_grad:
                y_c = y.reshape(rows, n).to(compute_dtype)
                grad_linear_weight = (grad_out_2d.t() @ y_c).to(linear_weight.dtype)
            grad_linear_bias = None
            if ctx.linear_bias_dtype is not None:
                grad_linear_bias = grad_out_2d.sum(0).to(ctx.linear_bias_dtype)
        grad_residual = grad_x if ctx.has_residual else None
        return grad_x, grad_residual, grad_norm_weight, grad_norm_bias, grad_linear_weight, grad_linear_bias, None, None

    @staticmethod
    def _double_backward(ctx, grad_out, grad_residual_out):
        """The backward as differentiable ops (norm and linear re-run in plain PyTorch with the
        forward's casts, then differentiated), so second derivatives are exact."""
        x, norm_weight, norm_bias, linear_weight, _, _ = ctx.saved_tensors
        grad_x = grad_norm_weight = grad_norm_bias = grad_linear_weight = grad_linear_bias = None
        if grad_out is not None:
            with torch.enable_grad(), autocast_as((x.device.type, False, None)):
                y = _norm_differentiable(ctx.is_rms, x, norm_weight, norm_bias, ctx.eps)
                out = F.linear(y.to(grad_out.dtype), linear_weight.to(grad_out.dtype))
            grad_x, grad_norm_weight, grad_norm_bias, grad_linear_weight = grads_with_graph(
                out, [x, norm_weight, norm_bias, linear_weight], grad_out
            )
            if ctx.linear_bias_dtype is not None:
                rows = grad_out.shape[:-1].numel()
                grad_linear_bias = grad_out.reshape(rows, grad_out.shape[-1]).sum(0).to(ctx.linear_bias_dtype)
        if grad_residual_out is not None:
            grad_x = grad_residual_out if grad_x is None else grad_x + grad_residual_out
        grad_residual = grad_x if ctx.has_residual else None
        return grad_x, grad_residual, grad_norm_weight, grad_norm_bias, grad_linear_weight, grad_linear_bias, None, None


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
    if norm not in _NORMS:
        raise ValueError(f"memopt.norm_linear: norm must be one of {_NORMS}, got {norm!r}")
    is_rms = norm == "rmsnorm"
    if is_rms and norm_bias is not None:
        raise ValueError("memopt.norm_linear: norm_bias must be None for norm='rmsnorm' (RMSNorm has no bias)")
    _check_public("norm_linear", x, residual, norm_weight, norm_bias, "norm_weight", "norm_bias")
    check_linear("norm_linear", x, x.shape[-1] if x.dim() else 0, linear_weight, linear_bias)
    eps = check_eps("norm_linear", eps)
    return NormLinearFunction.apply(
        x.contiguous(), _contiguous(residual), norm_weight, norm_bias, linear_weight, linear_bias, is_rms, eps
    )


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
