"""bias + activation, SwiGLU, and activation -> linear, saving no activation output.

Layers: kernels in ``csrc/activation.cpp`` (CPU) and ``csrc/activation_cuda.cu`` (CUDA), with the
math shared in ``csrc/activation.h``, registered as ``torch.ops.memopt.bias_act_fwd`` /
``bias_act_fwd_inplace`` / ``bias_act_bwd`` / ``bias_act_bwd_inplace`` / ``swiglu_fwd`` /
``swiglu_bwd``; the fake impls below let ``torch.compile`` trace them. The ``_inplace`` ops write
their result over an input that the caller made itself (a matmul output) and needs no more:
``bias_act_fwd_inplace`` y over x, for the block's forward without a graph
(``block_functions.block_forward``); ``bias_act_bwd_inplace`` grad_x over grad_y, for
act_linear's node and the block's FFN backward.

* :func:`bias_act` and :func:`swiglu` call the differentiable ops ``torch.ops.memopt.bias_act`` /
  ``swiglu``, whose autograd node is C++ (``csrc/activation_autograd.cpp``): it saves the
  pre-activation ``x`` and the bias, and the backward kernel recomputes ``act'`` from them; under
  ``create_graph=True`` the backward is ATen's differentiable activation backward ops (exact
  second derivatives). No Python runs in their forward or backward.
* :func:`act_linear` calls ``torch.ops.memopt.act_linear``, whose C++ node (same file) computes
  ``F.linear(act(x + bias), W, b)`` and saves ``x`` and the parameters but not ``act(x + bias)``,
  which eager PyTorch keeps for the weight gradient: the backward rebuilds it with the forward
  kernel, in the one activation-sized buffer it allocates.

``bias_act_ref`` / ``swiglu_ref`` / ``act_linear_ref`` are the plain PyTorch references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memopt import _extension
from memopt.ops._common import call_unchecked, check_fake_devices, check_float_x, check_linear, check_tensor

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
ACT_LINEAR_ACTIVATIONS = ACTIVATIONS + ("swiglu",)


def _check_fake_devices(op: str, x, bias, **others) -> None:
    check_fake_devices(op, "x", x, bias=bias, **others)


@torch.library.register_fake("memopt::bias_act_fwd")
def _bias_act_fwd_fake(x, bias, activation):
    _check_fake_devices("bias_act", x, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("memopt::bias_act_fwd_inplace")
def _bias_act_fwd_inplace_fake(x, bias, activation):
    _check_fake_devices("bias_act", x, bias)
    return None


def _bias_grad_fake(x, bias, wanted: bool):
    """The bias gradient: like bias, or empty without a bias or when it was not asked for
    (return_grad_bias False)."""
    if bias is None or not wanted:
        return x.new_empty(0)
    return torch.empty_like(bias, memory_format=torch.contiguous_format)


@torch.library.register_fake("memopt::bias_act_bwd")
def _bias_act_bwd_fake(grad_y, x, bias, activation, return_y, return_grad_bias=True):
    _check_fake_devices("bias_act", x, bias, grad_y=grad_y)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if return_y else x.new_empty(0)
    return grad_x, _bias_grad_fake(x, bias, return_grad_bias), y


@torch.library.register_fake("memopt::bias_act_bwd_inplace")
def _bias_act_bwd_inplace_fake(grad_y, x, bias, activation, return_y, return_grad_bias=True):
    _check_fake_devices("bias_act", x, bias, grad_y=grad_y)
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if return_y else x.new_empty(0)
    return _bias_grad_fake(x, bias, return_grad_bias), y


@torch.library.register_fake("memopt::swiglu_fwd")
def _swiglu_fwd_fake(x, bias):
    _check_fake_devices("swiglu", x, bias)
    torch._check(x.shape[-1] % 2 == 0, lambda: f"memopt.swiglu: x's last dimension must be even, got {x.shape[-1]}")
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


@torch.library.register_fake("memopt::swiglu_bwd")
def _swiglu_bwd_fake(grad_y, x, bias, return_y, return_grad_bias=True):
    _check_fake_devices("swiglu", x, bias, grad_y=grad_y)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,)) if return_y else x.new_empty(0)
    return grad_x, _bias_grad_fake(x, bias, return_grad_bias), y


@torch.library.register_fake("memopt::bias_act")
def _bias_act_fake(x, bias, activation):
    return _bias_act_fwd_fake(x, bias, activation)


@torch.library.register_fake("memopt::swiglu")
def _swiglu_fake(x, bias):
    return _swiglu_fwd_fake(x, bias)


@torch.library.register_fake("memopt::act_linear")
def _act_linear_fake(x, bias, linear_weight, linear_bias, activation):
    _check_fake_devices("act_linear", x, bias, linear_weight=linear_weight, linear_bias=linear_bias)
    y = _swiglu_fwd_fake(x, bias) if activation == "swiglu" else _bias_act_fwd_fake(x, bias, activation)
    # F.linear on fake tensors gives the dtype autocast would (the op runs its linear under it)
    return F.linear(y, linear_weight, linear_bias)


def _check_activation(op: str, activation: str, allowed: tuple[str, ...]) -> None:
    if activation not in allowed:
        names = ", ".join(f'"{a}"' for a in allowed)
        raise ValueError(f"memopt.{op}: activation must be one of {names}, got {activation!r}")


def _check_x(op: str, x) -> None:
    """x a tensor of at least 1 dimension, of a dtype the kernels of its device take."""
    check_tensor(op, "x", x)
    if x.dim() == 0:
        raise ValueError(f"memopt.{op}: x must have at least 1 dimension, got a 0-d tensor")
    check_float_x(op, x)


def _check_bias(op: str, x: torch.Tensor, bias: torch.Tensor | None, width: int, name: str = "bias") -> None:
    check_tensor(op, name, bias, optional=True)
    if bias is None:
        return
    if bias.device != x.device:
        raise ValueError(f"memopt.{op}: {name} must be on x's device ({x.device}), got {bias.device}")
    if bias.shape != (width,):
        raise ValueError(f"memopt.{op}: {name} must have shape [{width}], got {list(bias.shape)}")
    if bias.dtype != x.dtype and bias.dtype != torch.float32:
        raise ValueError(f"memopt.{op}: {name} must have x's dtype ({x.dtype}) or float32, got {bias.dtype}")


# The activations as PyTorch functions: the reference, and the graph of the double backward.
_TORCH_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": lambda h: F.gelu(h, approximate="none"),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}


def _act_differentiable(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """The activation in differentiable PyTorch ops, in the kernels' compute dtype (float64 for
    float64, float32 otherwise), returned in x's dtype: the graph a backward under
    ``create_graph=True`` differentiates."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(compute) if bias is None else x.to(compute) + bias.to(compute)
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        y = F.silu(gate) * up
    else:
        y = _TORCH_ACTIVATIONS[activation](h)
    return y.to(x.dtype)


