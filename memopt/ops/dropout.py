"""dropout_add: ``out = residual + dropout(x, p)`` with a mask that is never stored.

Layers: kernels in ``csrc/dropout.cpp`` (CPU) and ``csrc/dropout_cuda.cu`` (CUDA), registered as
``torch.ops.memopt.dropout_add_fwd`` / ``dropout_add_bwd``; the fake impls below let
``torch.compile`` trace them; ``DropoutAddFunction`` saves only the 16-byte RNG key; the
backward regenerates the mask. ``dropout_add_ref`` is the plain PyTorch reference.
"""

from __future__ import annotations

import torch

from memopt import _extension
from memopt.ops._common import check_dropout_p, check_fake_devices, check_float_x, check_tensor
from memopt.ops._philox import dropout_keep_mask
from memopt.ops._rng import check_fake_rng_key, check_rng_key, new_rng_key


@torch.library.register_fake("memopt::dropout_add_fwd")
def _dropout_add_fwd_fake(x, residual, p, rng_key):
    check_fake_rng_key("dropout_add", rng_key)
    check_fake_devices("dropout_add", "x", x, residual=residual)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("memopt::dropout_add_bwd")
def _dropout_add_bwd_fake(grad_out, p, rng_key):
    check_fake_rng_key("dropout_add", rng_key)
    return torch.empty_like(grad_out, memory_format=torch.contiguous_format)


class DropoutMaskFunction(torch.autograd.Function):
    """``grad -> keep * grad / (1 - p)`` with the mask of ``rng_key``: dropout's gradient.

    It is linear and its own adjoint, so its backward is itself with the same key: a double
    backward through :func:`dropout_add` replays the forward's mask.
    """

    @staticmethod
    def forward(ctx, grad, p, rng_key):
        ctx.p = p
        ctx.save_for_backward(rng_key)
        return torch.ops.memopt.dropout_add_bwd(grad.contiguous(), p, rng_key)

    @staticmethod
    def backward(ctx, grad_grad):
        (rng_key,) = ctx.saved_tensors
        return DropoutMaskFunction.apply(grad_grad, ctx.p, rng_key), None, None


class DropoutAddFunction(torch.autograd.Function):
    """Saves the RNG key only; the mask is rebuilt from it in the backward kernel (through
    :class:`DropoutMaskFunction`, so the backward is differentiable with the same mask)."""

    @staticmethod
    def forward(ctx, x, residual, p, rng_key):
        out = torch.ops.memopt.dropout_add_fwd(x, residual, p, rng_key)
        ctx.p = p
        ctx.has_residual = residual is not None
        ctx.save_for_backward(rng_key)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (rng_key,) = ctx.saved_tensors
        grad_x = DropoutMaskFunction.apply(grad_out, ctx.p, rng_key) if ctx.needs_input_grad[0] else None
        grad_residual = grad_out if ctx.has_residual and ctx.needs_input_grad[1] else None
        return grad_x, grad_residual, None, None


def dropout_add(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    p: float = 0.5,
    training: bool = True,
    rng_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + dropout(x, p)`` in one pass, saving no mask for backward.

    Args:
        x: ``(*, n)`` tensor to drop out.
        residual: tensor of ``x``'s shape added after dropout, or None.
        p: drop probability in ``[0, 1)``.
        training: when False (or ``p == 0``) dropout is the identity.
        rng_key: int64 CPU tensor ``(seed, offset)`` of shape ``[2]``, also for CUDA data; drawn
            from torch's default generator when None, so ``torch.manual_seed`` fixes the mask.
            Pass the same key to replay it.

    Returns:
        ``(*, n)`` tensor with the dtype that ``x + residual`` would have.
    """
    check_tensor("dropout_add", "x", x)
    check_tensor("dropout_add", "residual", residual, optional=True)
    if rng_key is not None:
        check_rng_key("dropout_add", rng_key)
    check_dropout_p("dropout_add", p)
    if not isinstance(training, bool):
        raise TypeError(f"memopt.dropout_add: training must be a bool, got {type(training).__name__} {training!r}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"memopt.dropout_add: residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.device != x.device:
            raise ValueError(f"memopt.dropout_add: residual must be on x's device ({x.device}), got {residual.device}")
    if not training or p == 0.0:
        return x if residual is None else x + residual
    _extension.require_cuda_kernels("dropout_add", x)
    if residual is not None and residual.dtype != x.dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    check_float_x("dropout_add", x)  # (the dtype of x + residual)
    if rng_key is None:
        rng_key = new_rng_key()
    x = x.contiguous()
    if residual is not None:
        residual = residual.contiguous()
        if residual is x:  # dropout_add(x, x): torch.compile cannot trace one tensor in two inputs of a Function
            residual = residual.view_as(residual)
    return DropoutAddFunction.apply(x, residual, float(p), rng_key)


def dropout_add_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    p: float,
    rng_key: torch.Tensor,
    upcast: bool = False,
) -> torch.Tensor:
    """Plain PyTorch reference: the Philox mask from ``memopt.ops._philox``, then eager ops.

    With ``upcast`` the arithmetic runs in float64 and the result is returned in float64.
    """
    seed, offset = (int(v) for v in rng_key.tolist())
    keep = dropout_keep_mask(x.shape, p, seed, offset).to(x.device)
    if upcast:
        x = x.double()
        residual = None if residual is None else residual.double()
    # x * keep, not where(keep, x, 0): NaN and inf at a dropped position give NaN, as in torch.
    out = x * keep.to(x.dtype) / (1.0 - p)
    return out if residual is None else out + residual
