"""The two axes of every memopt entry point: a recompute ``policy`` and ``offload``.

``policy`` says *what* is saved for backward; ``offload`` says *where* it lives. Every entry
point (``FusedCheckpointBlock``, ``FusedCheckpointStack``, ``memopt.checkpoint``, ``memopt.wrap``,
``memopt.plan``) takes both, with the meanings below.

Policies (:data:`POLICIES`):

- ``"none"``: no recompute; what autograd (or the fused block's backward kernels) needs is saved.
- ``"selective"``: the outputs of the expensive ops (matmuls, attention) are saved and the cheap
  ones (norms, activations, dropout masks, softmax, views) are recomputed from them. In the
  fused block this is the block's own saved set; for arbitrary code (``memopt.checkpoint``,
  ``memopt.wrap``) it is PyTorch's selective activation checkpointing with the op list
  :data:`SELECTIVE_SAVED_OPS`.
- ``"full"``: only the inputs are saved; the whole forward is recomputed in backward.
- a PyTorch selective-checkpoint policy function ``policy_fn(ctx, op, *args, **kwargs) ->
  torch.utils.checkpoint.CheckpointPolicy`` (``memopt.checkpoint`` and ``memopt.wrap`` only):
  the op outputs it marks ``MUST_SAVE``/``PREFER_SAVE`` are saved, the rest recomputed, as under
  ``torch.utils.checkpoint.checkpoint(..., context_fn=partial(create_selective_checkpoint_contexts,
  policy_fn))``; ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` (torch 2.14's enum; eager torch
  recomputes those) are saved and go to host memory through memopt's engine, as ``offload=True``
  would move them (see :class:`PolicyFunctionCall`). It may save random ops (dropout masks,
  ``rand_like``): the recompute puts the generator where the forward left it after each, so later
  random ops draw the same numbers (note [what a recompute may rely on], 3, in
  ``memopt/checkpoint.py``). The fused blocks decide their saved set themselves and take the
  names only.

Offload (``offload=``):

- ``False``: what the policy saves stays on the device.
- ``True``: it goes to host memory through ``memopt.offload``'s engine: the one that is active
  around the call (the call marks a new group there), else the process default
  (:func:`memopt.offload.default_offload`).
- a ``memopt.Offload``: that engine (a new group in it when it is already active).

Offload moves what the policy keeps: ``policy="selective", offload=True`` is the usual pairing
(little on the device, no extra matmul); under ``"full"`` it moves the layer inputs themselves,
so the device holds no layer's activations between its forward and its backward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy

from memopt.offload import Offload

POLICIES = ("none", "selective", "full")
"""The recompute policies, weakest (saves most) first."""

_aten = torch.ops.aten


def _existing_ops(names: list[str]) -> frozenset:
    # Some attention kernels exist only in some builds or versions of torch.
    ops = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            ops.extend(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


SELECTIVE_SAVED_OPS: frozenset = _existing_ops(
    [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "linear",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ]
)
"""The aten ops whose outputs ``policy="selective"`` saves in arbitrary code; every other op is
recomputed."""


# id(op) -> (op, whether "selective" saves its outputs). An op overload's own __hash__ is Python
# code (~0.5 us), run for every op of every checkpointed forward by a set lookup; an int key is
# not. The op is kept in the value so that its id cannot be reused by another object.
_SAVED_BY_ID: dict[int, tuple[Any, bool]] = {}


def is_selective_saved(op) -> bool:
    """Whether ``policy="selective"`` saves the outputs of ``op`` (it is in :data:`SELECTIVE_SAVED_OPS`)."""
    known = _SAVED_BY_ID.get(id(op))
    if known is None:
        known = _SAVED_BY_ID[id(op)] = (op, op in SELECTIVE_SAVED_OPS)
    return known[1]


def selective_checkpoint_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The ``policy_fn`` of PyTorch's ``create_selective_checkpoint_contexts`` for ``"selective"``."""
    return CheckpointPolicy.MUST_SAVE if is_selective_saved(op) else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE = frozenset((CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE))
