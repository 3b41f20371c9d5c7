"""A plain PyTorch GPT-2 (pre-LN, matmul + softmax attention or SDPA, GELU MLP, dropout, tied head).

The estimator's eager formula describes exactly this model; the tests count what it saves.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class EagerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, max_seq: int, sdpa: bool = False):
        super().__init__()
        self.n_heads, self.dropout, self.sdpa = n_heads, dropout, sdpa
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, d_ff)
        self.c_fc2 = nn.Linear(d_ff, d_model)
        self.register_buffer("causal", torch.ones(max_seq, max_seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        hd = d // self.n_heads
        q, k, v = self.c_attn(self.ln_1(x)).view(b, s, 3, self.n_heads, hd).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            p = self.dropout if self.training else 0.0
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            probs = scores.masked_fill(self.causal[:s, :s], float("-inf")).softmax(-1)
            probs = F.dropout(probs, self.dropout, self.training)
            o = probs @ v
        o = o.transpose(1, 2).reshape(b, s, d)
        x = x + F.dropout(self.c_proj(o), self.dropout, self.training)
        h = self.c_fc2(F.gelu(self.c_fc(self.ln_2(x))))
        return x + F.dropout(h, self.dropout, self.training)


class EagerGPT(nn.Module):
    def __init__(self, n_layers, d_model, n_heads, vocab_size, seq_len, d_ff=None, dropout=0.1,
                 checkpoint: bool = False):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.dropout, self.checkpoint = dropout, checkpoint
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(EagerBlock(d_model, n_heads, d_ff, dropout, seq_len) for _ in range(n_layers))
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
