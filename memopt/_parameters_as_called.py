"""A recompute that runs on the parameters its forward ran on.

memopt's recomputes (:func:`memopt.checkpoint`'s, the tiled FFN's backward) call the user's
function again, and a module's forward reads its parameters from the module's attributes at that
time, not from the forward's. Between the two, the tensors the module holds as parameters can
change without any write into a tensor:

* ``torch.func.functional_call(model, fast_weights, x)`` (MAML, fast weights, hypernetworks)
  puts ``fast_weights`` into the modules for the call and the model's own parameters back when it
  returns, before the backward;
* an assignment ``module.weight = nn.Parameter(...)`` between forward and backward.

A recompute then runs with other weights than the forward: gradients silently wrong
(``torch.utils.checkpoint`` is, too), or ``None`` for the forward's parameter where the tiled FFN
asks for its gradient.

Note:
    :class:`ParametersAsCalled` records, when the forward starts, the tensor in every
    ``_parameters`` entry of the modules the function runs (by identity: no copy), and each
    later call (a recompute) puts back the recorded tensors that are no longer there, as
    ``torch.func.functional_call`` reparametrizes, and what it found there after the call. The
    usual case, nothing replaced, costs one identity check per entry. Writes into a parameter
    (``optimizer.step()``) are a different matter: the tensor is the same and autograd's version
    checks apply. Entries where the recorded or the current tensor is a ``DTensor`` are left to
    their owner: FSDP2 swaps sharded ``DTensor`` parameters and unsharded ones in and out around
    every forward and backward of its modules, and its hooks put the right ones in place for the
    recompute. A parametrization (``torch.nn.utils.parametrize``, ``weight_norm``) keeps its
    parameters in ``_parameters`` of its own submodules, which are walked too; the recompute
    rebuilds the weight from them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

from torch import nn

_MISSING = object()


def submodules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """``modules`` and all their submodules, each once (``nn.Module.modules()`` of each, merged;
    about half its cost: every checkpointed call walks them)."""
    found: dict[int, nn.Module] = {}
    pending = list(modules)
    while pending:
        module = pending.pop()
        if module is not None and id(module) not in found:
            found[id(module)] = module
            pending += module._modules.values()
    return list(found.values())


def _is_dtensor(value: Any) -> bool:
    dtensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return dtensor_module is not None and isinstance(value, dtensor_module.DTensor)


class ParametersAsCalled:
    """``fn`` called with the parameters that ``modules`` (their ``_parameters`` entries; pass
    :func:`submodules`) held when this object was made, as the forward starts. The first call is
    the forward, made right away, and runs as it is; each later one (a recompute, or the next
    chunk of a tiled forward) first puts back the recorded tensors that were replaced since."""

    __slots__ = ("fn", "_entries", "_called")

    def __init__(self, fn: Callable, modules: list[nn.Module]):
        self.fn = fn
        # (module, name, tensor or None): None entries too, so that a bias added later is taken out
        self._entries = [(module, name, value) for module in modules for name, value in module._parameters.items()]
        self._called = False

    def __call__(self, *args, **kwargs):
        if not self._called:
            self._called = True
            return self.fn(*args, **kwargs)
        replaced = [
            (module, name, value, now)
            for module, name, value in self._entries
            if (now := module._parameters.get(name, _MISSING)) is not value
        ]
        replaced = [entry for entry in replaced if not (_is_dtensor(entry[2]) or _is_dtensor(entry[3]))]
        if not replaced:
            return self.fn(*args, **kwargs)
        for module, name, value, _ in replaced:
            module._parameters[name] = value
        try:
            return self.fn(*args, **kwargs)
        finally:
            for module, name, _, now in replaced:
                if now is _MISSING:
                    module._parameters.pop(name, None)
                else:
                    module._parameters[name] = now
