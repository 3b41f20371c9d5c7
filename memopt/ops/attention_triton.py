"""Triton kernels for scaled dot-product attention that recompute the probabilities in backward.

Forward (``_attn_fwd_kernel``): one program per (query block, head, batch element); an online softmax
over key blocks (FlashAttention-2's loop order) keeps a running row max and row sum in registers
and writes only the output and one float32 log-sum-exp per row. Backward: ``_attn_bwd_delta_kernel``
computes ``delta = rowsum(dout * out)``; ``_attn_bwd_dkdv_kernel`` runs one program per (key
block, kv head, batch element), walks the query blocks of every query head of its group and accumulates
dk and dv in registers; ``_attn_bwd_dq_kernel`` runs one program per (query block, head, batch element)
and walks the key blocks. Each output element is written by exactly one program (no atomics), so
gradients are bit-for-bit deterministic; grouped-query heads are summed inside the dkdv program.

Layouts. ``q``: (B, H, Sq, D); ``k``, ``v``: (B, Hkv, Sk, D), any strides with the last one 1; D any
head size from 1 to 256, tiled as ``block_head_dim(D)`` (a power of two) with the columns past D masked.
``out``, ``dq`` (B, H, Sq, D), ``dk``, ``dv`` (B, Hkv, Sk, D) are written in (B, S, H, D) memory
order; ``lse``: (B, H, Sq) float32, natural log.

Causal masking is top-left aligned, as ``F.scaled_dot_product_attention(is_causal=True)``: query
``i`` sees keys ``j <= i``, whatever ``Sq`` and ``Sk`` are, so no row is ever empty.

Masking. Only the tiles that cross the causal diagonal or the end of ``seq_k`` are masked; the
loops compute a per-block flag, uniform across the program, and branch around the mask elsewhere
(in the dk/dv kernel only the diagonal needs it, and under dropout it masks every causal tile, see
there). One loop with a branch rather than two copies of the loop specialised by a
``tl.constexpr`` (the Triton tutorial's two stages): the two-copy form compiled for sm_90 spilled
registers in the head_dim 128 dk/dv and dq kernels, the branch does not
(``python -m bench.attention_aot``).

Dropout on the probabilities. Element ``(b, h, i, j)`` of the (B, H, Sq, Sk) probability tensor has
the linear index ``idx = ((b * H + h) * Sq + i) * Sk + j`` and draws the word ``idx % 4`` of
``philox4x32_10(counter=offset + idx // 4, key=seed)``, i.e. ``tl.randint4x(seed, offset + idx // 4)``;
it is kept iff that uint32 word is ``>= floor(p * 2^32)`` and kept values are scaled by
``1 / (1 - p)``. This is the convention of ``csrc/philox.h`` applied to the probability tensor, so
``memopt.ops._philox.dropout_keep_mask((B, H, Sq, Sk), p, seed, offset)`` rebuilds the same mask.
When ``Sk % 4 == 0`` each row starts at a multiple of 4, so four adjacent probabilities share one
counter and one Philox call yields all four (``GROUPED_RNG``); otherwise each probability makes
its own call and keeps one word. Both give the same mask.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from memopt.ops._common import attention_out_empty

LOG2E = 1.4426950408889634


def interpreter_enabled() -> bool:
    """True when the @triton.jit kernels of this module were built for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Read once, when the decorators below run (Triton reads TRITON_INTERPRET at that moment too).
INTERPRETED = interpreter_enabled()

