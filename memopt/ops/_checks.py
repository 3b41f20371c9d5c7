"""Argument checks shared by the public ops: each error names the op, the argument and what was
expected, before anything reaches a kernel (whose own checks raise RuntimeError)."""

from __future__ import annotations

import math
import numbers

import torch


def check_tensor(op: str, name: str, value, *, optional: bool = False) -> None:
    """TypeError unless ``value`` is a tensor (or None, when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        expected = "a tensor or None" if optional else "a tensor"
        raise TypeError(f"memopt.{op}: {name} must be {expected}, got {type(value).__name__}")


def check_eps(op: str, eps) -> float:
    """``eps`` as a float: a real number (not a bool), finite and >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"memopt.{op}: eps must be a real number, got {type(eps).__name__} {eps!r}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"memopt.{op}: eps must be a finite number >= 0, got {eps!r}")
    return eps


# The dtypes autocast casts to its low-precision dtype (float64 is left alone).
_AUTOCAST_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def check_linear(op: str, x: torch.Tensor, in_features: int, weight, bias) -> None:
    """``weight`` ``(out_features, in_features)`` and ``bias`` ``(out_features,)`` or None, on x's
    device; outside ``torch.autocast`` both in x's dtype (what ``F.linear`` needs after the norm or
    activation, which return x's dtype), under autocast in a dtype autocast casts."""
    check_tensor(op, "linear_weight", weight)
    check_tensor(op, "linear_bias", bias, optional=True)
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(
            f"memopt.{op}: linear_weight must have shape [out_features, {in_features}], got {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"memopt.{op}: linear_bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
    autocast = torch.is_autocast_enabled(x.device.type)
    for name, param in (("linear_weight", weight), ("linear_bias", bias)):
        if param is None:
            continue
        if param.device != x.device:
            raise ValueError(f"memopt.{op}: {name} must be on x's device ({x.device}), got {param.device}")
        if autocast:
            if param.dtype not in _AUTOCAST_CASTABLE or x.dtype not in _AUTOCAST_CASTABLE:
                raise ValueError(
                    f"memopt.{op}: under torch.autocast x and {name} must be float32, float16 or bfloat16 "
                    f"(autocast casts those), got x {x.dtype} and {name} {param.dtype}"
                )
        elif param.dtype != x.dtype:
            raise ValueError(
                f"memopt.{op}: {name} must have x's dtype ({x.dtype}) outside torch.autocast, got {param.dtype}"
            )
