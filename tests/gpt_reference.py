"""A plain PyTorch GPT-2 (pre-LN, matmul + softmax attention or SDPA, GELU MLP, dropout, tied head),
its blocks memopt's one eager reference (``memopt.EagerTransformerBlock``).

The estimator's eager formula describes exactly this model; the tests count what it saves.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from memopt import EagerTransformerBlock


def eager_block(d_model: int, n_heads: int, d_ff: int, dropout: float, max_seq: int, sdpa: bool = False):
    """memopt's one eager reference block in the GPT-2 configuration (``max_seq`` is accepted for
    the estimator tests' call shape; the block needs no size-bound buffer)."""
    del max_seq
    return EagerTransformerBlock(
        d_model, n_heads, d_ff, dropout=dropout, activation="gelu", norm="layernorm", norm_first=True,
        causal=True, attention="sdpa" if sdpa else "math",
    )  # fmt: skip


class EagerGPT(nn.Module):
    def __init__(self, n_layers, d_model, n_heads, vocab_size, seq_len, d_ff=None, dropout=0.1,
                 checkpoint: bool = False):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.dropout, self.checkpoint = dropout, checkpoint
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(eager_block(d_model, n_heads, d_ff, dropout, seq_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = F.dropout(self.wte(ids) + self.wpe(pos), self.dropout, self.training)
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)