# GPU launch configurations, tuned by hand for Hopper (H100/H200, 227 KB shared memory per block):
# nothing can be measured on the build machine, so this is a table, and
# tests/test_attention_aot.py proves that every entry compiles for sm_90 without spilling.
#   kernel -> (block head_dim, dropout) -> (BLOCK_M, BLOCK_N, num_warps, num_stages)
# with one entry per power of two in BLOCK_HEAD_DIMS (tests/test_attention.py checks the two
# agree): a head_dim in between runs the entry of the power of two above it (block_head_dim).
# BLOCK_M tiles queries and BLOCK_N keys in every kernel; one entry serves float16 and bfloat16,
# causal or not. Dropout gets smaller tiles: Philox keeps four 32-bit words of state per element of
# the score tile while it runs, which spills the plain tiles.
# Triton 3.6 (the GPU machine's) allocates more registers than 3.8 for the same tile: bwd_dkdv at
# head_dim 32 (no dropout) takes 8 warps and at head_dim 128 with dropout BLOCK_M 16, the first
# entries that spill under neither (bench/attention_aot.py, compiled with both). bwd_dq at 128 with
# dropout takes 8 warps: with 4 (252 registers a thread unmasked) its masked tiles (head_dim 96)
# spilled 16 bytes under both; with 8, 158-180 registers in every variant.
GPU_CONFIGS = {
    "fwd": {
        (16, False): (128, 64, 4, 3), (16, True): (64, 64, 4, 3),
        (32, False): (128, 64, 4, 3), (32, True): (64, 64, 4, 3),
        (64, False): (128, 64, 4, 3), (64, True): (64, 64, 4, 3),
        (128, False): (128, 64, 8, 3), (128, True): (64, 64, 8, 3),
        (256, False): (64, 32, 8, 2), (256, True): (64, 32, 8, 2),
    },
    "bwd_dkdv": {
        (16, False): (32, 128, 4, 3), (16, True): (32, 64, 4, 3),
        (32, False): (32, 128, 8, 3), (32, True): (32, 64, 4, 3),
        (64, False): (32, 128, 8, 3), (64, True): (32, 128, 8, 3),
        (128, False): (32, 128, 8, 2), (128, True): (16, 64, 8, 2),
        (256, False): (32, 32, 8, 1), (256, True): (32, 32, 8, 1),
    },
    "bwd_dq": {
        (16, False): (128, 32, 4, 3), (16, True): (64, 32, 4, 3),
        (32, False): (128, 32, 4, 3), (32, True): (64, 32, 4, 3),
        (64, False): (128, 32, 4, 3), (64, True): (64, 32, 4, 3),
        (128, False): (128, 32, 8, 2), (128, True): (64, 32, 8, 3),
        (256, False): (64, 32, 8, 2), (256, True): (64, 32, 8, 2),
    },
}
BLOCK_HEAD_DIMS = (16, 32, 64, 128, 256)
# rowsum(dout * out): no dropout variant, BLOCK_N unused; the head sizes of the forward table.
GPU_CONFIGS["bwd_delta"] = {(d, False): (64, 0, 4, 1) for d, dropout in GPU_CONFIGS["fwd"] if not dropout}
# The entries of GPU_CONFIGS that a launch runs instead when Triton compiles the kernels without
# its 16-divisibility hint on some pointer or stride (see args_aligned): always with a head_dim
# that is not a multiple of 16, and with strided views of a wider buffer whatever the head_dim.
# Loads are then not vectorised and the kernels hold more registers; these entries of the table
# spilled there (sm_90, bfloat16, the most bytes a variant stored, triton 3.8 unless said, strides
# and element pointers unhinted): bwd_dkdv at 128 816, with dropout 96, at 256 with dropout 108,
# at 64 (triton 3.6) 140, with dropout 36; bwd_dq at 64 168, at 128 134, at 256 with dropout 56
# (3.6: 16); bwd_delta at 256 (3.6) 16; fwd at 256 with dropout 8; at a block's own width (views of
# wider rows, pointers hinted) bwd_dkdv at 128 700, bwd_dq at 64 60, at 128 36. Smaller tiles or
# more warps, none spilling under 3.6 or 3.8 (bench/attention_aot.py compiles every entry with the
# strides unhinted: at masked head_dims with the pointers hinted and not, at the block's own width
# with them; without either hint Triton emitted the same PTX).
UNALIGNED_GPU_CONFIGS = {
    "fwd": {(256, True): (32, 32, 8, 2)},
    "bwd_dkdv": {
        (64, False): (32, 64, 8, 3), (64, True): (32, 64, 8, 3),
        (128, False): (32, 64, 8, 2), (128, True): (16, 32, 8, 2), (256, True): (32, 16, 8, 1),
    },
    "bwd_dq": {(64, False): (128, 32, 8, 3), (128, False): (64, 32, 8, 2), (256, True): (16, 32, 8, 2)},
    "bwd_delta": {(256, False): (64, 0, 8, 1)},
}

