"""The GPT-style layer stack every benchmark configuration trains, and its checkpoint wrappers.

The eager baseline is memopt's one eager reference, ``memopt.EagerTransformerBlock`` (plain
PyTorch ops): pre-LayerNorm, causal multi-head attention (SDPA, or ``attention="math"``: matmul,
mask, softmax, dropout, matmul), exact GELU MLP, dropout on the attention probabilities and on
both residual branches. ``memopt.FusedCheckpointBlock`` has the same parameter names and layouts,
so one ``state_dict`` initialises every configuration and the gradient check compares like with like.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from memopt import EagerTransformerBlock
from memopt.policy import POLICIES, selective_checkpoint_policy


def gpt_block(d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, attention: str = "sdpa") -> EagerTransformerBlock:
    """The harness's eager block: ``memopt.EagerTransformerBlock`` in the GPT-2 configuration.

    Shape: ``(batch, seq, d_model) -> (batch, seq, d_model)``.
    """
    return EagerTransformerBlock(
        d_model, n_heads, d_ff, dropout=dropout, activation="gelu", norm="layernorm", norm_first=True,
        causal=True, attention=attention,
    )  # fmt: skip


def _selective_context_fn() -> Callable:
    # memopt's "selective" op list (memopt.policy.SELECTIVE_SAVED_OPS: matmuls, SDPA kernels)
    # through PyTorch's own selective checkpointing: the baseline users can write today.
    return functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy)


class LayerStack(nn.Module):
    """``n_layers`` blocks applied in sequence, each optionally under ``torch.utils.checkpoint``.

    Args:
        layers: the blocks (any modules mapping ``(B, S, D)`` to ``(B, S, D)``).
        checkpoint_mode: ``"none"``; ``"full"``: non-reentrant ``torch.utils.checkpoint`` per
            layer; ``"selective"``: the same with PyTorch's selective checkpointing, saving the
            outputs of ``memopt.policy.SELECTIVE_SAVED_OPS`` (matmuls, SDPA) and recomputing
            the rest.
    """

    def __init__(self, layers: list[nn.Module], checkpoint_mode: str = "none"):
        super().__init__()
        if checkpoint_mode not in POLICIES:
            raise ValueError(f"LayerStack: checkpoint_mode must be one of {POLICIES}, got {checkpoint_mode!r}")
        self.layers = nn.ModuleList(layers)
        self.checkpoint_mode = checkpoint_mode
        self._checkpoint_kwargs: dict = {"use_reentrant": False}
        if checkpoint_mode == "selective":
            self._checkpoint_kwargs["context_fn"] = _selective_context_fn()
            # Let outer saved-tensor hooks (the harness's byte counter) see what SAC saves, as
            # they see every other saved tensor; torch versions without the switch ignore them.
            if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
                self._checkpoint_kwargs["respect_saved_tensors_hooks"] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.checkpoint_mode == "none":
                x = layer(x)
            else:
                x = checkpoint(layer, x, **self._checkpoint_kwargs)
        return x


def make_reference_blocks(
    n_layers: int, d_model: int, n_heads: int, d_ff: int, dropout: float, seed: int
) -> list[EagerTransformerBlock]:
    """``n_layers`` freshly initialised eager blocks; every configuration copies their weights."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    blocks = [gpt_block(d_model, n_heads, d_ff, dropout, attention="math") for _ in range(n_layers)]
    torch.random.set_rng_state(generator_state)
    return blocks