# The CPU-offload values (torch 2.14 has them, earlier torch does not), each with the save value
# of the same strength that memopt hands PyTorch's selective checkpointing in its place.
_CPU_OFFLOAD_AS_SAVE = {
    getattr(CheckpointPolicy, offload_name): getattr(CheckpointPolicy, save_name)
    for offload_name, save_name in (("MUST_CPU_OFFLOAD", "MUST_SAVE"), ("PREFER_CPU_OFFLOAD", "PREFER_SAVE"))
    if hasattr(CheckpointPolicy, offload_name)
}


class PolicyFunctionCall:
    """A user's selective-checkpoint policy function, for one checkpointed call.

    PyTorch's selective checkpointing calls it with every op of the forward (and, in torch before
    2.13, again in the recompute with ``ctx.is_recompute`` True). It answers what the user's
    function answers, with the CPU-offload values replaced by the save value of the same strength,
    and records, for the forward only, which calls were saved and which the function wanted on
    the host, as ``(op, n)``: the ``n``-th call of ``op`` in the forward.

    Args:
        policy_fn: ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (a bool is taken as
            PyTorch takes it: True saves).
        owner: who calls, for error messages.
    """

    def __init__(self, policy_fn: Callable[..., Any], owner: str = "memopt.checkpoint"):
        self.policy_fn = policy_fn
        self.owner = owner
        self.saved: set[tuple[Any, int]] = set()
        self.offloaded: list[tuple[Any, int]] = []
        self._calls: dict = defaultdict(int)

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = self.policy_fn(ctx, op, *args, **kwargs)
        if isinstance(decision, bool):
            decision = CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.PREFER_RECOMPUTE
        if not isinstance(decision, CheckpointPolicy):
            raise TypeError(
                f"{self.owner}: the policy function must return a torch.utils.checkpoint.CheckpointPolicy, "
                f"got {decision!r} for {op}"
            )
        to_host = decision in _CPU_OFFLOAD_AS_SAVE
        decision = _CPU_OFFLOAD_AS_SAVE.get(decision, decision)
        if not ctx.is_recompute:
            site = (op, self._calls[op])
            self._calls[op] += 1
            if decision in _SAVE:
                self.saved.add(site)
            if to_host:
                self.offloaded.append(site)
        return decision

    def is_saved(self, op, n: int) -> bool:
        """Whether the forward saved the outputs of the ``n``-th call of ``op``."""
        return (op, n) in self.saved


def check_policy(value: Any, owner: str, name: str = "policy", functions: bool = False) -> str | Callable:
    """``value`` if it is one of :data:`POLICIES` (or, with ``functions``, a selective-checkpoint
    policy function); else ``ValueError`` naming ``owner``'s argument ``name``
    (``policy="offload"`` is told what to write instead)."""
    if callable(value) and not isinstance(value, str):
        if functions:
            return value
        raise ValueError(
            f"{owner}: {name} must be one of {list(POLICIES)}, got the function {value!r}; a PyTorch "
            "selective-checkpoint policy function is taken by memopt.checkpoint and memopt.wrap"
        )
    if value == "offload":
        raise ValueError(
            f"{owner}: {name}='offload' is not a policy: offload is its own argument; "
            "write policy='selective', offload=True"
        )
    if not isinstance(value, str) or value not in POLICIES:
        raise ValueError(f"{owner}: {name} must be one of {list(POLICIES)}, got {value!r}")
    return value


def check_offload(value: Any, owner: str, name: str = "offload") -> bool | Offload:
    """``value`` if it is False, True or a ``memopt.Offload``; else ``TypeError`` naming it."""
    if isinstance(value, bool) or isinstance(value, Offload):
        return value
    raise TypeError(f"{owner}: {name} must be False, True or a memopt.Offload (memopt.offload(...)), got {value!r}")
