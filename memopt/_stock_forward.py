"""Whether calling a module runs exactly its class's stock forward.

memopt's fused paths read a module's parameters and never call the module: the block reads its
linears' and norms' weights, the chunked LM-head loss reads ``lm_head.weight``, ``from_torch``
copies an ``nn.TransformerEncoderLayer``'s weights. That is exact only while ``module(x)`` is the
stock ``forward`` applied to those parameters.

Note:
    Three things break it silently, and each check here refuses all three: module hooks (a
    pre-hook that recomputes ``weight``, as ``torch.nn.utils.prune`` installs, would not run),
    a subclass that overrides ``forward`` (a PEFT LoRA layer keeps the frozen base weight as
    ``.weight``: its adapter would be skipped), and a ``forward`` patched onto the instance.
    Parametrizations (``torch.nn.utils.parametrize``) pass: they live on the parameter, which
    the fused path reads through the same attribute.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def has_module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` holds forward, forward pre-, backward or backward pre-hooks."""
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks)


def runs_stock_forward(module: nn.Module, forward: Callable) -> bool:
    """Whether ``module(*args)`` is exactly ``forward(module, *args)``: its class's ``forward`` is
    ``forward`` (not an override), none is set on the instance, and it has no module hooks."""
    return type(module).forward is forward and "forward" not in vars(module) and not has_module_hooks(module)
