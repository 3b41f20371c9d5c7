"""The registry of configurations the harness compares: what users have today, and memopt.

Every configuration is built from the same reference blocks (``BuildContext.reference_blocks``)
so that all of them start from identical weights. A configuration that cannot run here (offload
without a GPU, ``torch.compile`` not requested) says why through ``unavailable``; the harness
lists it with that reason instead of hiding it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

import memopt
from bench.model import LayerStack, gpt_block
from memopt.policy import POLICIES

FUSED_CHOICES = tuple((policy, False) for policy in POLICIES) + (("selective", True),)
"""The ``(policy, offload)`` of each ``memopt-*`` block row: every policy, and the selective set
offloaded (the row ``memopt-offload``)."""


@dataclass(frozen=True)
class BuildContext:
    """What a configuration needs to build its model."""

    reference_blocks: list[memopt.EagerTransformerBlock]
    d_model: int
    n_heads: int
    d_ff: int
    dropout: float
    device: torch.device
    dtype: torch.dtype
    compile: bool = False

    def with_dropout(self, dropout: float) -> "BuildContext":
        return replace(self, dropout=dropout)


@dataclass(frozen=True)
class BenchConfig:
    """One row of the comparison.

    Attributes:
        name: short unique name (the table's first column).
        provider: ``"torch"`` or ``"memopt"``.
        description: one line for the README and the JSON.
        build: returns the model ``(B, S, D) -> (B, S, D)`` in training mode on the context's
            device and dtype, with the reference weights.
        unavailable: returns why the configuration cannot run here, or None when it can.
        tracks_memory: False when allocations bypass the dispatcher (compiled code), so the
            live-tensor tracker cannot see them.
    """

    name: str
    provider: str
    description: str
    build: Callable[[BuildContext], nn.Module]
    unavailable: Callable[[BuildContext], str | None] = field(default=lambda ctx: None)
    tracks_memory: bool = True


def eager_blocks(ctx: BuildContext, attention: str) -> list[memopt.EagerTransformerBlock]:
    """Copies of the reference blocks with the context's dropout, attention, device and dtype."""
    blocks = []
    for ref in ctx.reference_blocks:
        block = gpt_block(ctx.d_model, ctx.n_heads, ctx.d_ff, ctx.dropout, attention=attention)
        block.load_state_dict(ref.state_dict())
        blocks.append(block.to(device=ctx.device, dtype=ctx.dtype))
    return blocks


def eager_stack(ctx: BuildContext, attention: str = "sdpa", checkpoint_mode: str = "none") -> nn.Module:
    return LayerStack(eager_blocks(ctx, attention), checkpoint_mode).train()


def fused_stack(ctx: BuildContext, policy: str, offload: bool = False) -> nn.Module:
    """A stack of ``memopt.FusedCheckpointBlock`` with the reference weights loaded."""
    blocks = []
    for ref in ctx.reference_blocks:
        block = memopt.FusedCheckpointBlock(
            ctx.d_model,
            ctx.n_heads,
            ctx.d_ff,
            dropout=ctx.dropout,
            activation="gelu",
            norm="layernorm",
            norm_first=True,
            causal=True,
            policy=policy,
            offload=offload,
        )
        block.load_state_dict(ref.state_dict())
        blocks.append(block.to(device=ctx.device, dtype=ctx.dtype))
    return LayerStack(blocks, "none").train()


def _needs_offload_device(ctx: BuildContext) -> str | None:
    if ctx.device.type != "cuda":
        return "offload moves activations from GPU to host memory; there is no GPU here"
    return None


def _needs_compile(ctx: BuildContext) -> str | None:
    if not ctx.compile:
        return "torch.compile not requested (inductor costs ~20 s cold on CPU; pass --compile)"
    return None


def _compiled_stack(ctx: BuildContext) -> nn.Module:
    return torch.compile(eager_stack(ctx, "sdpa"))


def _compiled_fused_stack(ctx: BuildContext) -> nn.Module:
    # memopt's ops are opaque to inductor (registered ops with fake impls): it fuses what lies
    # between them (the residual stream, the layers' glue), as a user compiling the model gets.
    return torch.compile(fused_stack(ctx, "none", False))


def _wrapped_stack(ctx: BuildContext) -> nn.Module:
    return memopt.wrap(eager_stack(ctx, "sdpa"))


def _fused_config(policy: str, offload: bool) -> BenchConfig:
    return BenchConfig(
        name="memopt-offload" if offload else f"memopt-{policy}",
        provider="memopt",
        description=f"memopt.FusedCheckpointBlock per layer, policy={policy!r}, offload={offload}",
        build=lambda ctx: fused_stack(ctx, policy, offload),
        unavailable=_needs_offload_device if offload else (lambda ctx: None),
    )


def default_configs() -> list[BenchConfig]:
    """Baselines first (``eager-math`` is the gradient reference, ``torch-checkpoint`` the ratio
    reference), then memopt."""
    return [
        BenchConfig(
            "eager-math",
            "torch",
            "eager blocks, attention as matmul + softmax + dropout + matmul, no checkpointing",
            lambda ctx: eager_stack(ctx, "math"),
        ),
        BenchConfig(
            "eager-sdpa",
            "torch",
            "eager blocks, F.scaled_dot_product_attention, no checkpointing",
            lambda ctx: eager_stack(ctx, "sdpa"),
        ),
        BenchConfig(
            "torch-checkpoint",
            "torch",
            "torch.utils.checkpoint (non-reentrant) around each eager-sdpa layer",
            lambda ctx: eager_stack(ctx, "sdpa", "full"),
        ),
        BenchConfig(
            "torch-selective",
            "torch",
            "PyTorch selective checkpointing per layer: save mm/addmm/bmm/SDPA outputs, recompute the rest",
            lambda ctx: eager_stack(ctx, "sdpa", "selective"),
        ),
        BenchConfig(
            "torch-compile",
            "torch",
            "eager-sdpa stack under torch.compile (inductor)",
            _compiled_stack,
            unavailable=_needs_compile,
            tracks_memory=False,
        ),
        *[_fused_config(policy, offload) for policy, offload in FUSED_CHOICES],
        BenchConfig(
            "memopt-compile",
            "memopt",
            "memopt-none's stack under torch.compile (inductor), the counterpart of torch-compile",
            _compiled_fused_stack,
            unavailable=_needs_compile,
            tracks_memory=False,
        ),
        BenchConfig(
            "memopt-wrap",
            "memopt",
            "memopt.wrap applied to the eager-sdpa stack",
            _wrapped_stack,
        ),
    ]


GRAD_REFERENCE = "eager-math"
RATIO_REFERENCE = "torch-checkpoint"
# The baseline of memopt "none" and "selective" (the speed targets: at most 1.00x / 1.02x its time).
EAGER_REFERENCE = "eager-sdpa"


def config_names() -> list[str]:
    return [c.name for c in default_configs()]

