"""philox_keep_mask, philox_dropout_scale: dropout masks of parts of a larger tensor.

Layers: kernels in ``csrc/philox_mask.cpp`` (CPU) and ``csrc/philox_mask_cuda.cu`` (CUDA,
philox_keep_mask only), registered as ``torch.ops.memopt.philox_keep_mask`` and
``torch.ops.memopt.philox_dropout_scale``; the fake impls below let ``torch.compile`` trace them.
``philox_keep_mask_ref`` is the plain PyTorch reference built on ``memopt.ops._philox``.

Used where a kernel is not fused with its dropout: the native CPU attention path multiplies each key
chunk of the (B, H, Sq, Sk) probabilities by ``philox_dropout_scale`` of that window, the same bits
the fused kernels draw for those elements (``csrc/philox.h``), without building an index tensor.
"""

from __future__ import annotations

import torch

from memopt import _extension
from memopt.ops._common import check_dropout_p, check_tensor
from memopt.ops._philox import dropout_threshold, philox4x32_10
from memopt.ops._rng import check_fake_rng_key, check_rng_key


@torch.library.register_fake("memopt::philox_keep_mask")
def _philox_keep_mask_fake(index, p, rng_key):
    check_fake_rng_key("philox_keep_mask", rng_key)
    return torch.empty(index.shape, dtype=torch.bool, device=index.device)


def philox_keep_mask(index: torch.Tensor, p: float, rng_key: torch.Tensor) -> torch.Tensor:
    """Keep bits of the elements ``index`` of a tensor dropped out with ``p`` under ``rng_key``.

    Element ``i`` is kept iff word ``i % 4`` of ``philox4x32_10(offset + i // 4, seed)`` is
    ``>= dropout_threshold(p)`` (``csrc/philox.h``), the mask every memopt dropout applies.

    Args:
        index: int64 tensor of any shape holding flat element indices ``>= 0``, on CPU or CUDA.
        p: drop probability in ``[0, 1)``.
        rng_key: int64 CPU tensor ``(seed, offset)`` of shape ``[2]``, also for CUDA ``index``.

    Returns:
        bool tensor of ``index``'s shape (contiguous, on ``index``'s device): True where kept.
    """
    check_tensor("philox_keep_mask", "index", index)
    if index.dtype != torch.int64:
        raise ValueError(f"memopt.philox_keep_mask: index must be int64, got {index.dtype}")
    check_dropout_p("philox_keep_mask", p)
    check_rng_key("philox_keep_mask", rng_key)
    _extension.require_cuda_kernels("philox_keep_mask", index)
    return torch.ops.memopt.philox_keep_mask(index, float(p), rng_key)


def philox_keep_mask_ref(index: torch.Tensor, p: float, rng_key: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch reference of :func:`philox_keep_mask` (int64 arithmetic on the host)."""
    seed, offset = (int(v) for v in rng_key.tolist())
    index = index.cpu().to(torch.int64)
    words = philox4x32_10(offset + index // 4, seed).gather(-1, (index % 4).unsqueeze(-1)).squeeze(-1)
    return words >= dropout_threshold(p)


@torch.library.register_fake("memopt::philox_dropout_scale")
def _philox_dropout_scale_fake(size, index_strides, index_offset, p, rng_key, dtype):
    check_fake_rng_key("philox_dropout_scale", rng_key)
    return torch.empty(size, dtype=dtype)


def philox_dropout_scale(
    size, index_strides, index_offset: int, p: float, rng_key: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dropout factors of a strided window of element indices, as a CPU tensor of ``size``.

    Entry ``(i_0, .., i_n)`` stands for the element ``index_offset + sum_d i_d * index_strides[d]``
    of a tensor dropped out with ``p`` under ``rng_key``: ``1 / (1 - p)`` where that element is kept
    (:func:`philox_keep_mask`'s bits), ``0`` where it is dropped. The last index stride must be 1.
    E.g. rows ``r0:`` and columns ``c0:c1`` of a ``(B, H, Sq, Sk)`` tensor: ``size=(B, H, Sq - r0,
    c1 - c0)``, ``index_strides=(H * Sq * Sk, Sq * Sk, Sk, 1)``, ``index_offset=r0 * Sk + c0``.

    ``rng_key``: int64 CPU tensor ``(seed, offset)`` of shape ``[2]``.

    Returns:
        float32 or float64 (``dtype``) contiguous CPU tensor of ``size``.
    """
    check_rng_key("philox_dropout_scale", rng_key)
    return torch.ops.memopt.philox_dropout_scale(list(size), list(index_strides), int(index_offset), float(p), rng_key, dtype)
