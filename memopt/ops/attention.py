"""attention: scaled dot-product attention that stores no probability matrix.

Layers: the ops ``torch.ops.memopt.attention_fwd`` / ``attention_bwd`` / ``attention_bwd_packed``
(``torch.library.define`` with CPU and CUDA kernels and fake impls so ``torch.compile`` traces them); ``AttentionFunction``
saves q, k, v, the output, one log-sum-exp per row (float32, float64 for float64 inputs) and the 16-byte RNG key, O(seq) bytes
where eager attention keeps the (B, H, Sq, Sk) probabilities and dropout mask; the backward
recomputes the probabilities block by block. On CPU, when "auto" resolves to a flash backend,
:func:`attention` calls the C++ op ``torch.ops.memopt.attention_flash_cpu`` instead
(``csrc/attention_cpu.cpp``: the "cpu_flash" kernels for a causal mask or dropout, ATen's flash
kernels otherwise, both keeping this contract as they are, under a C++ autograd node that saves
q, k, v, out, lse and, with dropout, the key, so no Python runs in its forward or backward;
second derivatives exact as here, the dropout mask included). The "cpu_flash" kernels are
also ops of their own, ``torch.ops.memopt.cpu_flash_attention_{fwd,bwd,bwd_packed}`` (C++, fake
impls below); ``_bwd_packed`` writes the three gradients into one (B, S, H + 2 Hkv, D) tensor, the
layout of the block's fused qkv projection, so the block needs no ``torch.cat`` to assemble them.
``attention_ref`` is the plain PyTorch reference.

The contract every backend keeps (so the block, the policies and the tests do not care which one
ran): ``out`` (B, H, Sq, D) is contiguous when q is (no copy into another layout: ATen's CPU
kernel writes q's layout) and else a view of a (B, Sq, H, D) buffer (q, k, v as views of a fused
qkv projection, the block's case, whose reshape to (tokens, H * D) is then free)
(``_common.attention_out_empty``); ``lse`` (B, H, Sq) is contiguous in the accumulation dtype and is the natural-log log-sum-exp of each row of scaled scores (the same
number whichever kernel computed it, so any backward can consume any forward's lse), the gradients
are (B, H, S, D) views of (B, S, H, D) buffers, and a dropout mask is a function of the RNG key,
replayed from it in every backward and recompute: memopt's kernels regenerate the Philox mask of
``attention_triton``'s docstring, ATen's CUDA kernels draw their own from the CUDA generator set to
the key (:func:`_cuda_generator_at`). One key gives one mask per backend, so every policy of the
block, which resolves the backend the same way each time, gives the same result.

Backends (``backend=`` of :func:`attention` and of both ops):
  * ``"triton"``: memopt's Triton kernels (``attention_triton``): CUDA float16/bfloat16; on CPU in
    Triton's interpreter (float32, ``TRITON_INTERPRET=1`` before memopt is imported), how CI
    tests them. Any dropout, grouped-query heads without copies.
  * ``"native"``: memopt's chunked PyTorch path on CPU (float32, float64): an online softmax over
    key chunks forward, chunk-by-chunk recomputation backward, dropout factors from the C++ Philox
    kernel ``memopt::philox_dropout_scale``. Also the CPU path when triton is not installed.
  * ``"cpu_flash"``: memopt's C++ flash kernels for CPU (``csrc/attention_cpu_kernels_impl.h``,
    float32, float64, grouped-query heads natively, any dropout): tiles of 64 query rows whose
    products run on vectors (blocks of 4 rows held in registers, on the strided rows of q, k, v and
    on k^T, v^T transposed once per head; no BLAS), each block of 4 query rows multiplying only the
    keys its last row sees, an online softmax over blocks of 512 keys, the dropout factors of each
    row of probabilities regenerated from its Philox counters (eight calls at a time with AVX2).
    ATen's CPU kernel splits keys in blocks of 512 and so computes a causal score matrix whole
    below that length.
  * ``"aten_flash"``: ATen's fused flash kernels through their ops: on CPU
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (float32, float64; grouped-query heads
    natively; no dropout: it draws no mask a key can be given for), on CUDA
    ``aten._scaled_dot_product_flash_attention`` (any dropout).
  * ``"cudnn"``, ``"efficient"`` (CUDA, any dropout): ``aten._scaled_dot_product_cudnn_attention``
    and ``aten._scaled_dot_product_efficient_attention``.
  On CUDA ATen's kernels run only where the causal mask is square (they refuse or
  bottom-right-align a non-square causal mask, memopt aligns it top-left like
  ``F.scaled_dot_product_attention``) and ``torch.backends.cuda.can_use_*`` accepts the inputs
  with their dropout; with dropout they run under :func:`_cuda_generator_at` (not while a CUDA
  graph is captured) and their backward is given the Philox seed and offset of the key.
  Grouped-query heads are expanded (a copy) for ATen's CUDA kernels.

Head sizes: any from 1 to 256 on every backend. memopt's Triton kernels tile a head as the next
power of two (at least 16) with the columns past head_dim masked (read as zeros, never written),
so they run the launch configuration of that power of two; the CPU kernels take any size.

``"auto"`` (the default) picks, by :func:`resolve_backend`:
  * CPU: ``"cpu_flash"``, with or without a mask or dropout (``cpu_backend`` can force
    ``"native"``, ``"triton"`` or ``"cpu_flash"``). Forward + backward, float32, one thread, q/k/v
    views of one fused projection, min of 15 (2026-12-05, AMD EPYC with AVX-512): without dropout
    ``"cpu_flash"`` / ``"aten_flash"`` causal 0.52x at (2, 8, 256, 64), 0.53x at (1, 4, 256, 64),
    0.47x at (2, 6, 512, 64), 0.68x at (1, 8, 1024, 64); without a mask 0.87x, 0.86x, 0.83x, 0.96x.
    With dropout 0.1 ``"cpu_flash"`` / ``"native"`` causal 0.42x at (2, 8, 256, 64), 0.48x at
    (2, 6, 512, 64), 0.57x at (1, 4, 1024, 64), 0.33x at (2, 2, 16, 16); without a mask 0.56x,
    0.57x, 0.67x, 0.37x. Before the tile products ran on vectors (MKL's sgemm per tile, 2026-12-02)
    causal ``"cpu_flash"`` was 0.66-0.73x ``"aten_flash"`` and 1.02-1.12x without a mask at seq
    256, so "auto" kept ATen's kernels there. Head sizes that are not powers of two, (2, 8, 256, D)
    with D 40, 80, 96, 200 (2026-12-06): one thread, min of 10, causal 0.52-0.57x, without a mask
    0.88-0.92x; two threads (``python -m bench.attention --preset cpu-head-dims``, medians,
    ``bench/results/attention_cpu-head-dims.json``) causal 0.60-0.74x, without a mask
    0.84-0.98x. ``python -m bench.attention --preset cpu`` times every backend side by side.
  * CUDA: with grouped-query heads, a non-square causal mask or a head_dim that is not a multiple
    of 8 (ATen's ops take none, ``F.scaled_dot_product_attention`` pads it), ``"triton"``;
    otherwise the first of ``"cudnn"`` (compute capability 9.0 and above only), ``"aten_flash"``,
    ``"efficient"`` that ``torch.backends.cuda.can_use_*`` accepts for the inputs and dropout, else
    ``"triton"``. With dropout, the H200 run of ``bench/results/h200-20261204`` measured memopt's Triton kernels at
    2.1-2.2x SDPA cuDNN's time at head_dim 64 and 3.8-4.3x at head_dim 128, so dropout goes to
    ATen's kernels too. The H200 run
    of ``bench/results/h200-20261130`` measured SDPA's flash backend ahead of memopt's Triton
    kernels in 14 of 16 cases (218-318 against 205-303 TFLOP/s forward+backward, bf16, seq 4k-16k);
    cuDNN ahead of flash on Hopper is the issue's figure (about 580-630 TFLOP/s at head_dim 128),
    not yet measured here: ``python -m bench.attention --preset h200`` times every backend.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from memopt import _extension  # noqa: F401  (loads memopt._C: torch.ops.memopt.*)
from memopt.ops import philox_mask as _philox_mask  # noqa: F401  (registers the fake of philox_dropout_scale)
from memopt.ops._common import attention_out_empty, building_graph, check_fake_devices, grads_with_graph
from memopt.ops._philox import dropout_keep_mask
from memopt.ops._rng import check_fake_rng_key, check_rng_key, new_rng_key

try:
    from memopt.ops import attention_triton
except ModuleNotFoundError as _err:
    # CPU-only torch wheels come without triton: CPU attention then runs the native path, and
    # CUDA tensors are refused by _check_inputs with an install hint.
    if _err.name != "triton":
        raise
    attention_triton = None

# Every backend takes any head_dim from 1 to MAX_HEAD_DIM (ATen's fused CUDA kernels go up to
# 256), so a model runs on either device: the Triton kernels tile a head of any such size as the
# next power of two (attention_triton.block_head_dim), the CPU kernels take it as it is.
MAX_HEAD_DIM = 256
GPU_DTYPES = (torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32,)
NATIVE_DTYPES = (torch.float32, torch.float64)

BACKENDS = ("auto", "triton", "native", "cpu_flash", "aten_flash", "cudnn", "efficient")
CPU_BACKENDS = ("triton", "native", "cpu_flash", "aten_flash")
CUDA_BACKENDS = ("triton", "aten_flash", "cudnn", "efficient")
ATEN_CUDA_BACKENDS = ("cudnn", "aten_flash", "efficient")

# Keys per chunk of the native CPU path: its temporaries are (B, H, Sq, chunk).
NATIVE_CHUNK = 128

# What "auto" resolves to on CPU: None for the rule in the module docstring, or a forced backend.
_cpu_backend: str | None = None


def get_cpu_backend() -> str:
    """``"auto"`` (the rule of the module docstring), ``"triton"``, ``"native"`` or ``"cpu_flash"``:
    what ``"auto"`` runs on CPU."""
    return _cpu_backend or "auto"


@contextlib.contextmanager
def cpu_backend(name: str):
    """Make ``"auto"`` run ``name`` (``"auto"``, ``"triton"``, ``"native"`` or ``"cpu_flash"``: the
    CPU backends that take any dropout) on CPU inside the block, also where the ops are called
    without a ``backend`` (``FusedCheckpointBlock``).

    ``"triton"`` needs ``TRITON_INTERPRET=1`` set before memopt was imported.
    """
    global _cpu_backend
    if name not in ("auto", "triton", "native", "cpu_flash"):
        raise ValueError(f"memopt.attention: cpu backend must be 'auto', 'triton', 'native' or 'cpu_flash', got {name!r}")
    if name == "triton":
        _require_interpreter()
    previous, _cpu_backend = _cpu_backend, (None if name == "auto" else name)
    try:
        yield
    finally:
        _cpu_backend = previous


def _require_interpreter() -> None:
    if attention_triton is None:
        raise RuntimeError(
            "memopt.attention: the 'triton' CPU backend runs the kernels in Triton's interpreter, but triton "
            "is not installed (CPU-only torch wheels do not pull it in: pip install triton)"
        )
    if not attention_triton.INTERPRETED:
        raise RuntimeError(
            "memopt.attention: the 'triton' CPU backend runs the kernels in Triton's interpreter, which "
            "needs TRITON_INTERPRET=1 in the environment before memopt is imported"
        )
    if (problem := _interpreter_numpy_problem()) is not None:
        raise RuntimeError(f"memopt.attention: the 'triton' CPU backend cannot run here: {problem}")


@functools.lru_cache(maxsize=1)
def _interpreter_numpy_problem() -> str | None:
    """Triton's interpreter before 3.7 takes a loop bound computed in the kernel as
    ``int(ndarray of shape (1,))``, which numpy 2.4 refuses; every kernel here has such bounds."""
    import numpy
    import triton

    def major_minor(version: str) -> tuple[int, int]:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter does not work with numpy {numpy.__version__} "
            "(it converts 1-element arrays with int()); install numpy<2.4 or triton>=3.7"
        )
    return None


def supported_dtypes(device: torch.device | str) -> tuple[torch.dtype, ...]:
    """The q/k/v dtypes ``"auto"`` takes on ``device`` (on CPU: with the current ``cpu_backend``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return GPU_DTYPES
    return INTERPRETER_DTYPES if _cpu_backend == "triton" else NATIVE_DTYPES


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the saved log-sum-exp: the accumulation dtype (float64 for float64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_dim_supported(head_dim: int) -> bool:
    """Whether every backend takes heads of ``head_dim`` (1 to :data:`MAX_HEAD_DIM`)."""
    return 1 <= head_dim <= MAX_HEAD_DIM


def _aten_cuda_head_dim(q) -> bool:
    """ATen's fused CUDA ops take head sizes that are multiples of 8 (``F.scaled_dot_product_attention``
    pads the others before calling them, a copy of q, k and v); memopt's Triton kernels run the rest."""
    return q.shape[-1] % 8 == 0


def _check_backend_name(backend) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"memopt.attention: backend must be one of {BACKENDS}, got {backend!r}")


def _causal_square(q, k, causal: bool) -> bool:
    return not causal or q.shape[2] == k.shape[2]


@functools.lru_cache(maxsize=None)
def _compute_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _aten_cuda_accepts(backend: str, q, k, v, causal: bool, dropout_p: float = 0.0) -> bool:
    """Whether torch's own checks (``torch.backends.cuda.can_use_*``) let ``backend`` run these
    inputs with this dropout, planned for backward (requires_grad) whatever the grad mode."""
    params = torch.backends.cuda.SDPAParams(
        *(t.detach().requires_grad_() for t in (q, k, v)), None, float(dropout_p), causal, False
    )
    check = {
        "cudnn": torch.backends.cuda.can_use_cudnn_attention,
        "aten_flash": torch.backends.cuda.can_use_flash_attention,
        "efficient": torch.backends.cuda.can_use_efficient_attention,
    }[backend]
    return bool(check(params))


def resolve_backend(backend: str, q, k, v, causal: bool, dropout_p: float) -> str:
    """The backend ``backend`` runs for these inputs: itself when given by name (refused with a
    ValueError where it cannot keep the contract), else the rule of the module docstring."""
    _check_backend_name(backend)
    device = q.device.type
    if device == "cuda":
        if backend == "auto":
            if k.shape[1] != q.shape[1] or not _causal_square(q, k, causal):
                return "triton"
            if not _aten_cuda_head_dim(q):
                return "triton"
            candidates = ATEN_CUDA_BACKENDS if _compute_capability(q.device.index or 0) >= (9, 0) else ATEN_CUDA_BACKENDS[1:]
            for name in candidates:
                if _aten_cuda_accepts(name, q, k, v, causal, dropout_p):
                    return name
            return "triton"
        if backend not in CUDA_BACKENDS:
            raise ValueError(f"memopt.attention: backend {backend!r} does not run on CUDA; CUDA backends are {CUDA_BACKENDS}")
        if backend in ATEN_CUDA_BACKENDS:
            _check_aten_keeps_contract(backend, q, k, causal, dropout_p)
            if not _aten_cuda_accepts(backend, q, k, v, causal, dropout_p):
                raise ValueError(
                    f"memopt.attention: torch cannot run backend {backend!r} on these inputs (shapes {tuple(q.shape)}, "
                    f"{tuple(k.shape)}, dtype {q.dtype}, dropout_p {dropout_p}); torch.backends.cuda.can_use_"
                    f"{'flash' if backend == 'aten_flash' else backend}_attention(..., debug=True) says why"
                )
        return backend
    if backend == "auto":
        if _cpu_backend is None:
            return "cpu_flash"
        backend = _cpu_backend
    elif backend not in CPU_BACKENDS:
        raise ValueError(f"memopt.attention: backend {backend!r} does not run on CPU; CPU backends are {CPU_BACKENDS}")
    if backend == "triton":
        _require_interpreter()
        # Checked here, not only in _check_inputs: the block's autograd functions resolve the
        # backend and call its kernels directly, and the interpreter path computes in float32.
        if q.dtype not in INTERPRETER_DTYPES:
            raise ValueError(
                f"memopt.attention: q, k, v dtype must be one of {INTERPRETER_DTYPES} in the Triton interpreter, got {q.dtype}"
            )
    if backend == "aten_flash":
        _check_aten_keeps_contract(backend, q, k, causal, dropout_p)
    return backend


def _check_aten_keeps_contract(backend: str, q, k, causal: bool, dropout_p: float) -> None:
    if dropout_p > 0.0 and q.device.type != "cuda":
        raise ValueError(
            f"memopt.attention: backend {backend!r} on CPU cannot replay a dropout mask (ATen's CPU kernel draws "
            "none it can be given a key for); use backend='auto', 'cpu_flash', 'native' or 'triton' with dropout_p > 0"
        )
    if q.device.type == "cuda" and not _causal_square(q, k, causal):
        raise ValueError(
            f"memopt.attention: backend {backend!r} does not align a causal mask with seq_q != seq_k "
            f"(got {q.shape[2]} and {k.shape[2]}) top-left; use backend='auto' or 'triton'"
        )
    if q.device.type == "cuda" and not _aten_cuda_head_dim(q):
        raise ValueError(
            f"memopt.attention: backend {backend!r} takes a head_dim that is a multiple of 8 on CUDA, got "
            f"head_dim={q.shape[-1]}; use backend='auto' or 'triton'"
        )


def _check_inputs(q, k, v, causal, dropout_p, rng_key, backend="auto") -> str:
    """Validate once, at the op boundary, with messages naming the argument; returns the
    backend that runs (:func:`resolve_backend`)."""
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
    if not head_dim_supported(head_dim):
        raise ValueError(f"memopt.attention: head_dim must be between 1 and {MAX_HEAD_DIM}, got head_dim={head_dim}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"memopt.attention: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"memopt.attention: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"memopt.attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    check_rng_key("attention", rng_key)
    if q.device.type == "cuda" and attention_triton is None and backend in ("auto", "triton"):
        raise RuntimeError(
            "memopt.attention: CUDA tensors run memopt's Triton kernels, but triton is not installed "
            f"(torch {torch.__version__} came without it): pip install triton"
        )
    resolved = resolve_backend(backend, q, k, v, causal, dropout_p)
    if q.device.type == "cuda":
        allowed, where = GPU_DTYPES, "on CUDA"
    elif resolved == "triton":
        allowed, where = INTERPRETER_DTYPES, "in the Triton interpreter"
    else:
        allowed, where = NATIVE_DTYPES, "on CPU"
    if q.dtype not in allowed:
        raise ValueError(f"memopt.attention: q, k, v dtype must be one of {allowed} {where}, got {q.dtype}")
    if resolved == "triton":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1 and t.shape[-1] > 1:  # a size-1 dim's stride is never used
                raise ValueError(f"memopt.attention: {name} must have a unit stride in its last dim, got strides {t.stride()}")
    return resolved


# ---------------------------------------------------------------------------------------------
# Layout helpers shared by the backends.
# ---------------------------------------------------------------------------------------------


def _bshd_empty(batch, heads, seq, head_dim, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (B, H, S, D) view of a (B, S, H, D) buffer: the layout of every output."""
    return torch.empty((batch, seq, heads, head_dim), dtype=like.dtype, device=like.device).transpose(1, 2)


def _as_bshd(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, S, D) in the output layout: itself when it has it, else a copy."""
    if t.transpose(1, 2).is_contiguous():
        return t
    out = _bshd_empty(t.shape[0], t.shape[1], t.shape[2], t.shape[3], t)
    out.copy_(t)
    return out


def _as_out_layout(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` in the output layout for ``q``: itself when it has it (ATen's CPU kernel writes
    q's layout), else a copy."""
    if not q.is_contiguous():
        return _as_bshd(out)
    return out if out.is_contiguous() else out.contiguous()


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit-stride last dimension: itself when it has one, else a contiguous copy.
    ATen's raw attention ops (the ``aten_flash`` / ``cudnn`` / ``efficient`` backends) read each
    head's row as consecutive elements whatever the strides say; SDPA's own front end copies such
    inputs first, and so must memopt."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _sum_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H, S, D) gradient of expanded k or v -> (B, H / group, S, D), in the output layout."""
    if group == 1:
        return _as_bshd(t)
    batch, heads, seq, head_dim = t.shape
    out = _bshd_empty(batch, heads // group, seq, head_dim, t)
    torch.sum(t.view(batch, heads // group, group, seq, head_dim), dim=2, out=out)
    return out


# ---------------------------------------------------------------------------------------------
# Native CPU path: key chunks, online softmax, recompute in backward.
#
# Under the top-left causal mask query i sees key j iff j <= i, so key chunk [n0, n1) is seen only
# by queries i >= n0: each chunk computes on those query rows alone (about half the work), and only
# its part left of the diagonal (rows n0 .. n1 - 2) needs the mask. q is scaled once up front, so
# the scores come out of one matmul and the dk matmul carries the scale.
# ---------------------------------------------------------------------------------------------


def _causal_hidden(n0: int, n1: int, row0: int, rows: int, device) -> torch.Tensor:
    """(rows, n1 - n0) bool: True where query ``row0 + r`` must not see key ``n0 + c`` (c > r + row0 - n0)."""
    return torch.arange(n0, n1, device=device)[None, :] > torch.arange(row0, row0 + rows, device=device)[:, None]


def _dropout_scale(batch, heads, seq_q, seq_k, row0, n0, n1, dropout_p, rng_key, dtype) -> torch.Tensor:
    """(B, H, Sq - row0, n1 - n0) factors ``keep / (1 - p)`` of the window [row0:, n0:n1] of the
    (B, H, Sq, Sk) probabilities, drawn by the C++ Philox kernel (no index tensor)."""
    return torch.ops.memopt.philox_dropout_scale(
        [batch, heads, seq_q - row0, n1 - n0], [heads * seq_q * seq_k, seq_q * seq_k, seq_k, 1],
        row0 * seq_k + n0, dropout_p, rng_key, dtype,
    )  # fmt: skip


def _attention_fwd_native(q, k, v, causal, dropout_p, scale, rng_key):
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # (B, Hkv, group, Sq, D): the query heads of one kv head share its k and v chunks (broadcast).
    q_scaled = (q * scale).view(batch, kv_heads, group, seq_q, head_dim)
    row_max = torch.full((batch, kv_heads, group, seq_q, 1), -math.inf, dtype=q.dtype)
    row_sum = torch.zeros((batch, kv_heads, group, seq_q, 1), dtype=q.dtype)
    acc = torch.zeros((batch, kv_heads, group, seq_q, head_dim), dtype=q.dtype)
    for n0 in range(0, seq_k, NATIVE_CHUNK):
        n1 = min(seq_k, n0 + NATIVE_CHUNK)
        row0 = min(n0, seq_q) if causal else 0
        if row0 == seq_q:
            break
        rows = slice(row0, seq_q)
        k_chunk = k[:, :, None, n0:n1]
        v_chunk = v[:, :, None, n0:n1]
        probs = torch.matmul(q_scaled[:, :, :, rows], k_chunk.transpose(-1, -2))
        if causal and n1 - 1 > row0:
            probs.masked_fill_(_causal_hidden(n0, n1, row0, seq_q - row0, q.device), -math.inf)
        # Row row0 sees key n0 (row0 >= n0 under the causal mask), so every max is finite.
        new_max = torch.maximum(row_max[:, :, :, rows], probs.amax(-1, keepdim=True))
        alpha = torch.exp(row_max[:, :, :, rows] - new_max)
        probs.sub_(new_max).exp_()
        row_sum[:, :, :, rows] = row_sum[:, :, :, rows] * alpha + probs.sum(-1, keepdim=True)
        if dropout_p > 0.0:
            factor = _dropout_scale(batch, heads, seq_q, seq_k, row0, n0, n1, dropout_p, rng_key, q.dtype)
            probs.mul_(factor.view(probs.shape))
        acc_rows = acc[:, :, :, rows]
        acc_rows.mul_(alpha).add_(torch.matmul(probs, v_chunk))
        row_max[:, :, :, rows] = new_max
    out = attention_out_empty(q)
    torch.div(acc.view(batch, heads, seq_q, head_dim), row_sum.view(batch, heads, seq_q, 1), out=out)
    lse = (row_max + torch.log(row_sum)).view(batch, heads, seq_q)
    return out, lse


def _attention_bwd_native(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key):
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    shape5 = (batch, kv_heads, group, seq_q)
    grad_out = grad_out.to(q.dtype)
    q_scaled = (q * scale).view(*shape5, head_dim)
    grad_out5 = grad_out.reshape(*shape5, head_dim)
    delta = (grad_out * out).sum(-1).view(*shape5, 1)
    lse = lse.to(q.dtype).view(*shape5, 1)
    dq = torch.zeros((*shape5, head_dim), dtype=q.dtype)
    dk = _bshd_empty(batch, kv_heads, seq_k, head_dim, k)
    dv = _bshd_empty(batch, kv_heads, seq_k, head_dim, v)
    for n0 in range(0, seq_k, NATIVE_CHUNK):
        n1 = min(seq_k, n0 + NATIVE_CHUNK)
        row0 = min(n0, seq_q) if causal else 0
        if row0 == seq_q:
            # No query sees these keys: their gradients are zero.
            dk[:, :, n0:].zero_()
            dv[:, :, n0:].zero_()
            break
        rows = slice(row0, seq_q)
        k_chunk = k[:, :, None, n0:n1]
        v_chunk = v[:, :, None, n0:n1]
        probs = torch.matmul(q_scaled[:, :, :, rows], k_chunk.transpose(-1, -2)).sub_(lse[:, :, :, rows]).exp_()
        if causal and n1 - 1 > row0:
            probs.masked_fill_(_causal_hidden(n0, n1, row0, seq_q - row0, q.device), 0.0)
        grad_probs = torch.matmul(grad_out5[:, :, :, rows], v_chunk.transpose(-1, -2))
        if dropout_p > 0.0:
            factor = _dropout_scale(batch, heads, seq_q, seq_k, row0, n0, n1, dropout_p, rng_key, q.dtype)
            factor = factor.view(probs.shape)
            grad_probs.mul_(factor)
            dropped = probs * factor
        else:
            dropped = probs
        dv_chunk = torch.matmul(dropped.transpose(-1, -2), grad_out5[:, :, :, rows])
        del dropped
        grad_scores = grad_probs.sub_(delta[:, :, :, rows]).mul_(probs)  # softmax backward, in place
        dq[:, :, :, rows] += torch.matmul(grad_scores, k_chunk)
        dk_chunk = torch.matmul(grad_scores.transpose(-1, -2), q_scaled[:, :, :, rows])
        torch.sum(dk_chunk, dim=2, out=dk[:, :, n0:n1])
        torch.sum(dv_chunk, dim=2, out=dv[:, :, n0:n1])
    grad_q = _bshd_empty(batch, heads, seq_q, head_dim, q)
    torch.mul(dq.view(batch, heads, seq_q, head_dim), scale, out=grad_q)
    return grad_q, dk, dv


# ---------------------------------------------------------------------------------------------
# ATen's kernels through their ops (no dropout; see the module docstring for when they run).
# ---------------------------------------------------------------------------------------------


def _check_aten_cpu_scale(causal: bool, scale: float) -> None:
    # ATen's CPU flash kernel returns NaN for a causal call with scale <= 0 (torch's own SDPA on
    # CPU too); memopt's backends do not, and a backend must not change the result.
    if causal and not scale > 0:
        raise ValueError(
            f"memopt.attention: backend 'aten_flash' on CPU gives NaN for causal attention with scale <= 0 "
            f"(got scale={scale}); use backend='auto', 'cpu_flash' or 'native'"
        )


def _attention_fwd_aten_cpu(q, k, v, causal, scale):
    # Grouped-query heads run natively; out comes in q's dim order, lse as a (B, Sq, H) buffer.
    _check_aten_cpu_scale(causal, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), dropout_p=0.0, is_causal=causal, scale=scale
    )
    return _as_out_layout(out, q), lse.contiguous()  # the layout of the caller's q, not of its copy


def _attention_bwd_aten_cpu(grad_out, q, k, v, out, lse, causal, scale):
    _check_aten_cpu_scale(causal, scale)
    q, k, v, out = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), _unit_last_stride(out)
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _unit_last_stride(grad_out.to(q.dtype)), q, k, v, out, lse, dropout_p=0.0, is_causal=causal, scale=scale
    )
    return _as_bshd(grad_q), _as_bshd(grad_k), _as_bshd(grad_v)


@functools.lru_cache(maxsize=None)
def _aten_lse_layout(backend: str) -> tuple[int, int]:
    """(rank, row alignment) of the log-sum-exp that ATen's CUDA ``backend`` returns and its
    backward takes, read from torch's meta kernel (it differs across torch versions: cuDNN's is
    (B, H, Sq, 1) in torch 2.14, the memory-efficient kernel pads Sq to a multiple of 32)."""
    q = torch.empty(1, 1, 33, 64, dtype=torch.float16, device="meta")
    lse = _aten_cuda_fwd_call(backend, q, q, q, False, 0.125)[1]
    return lse.dim(), lse.shape[2]


def _aten_cuda_fwd_call(backend, q, k, v, causal, scale, dropout_p=0.0):
    """The result tuple of ATen's CUDA op for ``backend``, as the op returns it: (out, lse, ...)
    with the Philox seed and offset tensors at :data:`_ATEN_PHILOX_FIELDS`."""
    if backend == "aten_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, return_debug_mask=False, scale=scale
        )
    if backend == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=dropout_p, is_causal=causal,
            return_debug_mask=False, scale=scale,
        )  # fmt: skip
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=dropout_p, is_causal=causal, scale=scale
    )


# Where each op's result holds the Philox seed and offset tensors its backward takes.
_ATEN_PHILOX_FIELDS = {"aten_flash": (6, 7), "cudnn": (6, 7), "efficient": (2, 3)}


@contextlib.contextmanager
def _cuda_generator_at(device: torch.device, rng_key: torch.Tensor):
    """Run the block with torch's default CUDA generator of ``device`` at the state ``rng_key``
    names, then put back the state it had: the masks ATen's dropout kernels draw inside are a
    function of the key alone, and the user's random stream does not move.

    Note:
        This is what lets memopt run ATen's fused dropout attention under its contract. ATen's
        kernels draw the mask from the generator's (seed, offset) at the call; memopt sets that
        state from its own key (seed, 4 * offset: CUDA's Philox offsets come in steps of 4), so
        every recompute, and the backward (given the seed and offset tensors the same state makes
        the forward return), replays the forward's mask exactly. The mask is ATen's, not the one
        of ``attention_triton``'s docstring: a key gives the same mask on one backend, device and
        shape, as torch's own seeds do.
    """
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "memopt.attention: ATen's dropout attention replays its mask by setting the CUDA generator's state, "
            "which cannot be done while a CUDA graph is captured; pass backend='triton' (memopt's kernels "
            "replay the mask from the key on the device)"
        )
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    saved = generator.get_state()
    seed, offset = (int(x) for x in rng_key.tolist())
    try:
        generator.manual_seed(seed % 2**64)
        generator.set_offset((4 * offset) % 2**64)
        yield
    finally:
        generator.set_state(saved)


def _aten_philox_tensors(backend, q, k, v, causal, scale, dropout_p, rng_key):
    """The seed and offset tensors ATen's forward returned for ``rng_key``, in the form this torch
    gives them (it differs across versions and under CUDA graphs): a forward on the first 16 (or
    fewer) rows of one head of the inputs, at the generator state of the key, returns them as the
    real forward did (they hold the generator's seed and offset at the call, not the shape)."""
    rows = min(q.shape[2], k.shape[2], 16)
    with _cuda_generator_at(q.device, rng_key):
        result = _aten_cuda_fwd_call(backend, q[:1, :1, :rows], k[:1, :1, :rows], v[:1, :1, :rows], causal, scale, dropout_p)
    seed_field, offset_field = _ATEN_PHILOX_FIELDS[backend]
    return result[seed_field], result[offset_field]


def _attention_fwd_aten_cuda(backend, q, k, v, causal, scale, dropout_p=0.0, rng_key=None):
    batch, heads, seq_q, _ = q.shape
    group = heads // k.shape[1]
    q = _unit_last_stride(q)
    k_full, v_full = _unit_last_stride(_expand_kv(k, group)), _unit_last_stride(_expand_kv(v, group))
    if dropout_p > 0.0:
        with _cuda_generator_at(q.device, rng_key):
            result = _aten_cuda_fwd_call(backend, q, k_full, v_full, causal, scale, dropout_p)
    else:
        result = _aten_cuda_fwd_call(backend, q, k_full, v_full, causal, scale)
    lse = result[1].reshape(batch, heads, -1)[:, :, :seq_q].contiguous()
    return _as_out_layout(result[0], q), lse


def _attention_bwd_aten_cuda(backend, grad_out, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng_key=None):
    batch, heads, seq_q, _ = q.shape
    seq_k = k.shape[2]
    group = heads // k.shape[1]
    q, out = _unit_last_stride(q), _unit_last_stride(out)
    k_full, v_full = _unit_last_stride(_expand_kv(k, group)), _unit_last_stride(_expand_kv(v, group))
    grad_out = _unit_last_stride(grad_out.to(q.dtype))
    rank, rows = _aten_lse_layout(backend)
    if rows != 33:  # padded rows (the memory-efficient kernel): zeros past seq_q
        padded = -(-seq_q // 32) * 32
        lse = torch.nn.functional.pad(lse, (0, padded - seq_q))
    if rank == 4:
        lse = lse.unsqueeze(-1)
    if dropout_p > 0.0:
        seed, offset = _aten_philox_tensors(backend, q, k_full, v_full, causal, scale, dropout_p, rng_key)
    else:  # without dropout the Philox seed and offset are not read: empty placeholders
        seed = offset = torch.empty(0, dtype=torch.int64, device=q.device)
    if backend == "aten_flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k_full, v_full, out, lse, None, None, seq_q, seq_k, dropout_p, causal, seed, offset, scale=scale
        )
    elif backend == "cudnn":
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k_full, v_full, out, lse, seed, offset, None, None, None, seq_q, seq_k, dropout_p, causal,
            scale=scale,
        )  # fmt: skip
    else:
        # The memory-efficient backward (xformers' kernel) takes out's row stride as H * D, the
        # (B, S, H, D) buffer its forward wrote, whatever out's own strides say: a contiguous
        # (B, H, S, D) out gave dq off by 2.3 on an H200 (bench/results/h200-20261204b), so out
        # goes back into that layout (a copy when q was contiguous).
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k_full, v_full, None, _as_bshd(out), lse, seed, offset, dropout_p, [True, True, True, False],
            causal, scale=scale,
        )  # fmt: skip
    grad_q, grad_k, grad_v = grads[:3]
    return _as_bshd(grad_q), _sum_groups(grad_k, group), _sum_groups(grad_v, group)


def aten_dropout_keep_mask(backend, q, k, causal, dropout_p, scale, rng_key) -> torch.Tensor:
    """(B, H, Sq, Sk) bool: the entries ATen's CUDA ``backend`` keeps under ``rng_key``, read from
    its own forward (the mask is not exposed otherwise): with v the columns ``[n0, n0 + D)`` of the
    identity, out[..., i, d] is probability (i, n0 + d) times its dropout factor, non-zero exactly
    where the entry is kept (a probability rounds to zero only below the smallest normal half
    number, where a dropped or kept entry adds nothing anyway). ``ceil(Sk / D)`` forward calls: for
    the exact second derivatives of :func:`_attention_backward_with_graph` and for tests."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    k_full = _expand_kv(k, heads // k.shape[1])
    keep = torch.empty(batch, heads, seq_q, seq_k, dtype=torch.bool, device=q.device)
    with torch.no_grad():
        for n0 in range(0, seq_k, head_dim):
            n1 = min(seq_k, n0 + head_dim)
            eye = torch.zeros(batch, heads, seq_k, head_dim, dtype=q.dtype, device=q.device)
            eye[:, :, n0:n1].copy_(torch.eye(n1 - n0, head_dim, dtype=q.dtype, device=q.device))
            out = _attention_fwd_aten_cuda(backend, q, k_full, eye, causal, scale, dropout_p, rng_key)[0]
            keep[..., n0:n1] = out[..., : n1 - n0] != 0
    if causal:
        keep.masked_fill_(_causal_hidden(0, seq_k, 0, seq_q, q.device), False)
    return keep


# ---------------------------------------------------------------------------------------------
# Registered ops: defined with torch.library.define and given a CPU and a CUDA kernel, as the C++
# ops are (torch.library.custom_op would wrap each call in dispatch-mode and alias checks that
# cost ~40 us per call, 1-2 % of a small attention call). Like the C++ ops they have no autograd
# kernel: AttentionFunction is the differentiable entry; torch warns when a direct call on
# tensors that require grad is backpropagated through (its gradients are then None).
# ---------------------------------------------------------------------------------------------

torch.library.define(
    "memopt::attention_fwd",
    "(Tensor q, Tensor k, Tensor v, bool causal, float dropout_p, float scale, Tensor rng_key, str backend='auto') "
    "-> (Tensor, Tensor)",
)
torch.library.define(
    "memopt::attention_bwd",
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float dropout_p, "
    "float scale, Tensor rng_key, str backend='auto') -> (Tensor, Tensor, Tensor)",
)
torch.library.define(
    "memopt::attention_bwd_packed",
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float dropout_p, "
    "float scale, Tensor rng_key, str backend='auto') -> Tensor",
)


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    dropout_p: float,
    scale: float,
    rng_key: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. Returns ``out`` (B, H, Sq, D), contiguous when q is, else stored in
    (B, Sq, H, D) memory order, and ``lse`` (B, H, Sq), contiguous, in ``lse_dtype(q.dtype)``: the
    natural-log log-sum-exp of each row of scaled scores."""
    backend = _check_inputs(q, k, v, causal, dropout_p, rng_key, backend)
    return run_attention_fwd(backend, q, k, v, causal, dropout_p, scale, rng_key)


def run_attention_fwd(backend: str, q, k, v, causal: bool, dropout_p: float, scale: float, rng_key):
    """:func:`attention_fwd`'s kernels for a ``backend`` already resolved, on inputs already
    checked: for callers whose q, k, v are valid by construction (the block's views of its own
    qkv projection), which so skip the checks and the dispatcher's round trip into this Python
    kernel (~35 us a call on CPU, measured)."""
    if backend == "native":
        return _attention_fwd_native(q, k, v, causal, dropout_p, scale, rng_key)
    if backend == "cpu_flash":
        return torch.ops.memopt.cpu_flash_attention_fwd(q, k, v, causal, scale, dropout_p, rng_key)
    if backend == "aten_flash" and q.device.type == "cpu":
        return _attention_fwd_aten_cpu(q, k, v, causal, scale)
    if backend in ATEN_CUDA_BACKENDS:
        return _attention_fwd_aten_cuda(backend, q, k, v, causal, scale, dropout_p, rng_key)
    return attention_triton.attention_fwd_triton(q, k, v, causal, dropout_p, scale, rng_key)


def _without_grad(kernel):
    """``kernel`` run under ``torch.no_grad()``: an op kernel computes values, never a graph (its
    inputs may require grad when the op is called directly)."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        with torch.no_grad():
            return kernel(*args, **kwargs)

    return run


torch.library.impl("memopt::attention_fwd", ("cpu", "cuda"), _without_grad(attention_fwd))


@torch.library.register_fake("memopt::attention_fwd")
def _attention_fwd_fake(q, k, v, causal, dropout_p, scale, rng_key, backend="auto"):
    check_fake_devices("attention", "q", q, k=k, v=v)
    if rng_key is not None:
        check_fake_rng_key("attention", rng_key)
    out = attention_out_empty(q)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    return out, lse


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
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from the saved ``out`` and ``lse``; recomputes the probabilities.
    Returns ``grad_q`` (B, H, Sq, D) and ``grad_k``, ``grad_v`` (B, Hkv, Sk, D), each a view of a
    (B, S, H, D) buffer."""
    backend = _check_bwd_inputs("attention_bwd", grad_out, q, k, v, out, lse, causal, dropout_p, rng_key, backend)
    return run_attention_bwd(backend, grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)


def attention_bwd_packed(
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
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`attention_bwd`'s three gradients as one ``(B, S, H + 2 Hkv, D)`` contiguous tensor,
    q's heads first: the layout of a fused qkv projection's output, so its backward needs no
    ``torch.cat``. Self-attention only (``seq_q == seq_k``)."""
    backend = _check_bwd_inputs("attention_bwd_packed", grad_out, q, k, v, out, lse, causal, dropout_p, rng_key, backend)
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            "memopt.attention_bwd_packed: packs the gradients of q, k and v along the heads, so seq_q must "
            f"equal seq_k, got {q.shape[2]} and {k.shape[2]}; use memopt.attention_bwd"
        )
    return run_attention_bwd_packed(backend, grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)


def _check_bwd_inputs(op: str, grad_out, q, k, v, out, lse, causal, dropout_p, rng_key, backend) -> str:
    """:func:`_check_inputs` plus the backward's own arguments; returns the backend that runs."""
    backend = _check_inputs(q, k, v, causal, dropout_p, rng_key, backend)
    expected = (q.shape[0], q.shape[1], q.shape[2])
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.device != q.device:
            got = f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"memopt.{op}: {name} must have q's shape {tuple(q.shape)} on {q.device}, got {got}")
    want = lse_dtype(q.dtype)
    if not isinstance(lse, torch.Tensor) or lse.shape != expected or lse.dtype != want or lse.device != q.device:
        got = f"{lse.dtype} {tuple(lse.shape)} on {lse.device}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"memopt.{op}: lse must be {want} of shape {expected} on {q.device}, got {got}")
    return backend


def run_attention_bwd_packed(backend: str, grad_out, q, k, v, out, lse, causal: bool, dropout_p: float, scale: float, rng_key):
    """:func:`run_attention_bwd`'s three gradients as one ``(B, S, H + 2 Hkv, D)`` tensor, the layout
    of a fused qkv projection's output (the block's): written there by the ``"cpu_flash"`` and
    ``"triton"`` kernels, assembled with one copy from ATen's and the native path's."""
    if backend == "cpu_flash":
        return torch.ops.memopt.cpu_flash_attention_bwd_packed(grad_out, q, k, v, out, lse, causal, scale, dropout_p, rng_key)
    if backend == "triton":
        return _attention_bwd_triton(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key, packed=True)
    return pack_qkv_grads(*run_attention_bwd(backend, grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key))


def pack_qkv_grads(grad_q, grad_k, grad_v):
    """(B, H, S, D) gradients of q, k, v as one (B, S, H + 2 Hkv, D) tensor, q's heads first (one copy)."""
    return torch.cat((grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)), dim=2)


def run_attention_bwd(backend: str, grad_out, q, k, v, out, lse, causal: bool, dropout_p: float, scale: float, rng_key):
    """:func:`attention_bwd`'s kernels for a ``backend`` already resolved, on inputs already
    checked (see :func:`run_attention_fwd`)."""
    if backend == "native":
        return _attention_bwd_native(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)
    if backend == "cpu_flash":
        return torch.ops.memopt.cpu_flash_attention_bwd(grad_out, q, k, v, out, lse, causal, scale, dropout_p, rng_key)
    if backend == "aten_flash" and q.device.type == "cpu":
        return _attention_bwd_aten_cpu(grad_out, q, k, v, out, lse, causal, scale)
    if backend in ATEN_CUDA_BACKENDS:
        return _attention_bwd_aten_cuda(backend, grad_out, q, k, v, out, lse, causal, scale, dropout_p, rng_key)
    return _attention_bwd_triton(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)


def _attention_bwd_triton(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key, packed=False):
    if grad_out.dtype != q.dtype:
        grad_out = grad_out.to(q.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    return attention_triton.attention_bwd_triton(
        grad_out, q, k, v, out, lse.contiguous(), causal, dropout_p, scale, rng_key, packed=packed
    )


torch.library.impl("memopt::attention_bwd", ("cpu", "cuda"), _without_grad(attention_bwd))
torch.library.impl("memopt::attention_bwd_packed", ("cpu", "cuda"), _without_grad(attention_bwd_packed))


@torch.library.register_fake("memopt::attention_flash_cpu")
def _attention_flash_cpu_fake(q, k, v, causal, scale=None, dropout_p=0.0, rng_key=None):
    check_fake_devices("attention", "q", q, k=k, v=v)
    if rng_key is not None:
        check_fake_rng_key("attention", rng_key)
    return attention_out_empty(q)


@torch.library.register_fake("memopt::cpu_flash_attention_fwd")
def _cpu_flash_attention_fwd_fake(q, k, v, causal, scale, dropout_p=0.0, rng_key=None):
    check_fake_devices("attention", "q", q, k=k, v=v)
    if rng_key is not None:
        check_fake_rng_key("attention", rng_key)
    return attention_out_empty(q), q.new_empty(q.shape[:3])


@torch.library.register_fake("memopt::cpu_flash_attention_bwd")
def _cpu_flash_attention_bwd_fake(grad_out, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng_key=None):
    return _attention_bwd_fake(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)


@torch.library.register_fake("memopt::cpu_flash_attention_bwd_packed")
def _cpu_flash_attention_bwd_packed_fake(grad_out, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng_key=None):
    torch._check_value(
        q.shape[2] == k.shape[2],
        lambda: "memopt.cpu_flash_attention_bwd_packed: packs the gradients of q, k and v along the heads, so "
        f"seq_q must equal seq_k, got {q.shape[2]} and {k.shape[2]}; use memopt.cpu_flash_attention_bwd",
    )
    return _attention_bwd_packed_fake(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key)


@torch.library.register_fake("memopt::attention_bwd")
def _attention_bwd_fake(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key, backend="auto"):
    check_fake_devices("attention", "q", q, grad_out=grad_out, k=k, v=v, out=out, lse=lse)
    if rng_key is not None:
        check_fake_rng_key("attention", rng_key)
    grads = []
    for t in (q, k, v):
        batch, heads, seq, head_dim = t.shape
        grads.append(t.new_empty((batch, seq, heads, head_dim)).transpose(1, 2))
    return tuple(grads)


@torch.library.register_fake("memopt::attention_bwd_packed")
def _attention_bwd_packed_fake(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key, backend="auto"):
    check_fake_devices("attention", "q", q, grad_out=grad_out, k=k, v=v, out=out, lse=lse)
    if rng_key is not None:
        check_fake_rng_key("attention", rng_key)
    torch._check_value(
        q.shape[2] == k.shape[2],
        lambda: "memopt.attention_bwd_packed: packs the gradients of q, k and v along the heads, so seq_q must "
        f"equal seq_k, got {q.shape[2]} and {k.shape[2]}; use memopt.attention_bwd",
    )
    batch, heads, seq, head_dim = q.shape
    return q.new_empty((batch, seq, heads + 2 * k.shape[1], head_dim))


# ---------------------------------------------------------------------------------------------
# Autograd and the public function.
# ---------------------------------------------------------------------------------------------


def _attention_backward_with_graph(ctx, grad_out):
    """The backward as differentiable ops, for ``create_graph=True`` (second derivatives): the
    attention is run again as :func:`attention_ref` (the same dropout mask: regenerated from the
    key, or read back from ATen's kernel for its CUDA backends; half types in float32) and
    differentiated, so second derivatives are exact. It materialises the (B, H, Sq, Sk)
    probabilities, as any double backward through attention must keep them."""
    q, k, v, _, _, rng_key = ctx.saved_tensors
    keep = None
    if ctx.dropout_p > 0.0 and ctx.backend in ATEN_CUDA_BACKENDS:
        keep = aten_dropout_keep_mask(ctx.backend, q.detach(), k.detach(), ctx.causal, ctx.dropout_p, ctx.scale, rng_key)
    half = q.dtype in (torch.float16, torch.bfloat16)
    with torch.enable_grad():
        out = _attention_ref_with_keep(
            *((t.float() if half else t) for t in (q, k, v)), ctx.causal, ctx.dropout_p, ctx.scale, rng_key, keep
        ).to(q.dtype)
    return grads_with_graph(out, [q, k, v], grad_out)


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out, lse and the RNG key; the backward recomputes the probabilities.

    ``apply(q, k, v, causal, dropout_p, scale, rng_key, backend="auto")``; the backward runs the
    backend the forward resolved to."""

    @staticmethod
    def forward(ctx, q, k, v, causal, dropout_p, scale, rng_key, backend="auto"):
        out, lse = torch.ops.memopt.attention_fwd(q, k, v, causal, dropout_p, scale, rng_key, backend)
        # The op validated the inputs; the backward runs the backend it resolved to.
        backend = resolve_backend(backend, q, k, v, causal, dropout_p)
        ctx.causal, ctx.dropout_p, ctx.scale, ctx.backend = causal, dropout_p, scale, backend
        ctx.save_for_backward(q, k, v, out, lse, rng_key)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if building_graph(grad_out):
            return (*_attention_backward_with_graph(ctx, grad_out), None, None, None, None, None)
        q, k, v, out, lse, rng_key = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.ops.memopt.attention_bwd(
            grad_out, q, k, v, out, lse, ctx.causal, ctx.dropout_p, ctx.scale, rng_key, ctx.backend
        )
        return grad_q, grad_k, grad_v, None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    rng_key: torch.Tensor | None = None,
    backend: str = "auto",
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
        scale: softmax scale (a real number); ``1 / sqrt(head_dim)`` when None.
        rng_key: int64 CPU tensor ``(seed, offset)`` for the dropout mask; drawn from torch's
            default generator when None, so ``torch.manual_seed`` fixes it. The mask is never
            stored: the backward regenerates it (convention in ``attention_triton``'s docstring).
        backend: ``"auto"`` or one of ``"triton"``, ``"native"``, ``"cpu_flash"``, ``"aten_flash"``, ``"cudnn"``,
            ``"efficient"`` (module docstring: what each is, what ``"auto"`` picks). Every backend
            saves the same tensors and gives the same result to rounding; a named backend that
            cannot keep the contract for these inputs (ATen's with dropout) raises ValueError.

    head_dim: any from 1 to 256 (on CUDA, ATen's kernels run multiples of 8, memopt's Triton
    kernels the others). dtypes: float16/bfloat16 on CUDA, float32 in the
    Triton interpreter, float32/float64 on the other CPU backends.

    Returns:
        ``(batch, heads, seq_q, head_dim)``: contiguous when q is, else a transposed view of a
        ``(batch, seq_q, heads, head_dim)`` buffer, so that for q a view of a fused projection
        ``out.transpose(1, 2).reshape(batch, seq_q, -1)`` is free.
    """
    if (
        type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
        and q.is_cpu and k.is_cpu and v.is_cpu and rng_key is None and backend == "auto"
        and type(causal) is bool and (scale is None or type(scale) is float) and _cpu_backend is None
        and not torch.compiler.is_compiling()
    ):  # fmt: skip
        # The common CPU calls: the flash kernels "auto" picks under the C++ node
        # (csrc/attention_cpu.cpp), which checks the tensors itself with this function's
        # messages; the checks below would cost more than the node.
        if type(dropout_p) in (float, int) and dropout_p == 0:
            return torch.ops.memopt.attention_flash_cpu(q, k, v, causal, scale)
        if type(dropout_p) is float and 0.0 < dropout_p < 1.0:
            return torch.ops.memopt.attention_flash_cpu(q, k, v, causal, scale, dropout_p, new_rng_key())
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"memopt.attention: {name} must be a tensor, got {type(t).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"memopt.attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise TypeError(f"memopt.attention: scale must be a finite real number or None, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"memopt.attention: causal must be a bool, got {causal!r}")
    if rng_key is not None and not isinstance(rng_key, torch.Tensor):
        raise TypeError(f"memopt.attention: rng_key must be an int64 CPU tensor (seed, offset) or None, got {type(rng_key).__name__}")
    _check_backend_name(backend)
    devices = [t.device for t in (q, k, v)]
    if len(set(devices)) > 1:
        # Checked here too: a meta tensor among the inputs would route the op to its fake impl.
        raise ValueError(f"memopt.attention: q, k and v must be on one device, got {', '.join(map(str, devices))}")
    if scale is None:
        # (a 0-d q or head_dim 0 gets the shape checks' error below, not a ZeroDivisionError here)
        head_dim = q.shape[-1] if q.dim() > 0 else 0
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if rng_key is None:
        # A new placeholder per call, not a module-level tensor: under a FakeTensorMode (shape
        # inference without torch.compile) a real tensor cannot reach the op with fake ones.
        rng_key = new_rng_key() if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64)
    if (
        q.device.type == "cpu" and backend == "auto" and not torch.compiler.is_compiling()
        and _check_inputs(q, k, v, causal, dropout_p, rng_key, backend) in ("cpu_flash", "aten_flash")
    ):  # fmt: skip
        # (Not under torch.compile: the C++ node's checks read the sizes as ints, which would
        # specialise the graph to each batch, head count and length: a recompile per shape.)
        # The C++ autograd node (csrc/attention_cpu.cpp) runs what "auto" picks (the same rule in
        # C++): the same kernels and saved tensors as AttentionFunction, without its Python overhead.
        # (without dropout the node keeps no key: the placeholder is not read)
        return torch.ops.memopt.attention_flash_cpu(q, k, v, causal, float(scale), float(dropout_p), rng_key)
    return AttentionFunction.apply(q, k, v, causal, float(dropout_p), float(scale), rng_key, backend)


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
    return _attention_ref_with_keep(q, k, v, causal, dropout_p, scale, rng_key, None)


def _attention_ref_with_keep(q, k, v, causal, dropout_p, scale, rng_key, keep):
    """:func:`attention_ref` in the inputs' dtype; ``keep`` (B, H, Sq, Sk) bool, when given, is the
    dropout mask (ATen's), else it is built from ``rng_key``."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    group = heads // k.shape[1]
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_causal_hidden(0, seq_k, 0, seq_q, q.device), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        if keep is None:
            seed, offset = (int(x) for x in rng_key.tolist())
            keep = dropout_keep_mask((batch, heads, seq_q, seq_k), dropout_p, seed, offset).to(q.device)
        probs = torch.where(keep, probs / (1.0 - dropout_p), torch.zeros_like(probs))
    return torch.matmul(probs, v)
