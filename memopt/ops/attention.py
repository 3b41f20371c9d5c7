"""attention: scaled dot-product attention that stores no probability matrix.

Layers: Triton kernels in ``memopt/ops/attention_triton.py``; the ops
``torch.ops.memopt.attention_fwd`` / ``attention_bwd`` (``torch.library.custom_op``, with fake
impls so ``torch.compile`` traces them); ``AttentionFunction`` saves q, k, v, the output, one
float32 log-sum-exp per row and the 16-byte RNG key, O(seq) bytes where eager attention keeps the
(B, H, Sq, Sk) probabilities and dropout mask; the backward recomputes the probabilities block by
block. ``attention_ref`` is the plain PyTorch reference.

Which code runs where:
  * CUDA tensors: the Triton kernels on the GPU (float16, bfloat16).
  * CPU tensors, ``TRITON_INTERPRET=1`` set before memopt was imported: the same Triton kernels in
    Triton's interpreter (float32), which is how CI tests them.
  * CPU tensors otherwise: a native PyTorch path (float32, float64) with the same contract: an
    online softmax over key chunks forward, chunk-by-chunk recomputation backward. This is also the
    only CPU path when triton is not installed (CPU-only torch wheels do not pull it in).
``cpu_backend("native" | "triton")`` switches the CPU path explicitly (tests run both).
"""

from __future__ import annotations

import contextlib
import math

import torch

from memopt.ops.philox_mask import philox_keep_mask
from memopt.ops._philox import dropout_keep_mask
from memopt.ops._rng import new_rng_key

try:
    from memopt.ops import attention_triton
except ModuleNotFoundError as _err:
    # CPU-only torch wheels come without triton: CPU attention then runs the native path, and
    # CUDA tensors are refused by _check_inputs with an install hint.
    if _err.name != "triton":
        raise
    attention_triton = None

# The head sizes the GPU kernels have launch configurations for (attention_triton.GPU_CONFIGS;
# tests check the two agree); the CPU paths take the same ones, so a model runs on either device.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
GPU_DTYPES = (torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32,)
NATIVE_DTYPES = (torch.float32, torch.float64)

# Keys per chunk of the native CPU path: its temporaries are (B, H, Sq, chunk).
NATIVE_CHUNK = 128

_cpu_backend = "triton" if attention_triton is not None and attention_triton.INTERPRETED else "native"


def get_cpu_backend() -> str:
    """``"triton"`` (kernels in Triton's interpreter) or ``"native"`` (plain PyTorch)."""
    return _cpu_backend


@contextlib.contextmanager
def cpu_backend(name: str):
    """Run CPU attention on ``name`` (``"triton"`` or ``"native"``) inside the block.

    ``"triton"`` needs ``TRITON_INTERPRET=1`` set before memopt was imported.
    """
    global _cpu_backend
    if name not in ("triton", "native"):
        raise ValueError(f"memopt.attention: cpu backend must be 'triton' or 'native', got {name!r}")
    if name == "triton" and attention_triton is None:
        raise RuntimeError(
            "memopt.attention: the 'triton' CPU backend runs the kernels in Triton's interpreter, but triton "
            "is not installed (CPU-only torch wheels do not pull it in: pip install triton)"
        )
    if name == "triton" and not attention_triton.INTERPRETED:
        raise RuntimeError(
            "memopt.attention: the 'triton' CPU backend runs the kernels in Triton's interpreter, which "
            "needs TRITON_INTERPRET=1 in the environment before memopt is imported"
        )
    previous, _cpu_backend = _cpu_backend, name
    try:
        yield
    finally:
        _cpu_backend = previous