def _act_forward(x, bias, activation):
    if activation == "swiglu":
        return torch.ops.memopt.swiglu_fwd(x, bias)
    return torch.ops.memopt.bias_act_fwd(x, bias, activation)


def _act_forward_inplace(x, bias, activation):
    """``_act_forward(x, bias, activation)`` written over ``x`` (the same bits), for a caller that
    made ``x`` (a matmul output, contiguous) and needs it no more; returns ``x``. Swiglu's output
    is half as wide and comes in a new tensor."""
    if activation == "swiglu":
        return torch.ops.memopt.swiglu_fwd(x, bias)
    torch.ops.memopt.bias_act_fwd_inplace(x, bias, activation)
    return x


def _act_backward(grad_y, x, bias, activation, return_y: bool = True, grad_y_is_scratch: bool = False,
                  need_bias: bool = True):
    """(grad_x, grad_bias, y): the gradient through the activation and the rebuilt activation
    (an empty tensor when ``return_y`` is False); grad_bias is empty without a bias or, with
    ``need_bias`` False (a frozen bias), not computed.

    ``grad_y_is_scratch``: the caller made ``grad_y`` (a matmul output) and needs it no more, so
    grad_x may be written over it (``bias_act_bwd_inplace``; swiglu's grad_x is twice as wide and
    cannot be): the backward then allocates nothing of x's size besides the rebuilt y.
    """
    if activation == "swiglu":
        return torch.ops.memopt.swiglu_bwd(grad_y, x, bias, return_y, need_bias)
    if grad_y_is_scratch:
        grad_bias, y = torch.ops.memopt.bias_act_bwd_inplace(grad_y, x, bias, activation, return_y, need_bias)
        return grad_y, grad_bias, y
    return torch.ops.memopt.bias_act_bwd(grad_y, x, bias, activation, return_y, need_bias)


# The differentiable ops; bias_act, swiglu and act_linear call them before any check
# (_common.call_unchecked's Note). Strided x and bias are copied by the ops in a recorded op
# (activation_autograd.cpp).
_BIAS_ACT = torch.ops.memopt.bias_act.default
_SWIGLU = torch.ops.memopt.swiglu.default
_ACT_LINEAR = torch.ops.memopt.act_linear.default


