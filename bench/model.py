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


def sac_saved_bytes_countable() -> bool:
    """Whether this torch's checkpoint shows the tensors PyTorch's selective checkpointing saves to
    outer saved-tensor hooks (``respect_saved_tensors_hooks``, torch 2.14): without it a byte
    count of a selective-checkpointing run leaves them all out."""
    return "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


def selective_checkpoint_kwargs() -> dict:
    """``torch.utils.checkpoint`` keyword arguments for PyTorch's selective checkpointing of
    memopt's "selective" op list (``memopt.policy.SELECTIVE_SAVED_OPS``: matmuls, SDPA kernels),
    the baseline users can write today; what it saves is shown to outer saved-tensor hooks (the
    harnesses' byte counters) where this torch can."""
    kwargs = {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy),
    }
    if sac_saved_bytes_countable():
        kwargs["respect_saved_tensors_hooks"] = True
    return kwargs


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
        selective = checkpoint_mode == "selective"
        self._checkpoint_kwargs = selective_checkpoint_kwargs() if selective else {"use_reentrant": False}

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
