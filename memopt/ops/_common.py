"""What the op families (norm, activation, dropout, attention) share.

* Argument checks: each error names the op, the argument and what was expected, before anything
  reaches a kernel (whose own checks raise RuntimeError).
* Autocast state for any device type (``meta`` has no autocast: it is never on there).
* Double backward: the fast backward kernels are not differentiable. When a backward runs with
  ``create_graph=True`` (grad mode is on inside a backward exactly then), each Function re-runs
  its forward in differentiable PyTorch ops and differentiates that instead, so gradient
  penalties, Hessian-vector products and MAML get exact second derivatives; an ordinary backward
  keeps the kernels.
* The attention output's layout, which the Triton and the PyTorch backends allocate alike.
* :func:`call_unchecked`: the public functions whose ops check everything themselves (norms,
  activations) call the op before any Python check.
"""

from __future__ import annotations

import contextlib
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


def check_fake_devices(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """The kernels refuse a tensor on another device than ``ref`` (x, or q); so must the fakes,
    which also run as the ops' Meta kernels: a CPU ``ref`` with one meta argument dispatches there
    and would get back an uninitialised CPU tensor. None stands for an absent optional."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"memopt.{op}: {name} must be on {ref_name}'s device ({ref.device}), got {t.device}")


def check_eps(op: str, eps) -> float:
    """``eps`` as a float: a real number (not a bool), finite and >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"memopt.{op}: eps must be a real number, got {type(eps).__name__} {eps!r}")
    if not isinstance(eps, torch.SymFloat):  # (traced with dynamic=True, eps is symbolic: kept so)
        eps = float(eps)
    # Comparisons, not math.isfinite: on a symbolic eps they become torch.compile guards. NaN fails both.
    if not (0 <= eps < math.inf):
        raise ValueError(f"memopt.{op}: eps must be a finite number >= 0, got {eps!r}")
    return eps


def check_dropout_p(op: str, p) -> None:
    """TypeError unless ``p`` is a real number (not a bool), ValueError unless it is in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"memopt.{op}: p must be a float in [0, 1), got {type(p).__name__} {p!r}")
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"memopt.{op}: p must be a float in [0, 1), got {p!r}")


def check_float_x(op: str, x: torch.Tensor) -> None:
    """x's dtype is one the kernels of its device take (the rule of csrc/common.h's
    check_float_dtype, with the public op's name). float32 costs one comparison: the public
    element-wise ops run this on every call."""
    dtype = x.dtype
    if dtype == torch.float32:
        return
    if dtype not in (torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(f"memopt.{op}: x must be float32, float64, float16 or bfloat16, got {dtype}")
    device_type = x.device.type
    if device_type == "cpu" and dtype != torch.float64:
        raise ValueError(f"memopt.{op}: x is {dtype} on CPU; the CPU kernels take float32 or float64")
    if device_type == "cuda" and dtype == torch.float64:
        raise ValueError(f"memopt.{op}: x is float64 on CUDA; the CUDA kernels take float32, float16 or bfloat16")


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
    autocast = autocast_state(x.device.type)[1]
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


@torch.compiler.assume_constant_result
def _autocast_available(device_type: str) -> bool:
    """Whether autocast exists for ``device_type`` (not for ``meta``): fixed for the process, and
    read outside the graph under torch.compile (dynamo before torch 2.13 cannot trace
    ``torch._C._is_autocast_available``; fullgraph would fail on it)."""
    return torch.amp.is_autocast_available(device_type)


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype | None]:
    """(device_type, enabled, dtype) of autocast now; disabled where autocast does not exist."""
    if not _autocast_available(device_type):
        return device_type, False, None
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


_NO_CONTEXT = contextlib.nullcontext()


def autocast_as(state: tuple[str, bool, torch.dtype | None]):
    """Enter the autocast state that :func:`autocast_state` recorded (nothing for ``meta``, nor
    when it is the state already: entering ``torch.autocast`` costs ~5-20 us, each time)."""
    device_type, enabled, dtype = state
    if not _autocast_available(device_type):
        return _NO_CONTEXT
    if torch.is_autocast_enabled(device_type) == enabled and (not enabled or torch.get_autocast_dtype(device_type) == dtype):
        return _NO_CONTEXT
    return torch.autocast(device_type, enabled=enabled, dtype=dtype)


def autocast_off(device_type: str):
    """A context with autocast off on ``device_type``; nothing to enter when it is off already
    (always, for a device type without autocast, such as ``meta``, where asking raises)."""
    if _autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


def building_graph(*grads) -> bool:
    """Whether a backward takes its differentiable path (the recompute as differentiable ops,
    differentiated) rather than the kernels: under ``create_graph=True``, and when one of its
    incoming ``grads`` is batched (``torch.autograd.grad(..., is_grads_batched=True)``,
    ``jacobian(vectorize=True)``, ``hessian(vectorize=True)``: legacy vmap), which the kernels
    cannot take (they have no batching rule, and vmap's fallback cannot run their in-place and
    out= products). Batched gradients do not occur under torch.compile, which is not asked."""
    if torch.is_grad_enabled():
        return True
    return not torch.compiler.is_compiling() and any(
        g is not None and torch._C._functorch.is_legacy_batchedtensor(g) for g in grads
    )


def grads_with_graph(output: torch.Tensor, inputs, grad_output: torch.Tensor | None) -> list:
    """``torch.autograd.grad(output, inputs, grad_output, create_graph=True)`` for the inputs that
    require grad; None for the others (and for all when ``grad_output`` is None)."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    grads = iter(
        torch.autograd.grad(output, wanted, grad_output, create_graph=True, allow_unused=True)
        if wanted and grad_output is not None else [None] * len(wanted)
    )
    return [next(grads) if t is not None and t.requires_grad else None for t in inputs]