# Under the interpreter the blocks are small so CPU tests stay fast, and tile edges are crossed
# by short sequences.
INTERPRETER_CONFIG = (16, 16, 1, 1)


def block_head_dim(head_dim: int) -> int:
    """The width the kernels tile a head of ``head_dim`` (1 to 256) as: ``head_dim`` when it is a
    power of two from 16 up (``tl.arange`` and ``tl.dot`` need one), else the next such power, with
    the columns past ``head_dim`` masked: read as zeros, so they add nothing to any product, and
    never written. (Integer arithmetic: triton 3.8's ``triton.next_power_of_2`` costs about 7 us
    a call on the host, and each launch asks twice.)"""
    return max(16, 1 << (head_dim - 1).bit_length())


def args_aligned(tensors, strides) -> bool:
    """Whether Triton compiles a launch with its 16-divisibility hint on every pointer and stride
    it passes: Triton specialises each pointer on ``data_ptr() % 16 == 0`` (bytes) and each integer
    on ``value % 16 == 0``, one argument at a time. ``tensors``: the element tensors the kernel
    reads and writes (lse and delta, fresh float32 buffers, are always aligned); ``strides``: every
    stride passed. False with a head_dim that is not a multiple of 16 (a fresh output's head or
    row stride is head_dim itself), and with strided views of a wider buffer (q, k, v of head_dim 64
    sliced from rows of 72) or views at an unaligned offset, whatever the head_dim: the loads are
    then not vectorised and the kernels run ``UNALIGNED_GPU_CONFIGS``."""
    for stride in strides:
        if stride % 16:
            return False
    for tensor in tensors:
        if tensor.data_ptr() % 16:
            return False
    return True


