"""Whether a call records an autograd graph: the one rule for skipping a checkpoint.

A checkpoint saves less for a backward; where no backward graph is recorded it saves nothing
and costs host time only (its frame, the RNG state stash, buffer copies, saved-tensor hooks, the
selective policy's dispatch mode on every op). :func:`memopt.checkpoint`, ``memopt.wrap``'s
layers and the torch layer that a swapped ``nn.TransformerEncoderLayer`` falls back to ask
:func:`records_graph` and call the function directly when it says no. The fused block's
``memopt.block_functions.needs_autograd`` is the same rule for one input and the block's
parameters.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.utils._pytree import tree_leaves

from memopt._parameters_as_called import submodules


def records_graph(tensors: Any, modules: Iterable[nn.Module] | None) -> bool:
    """Whether a call that reads ``tensors`` and runs ``modules`` records an autograd graph or
    runs under forward-mode AD, so that it must take memopt's checkpointed path:

    * a forward-mode AD level is active (``torch.autograd.forward_ad.dual_level``,
      ``torch.func.jvp``): True, the checkpointed path as it always ran;
    * gradients are off (``torch.no_grad``, ``torch.inference_mode``): False. A function that
      turns gradients on inside records a graph there; ``torch.utils.checkpoint`` runs such a
      call plainly too (no saved-tensor hooks when gradients are off as it starts), so the
      direct call keeps as much memory as torch's checkpoint would;
    * ``modules`` is None (the call may read tensors nobody can see: a closure, a plain
      function): True;
    * otherwise whether a tensor among the leaves of ``tensors`` (a pytree: ``(args, kwargs)``)
      or a parameter of ``modules`` or of their submodules (their ``_parameters`` as the call
      starts: ``torch.func.functional_call``'s and FSDP2's swapped-in ones) requires grad. A leaf
      that is neither a tensor nor a plain value (None, bool, int, float, complex, str, bytes, a
      dtype, device, layout, memory format or enum) counts as one that requires grad: an object
      that is no registered pytree node (a plain dataclass, a cache object, a function) may hold
      such a tensor unseen.

    This is the rule of ``memopt.block_functions.needs_autograd``, for any call. Tensors the call
    reads from elsewhere (a tied weight held as a plain attribute, another module's parameter
    read by a closure or a hook) are not seen: a call that reads one that requires grad records
    a graph where this says False. Running it directly is still exact; only the checkpoint's
    memory saving is lost (``memopt.wrap`` notices it from the output, outside ``torch.compile``,
    and checkpoints the layer's later calls). Traces under ``torch.compile(fullgraph=True)``.
    """
    if forward_ad._current_level >= 0:  # -1 outside every dual level; read under torch.compile too
        return True
    if not torch.is_grad_enabled():
        return False
    if modules is None:
        return True
    if may_require_grad(tensors):
        return True
    for module in submodules(modules):
        for p in module._parameters.values():
            if p is not None and p.requires_grad:
                return True
    return False


# Values that hold no tensor: None, bool, int, float, complex, str, bytes, dtypes, devices,
# layouts, memory formats, enums (torch.Size is a tuple of ints, seen through below).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum)  # fmt: skip


def may_require_grad(tree: Any) -> bool:
    """Whether ``tree`` (a pytree: a call's ``(args, kwargs)``, or its result) may hold a tensor
    that requires grad: a tensor leaf that requires grad, or a leaf that is neither a tensor nor a
    plain value (a plain dataclass, a cache object, a closure: no registered pytree node, so its
    tensors cannot be seen). :func:`records_graph` asks it of a call's arguments; ``memopt.wrap``
    of a result, where True means the call may have recorded a graph that reaches it."""
    # tree_leaves flattens the whole tree first (~4 us for a layer's (args, kwargs)); the usual
    # hit, a tensor argument that requires grad (the hidden states in training), comes first
    # here, and tuples, lists and dicts are walked without it.
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if isinstance(tree, (tuple, list)):
        return any(may_require_grad(v) for v in tree)
    if isinstance(tree, dict):
        return any(may_require_grad(v) for v in tree.values())
    if isinstance(tree, _PLAIN):
        return False
    leaves = tree_leaves(tree)  # another pytree node (a registered dataclass), or a leaf
    if len(leaves) == 1 and leaves[0] is tree:
        return True  # no pytree node: what it holds is unseen
    return any(may_require_grad(leaf) for leaf in leaves)
