"""What the autograd Functions share for ``create_graph=True`` (double backward).

The fast backward kernels are not differentiable. When a backward runs with
``create_graph=True`` (grad mode is on inside a backward exactly then), each Function re-runs its
forward in differentiable PyTorch ops and differentiates that instead, so gradient penalties,
Hessian-vector products and MAML get exact second derivatives; an ordinary backward keeps the
kernels.
"""

from __future__ import annotations

import torch


def building_graph() -> bool:
    """True inside a backward that runs with ``create_graph=True``."""
    return torch.is_grad_enabled()


def grads_with_graph(output: torch.Tensor, inputs, grad_output: torch.Tensor | None) -> list:
    """``torch.autograd.grad(output, inputs, grad_output, create_graph=True)`` for the inputs that
    require grad; None for the others (and for all when ``grad_output`` is None)."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    grads = iter(
        torch.autograd.grad(output, wanted, grad_output, create_graph=True, allow_unused=True)
        if wanted and grad_output is not None else [None] * len(wanted)
    )
    return [next(grads) if t is not None and t.requires_grad else None for t in inputs]
