"""Philox4x32-10 in plain PyTorch: the independent reference for every memopt dropout mask.

Implements the convention documented in ``csrc/philox.h``: element ``i`` of a contiguous tensor
draws word ``i % 4`` of ``philox4x32_10(counter=offset + i // 4, key=seed)`` and is kept iff that
word is ``>= dropout_threshold(p)``. Slow (int64 arithmetic on the host), for tests only.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85


def _u64_to_words(value: int) -> tuple[int, int]:
    value &= (1 << 64) - 1
    return value & _MASK32, value >> 32


def philox4x32_10(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """Four uint32 words (as int64, shape ``counter.shape + (4,)``) per 64-bit counter."""
    counter = counter.to(torch.int64)
    c0 = counter & _MASK32
    c1 = (counter >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = _u64_to_words(seed)
    for _ in range(10):
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return torch.stack([c0, c1, c2, c3], dim=-1)


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a < 2^32, b < 2^32, exactly, in int64."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    b_lo, b_hi = b & 0xFFFF, b >> 16
    lo_lo = a_lo * b_lo
    mid = a_hi * b_lo + a_lo * b_hi  # < 2^33
    hi_hi = a_hi * b_hi
    low = lo_lo + ((mid & 0xFFFF) << 16)
    high = hi_hi + (mid >> 16) + (low >> 32)
    return high & _MASK32, low & _MASK32


def dropout_threshold(p: float) -> int:
    scaled = p * 4294967296.0
    return 0xFFFFFFFF if scaled >= 4294967295.0 else int(scaled)


def philox_words(numel: int, seed: int, offset: int = 0) -> torch.Tensor:
    """The random word of each element ``0 .. numel-1`` (int64 holding uint32)."""
    blocks = (numel + 3) // 4
    counters = torch.arange(blocks, dtype=torch.int64) + offset
    return philox4x32_10(counters, seed).reshape(-1)[:numel]


def dropout_keep_mask(shape, p: float, seed: int, offset: int = 0) -> torch.Tensor:
    """Boolean keep-mask of a contiguous tensor of ``shape`` under key ``(seed, offset)``."""
    numel = 1
    for s in shape:
        numel *= int(s)
    words = philox_words(numel, seed, offset)
    return (words >= dropout_threshold(p)).reshape(tuple(shape))
