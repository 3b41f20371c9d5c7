"""The GPT-style layer stack every benchmark configuration trains, and its checkpoint wrappers.

``GPTBlock`` is the eager baseline: pre-LayerNorm, causal multi-head attention, GELU MLP,
dropout on the attention probabilities and on both residual branches. Its parameter names are
the ones ``memopt.FusedCheckpointBlock`` is expected to use (``norm1, qkv, out_proj, norm2,
fc1, fc2``), so one ``state_dict`` initialises every configuration and the gradient sanity check
compares like with like.

Conventions the fused block must share for the weights to mean the same thing:
``qkv.weight`` is ``(3 * d_model, d_model)`` with rows ``[q; k; v]``, each split into heads as
``(n_heads, head_dim)``; GELU is the exact (erf) form; attention is scaled by ``head_dim**-0.5``.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from memopt.policy import POLICIES, selective_checkpoint_policy

ATTENTION_IMPLS = ("math", "sdpa")

# Names FusedCheckpointBlock is expected to use; the lead confirms them when the block lands.
FUSED_BLOCK_PARAMETER_NAMES = (
    "norm1.weight",
    "norm1.bias",
    "qkv.weight",
    "qkv.bias",
    "out_proj.weight",
    "out_proj.bias",
    "norm2.weight",
    "norm2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
)


class GPTBlock(nn.Module):
    """One pre-LN transformer decoder layer in plain PyTorch.

    Args:
        d_model: width of the residual stream.
        n_heads: attention heads; must divide ``d_model``.
        d_ff: hidden width of the MLP.
        dropout: drop probability for attention probabilities and both residual branches.
        attention: ``"math"`` (matmul, mask, softmax, dropout, matmul: what a hand-written
            block saves) or ``"sdpa"`` (``F.scaled_dot_product_attention``, causal).

    Shape: ``(batch, seq, d_model) -> (batch, seq, d_model)``.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, attention: str = "sdpa"):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"GPTBlock: d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"GPTBlock: attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.attention = attention
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        seq = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return torch.matmul(F.dropout(probs, p, self.training), v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_heads
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.n_heads, head_dim).permute(2, 0, 3, 1, 4)
        attn = self._attend(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(batch, seq, d_model)
        x = x + F.dropout(self.out_proj(attn), self.dropout, self.training)
        hidden = F.gelu(self.fc1(self.norm2(x)))
        return x + F.dropout(self.fc2(hidden), self.dropout, self.training)


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
) -> list[GPTBlock]:
    """``n_layers`` freshly initialised eager blocks; every configuration copies their weights."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    blocks = [GPTBlock(d_model, n_heads, d_ff, dropout, attention="math") for _ in range(n_layers)]
    torch.random.set_rng_state(generator_state)
    return blocks


def fused_state_dict_from_eager(eager_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map one ``GPTBlock`` state dict onto ``FusedCheckpointBlock``'s parameter names.

    The two share the names in ``FUSED_BLOCK_PARAMETER_NAMES`` and the layout conventions in
    this module's docstring, so the mapping is the identity on those keys; it exists to fail
    loudly, naming the keys, if either side drifts.
    """
    missing = [k for k in FUSED_BLOCK_PARAMETER_NAMES if k not in eager_state]
    unexpected = [k for k in eager_state if k not in FUSED_BLOCK_PARAMETER_NAMES]
    if missing or unexpected:
        raise KeyError(
            f"fused_state_dict_from_eager: eager state dict must have exactly {FUSED_BLOCK_PARAMETER_NAMES}; "
            f"missing {missing}, unexpected {unexpected}"
        )
    return {k: eager_state[k] for k in FUSED_BLOCK_PARAMETER_NAMES}