def attention_out_empty(q: torch.Tensor) -> torch.Tensor:
    """The uninitialised attention output for ``q`` (B, H, Sq, D), in every backend's layout (the
    contract in ``memopt.ops.attention``): contiguous when q is, else a (B, H, Sq, D) view of a
    (B, Sq, H, D) buffer."""
    if q.is_contiguous():
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch, heads, seq, head_dim = q.shape
    return torch.empty((batch, seq, heads, head_dim), dtype=q.dtype, device=q.device).transpose(1, 2)


def saved_for_recompute(ctx, grad: torch.Tensor, count: int) -> tuple:
    """``ctx.saved_tensors`` for a backward that recomputes forward work from its first ``count``
    (its activations; the rest, parameters and keys, are read as they are); under
    ``torch.compile`` with CSE on, those ``count`` through :func:`recompute_barrier`.

    Note: AOT autograd traces a Function's forward and backward into one joint graph and merges
    equal nodes (CSE) before it splits the graph again. A recompute in the backward is the
    forward's ops on the forward's inputs: merged with them, the split saves the forward's
    intermediates instead of recomputing them (a 2-layer "full" stack saved 16x its eager bytes,
    "selective" 1.4x, numerics unchanged). Ops on the barrier's outputs are new nodes; the
    barrier takes the backward's incoming gradient, so the split cannot move it (and the
    recompute after it) into the forward either. Its price: one copy of those saved tensors per
    backward, under compile only. (A view is not enough: inductor's joint-graph passes drop
    ``alias`` and ``clone`` nodes before the split.)
    """
    saved = ctx.saved_tensors
    if count and torch.compiler.is_compiling() and torch._functorch.config.cse:
        return (*(None if t is None else recompute_barrier(t, grad) for t in saved[:count]), *saved[count:])
    return saved


@torch.library.custom_op("memopt::recompute_barrier", mutates_args=())
def recompute_barrier(t: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that graph passes cannot merge with ``t`` or move before ``after`` is
    computed (:func:`saved_for_recompute`); ``after`` is not read."""
    return t.clone()


@recompute_barrier.register_fake
def _recompute_barrier_fake(t, after):
    return torch.empty_like(t)


# Note: the public functions of ops with C++ autograd nodes (memopt.layer_norm, rms_norm,
# norm_linear, bias_act, swiglu, act_linear) call the op first and run their Python checks only
# when it raises. The ops check every condition those checks do (norm_common.cpp,
# activation_common.cpp, check_norm_linear and check_act_linear over autograd_common.h's
# check_linear_params), so an input the checks would refuse never gets through,
# and a refused one gets the Python message; the checks cost ~15-20 us a call (more once a GEMM
# has swept the caches), which at 512 x 512 was the whole of memopt's lead over F.layer_norm.
# Under torch.compile the checks run first, as before.
def call_unchecked(op, *args):
    """``op(*args)`` before any Python check, or None when it raised (the checked call that follows
    says what was wrong) or when tracing under torch.compile (the checks run first there)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return op(*args)
    except Exception:
        return None
