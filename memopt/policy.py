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

from typing import Any

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


def selective_checkpoint_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The ``policy_fn`` of PyTorch's ``create_selective_checkpoint_contexts`` for ``"selective"``."""
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_policy(value: Any, owner: str, name: str = "policy") -> str:
    """``value`` if it is one of :data:`POLICIES`; else ``ValueError`` naming ``owner``'s argument
    ``name`` (``policy="offload"`` is told what to write instead)."""
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