def gpu_config(kernel: str, head_dim: int, dropout: bool, aligned: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kernel`` on the GPU for heads of ``head_dim``,
    from ``UNALIGNED_GPU_CONFIGS`` where it has the entry and the launch is not ``aligned``
    (:func:`args_aligned`), else from ``GPU_CONFIGS``."""
    key = (block_head_dim(head_dim), dropout and kernel != "bwd_delta")
    if not aligned and key in UNALIGNED_GPU_CONFIGS[kernel]:
        return UNALIGNED_GPU_CONFIGS[kernel][key]
    return GPU_CONFIGS[kernel][key]


def launch_config(kernel: str, head_dim: int, dropout: bool, tensors, strides) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``kernel`` on this backend, launched on
    ``tensors`` with ``strides`` (see :func:`args_aligned`)."""
    if INTERPRETED:
        return INTERPRETER_CONFIG
    return gpu_config(kernel, head_dim, dropout, args_aligned(tensors, strides))


@triton.jit
def _dropout_keep(
    seed, rng_offset, drop_threshold,
    row_index,       # (BLOCK_M,) int64: index of each row's column 0 in the (B, H, Sq, Sk) tensor
    start_n,         # first column of the tile
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPED: tl.constexpr,  # Sk % 4 == 0: four adjacent columns share one Philox call
):
    """(BLOCK_M, BLOCK_N) keep-mask: element idx keeps iff word idx % 4 of Philox(offset + idx // 4)
    is >= drop_threshold."""
    if GROUPED:
        # Rows start at multiples of 4 and so does start_n: columns 4c..4c+3 are words 0..3 of
        # one counter, so each call yields four elements instead of one.
        counter = rng_offset + (row_index[:, None] + start_n) // 4 + tl.arange(0, BLOCK_N // 4)[None, :].to(tl.int64)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        k0 = (r0.to(tl.int64) >= drop_threshold).to(tl.int8)
        k1 = (r1.to(tl.int64) >= drop_threshold).to(tl.int8)
        k2 = (r2.to(tl.int64) >= drop_threshold).to(tl.int8)
        k3 = (r3.to(tl.int64) >= drop_threshold).to(tl.int8)
        # tl.join adds a new minor dim, so the outer join interleaves: [k0, k1, k2, k3] per group.
        keep = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), (BLOCK_M, BLOCK_N)) != 0
    else:
        index = row_index[:, None] + (start_n + tl.arange(0, BLOCK_N))[None, :].to(tl.int64)
        r0, r1, r2, r3 = tl.randint4x(seed, rng_offset + index // 4)
        word = index % 4
        r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
        keep = r.to(tl.int64) >= drop_threshold
    return keep


@triton.jit
def _load_rows(
    base,            # element (0, 0) of one (seq, HEAD_DIM) slice
    rows,            # (R,) row indices
    stride_row,
    offs_d,          # (BLOCK_D,) column indices
    row_valid,       # (R,) rows to read; the others read as zeros
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM or the power of two above it: columns past HEAD_DIM read as zeros
):
    """(R, BLOCK_D) tile of the slice at ``base``."""
    mask = row_valid[:, None]
    if HEAD_DIM < BLOCK_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _load_cols(
    base,            # element (0, 0) of one (seq, HEAD_DIM) slice
    cols,            # (C,) sequence indices, as columns of the tile
    stride_col,
    offs_d,          # (BLOCK_D,) head-dim indices, as rows of the tile
    col_valid,       # (C,) sequence positions to read; the others read as zeros
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """(BLOCK_D, C) tile: the transpose of what :func:`_load_rows` reads, k^T or v^T."""
    mask = col_valid[None, :]
    if HEAD_DIM < BLOCK_D:
        mask = mask & (offs_d[:, None] < HEAD_DIM)
    return tl.load(base + cols[None, :].to(tl.int64) * stride_col + offs_d[:, None], mask=mask, other=0.0)


@triton.jit
def _store_rows(
    base, rows, stride_row, offs_d,
    row_valid,       # (R,) rows to write
    value,           # (R, BLOCK_D): columns past HEAD_DIM are not written
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    mask = row_valid[:, None]
    if HEAD_DIM < BLOCK_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(base + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :], value, mask=mask)


@triton.jit
def _bwd_tile_grads(
    scores,          # raw q . k products of the tile
    dp,              # dout . v products of the tile
    lse,             # (BLOCK_M,) per-query log-sum-exp, base 2
    delta,           # (BLOCK_M,) per-query rowsum(dout * out)
    offs_m, offs_n,  # query and key indices of the tile
    seq_q, seq_k, qk_scale,
    row_index,       # (BLOCK_M,) int64: index of each query's column 0 in the (B, H, Sq, Sk) tensor
    start_n,         # first key of the tile
    seed, rng_offset, drop_threshold, keep_scale,
    masked,          # the tile crosses the causal diagonal or a sequence end (see the module docstring)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS_ON_ROWS: tl.constexpr,  # tiles are (keys, queries), as in the dk/dv kernel
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    GROUPED_RNG: tl.constexpr,
):
    """Recompute one tile of the probabilities from the saved log-sum-exp and return
    ``(p_dropped, ds)``: the probabilities after dropout (what multiplied v in forward) and
    ``ds = p * (dp_dropped - delta)``, the softmax gradient before the softmax scale. Both backward
    kernels call this, so the probabilities and the regenerated dropout mask are the forward's by
    construction."""
    if KEYS_ON_ROWS:
        query_index = offs_m[None, :]
        key_index = offs_n[:, None]
        lse = lse[None, :]
        delta = delta[None, :]
    else:
        query_index = offs_m[:, None]
        key_index = offs_n[None, :]
        lse = lse[:, None]
        delta = delta[:, None]
    p = tl.exp2(scores * qk_scale - lse)
    if masked:
        valid = (query_index < seq_q) & (key_index < seq_k)
        if CAUSAL:
            valid = valid & (key_index <= query_index)
        p = tl.where(valid, p, 0.0)
    p_dropped = p
    if DROPOUT:
        keep = _dropout_keep(seed, rng_offset, drop_threshold, row_index, start_n, BLOCK_M, BLOCK_N, GROUPED_RNG)
        if KEYS_ON_ROWS:
            keep = tl.trans(keep)
        p_dropped = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    ds = p * (dp - delta)
    return p_dropped, ds


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_heads,       # H, query heads
    group_size,      # H // Hkv: query heads sharing one key/value head
    seq_q, seq_k,
    qk_scale,        # softmax scale * log2(e): scores are kept in base 2
    seed, rng_offset,  # Philox key and counter offset of the dropout mask
    drop_threshold,  # uint32 words below this are dropped
    keep_scale,      # 1 / (1 - dropout_p)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,   # block_head_dim(HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    GROUPED_RNG: tl.constexpr,  # seq_k % 4 == 0: one Philox call per four probabilities
    UPCAST_DOT: tl.constexpr,  # interpreter only: its low-precision tl.dot is wrong
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    pid_bh = batch * num_heads + head
    kv_head = head // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    row_valid = offs_m < seq_q
    q = _load_rows(q_base, offs_m, stride_qm, offs_d, row_valid, HEAD_DIM, BLOCK_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # First element of this block's rows in the (B, H, Sq, Sk) probability tensor.
    row_index = (pid_bh.to(tl.int64) * seq_q + offs_m.to(tl.int64)) * seq_k

    # Every row of this block sees every key below visible_end; only the blocks crossing it (the
    # causal diagonal, the end of seq_k) are masked.
    hi = seq_k
    visible_end = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M)
        visible_end = tl.minimum(seq_k, pid_m * BLOCK_M + 1)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_valid = offs_n < seq_k
        k_t = _load_cols(k_base, offs_n, stride_kn, offs_d, col_valid, HEAD_DIM, BLOCK_D)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, col_valid, HEAD_DIM, BLOCK_D)
        if UPCAST_DOT:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, k_t) * qk_scale
        if start_n + BLOCK_N > visible_end:
            valid = col_valid[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            scores = tl.where(valid, scores, float("-inf"))
        # Every row has a finite score in its first block (key 0 is always visible), so m_new is
        # finite and alpha is 0 on the first iteration, never NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _dropout_keep(seed, rng_offset, drop_threshold, row_index, start_n, BLOCK_M, BLOCK_N, GROUPED_RNG)
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / l_i[:, None]
    out_base = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    _store_rows(out_base, offs_m, stride_om, offs_d, row_valid, acc.to(Out.dtype.element_ty), HEAD_DIM, BLOCK_D)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # base 2 -> natural log: times ln(2)
    tl.store(Lse + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=row_valid)


@triton.jit
def _attn_bwd_delta_kernel(
    Out, DOut, Delta,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    num_heads, seq_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,   # block_head_dim(HEAD_DIM)
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    pid_bh = batch * num_heads + head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = offs_m < seq_q
    o = _load_rows(
        Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh, offs_m, stride_om, offs_d, row_valid,
        HEAD_DIM, BLOCK_D,
    ).to(tl.float32)
    do = _load_rows(
        DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh, offs_m, stride_dom, offs_d, row_valid,
        HEAD_DIM, BLOCK_D,
    ).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * seq_q + offs_m, tl.sum(o * do, 1), mask=row_valid)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,  # dk and dv (one layout)
    num_heads, num_kv_heads, group_size,
    seq_q, seq_k,
    qk_scale,        # softmax scale * log2(e)
    sm_scale,        # softmax scale, applied to dk once at the end
    seed, rng_offset, drop_threshold, keep_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,   # block_head_dim(HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    GROUPED_RNG: tl.constexpr,  # seq_k % 4 == 0: one Philox call per four probabilities
    UPCAST_DOT: tl.constexpr,
):
    # Transposed tiles throughout: rows are keys (BLOCK_N), columns are queries (BLOCK_M).
    pid_n = tl.program_id(0)
    # (kv head, batch) from the grid's y and z axes through one linear index and back: the same
    # values as reading the two ids, but Triton 3.6 then allocates as it did for a 1-D batch x
    # heads axis (236 registers, no spill, in the masked head_dim-48 dropout variant; read
    # directly, 255 and 4 bytes spilled: bench/attention_aot.py).
    pid_bkv = tl.program_id(2) * num_kv_heads + tl.program_id(1)
    batch = pid_bkv // num_kv_heads
    kv_head = pid_bkv % num_kv_heads

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_valid = offs_n < seq_k
    k = _load_rows(
        K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh, offs_n, stride_kn, offs_d, key_valid,
        HEAD_DIM, BLOCK_D,
    )
    v = _load_rows(
        V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh, offs_n, stride_vn, offs_d, key_valid,
        HEAD_DIM, BLOCK_D,
    )
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Under the top-left causal mask, queries before this key block see none of it, and queries
    # from its last key on see all of it: only the query blocks crossing the diagonal are masked.
    # Nothing else needs the mask. Queries past seq_q load as zeros (q, dout, lse, delta), which
    # makes their p * dout and ds exactly 0; rows of keys past seq_k are never stored, and a row
    # of a product depends only on the same row of its left operand.
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    for g in range(0, group_size):
        head = kv_head * group_size + g
        bh = batch * num_heads + head
        q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
        do_base = DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
        for start_m in range(lo, seq_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            query_valid = offs_m < seq_q
            q = _load_rows(q_base, offs_m, stride_qm, offs_d, query_valid, HEAD_DIM, BLOCK_D)
            do = _load_rows(do_base, offs_m, stride_dom, offs_d, query_valid, HEAD_DIM, BLOCK_D)
            if UPCAST_DOT:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(Lse + bh.to(tl.int64) * seq_q + offs_m, mask=query_valid, other=0.0) * 1.4426950408889634
            delta = tl.load(Delta + bh.to(tl.int64) * seq_q + offs_m, mask=query_valid, other=0.0)

            row_index = (bh.to(tl.int64) * seq_q + offs_m.to(tl.int64)) * seq_k
            # Under dropout every causal tile is masked: Philox costs far more than the mask, and the
            # branch spilled registers in the head_dim 128 per-element-RNG variant.
            if CAUSAL and not DROPOUT:
                masked = start_m < (pid_n + 1) * BLOCK_N - 1
            else:
                masked = CAUSAL
            p_dropped_t, ds_t = _bwd_tile_grads(
                tl.dot(k, tl.trans(q)), tl.dot(v, tl.trans(do)), lse, delta, offs_m, offs_n, seq_q, seq_k, qk_scale,
                row_index, pid_n * BLOCK_N, seed, rng_offset, drop_threshold, keep_scale, masked,
                BLOCK_M, BLOCK_N, True, CAUSAL, DROPOUT, GROUPED_RNG,
            )
            dv += tl.dot(p_dropped_t.to(do.dtype), do)
            dk += tl.dot(ds_t.to(q.dtype), q)

    dk = dk * sm_scale
    out_head = batch.to(tl.int64) * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    _store_rows(DK + out_head, offs_n, stride_dkn, offs_d, key_valid, dk.to(DK.dtype.element_ty), HEAD_DIM, BLOCK_D)
    _store_rows(DV + out_head, offs_n, stride_dkn, offs_d, key_valid, dv.to(DV.dtype.element_ty), HEAD_DIM, BLOCK_D)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    num_heads, group_size,
    seq_q, seq_k,
    qk_scale, sm_scale,
    seed, rng_offset, drop_threshold, keep_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,   # block_head_dim(HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    GROUPED_RNG: tl.constexpr,  # seq_k % 4 == 0: one Philox call per four probabilities
    UPCAST_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    pid_bh = batch * num_heads + head
    kv_head = head // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    query_valid = offs_m < seq_q
    q = _load_rows(
        Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh, offs_m, stride_qm, offs_d, query_valid,
        HEAD_DIM, BLOCK_D,
    )
    do = _load_rows(
        DOut + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh, offs_m, stride_dom, offs_d, query_valid,
        HEAD_DIM, BLOCK_D,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * seq_q + offs_m, mask=query_valid, other=0.0) * 1.4426950408889634
    delta = tl.load(Delta + pid_bh.to(tl.int64) * seq_q + offs_m, mask=query_valid, other=0.0)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    row_index = (pid_bh.to(tl.int64) * seq_q + offs_m.to(tl.int64)) * seq_k
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # As in the forward: only the key blocks crossing visible_end are masked. Rows past seq_q are
    # computed from zeros and never stored.
    hi = seq_k
    visible_end = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M)
        visible_end = tl.minimum(seq_k, pid_m * BLOCK_M + 1)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < seq_k
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, key_valid, HEAD_DIM, BLOCK_D)
        v_t = _load_cols(v_base, offs_n, stride_vn, offs_d, key_valid, HEAD_DIM, BLOCK_D)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v_t = v_t.to(tl.float32)
        _, ds = _bwd_tile_grads(
            tl.dot(q, tl.trans(k)), tl.dot(do, v_t), lse, delta, offs_m, offs_n, seq_q, seq_k, qk_scale,
            row_index, start_n, seed, rng_offset, drop_threshold, keep_scale, start_n + BLOCK_N > visible_end,
            BLOCK_M, BLOCK_N, False, CAUSAL, DROPOUT, GROUPED_RNG,
        )
        dq += tl.dot(ds.to(k.dtype), k)

    dq = dq * sm_scale
    dq_base = DQ + batch.to(tl.int64) * stride_dqb + head.to(tl.int64) * stride_dqh
    _store_rows(dq_base, offs_m, stride_dqm, offs_d, query_valid, dq.to(DQ.dtype.element_ty), HEAD_DIM, BLOCK_D)