def _backend_for(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else _cpu_backend


def supported_dtypes(device: torch.device | str) -> tuple[torch.dtype, ...]:
    """The q/k/v dtypes attention takes on ``device`` (on CPU: with the current ``cpu_backend``)."""
    return {"cuda": GPU_DTYPES, "triton": INTERPRETER_DTYPES, "native": NATIVE_DTYPES}[_backend_for(torch.device(device))]


def _check_inputs(q, k, v, dropout_p, rng_key) -> None:
    """Validate once, at the op boundary, with messages naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"memopt.attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"memopt.attention: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"memopt.attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, heads, seq_q, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"memopt.attention: k and v must be (batch={batch}, kv_heads, seq_k, head_dim={head_dim}) to match q "
            f"{tuple(q.shape)}, got {tuple(k.shape)}"
        )
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"memopt.attention: the heads of q ({heads}) must be a multiple of the heads of k and v ({kv_heads})"
        )
    if seq_q == 0 or seq_k == 0:
        raise ValueError(f"memopt.attention: sequence lengths must be >= 1, got seq_q={seq_q}, seq_k={seq_k}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"memopt.attention: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got head_dim={head_dim}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"memopt.attention: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"memopt.attention: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    backend = _backend_for(q.device)
    if backend == "cuda" and attention_triton is None:
        raise RuntimeError(
            "memopt.attention: CUDA tensors run memopt's Triton kernels, but triton is not installed "
            f"(torch {torch.__version__} came without it): pip install triton"
        )
    allowed = supported_dtypes(q.device)
    if q.dtype not in allowed:
        where = {"cuda": "on CUDA", "triton": "in the Triton interpreter", "native": "on the native CPU path"}[backend]
        raise ValueError(f"memopt.attention: q, k, v dtype must be one of {allowed} {where}, got {q.dtype}")
    if backend != "native":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"memopt.attention: {name} must have a unit stride in its last dim, got strides {t.stride()}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"memopt.attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if rng_key.dtype != torch.int64 or rng_key.shape != (2,) or rng_key.device.type != "cpu":
        raise ValueError(
            "memopt.attention: rng_key must be an int64 CPU tensor (seed, offset) of shape [2], got "
            f"{rng_key.dtype} {tuple(rng_key.shape)} on {rng_key.device}"
        )


# ---------------------------------------------------------------------------------------------
# Native CPU path: key chunks, online softmax, recompute in backward.
# ---------------------------------------------------------------------------------------------


def _keep_mask_chunk(shape_bhqk, n0: int, n1: int, dropout_p: float, rng_key: torch.Tensor) -> torch.Tensor:
    """Keep-mask of columns ``n0:n1`` of the (B, H, Sq, Sk) probabilities (module docstring of
    attention_triton: word ``idx % 4`` of Philox at counter ``offset + idx // 4``), drawn by the
    C++ kernel of ``memopt::philox_keep_mask`` for the chunk's flat indices."""
    batch, heads, seq_q, seq_k = shape_bhqk
    rows = torch.arange(0, batch * heads * seq_q * seq_k, seq_k, dtype=torch.int64).view(batch, heads, seq_q, 1)
    index = rows + torch.arange(n0, n1, dtype=torch.int64)
    return philox_keep_mask(index, dropout_p, rng_key)


def _causal_visible(seq_q: int, n0: int, n1: int, device) -> torch.Tensor:
    """(Sq, n1 - n0) bool: query i sees key j iff j <= i (top-left aligned)."""
    return torch.arange(n0, n1, device=device)[None, :] <= torch.arange(seq_q, device=device)[:, None]


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _attention_fwd_native(q, k, v, causal, dropout_p, scale, rng_key):
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    group = heads // k.shape[1]
    row_max = torch.full((batch, heads, seq_q, 1), -math.inf, dtype=q.dtype)
    row_sum = torch.zeros((batch, heads, seq_q, 1), dtype=q.dtype)
    acc = torch.zeros((batch, heads, seq_q, head_dim), dtype=q.dtype)
    for n0 in range(0, seq_k, NATIVE_CHUNK):
        n1 = min(seq_k, n0 + NATIVE_CHUNK)
        k_chunk = _expand_kv(k[:, :, n0:n1], group)
        v_chunk = _expand_kv(v[:, :, n0:n1], group)
        scores = torch.matmul(q, k_chunk.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(~_causal_visible(seq_q, n0, n1, q.device), -math.inf)
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        # A row can see nothing of a chunk under the causal mask; its max stays -inf only until
        # the first chunk, which always holds key 0.
        alpha = torch.exp(row_max - new_max)
        probs = torch.exp(scores - new_max)
        row_sum = row_sum * alpha + probs.sum(-1, keepdim=True)
        if dropout_p > 0.0:
            keep = _keep_mask_chunk((batch, heads, seq_q, seq_k), n0, n1, dropout_p, rng_key)
            probs = torch.where(keep, probs / (1.0 - dropout_p), torch.zeros_like(probs))
        acc = acc * alpha + torch.matmul(probs, v_chunk)
        row_max = new_max
    out = torch.empty((batch, seq_q, heads, head_dim), dtype=q.dtype).transpose(1, 2)
    out.copy_(acc / row_sum)
    lse = (row_max + torch.log(row_sum)).squeeze(-1).to(torch.float32)
    return out, lse


def _attention_bwd_native(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key):
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grad_out = grad_out.to(q.dtype)
    delta = (grad_out * out).sum(-1, keepdim=True)
    lse = lse.to(q.dtype).unsqueeze(-1)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty((batch, kv_heads, seq_k, head_dim), dtype=k.dtype)
    dv = torch.empty((batch, kv_heads, seq_k, head_dim), dtype=v.dtype)
    for n0 in range(0, seq_k, NATIVE_CHUNK):
        n1 = min(seq_k, n0 + NATIVE_CHUNK)
        k_chunk = _expand_kv(k[:, :, n0:n1], group)
        v_chunk = _expand_kv(v[:, :, n0:n1], group)
        probs = torch.exp(torch.matmul(q, k_chunk.transpose(-1, -2)) * scale - lse)
        if causal:
            probs = probs.masked_fill(~_causal_visible(seq_q, n0, n1, q.device), 0.0)
        grad_probs = torch.matmul(grad_out, v_chunk.transpose(-1, -2))
        if dropout_p > 0.0:
            keep = _keep_mask_chunk((batch, heads, seq_q, seq_k), n0, n1, dropout_p, rng_key)
            dropped = torch.where(keep, probs / (1.0 - dropout_p), torch.zeros_like(probs))
            grad_probs = torch.where(keep, grad_probs / (1.0 - dropout_p), torch.zeros_like(grad_probs))
        else:
            dropped = probs
        grad_scores = probs * (grad_probs - delta)
        dq += torch.matmul(grad_scores, k_chunk) * scale
        dk_chunk = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
        dv_chunk = torch.matmul(dropped.transpose(-1, -2), grad_out)
        dk[:, :, n0:n1] = dk_chunk.view(batch, kv_heads, group, n1 - n0, head_dim).sum(2)
        dv[:, :, n0:n1] = dv_chunk.view(batch, kv_heads, group, n1 - n0, head_dim).sum(2)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Registered ops.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("memopt::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    dropout_p: float,
    scale: float,
    rng_key: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. Returns ``out`` (B, H, Sq, D), stored in (B, Sq, H, D) memory order,
    and ``lse`` (B, H, Sq) float32: the natural-log log-sum-exp of each row of scaled scores."""
    _check_inputs(q, k, v, dropout_p, rng_key)
    if _backend_for(q.device) == "native":
        return _attention_fwd_native(q, k, v, causal, dropout_p, scale, rng_key)
    return attention_triton.attention_fwd_triton(q, k, v, causal, dropout_p, scale, rng_key)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, dropout_p, scale, rng_key):
    batch, heads, seq_q, head_dim = q.shape
    out = q.new_empty((batch, seq_q, heads, head_dim)).transpose(1, 2)
    lse = q.new_empty((batch, heads, seq_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("memopt::attention_bwd", mutates_args=())
def attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    dropout_p: float,
    scale: float,
    rng_key: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from the saved ``out`` and ``lse``; recomputes the probabilities.
    Returns contiguous ``grad_q`` (B, H, Sq, D) and ``grad_k``, ``grad_v`` (B, Hkv, Sk, D)."""
    _check_inputs(q, k, v, dropout_p, rng_key)
    expected = (q.shape[0], q.shape[1], q.shape[2])
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape or t.device != q.device:
            raise ValueError(f"memopt.attention_bwd: {name} must have q's shape {tuple(q.shape)} on {q.device}, got {tuple(t.shape)} on {t.device}")
    if lse.shape != expected or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"memopt.attention_bwd: lse must be float32 of shape {expected} on {q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    if _backend_for(q.device) == "native":
        return _attention_bwd_native(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)
    if grad_out.dtype != q.dtype:
        grad_out = grad_out.to(q.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    return attention_triton.attention_bwd_triton(grad_out, q, k, v, out, lse.contiguous(), causal, dropout_p, scale, rng_key)


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key):
    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    grad_k = torch.empty_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v, memory_format=torch.contiguous_format)
    return grad_q, grad_k, grad_v


# ---------------------------------------------------------------------------------------------
# Autograd and the public function.
# ---------------------------------------------------------------------------------------------


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse and the RNG key; the backward recomputes the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, causal, dropout_p, scale, rng_key):
        out, lse = torch.ops.memopt.attention_fwd(q, k, v, causal, dropout_p, scale, rng_key)
        ctx.causal, ctx.dropout_p, ctx.scale = causal, dropout_p, scale
        ctx.save_for_backward(q, k, v, out, lse, rng_key)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, rng_key = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.ops.memopt.attention_bwd(
            grad_out, q, k, v, out, lse, ctx.causal, ctx.dropout_p, ctx.scale, rng_key
        )
        return grad_q, grad_k, grad_v, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    rng_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention that keeps O(seq) bytes for backward, not O(seq^2).

    ``softmax(q @ k^T * scale + causal_mask)`` with dropout on the probabilities, times ``v``; the
    argument layout follows ``F.scaled_dot_product_attention``.

    Args:
        q: ``(batch, heads, seq_q, head_dim)``; may be a strided view (unit last-dim stride on the
            Triton paths), e.g. of a fused QKV projection.
        k, v: ``(batch, kv_heads, seq_k, head_dim)`` with ``heads % kv_heads == 0`` (grouped-query
            attention: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
        causal: mask future keys, top-left aligned like ``F.scaled_dot_product_attention``'s
            ``is_causal``: query ``i`` sees keys ``j <= i`` also when ``seq_q != seq_k``.
        dropout_p: drop probability on the attention probabilities, in ``[0, 1)``.
        scale: softmax scale; ``1 / sqrt(head_dim)`` when None.
        rng_key: int64 CPU tensor ``(seed, offset)`` for the dropout mask; drawn from torch's
            default generator when None, so ``torch.manual_seed`` fixes it. The mask is never
            stored: the backward regenerates it (convention in ``attention_triton``'s docstring).

    head_dim must be one of 16, 32, 64, 128, 256. dtypes: float16/bfloat16 on CUDA, float32 in the
    Triton interpreter, float32/float64 on the native CPU path.

    Returns:
        ``(batch, heads, seq_q, head_dim)``, a transposed view of a ``(batch, seq_q, heads,
        head_dim)`` buffer, so ``out.transpose(1, 2).reshape(batch, seq_q, -1)`` is free.
    """
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"memopt.attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    devices = [t.device for t in (q, k, v) if isinstance(t, torch.Tensor)]
    if len(set(devices)) > 1:
        # Checked here too: a meta tensor among the inputs would route the op to its fake impl.
        raise ValueError(f"memopt.attention: q, k and v must be on one device, got {', '.join(map(str, devices))}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if rng_key is None:
        rng_key = new_rng_key() if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64)
    return AttentionFunction.apply(q, k, v, bool(causal), float(dropout_p), float(scale), rng_key)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    rng_key: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Plain PyTorch reference: materialises the (B, H, Sq, Sk) probabilities and the dropout mask
    (built from ``memopt.ops._philox``). With ``upcast`` it computes in float64 and returns float64.
    Differentiable, so its gradients are the reference gradients."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    group = heads // k.shape[1]
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_visible(seq_q, 0, seq_k, q.device), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        seed, offset = (int(x) for x in rng_key.tolist())
        keep = dropout_keep_mask((batch, heads, seq_q, seq_k), dropout_p, seed, offset).to(q.device)
        probs = torch.where(keep, probs / (1.0 - dropout_p), torch.zeros_like(probs))
    return torch.matmul(probs, v)
