"""Dropout RNG keys drawn from torch's generator.

A key is an int64 CPU tensor ``(seed, offset)``. The seed is drawn from torch's default CPU
generator, so ``torch.manual_seed`` fixes every mask on every device; the tensor stays on the host
so CUDA launchers read it without a device sync, and drawing it is traceable by ``torch.compile``.
"""

from __future__ import annotations

import torch


def new_rng_key(generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh ``(seed, offset)`` key: a random 63-bit seed and offset 0.

    Returns an int64 CPU tensor of shape ``[2]``.
    """
    seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64)])


def rng_key(seed: int, offset: int = 0) -> torch.Tensor:
    """An explicit key, for replaying a mask."""
    return torch.tensor([seed, offset], dtype=torch.int64)