def bias_act(x: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "gelu") -> torch.Tensor:
    """``act(x + bias)``, saving only ``x`` (and ``bias``) for backward.

    Args:
        x: ``(*, n)`` pre-activation.
        bias: ``(n,)`` added before the activation, of x's dtype or float32, or None.
        activation: ``"relu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` (tanh approximation) or
            ``"silu"``; the formulas of ``F.relu``, ``F.gelu(approximate=...)`` and ``F.silu``.

    Returns:
        ``(*, n)`` tensor of x's dtype.
    """
    result = call_unchecked(_BIAS_ACT, x, bias, activation)
    if result is not None:
        return result
    _check_x("bias_act", x)
    _check_activation("bias_act", activation, ACTIVATIONS)
    _check_bias("bias_act", x, bias, x.shape[-1])
    _extension.require_cuda_kernels("bias_act", x)
    return _BIAS_ACT(x, bias, activation)


def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate + bias[:d]) * (up + bias[d:])`` where ``x = [gate | up]`` on the last dimension.

    Args:
        x: ``(*, 2 * d)`` tensor, the gate projection then the up projection.
        bias: ``(2 * d,)`` of x's dtype or float32, or None.

    Returns:
        ``(*, d)`` tensor of x's dtype.
    """
    result = call_unchecked(_SWIGLU, x, bias)
    if result is not None:
        return result
    _check_x("swiglu", x)
    if x.shape[-1] % 2:
        raise ValueError(f"memopt.swiglu: x's last dimension must be even ([gate | up]), got shape {list(x.shape)}")
    _check_bias("swiglu", x, bias, x.shape[-1])
    _extension.require_cuda_kernels("swiglu", x)
    return _SWIGLU(x, bias)


def act_linear(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None = None,
    *,
    activation: str = "gelu",
) -> torch.Tensor:
    """``F.linear(act(x + bias), linear_weight, linear_bias)`` without saving the activation.

    The FFN's second half: eager PyTorch keeps ``act(x + bias)`` for the weight gradient; this
    keeps ``x`` (the first matmul's output) and rebuilds the activation in the backward.

    Args:
        x: ``(*, n)`` pre-activation; for ``"swiglu"`` ``(*, 2 * d)`` holding ``[gate | up]``.
        bias: ``(n,)`` (``(2 * d,)`` for swiglu) added before the activation, or None.
        linear_weight: ``(out_features, k)`` with ``k = n`` (``d`` for swiglu).
        linear_bias: ``(out_features,)`` or None.
        activation: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` or ``"swiglu"``.

    Returns:
        ``(*, out_features)``; under ``torch.autocast`` in the autocast dtype, as ``F.linear``.
    """
    result = call_unchecked(_ACT_LINEAR, x, bias, linear_weight, linear_bias, activation)
    if result is not None:
        return result
    _check_x("act_linear", x)
    _check_activation("act_linear", activation, ACT_LINEAR_ACTIVATIONS)
    width = x.shape[-1]
    if activation == "swiglu" and width % 2:
        raise ValueError(f"memopt.act_linear: x's last dimension must be even for swiglu ([gate | up]), got {width}")
    act_width = width // 2 if activation == "swiglu" else width
    _check_bias("act_linear", x, bias, width)
    check_linear("act_linear", x, act_width, linear_weight, linear_bias)
    _extension.require_cuda_kernels("act_linear", x)
    return _ACT_LINEAR(x, bias, linear_weight, linear_bias, activation)


def bias_act_ref(
    x: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "gelu", upcast: bool = False
) -> torch.Tensor:
    """Plain PyTorch ``act(x + bias)``; with ``upcast`` in float64 (and returned in float64)."""
    if upcast:
        x = x.double()
        bias = None if bias is None else bias.double()
    h = x if bias is None else x + bias
    return _TORCH_ACTIVATIONS[activation](h)


def swiglu_ref(x: torch.Tensor, bias: torch.Tensor | None = None, upcast: bool = False) -> torch.Tensor:
    """Plain PyTorch ``silu(gate + b_gate) * (up + b_up)``; with ``upcast`` in float64."""
    if upcast:
        x = x.double()
        bias = None if bias is None else bias.double()
    h = x if bias is None else x + bias
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_linear_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    linear_weight: torch.Tensor,
    linear_bias: torch.Tensor | None = None,
    *,
    activation: str = "gelu",
    upcast: bool = False,
) -> torch.Tensor:
    """Plain PyTorch ``F.linear(act(x + bias), W, b)``; with ``upcast`` everything in float64."""
    if activation == "swiglu":
        y = swiglu_ref(x, bias, upcast=upcast)
    else:
        y = bias_act_ref(x, bias, activation, upcast=upcast)
    if upcast:
        linear_weight = linear_weight.double()
        linear_bias = None if linear_bias is None else linear_bias.double()
    return F.linear(y, linear_weight, linear_bias)