def _dropout_args(dropout_p: float, rng_key: torch.Tensor) -> tuple[int, int, int, float]:
    """(seed, offset, threshold, keep_scale) for the kernels, read from the host-side key."""
    if dropout_p == 0.0:
        return 0, 0, 0, 1.0
    seed, offset = (int(x) for x in rng_key.tolist())
    scaled = dropout_p * 4294967296.0
    threshold = 0xFFFFFFFF if scaled >= 4294967295.0 else int(scaled)
    return seed, offset, threshold, 1.0 / (1.0 - dropout_p)


# CUDA caps a grid's y and z extents at 65535 (x at 2**31 - 1).
MAX_GRID_YZ = 65535


def launch_grid(seq: int, block: int, heads: int, batch: int) -> tuple[int, int, int]:
    """(sequence blocks, heads, batch): one program per block of one head of one batch element.
    Heads and batch get their own axes, not one batch x heads axis, which CUDA would cap at 65535
    (batch 4096 x 16 heads would not launch); the programs of one head still run side by side (x
    varies fastest), sharing its keys and values in L2."""
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(
            f"memopt.attention: the Triton kernels launch one grid row per batch element and head, at most "
            f"{MAX_GRID_YZ} of each (CUDA's grid limit); got batch={batch}, heads={heads}: split the batch"
        )
    return (triton.cdiv(seq, block), heads, batch)


