"""philox_keep_mask: the dropout keep-mask of any set of element indices.

Layers: kernels in ``csrc/philox_mask.cpp`` (CPU) and ``csrc/philox_mask_cuda.cu`` (CUDA),
registered as ``torch.ops.memopt.philox_keep_mask``; the fake impl below lets ``torch.compile``
trace it. ``philox_keep_mask_ref`` is the plain PyTorch reference built on ``memopt.ops._philox``.

Used where a kernel is not fused with its dropout (the native CPU attention path): the mask of a
chunk of the (B, H, Sq, Sk) probabilities is ``philox_keep_mask(flat indices of the chunk, p,
rng_key)``, the same bits the fused kernels draw for those elements (``csrc/philox.h``).
"""

from __future__ import annotations

import torch

from memopt import _extension
from memopt.ops._philox import dropout_threshold, philox4x32_10


@torch.library.register_fake("memopt::philox_keep_mask")
def _philox_keep_mask_fake(index, p, rng_key):
    return torch.empty(index.shape, dtype=torch.bool, device=index.device)


def philox_keep_mask(index: torch.Tensor, p: float, rng_key: torch.Tensor) -> torch.Tensor:
    """Keep bits of the elements ``index`` of a tensor dropped out with ``p`` under ``rng_key``.

    Element ``i`` is kept iff word ``i % 4`` of ``philox4x32_10(offset + i // 4, seed)`` is
    ``>= dropout_threshold(p)`` (``csrc/philox.h``), the mask every memopt dropout applies.

    Args:
        index: int64 tensor of any shape holding flat element indices ``>= 0``, on CPU or CUDA.
        p: drop probability in ``[0, 1)``.
        rng_key: int64 CPU tensor ``(seed, offset)``.

    Returns:
        bool tensor of ``index``'s shape (contiguous, on ``index``'s device): True where kept.
    """
    _extension.require_cuda_kernels("philox_keep_mask", index)
    return torch.ops.memopt.philox_keep_mask(index, float(p), rng_key)


def philox_keep_mask_ref(index: torch.Tensor, p: float, rng_key: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch reference of :func:`philox_keep_mask` (int64 arithmetic on the host)."""
    seed, offset = (int(v) for v in rng_key.tolist())
    index = index.cpu().to(torch.int64)
    words = philox4x32_10(offset + index // 4, seed).gather(-1, (index % 4).unsqueeze(-1)).squeeze(-1)
    return words >= dropout_threshold(p)