def attention_fwd_triton(q, k, v, causal: bool, dropout_p: float, scale: float, rng_key):
    """Launch the forward kernel. Returns ``out`` ((B, H, Sq, D), contiguous when q is, else a view
    of a (B, Sq, H, D) buffer) and ``lse`` ((B, H, Sq) float32). Inputs are validated by the caller."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    out = attention_out_empty(q)
    lse = torch.empty((batch, heads, seq_q), device=q.device, dtype=torch.float32)
    seed, offset, threshold, keep_scale = _dropout_args(dropout_p, rng_key)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    block_m, block_n, num_warps, num_stages = launch_config("fwd", head_dim, dropout_p > 0.0, (q, k, v, out), strides)
    grid = launch_grid(seq_q, block_m, heads, batch)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse,
        *strides,
        heads, heads // kv_heads, seq_q, seq_k,
        scale * LOG2E, seed, offset, threshold, keep_scale,
        HEAD_DIM=head_dim, BLOCK_D=block_head_dim(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, DROPOUT=dropout_p > 0.0, GROUPED_RNG=seq_k % 4 == 0, UPCAST_DOT=INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


def attention_bwd_triton(
    grad_out, q, k, v, out, lse, causal: bool, dropout_p: float, scale: float, rng_key, packed: bool = False
):
    """Launch the three backward kernels. Returns ``dq`` (B, H, Sq, D) and ``dk``, ``dv``
    (B, Hkv, Sk, D), each a view of a (B, S, H, D) buffer; with ``packed`` (``Sq == Sk``), the one
    (B, S, H + 2 Hkv, D) buffer they are views of, q's heads first (a fused qkv projection's
    layout). Inputs are validated by the caller."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    delta = torch.empty((batch, heads, seq_q), device=q.device, dtype=torch.float32)
    # Gradients as (B, H, S, D) views of (B, S, H, D) buffers, the layout of out (and of q, k, v
    # when they are views of a fused qkv projection). The kernels take strides, so dk and dv share
    # one set: equal in both layouts.
    if packed:
        grad_qkv = torch.empty((batch, seq_q, heads + 2 * kv_heads, head_dim), device=q.device, dtype=q.dtype)
        dq, dk, dv = (g.transpose(1, 2) for g in grad_qkv.split((heads, kv_heads, kv_heads), dim=2))
    else:
        dq = torch.empty((batch, seq_q, heads, head_dim), device=q.device, dtype=q.dtype).transpose(1, 2)
        dk = torch.empty((batch, seq_k, kv_heads, head_dim), device=q.device, dtype=k.dtype).transpose(1, 2)
        dv = torch.empty((batch, seq_k, kv_heads, head_dim), device=q.device, dtype=v.dtype).transpose(1, 2)
    seed, offset, threshold, keep_scale = _dropout_args(dropout_p, rng_key)
    dropout = dropout_p > 0.0

    out_strides = out.stride()[:3]
    grad_out_strides = grad_out.stride()[:3]
    block_m, _, num_warps, num_stages = launch_config(
        "bwd_delta", head_dim, False, (out, grad_out), out_strides + grad_out_strides
    )
    _attn_bwd_delta_kernel[launch_grid(seq_q, block_m, heads, batch)](
        out, grad_out, delta,
        *out_strides, *grad_out_strides,
        heads, seq_q,
        HEAD_DIM=head_dim, BLOCK_D=block_head_dim(head_dim), BLOCK_M=block_m, num_warps=num_warps, num_stages=num_stages,
    )
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out_strides)
    dk_strides = dk.stride()[:3]
    block_m, block_n, num_warps, num_stages = launch_config(
        "bwd_dkdv", head_dim, dropout, (q, k, v, grad_out, dk, dv), strides + dk_strides
    )
    _attn_bwd_dkdv_kernel[launch_grid(seq_k, block_n, kv_heads, batch)](
        q, k, v, grad_out, lse, delta, dk, dv,
        *strides,
        *dk_strides,
        heads, kv_heads, group, seq_q, seq_k,
        scale * LOG2E, scale, seed, offset, threshold, keep_scale,
        HEAD_DIM=head_dim, BLOCK_D=block_head_dim(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, DROPOUT=dropout, GROUPED_RNG=seq_k % 4 == 0, UPCAST_DOT=INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    dq_strides = dq.stride()[:3]
    block_m, block_n, num_warps, num_stages = launch_config(
        "bwd_dq", head_dim, dropout, (q, k, v, grad_out, dq), strides + dq_strides
    )
    _attn_bwd_dq_kernel[launch_grid(seq_q, block_m, heads, batch)](
        q, k, v, grad_out, lse, delta, dq,
        *strides,
        *dq_strides,
        heads, group, seq_q, seq_k,
        scale * LOG2E, scale, seed, offset, threshold, keep_scale,
        HEAD_DIM=head_dim, BLOCK_D=block_head_dim(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, DROPOUT=dropout, GROUPED_RNG=seq_k % 4 == 0, UPCAST_DOT=INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    return grad_qkv if packed else (dq, dk, dv)
