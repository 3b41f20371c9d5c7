"""attention: Triton kernels (interpreter) and the native CPU path against a float64 reference,
the dropout mask against the Philox reference, saved bytes, opcheck, compile, errors; GPU tests
against F.scaled_dot_product_attention."""

import math

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.ops import attention as attention_ops
from memopt.ops._philox import dropout_keep_mask
from memopt.ops._rng import rng_key
from memopt.ops.attention import (
    MAX_HEAD_DIM,
    AttentionFunction,
    attention_ref,
    attention_triton,
    cpu_backend,
    resolve_backend,
)

from helpers import _WHY_NO_TRITON_INTERPRETER, gpu, needs_triton_interpreter as needs_interpreter

needs_triton = pytest.mark.skipif(attention_triton is None, reason="triton is not installed (CPU-only torch wheels lack it)")
# The CPU backends that replay memopt's dropout mask, and the one that runs without dropout only.
DROPOUT_BACKENDS = [
    pytest.param("triton", marks=needs_interpreter),
    pytest.param("native"),
    pytest.param("cpu_flash"),
]
BACKENDS = [*DROPOUT_BACKENDS, pytest.param("aten_flash")]
FLOAT64_BACKENDS = ["native", "cpu_flash", "aten_flash"]

# (atol, rtol) of attention outputs and gradients against the float64 reference. float32: the
# kernels accumulate over seq_k and head_dim in float32, a few ulps per step. float64: the saved
# log-sum-exp is float64 too, so gradients are float64-accurate (a float32 lse, as memopt kept
# before, is off by about 1e-7 and fails this).
ATTENTION_TOLERANCES = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (3e-5, 3e-5),
}

# (batch, heads, kv_heads, seq_q, seq_k, head_dim): odd lengths cross the interpreter's 16-wide
# tiles, seq_q != seq_k both ways, grouped-query heads (2 and 1 kv heads for 4 query heads).
SHAPES = [
    (1, 1, 1, 1, 1, 32),
    (1, 2, 2, 17, 17, 64),
    (1, 2, 1, 100, 100, 32),
    (1, 4, 2, 24, 70, 128),
    (1, 4, 1, 70, 24, 16),
    (2, 2, 2, 33, 20, 256),
]


def _shape_id(shape):
    b, h, hkv, sq, sk, d = shape
    return f"b{b}h{h}kv{hkv}q{sq}k{sk}d{d}"


def _inputs(shape, dtype=torch.float32, device="cpu"):
    b, h, hkv, sq, sk, d = shape
    q = torch.randn(b, h, sq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, hkv, sk, d, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def _run_and_reference(q, k, v, causal, dropout_p, key, backend="auto", scale=None):
    out = memopt.attention(q, k, v, causal=causal, dropout_p=dropout_p, rng_key=key, backend=backend, scale=scale)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal, dropout_p, scale, key)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    return (out, *grads), (ref, *ref_grads)


def _assert_close(actual, expected, dtype):
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    for name, a, e in zip(("out", "grad_q", "grad_k", "grad_v"), actual, expected):
        torch.testing.assert_close(a.double(), e, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_forward_and_gradients_match_reference(backend, causal, shape):
    q, k, v = _inputs(shape)
    actual, expected = _run_and_reference(q, k, v, causal, 0.0, None, backend=backend)
    _assert_close(actual, expected, torch.float32)
    # Contiguous q gives a contiguous out (no copy into another layout); the gradients are
    # (B, H, S, D) views of (B, S, H, D) buffers.
    assert actual[0].is_contiguous()
    for grad in actual[1:]:
        assert grad.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 2, 19, 19, 32), (1, 4, 2, 40, 24, 64), (2, 4, 1, 150, 270, 16)], ids=_shape_id)
def test_dropout_matches_reference_with_regenerated_mask(backend, causal, shape):
    q, k, v = _inputs(shape)
    key = rng_key(2024, 12)
    actual, expected = _run_and_reference(q, k, v, causal, 0.25, key, backend=backend)
    _assert_close(actual, expected, torch.float32)


# The kernels mask only the blocks that cross the causal diagonal or a sequence end. The GPU tiles
# are not square (BLOCK_M != BLOCK_N both ways, per kernel), so these run the interpreter with
# such tiles too: lengths that are multiples of both blocks, of one, of neither, a single partial
# block, seq_q != seq_k both ways (keys no query sees, queries that see every key), grouped heads.
MASK_EDGE_SHAPES = [
    (1, 2, 1, 64, 64, 16),
    (1, 2, 2, 48, 37, 16),
    (1, 2, 1, 20, 53, 16),
    (1, 4, 2, 53, 20, 16),
    (1, 1, 1, 5, 3, 16),
    (1, 2, 1, 37, 29, 40),  # a head tiled as 64, its columns past 40 masked
]


@needs_interpreter
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 32)], ids=lambda t: f"bm{t[0]}bn{t[1]}")
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", MASK_EDGE_SHAPES, ids=_shape_id)
def test_triton_masks_diagonal_and_edge_blocks_for_any_tiles(monkeypatch, tiles, dropout_p, causal, shape):
    monkeypatch.setattr(attention_triton, "INTERPRETER_CONFIG", (*tiles, 1, 1))
    q, k, v = _inputs(shape)
    with cpu_backend("triton"):
        actual, expected = _run_and_reference(q, k, v, causal, dropout_p, rng_key(31, 5))
    _assert_close(actual, expected, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
def test_triton_programs_find_their_batch_element_and_head(dropout_p):
    # Batch and heads are the grid's y and z axes: each program must read its own (b, h) slice
    # and draw its own mask rows ((b * H + h) * Sq + i), grouped heads included.
    q, k, v = _inputs((3, 4, 2, 21, 19, 16))
    with cpu_backend("triton"):
        actual, expected = _run_and_reference(q, k, v, True, dropout_p, rng_key(8, 3))
    _assert_close(actual, expected, torch.float32)


@needs_triton
def test_triton_launch_grid_keeps_batch_and_heads_within_cudas_limits():
    # One batch x heads axis would be capped at 65535 by CUDA: batch 4096 x 32 heads must launch.
    assert attention_triton.launch_grid(1000, 64, 32, 4096) == (16, 32, 4096)
    assert attention_triton.launch_grid(1, 64, 65535, 65535) == (1, 65535, 65535)
    with pytest.raises(ValueError, match="batch=65536, heads=2: split the batch"):
        attention_triton.launch_grid(64, 64, 2, 65536)


@needs_interpreter
def test_triton_refuses_a_batch_past_the_grid_limit_by_name():
    q = torch.randn(65536, 1, 1, 4)
    with cpu_backend("triton"), pytest.raises(ValueError, match="at most 65535 of each"):
        memopt.attention(q, q, q)


@pytest.mark.parametrize("scale", [-1.3, 0.0])
def test_causal_with_a_non_positive_scale_is_right_or_refused(scale):
    # ATen's CPU flash kernel gives NaN here (torch's SDPA on CPU too): aten_flash refuses it.
    q, k, v = _inputs((1, 2, 2, 9, 9, 8), dtype=torch.float64)
    for backend in ("auto", "native", "cpu_flash"):
        actual, expected = _run_and_reference(q, k, v, True, 0.0, None, backend=backend, scale=scale)
        _assert_close(actual, expected, torch.float64)
    with pytest.raises(ValueError, match="gives NaN for causal attention with scale <= 0"):
        memopt.attention(q, k, v, causal=True, scale=scale, backend="aten_flash")
    actual, expected = _run_and_reference(q, k, v, False, 0.0, None, backend="aten_flash", scale=scale)
    _assert_close(actual, expected, torch.float64)  # not causal: right


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("scale", [None, 2.0], ids=["scale-default", "scale-2"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 37, 29, 32), (1, 2, 2, 300, 300, 64)], ids=_shape_id)
def test_float64_matches_reference_to_float64_precision(backend, scale, shape):
    # Large scales make the softmax sharp, which is where a low-precision lse shows most.
    q, k, v = _inputs(shape, dtype=torch.float64)
    for causal in (False, True):
        actual, expected = _run_and_reference(q, k, v, causal, 0.0, None, backend=backend, scale=scale)
        _assert_close(actual, expected, torch.float64)
    if backend != "aten_flash":
        for causal in (False, True):
            actual, expected = _run_and_reference(q, k, v, causal, 0.1, rng_key(5), backend=backend, scale=scale)
            _assert_close(actual, expected, torch.float64)
    lse = torch.ops.memopt.attention_fwd(q, k, v, False, 0.0, 0.125, rng_key(0), backend)[1]
    assert lse.dtype == torch.float64


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("seq_k", [32, 30], ids=["seqk-mult4", "seqk-odd"])
def test_dropout_mask_is_the_documented_philox_mask(backend, p, seq_k):
    # q = 0 gives uniform probabilities 1/Sk; v = identity (Sk <= head_dim) copies each row of the
    # dropped probabilities into the output, so out * Sk * (1 - p) is the keep-mask itself.
    # seq_k % 4 == 0 takes the kernels' four-words-per-Philox-call path, 30 the per-element one.
    batch, heads, seq_q, head_dim = 1, 2, 48, 32
    q = torch.zeros(batch, heads, seq_q, head_dim)
    k = torch.randn(batch, heads, seq_k, head_dim)
    v = torch.eye(seq_k, head_dim).expand(batch, heads, seq_k, head_dim).contiguous()
    key = rng_key(77, 1000)
    out = memopt.attention(q, k, v, dropout_p=p, rng_key=key, backend=backend)
    assert torch.all(out[..., seq_k:] == 0)
    mask = out[..., :seq_k] * (seq_k * (1 - p))
    expected = dropout_keep_mask((batch, heads, seq_q, seq_k), p, 77, 1000)
    torch.testing.assert_close(mask, expected.float(), atol=1e-5, rtol=0)
    n = expected.numel()
    rate = (mask > 0.5).double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_same_key_is_bit_identical_and_seed_controls_it(backend):
    q, k, v = _inputs((1, 2, 1, 21, 21, 32))
    grad = torch.randn(1, 2, 21, 32)

    def run(key=None):
        out = memopt.attention(q, k, v, causal=True, dropout_p=0.3, rng_key=key)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    with cpu_backend(backend):
        first, second = run(rng_key(9)), run(rng_key(9))
        torch.manual_seed(3)
        seeded = run()
        torch.manual_seed(3)
        reseeded = run()
        other = run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for a, b in zip(seeded, reseeded):
        assert torch.equal(a, b)
    assert not torch.equal(reseeded[0], other[0])


@needs_interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_triton_and_native_paths_agree(dropout_p):
    q, k, v = _inputs((1, 4, 2, 45, 36, 64))
    grad = torch.randn(1, 4, 45, 64)
    results = {}
    for backend in ("triton", "native"):
        with cpu_backend(backend):
            out = memopt.attention(q, k, v, causal=True, dropout_p=dropout_p, rng_key=rng_key(4))
            results[backend] = (out, *torch.autograd.grad(out, (q, k, v), grad))
    for a, b in zip(results["triton"], results["native"]):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_of_fused_qkv_and_output_layout(backend):
    batch, seq, heads, head_dim = 2, 23, 2, 32
    qkv = torch.randn(batch, seq, 3, heads, head_dim, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, S, D), strided, no copy
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = memopt.attention(q, k, v, causal=True, backend=backend)
    # out is a (B, H, S, D) view of a (B, S, H, D) buffer.
    assert out.transpose(1, 2).is_contiguous()
    grad = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, grad)
    qkv64 = qkv.detach().double().requires_grad_()
    ref = attention_ref(*qkv64.permute(2, 0, 3, 1, 4).unbind(0), causal=True)
    (ref_dqkv,) = torch.autograd.grad(ref, qkv64, grad.double())
    _assert_close((out, dqkv), (ref, ref_dqkv), torch.float32)


@pytest.mark.parametrize("backend", ["auto", "native", "cpu_flash", "aten_flash"])
def test_inputs_whose_last_dim_is_not_unit_stride(backend):
    # (B, H, S, D) views of (B, H, D, S) buffers: legal strided inputs. ATen's raw CPU kernel reads
    # each row as consecutive elements whatever the strides say (aten_flash returned garbage).
    batch, heads, seq, head_dim = 1, 2, 9, 8
    q, k, v = (torch.randn(batch, heads, head_dim, seq).transpose(2, 3).requires_grad_() for _ in range(3))
    assert q.stride(-1) != 1
    grad = torch.randn(batch, heads, seq, head_dim).transpose(2, 3).contiguous().transpose(2, 3)  # strided too
    out = memopt.attention(q, k, v, causal=True, backend=backend)
    # q is not contiguous: every backend gives the documented (B, H, S, D) view of a (B, S, H, D)
    # buffer (aten_flash decided the layout from its contiguous copy of q).
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    _assert_close((out, *grads), (ref, *ref_grads), torch.float32)


@pytest.mark.parametrize("backend", ["auto", "native", "cpu_flash", "aten_flash"])
@pytest.mark.parametrize("threads", [1, 2])
def test_empty_batch_gives_empty_output_and_gradients(backend, threads):
    # cpu_flash split heads over threads with a division by the head count (SIGFPE at batch 0).
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = torch.randn(0, 2, 5, 8, requires_grad=True)
        out = memopt.attention(q, q, q, causal=True, backend=backend)
        (grad_q,) = torch.autograd.grad(out.sum(), q)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == (0, 2, 5, 8) and grad_q.shape == q.shape


@pytest.mark.parametrize("backend", ["auto", "native", "cpu_flash", "aten_flash"])
def test_shapes_under_a_fake_tensor_mode(backend):
    # Shape inference without torch.compile: no real tensor may reach the op (the no-dropout key
    # was a module-level real tensor).
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.randn(1, 4, 5, 8)
        k = torch.randn(1, 2, 7, 8)
        out = memopt.attention(q, k, k, backend=backend)
    assert out.shape == (1, 4, 5, 8)


@pytest.mark.parametrize(
    "backend,dropout_p,dtype",
    [
        pytest.param("triton", 0.0, torch.float32, marks=needs_interpreter),
        pytest.param("triton", 0.1, torch.float32, marks=needs_interpreter),
        ("native", 0.0, torch.float32), ("native", 0.1, torch.float32), ("native", 0.1, torch.float64),
        ("cpu_flash", 0.0, torch.float32), ("cpu_flash", 0.0, torch.float64), ("cpu_flash", 0.1, torch.float32),
        ("aten_flash", 0.0, torch.float32), ("aten_flash", 0.0, torch.float64), ("auto", 0.1, torch.float32),
        ("auto", 0.0, torch.float32),
    ],
)
def test_saves_only_qkv_out_lse_and_key(backend, dropout_p, dtype):
    batch, heads, seq, head_dim = 1, 2, 64, 32
    q, k, v = _inputs((batch, heads, heads, seq, seq, head_dim), dtype=dtype)
    key = rng_key(1)
    with memopt.SavedTensorCounter() as counter:
        memopt.attention(q, k, v, causal=True, dropout_p=dropout_p, rng_key=key, backend=backend)
    elem = dtype.itemsize
    tensor_bytes = batch * heads * seq * head_dim * elem
    # q, k, v, out, lse (one per row, float64 for float64) and the 16-byte key: O(seq), no Sq x Sk.
    # "auto" without dropout runs on CPU under memopt.attention_flash_cpu's C++ node, which has no
    # mask to replay: no key.
    key_bytes = 0 if backend == "auto" and dropout_p == 0.0 else 16
    assert counter.total_bytes == 4 * tensor_bytes + batch * heads * seq * elem + key_bytes
    qe, ke, ve = (t.detach().requires_grad_() for t in (q, k, v))
    eager = memopt.saved_bytes(
        lambda a, b, c: torch.softmax(a @ b.transpose(-1, -2), -1) @ c, qe, ke, ve
    )
    assert eager >= batch * heads * seq * seq * 4


# Tolerances tight enough to see a float32 log-sum-exp (memopt kept one before: every case below
# failed with it): central differences in float64 with eps 1e-6 are good to about 1e-10 here.
GRADCHECK_TOLERANCES = {"eps": 1e-6, "atol": 1e-9, "rtol": 1e-8}


@pytest.mark.parametrize(
    "backend,dropout_p",
    [("native", 0.2), ("native", 0.0), ("cpu_flash", 0.2), ("cpu_flash", 0.0), ("aten_flash", 0.0)],
    ids=lambda x: str(x),
)
@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_gradcheck_float64(backend, dropout_p, scale):
    q, k, v = _inputs((1, 2, 1, 7, 9, 16), dtype=torch.float64)
    key = rng_key(8)
    assert torch.autograd.gradcheck(
        lambda a, b, c: AttentionFunction.apply(a, b, c, True, dropout_p, scale, key, backend),
        (q, k, v), **GRADCHECK_TOLERANCES,
    )  # fmt: skip


@pytest.mark.parametrize(
    "backend,causal,dropout_p",
    [
        pytest.param("triton", False, 0.0, marks=needs_interpreter),
        pytest.param("triton", True, 0.2, marks=needs_interpreter),
        ("native", False, 0.0), ("native", True, 0.2), ("cpu_flash", False, 0.2), ("cpu_flash", True, 0.2),
        ("aten_flash", False, 0.0), ("aten_flash", True, 0.0), ("auto", True, 0.0), ("auto", True, 0.2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(backend, causal, dropout_p, dtype):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the interpreter path takes float32")
    q = torch.randn(1, 2, 9, 16, dtype=dtype)
    k = torch.randn(1, 1, 11, 16, dtype=dtype)
    v = torch.randn(1, 1, 11, 16, dtype=dtype)
    key = rng_key(3)
    torch.library.opcheck(torch.ops.memopt.attention_fwd.default, (q, k, v, causal, dropout_p, 0.25, key, backend))
    out, lse = torch.ops.memopt.attention_fwd(q, k, v, causal, dropout_p, 0.25, key, backend)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.memopt.attention_bwd.default, (grad_out, q, k, v, out, lse, causal, dropout_p, 0.25, key, backend)
    )


@pytest.mark.parametrize(
    "backend,dropout_p",
    [
        pytest.param("triton", 0.1, marks=needs_interpreter), ("native", 0.1), ("cpu_flash", 0.0), ("cpu_flash", 0.1),
        ("aten_flash", 0.0), ("auto", 0.0),
    ],
)
def test_compile_fullgraph(backend, dropout_p, compile_cache):
    q, k, v = _inputs((1, 2, 2, 20, 20, 32))
    key = rng_key(11)

    def fn(a, b, c):
        return memopt.attention(a, b, c, causal=True, dropout_p=dropout_p, rng_key=key, backend=backend)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v))
    out.sum().backward()
    dq = q.grad.clone()
    q.grad = None
    fn(q, k, v).sum().backward()
    torch.testing.assert_close(dq, q.grad)


def test_cpu_backend_switch_rejects_unknown_name():
    with pytest.raises(ValueError, match="cpu backend must be"):
        with cpu_backend("cuda"):
            pass


def test_without_triton_cpu_runs_native_and_triton_backend_says_install(monkeypatch):
    monkeypatch.setattr(attention_ops, "attention_triton", None)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        with cpu_backend("triton"):
            pass
    q, k, v = _inputs((1, 2, 1, 9, 7, 16))
    with cpu_backend("native"):
        actual, expected = _run_and_reference(q, k, v, True, 0.0, rng_key(3, 0))
    _assert_close(actual, expected, torch.float32)


@needs_triton
def test_gpu_launch_table_covers_every_block_head_dim():
    for kernel, table in attention_triton.GPU_CONFIGS.items():
        assert sorted({head_dim for head_dim, _ in table}) == list(attention_triton.BLOCK_HEAD_DIMS), kernel
        # The unaligned entries replace entries of the table, for launches without Triton's
        # divisibility hints (tests/test_attention_triton_config.py).
        unaligned = attention_triton.UNALIGNED_GPU_CONFIGS[kernel]
        assert set(unaligned) <= set(table), kernel
        for (block, dropout), config in unaligned.items():
            assert attention_triton.gpu_config(kernel, block - 8, dropout, False) == config
            assert attention_triton.gpu_config(kernel, block, dropout, True) == table[(block, dropout)]
    # Every head_dim memopt takes tiles as one of them: the smallest power of two >= max(16, head_dim).
    for head_dim in range(1, MAX_HEAD_DIM + 1):
        block = attention_triton.block_head_dim(head_dim)
        assert block in attention_triton.BLOCK_HEAD_DIMS and block >= head_dim, head_dim
        assert block == 16 or block // 2 < head_dim, head_dim


# Head sizes that are not powers of two (ViT-H's 80, Phi-3's 96, a multiple of 8 below 16, odd
# ones, 1), against the float64 reference: the Triton kernels tile them as the next power of two
# with the columns past head_dim masked; the CPU kernels' vectors end in a partial one.
ODD_HEAD_DIM_SHAPES = [
    (1, 2, 2, 19, 19, 80),
    (1, 4, 2, 17, 23, 96),
    (2, 2, 1, 9, 9, 24),
    (1, 2, 2, 21, 13, 3),
    (1, 1, 1, 5, 5, 1),
    (1, 2, 2, 7, 7, 200),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ODD_HEAD_DIM_SHAPES, ids=_shape_id)
def test_head_dims_that_are_not_powers_of_two_match_reference(backend, causal, shape):
    q, k, v = _inputs(shape)
    actual, expected = _run_and_reference(q, k, v, causal, 0.0, None, backend=backend)
    _assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
@pytest.mark.parametrize("shape", [(1, 2, 2, 19, 19, 80), (1, 4, 2, 17, 22, 40), (1, 2, 1, 9, 9, 5)], ids=_shape_id)
def test_head_dims_that_are_not_powers_of_two_with_dropout_match_reference(backend, shape):
    q, k, v = _inputs(shape)
    actual, expected = _run_and_reference(q, k, v, True, 0.3, rng_key(77, 8), backend=backend)
    _assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("head_dim", [0, MAX_HEAD_DIM + 1])
@pytest.mark.parametrize("backend", ["auto", "native", "aten_flash"])
def test_head_dim_outside_one_to_256_is_refused_by_every_cpu_path(head_dim, backend):
    q = _t(1, 2, 8, head_dim)
    with pytest.raises(ValueError, match=rf"head_dim must be between 1 and 256, got head_dim={head_dim}"):
        memopt.attention(q, q, q, backend=backend)
    with pytest.raises(ValueError, match=rf"head_dim must be between 1 and 256, got head_dim={head_dim}"):
        torch.ops.memopt.cpu_flash_attention_fwd(q, q, q, False, 0.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_attention_with_dropout_runs_the_cpp_node_and_matches_the_reference(causal):
    # "auto" with dropout on CPU: the C++ node over memopt's kernels, which keeps the key and
    # replays its mask; the float64 reference built from that key (grouped-query heads, seq_q !=
    # seq_k), and the same bits as the Python AttentionFunction over the same kernels.
    q, k, v = (t.double() for t in _inputs((2, 4, 2, 13, 11, 16)))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    key = rng_key(5)
    out = memopt.attention(q, k, v, causal=causal, dropout_p=0.3, rng_key=key)
    assert "FlashAttentionCpuFunction" in out.grad_fn.name()
    grad = torch.randn_like(out)
    ref = attention_ref(q, k, v, causal=causal, dropout_p=0.3, rng_key=key)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    actual = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)
    python_out = memopt.attention(q, k, v, causal=causal, dropout_p=0.3, rng_key=key, backend="cpu_flash")
    assert "AttentionFunction" in python_out.grad_fn.name()
    assert torch.equal(out, python_out)
    for a, p in zip(actual, torch.autograd.grad(python_out, (q, k, v), grad)):
        assert torch.equal(a, p)


def test_cpu_attention_with_dropout_and_no_key_draws_it_from_the_default_generator():
    # The fast path (no key given) draws the key as the checked path does: same seed, same mask.
    q, k, v = (t.detach() for t in _inputs((1, 2, 2, 16, 16, 32)))
    torch.manual_seed(11)
    drawn = memopt.attention(q, k, v, causal=True, dropout_p=0.25)
    torch.manual_seed(11)
    key = attention_ops.new_rng_key()
    torch.testing.assert_close(drawn, attention_ref(q, k, v, causal=True, dropout_p=0.25, rng_key=key, upcast=False))
    assert torch.equal(drawn, memopt.attention(q, k, v, causal=True, dropout_p=0.25, rng_key=key, backend="cpu_flash"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_cpu_op_with_dropout_opcheck_gradcheck_and_gradgradcheck(causal):
    q = torch.randn(1, 4, 9, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 11, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 11, 16, dtype=torch.float64, requires_grad=True)
    key = rng_key(3, 40)
    torch.library.opcheck(torch.ops.memopt.attention_flash_cpu.default, (q, k, v, causal, 0.25, 0.2, key))
    fn = lambda a, b, c: torch.ops.memopt.attention_flash_cpu(a, b, c, causal, 0.3, 0.2, key)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), **GRADCHECK_TOLERANCES)
    # second derivatives through the node's create_graph path: the same mask, as ATen ops
    assert torch.autograd.gradgradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_flash_cpu_op_refuses_a_bad_dropout_p_or_a_missing_key():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(ValueError, match=r"attention_flash_cpu: dropout_p must be in \[0, 1\), got 1"):
        torch.ops.memopt.attention_flash_cpu(q, k, v, False, None, 1.0, rng_key(1))
    with pytest.raises(ValueError, match="dropout_p > 0 needs rng_key"):
        torch.ops.memopt.attention_flash_cpu(q, k, v, False, None, 0.1)
    # the key's contents are checked where they are read, by the kernels' op (as dropout_add's are)
    with pytest.raises(RuntimeError, match="cpu_flash_attention_fwd: rng_key must be an int64 CPU tensor"):
        torch.ops.memopt.attention_flash_cpu(q, k, v, False, None, 0.1, torch.zeros(3, dtype=torch.int64))


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 9, 32)), "k and v must have the same shape"),
        (lambda: memopt.attention(_t(1, 2, 8, 32), _t(2, 2, 8, 32), _t(2, 2, 8, 32)), "batch=1"),
        (lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 64), _t(1, 2, 8, 64)), "head_dim=32"),
        (lambda: memopt.attention(_t(1, 3, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32)), "multiple of the heads"),
        (lambda: memopt.attention(_t(1, 2, 8, 300), _t(1, 2, 8, 300), _t(1, 2, 8, 300)), r"head_dim must be between 1 and 256, got head_dim=300"),
        (lambda: memopt.attention(_t(2, 8, 32), _t(2, 8, 32), _t(2, 8, 32)), "must be 4-D"),
        (lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32), dropout_p=1.0), "dropout_p must be"),
        (lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32), dropout_p=-0.1), "dropout_p must be"),
        (
            lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32, dtype=torch.float64), _t(1, 2, 8, 32)),
            "one dtype",
        ),
        (
            lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32), rng_key=torch.zeros(3, dtype=torch.long)),
            "rng_key",
        ),
        (
            lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32).to("meta")),
            "one device",
        ),
        (lambda: memopt.attention(_t(1, 2, 0, 32), _t(1, 2, 8, 32), _t(1, 2, 8, 32)), "sequence lengths"),
        (lambda: memopt.attention(None, _t(1, 2, 8, 32), _t(1, 2, 8, 32)), "q must be a tensor, got NoneType"),
        (lambda: memopt.attention(_t(1, 2, 8, 32), [[0.0]], _t(1, 2, 8, 32)), "k must be a tensor, got list"),
        (lambda: memopt.attention(_t(1, 2, 8, 32), _t(1, 2, 8, 32), None), "v must be a tensor, got NoneType"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), scale="abc"), "scale must be a finite real"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), scale=float("nan")), "scale must be a finite"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), dropout_p="0.1"), "dropout_p must be"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), causal="yes"), "causal must be a bool"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), rng_key=[1, 2]), "rng_key must be"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), backend="flash2"), "backend must be one of"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), backend=None), "backend must be one of"),
        (lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), backend="cudnn"), "does not run on CPU"),
        (
            lambda: memopt.attention(*(_t(1, 2, 8, 32) for _ in range(3)), dropout_p=0.1, backend="aten_flash"),
            "on CPU cannot replay a dropout mask",
        ),
        (
            lambda: torch.ops.memopt.attention_bwd(*(_t(1, 2, 8, 32, dtype=torch.float64) for _ in range(5)),
                                                   _t(1, 2, 8), False, 0.0, 0.1, rng_key(0), "native"),
            "lse must be torch.float64",
        ),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@needs_interpreter
def test_interpreter_rejects_half_precision_and_unit_stride_violations():
    with cpu_backend("triton"):
        with pytest.raises(ValueError, match="in the Triton interpreter"):
            memopt.attention(*(_t(1, 2, 8, 32, dtype=torch.bfloat16) for _ in range(3)))
        q = _t(1, 2, 32, 8).transpose(-1, -2)
        with pytest.raises(ValueError, match="unit stride"):
            memopt.attention(q, _t(1, 2, 8, 32), _t(1, 2, 8, 32))


def test_compiled_attention_recompiles_no_more_than_sdpa_across_shapes(compile_cache):
    # The CPU fast path's C++ node reads the sizes as ints: under compile every new length and
    # batch was a new graph (6 lengths: 6 graphs, then eager past the recompile limit).
    from torch._dynamo.utils import counters

    def graphs(fn):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="aot_eager")
        for batch, seq in ((2, 16), (2, 24), (2, 40), (3, 40), (4, 56)):
            q, k, v = (torch.randn(batch, 2, seq, 16, requires_grad=True) for _ in range(3))
            compiled(q, k, v).sum().backward()
        return counters["stats"]["unique_graphs"]

    sdpa = graphs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert graphs(lambda q, k, v: memopt.attention(q, k, v, causal=True)) <= sdpa
    assert graphs(lambda q, k, v: memopt.attention(q, k, v, causal=True, dropout_p=0.1)) <= sdpa


@needs_interpreter
def test_interpreter_refuses_float64_inside_the_block_too():
    # The block resolves the backend and calls its kernels directly: a float64 block under
    # cpu_backend("triton") ran the float32 interpreter path (4e-8 output error, not 1e-15).
    block = memopt.FusedCheckpointBlock(32, 2, 48, dtype=torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with cpu_backend("triton"), pytest.raises(ValueError, match="in the Triton interpreter, got torch.float64"):
        block(x)


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "cpu_flash"])
def test_head_dim_1_with_any_last_stride_runs(backend):
    # A (.., seq, 1) view from a transpose is contiguous with a last stride of seq; the stride of
    # a size-1 dim is never used, and .contiguous() returns the same view: no way to satisfy a
    # unit-stride check, which the Triton backend applied.
    q, k, v = (torch.randn(1, 2, 1, 7).transpose(-1, -2).requires_grad_() for _ in range(3))
    assert q.is_contiguous() and q.stride(-1) == 7
    key = rng_key(3)
    with cpu_backend(backend):
        got, ref = _run_and_reference(q, k, v, True, 0.25, key)
    for actual, expected in zip(got, ref):
        _assert_close(actual, expected, torch.float32)


# ---------------------------------------------------------------------------------------------
# GPU: the Triton kernels against F.scaled_dot_product_attention in half precision.
# ---------------------------------------------------------------------------------------------


def _max_error(actual, reference):
    return (actual.double() - reference).abs().max().item()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 4, 1024, 1024, 64), (1, 8, 2, 1537, 1537, 128), (2, 4, 1, 300, 1100, 32), (1, 4, 4, 1100, 257, 256),
     (1, 2, 2, 1029, 1029, 16), (1, 4, 4, 777, 777, 80), (1, 4, 2, 1025, 1025, 96), (1, 4, 4, 600, 600, 20)],
    ids=_shape_id,
)
def test_gpu_matches_sdpa(dtype, causal, shape):
    # flash-attention's rule: memopt's error against float64 is at most about twice the error of
    # PyTorch's own attention run in the same precision.
    q, k, v = _inputs(shape, dtype=dtype, device="cuda")
    group = shape[1] // shape[2]
    out = memopt.attention(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    kx, vx = (t.repeat_interleave(group, 1) for t in (k, v))
    sdpa = F.scaled_dot_product_attention(q, kx, vx, is_causal=causal)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    for name, a, s, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (sdpa, *sdpa_grads), (ref, *ref_grads)):
        ours, theirs = _max_error(a, r), _max_error(s, r)
        assert ours <= 2 * theirs + 1e-3 * r.abs().max().item(), f"{name}: memopt {ours:.3e}, sdpa {theirs:.3e}"


@gpu
def test_gpu_triton_runs_more_than_65535_batch_heads():
    # batch x heads = 69,632: past what one grid axis of CUDA launches.
    q, k, v = _inputs((4352, 16, 16, 8, 8, 16), dtype=torch.float16, device="cuda")
    actual, expected = _run_and_reference(q, k, v, True, 0.0, None, backend="triton")
    _assert_close(actual, expected, torch.float16)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seq_k", [64, 62], ids=["seqk-mult4", "seqk-odd"])
def test_gpu_dropout_mask_and_replay(dtype, seq_k):
    batch, heads, seq_q, head_dim = 2, 4, 1030, 64
    q = torch.zeros(batch, heads, seq_q, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(batch, heads, seq_k, head_dim, dtype=dtype, device="cuda")
    v = torch.eye(seq_k, head_dim, dtype=dtype, device="cuda").expand(batch, heads, seq_k, head_dim).contiguous()
    key = rng_key(123, 77)
    out = memopt.attention(q, k, v, dropout_p=0.2, rng_key=key, backend="triton")
    expected = dropout_keep_mask((batch, heads, seq_q, seq_k), 0.2, 123, 77).cuda()
    assert torch.equal(out[..., :seq_k].float() > 0.5 / (seq_k * 0.8), expected)

    qr, kr, vr = _inputs((1, 4, 2, 700, 700, 64), dtype=dtype, device="cuda")
    grad = torch.randn(1, 4, 700, 64, dtype=dtype, device="cuda")

    def run():
        o = memopt.attention(qr, kr, vr, causal=True, dropout_p=0.1, rng_key=rng_key(5), backend="triton")
        return (o, *torch.autograd.grad(o, (qr, kr, vr), grad))

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qr, kr, vr))
    ref = attention_ref(q64, k64, v64, True, 0.1, None, rng_key(5))
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, a, r in zip(("out", "dq", "dk", "dv"), first, (ref, *ref_grads)):
        assert _max_error(a, r) <= tol * max(1.0, r.abs().max().item()), name


@gpu
def test_gpu_saved_bytes_are_linear_in_seq():
    batch, heads, seq, head_dim = 1, 8, 4096, 64
    q, k, v = _inputs((batch, heads, heads, seq, seq, head_dim), dtype=torch.bfloat16, device="cuda")
    with memopt.SavedTensorCounter() as counter:
        memopt.attention(q, k, v, causal=True, dropout_p=0.1, rng_key=rng_key(0))
    assert counter.total_bytes == 4 * batch * heads * seq * head_dim * 2 + batch * heads * seq * 4 + 16


# ---------------------------------------------------------------------------------------------
# Backends: the "auto" rule, and the ATen ops the CUDA branches call.
# ---------------------------------------------------------------------------------------------


def test_auto_rule_on_cpu():
    q = _t(1, 2, 8, 32)
    # memopt's kernels with or without a mask (faster than ATen's at every shape measured) and
    # with dropout (ATen's CPU kernel draws no mask a key can set)
    for causal in (False, True):
        for dropout_p in (0.0, 0.1):
            assert resolve_backend("auto", q, q, q, causal, dropout_p) == "cpu_flash"
    with cpu_backend("native"):
        assert resolve_backend("auto", q, q, q, False, 0.0) == "native"
    assert resolve_backend("native", q, q, q, False, 0.0) == "native"


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
def test_every_cpu_backend_gives_the_same_result_to_rounding(dropout_p):
    # With dropout: the same elements dropped by every backend (one Philox mask under the key).
    q, k, v = _inputs((2, 4, 2, 70, 90, 64))
    grad = torch.randn(2, 4, 70, 64)
    key = rng_key(6, 40)
    interpreted = _WHY_NO_TRITON_INTERPRETER is None
    backends = ["native", "cpu_flash", "auto"] + ([] if dropout_p else ["aten_flash"]) + (["triton"] if interpreted else [])
    results = {}
    for backend in backends:
        out = memopt.attention(q, k, v, causal=True, dropout_p=dropout_p, rng_key=key, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out, (q, k, v), grad))
    for backend, result in results.items():
        for a, b in zip(result, results["native"]):
            torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-5, msg=lambda m, n=backend: f"{n}: {m}")


@pytest.mark.parametrize(
    "triton_version, numpy_version, broken",
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.0", False), ("3.8.0", "2.10.1", False)],
)
def test_triton_interpreter_numpy_clash_is_a_clear_error(monkeypatch, triton_version, numpy_version, broken):
    # Triton 3.6's interpreter ends with "only 0-dimensional arrays can be converted to Python
    # scalars" deep in a kernel under numpy 2.4 (measured: torch 2.11 + triton 3.6.0 + numpy 2.4.6).
    numpy = pytest.importorskip("numpy")
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    attention_ops._interpreter_numpy_problem.cache_clear()
    try:
        problem = attention_ops._interpreter_numpy_problem()
        if not broken:
            assert problem is None
            return
        assert "numpy<2.4" in problem and triton_version in problem and numpy_version in problem
        if attention_triton is not None and attention_triton.INTERPRETED:
            q = torch.randn(1, 1, 4, 16)
            with pytest.raises(RuntimeError, match=r"'triton' CPU backend cannot run here: .*numpy<2.4"):
                memopt.attention(q, q, q, backend="triton")
    finally:
        monkeypatch.undo()
        attention_ops._interpreter_numpy_problem.cache_clear()


class _CudaStandIn:
    """Shape and device of a CUDA tensor, for the auto rule on a machine without a GPU."""

    def __init__(self, *shape):
        self.shape = torch.Size(shape)
        self.device = torch.device("cuda", 0)
        self.dtype = torch.bfloat16


@pytest.mark.parametrize(
    "q_shape,kv_shape,causal,dropout_p,capability,accepts,expected",
    [
        ((1, 8, 512, 64), (1, 8, 512, 64), True, 0.0, (9, 0), {"cudnn", "aten_flash", "efficient"}, "cudnn"),
        ((1, 8, 512, 64), (1, 8, 512, 64), True, 0.0, (8, 0), {"cudnn", "aten_flash", "efficient"}, "aten_flash"),
        ((1, 8, 512, 64), (1, 8, 512, 64), False, 0.0, (9, 0), {"aten_flash", "efficient"}, "aten_flash"),
        ((1, 8, 512, 64), (1, 8, 512, 64), False, 0.0, (9, 0), {"efficient"}, "efficient"),
        ((1, 8, 512, 64), (1, 8, 512, 64), False, 0.0, (9, 0), set(), "triton"),
        # with dropout too: ATen's kernels replay their mask from the key (the CUDA generator set to it)
        ((1, 8, 512, 64), (1, 8, 512, 64), True, 0.1, (9, 0), {"cudnn", "aten_flash", "efficient"}, "cudnn"),
        ((1, 8, 512, 64), (1, 8, 512, 64), True, 0.1, (9, 0), {"cudnn-nodrop", "aten_flash", "efficient"}, "aten_flash"),
        ((1, 8, 512, 64), (1, 8, 512, 64), True, 0.1, (9, 0), {"cudnn-nodrop"}, "triton"),
        ((1, 8, 512, 64), (1, 2, 512, 64), True, 0.0, (9, 0), {"cudnn", "aten_flash", "efficient"}, "triton"),
        ((1, 8, 100, 64), (1, 8, 512, 64), True, 0.0, (9, 0), {"cudnn", "aten_flash", "efficient"}, "triton"),
        ((1, 8, 100, 64), (1, 8, 512, 64), False, 0.0, (9, 0), {"cudnn", "aten_flash", "efficient"}, "cudnn"),
        # head sizes: multiples of 8 go to ATen's kernels (when torch accepts them), the others to
        # memopt's (ATen's ops take none; F.scaled_dot_product_attention pads them)
        ((1, 8, 512, 80), (1, 8, 512, 80), True, 0.0, (9, 0), {"cudnn", "aten_flash", "efficient"}, "cudnn"),
        ((1, 8, 512, 20), (1, 8, 512, 20), True, 0.0, (9, 0), {"cudnn", "aten_flash", "efficient"}, "triton"),
        ((1, 8, 512, 3), (1, 8, 512, 3), False, 0.1, (8, 0), {"cudnn", "aten_flash", "efficient"}, "triton"),
    ],
)
def test_auto_rule_on_cuda(monkeypatch, q_shape, kv_shape, causal, dropout_p, capability, accepts, expected):
    monkeypatch.setattr(attention_ops, "_compute_capability", lambda index: capability)
    # "name-nodrop": torch accepts that backend without dropout only
    def accepts_fn(backend, q, k, v, causal, dropout_p=0.0):
        return backend in accepts or (dropout_p == 0.0 and f"{backend}-nodrop" in accepts)

    monkeypatch.setattr(attention_ops, "_aten_cuda_accepts", accepts_fn)
    q, kv = _CudaStandIn(*q_shape), _CudaStandIn(*kv_shape)
    assert resolve_backend("auto", q, kv, kv, causal, dropout_p) == expected


def test_named_cuda_backends_refuse_what_breaks_the_contract(monkeypatch):
    monkeypatch.setattr(attention_ops, "_aten_cuda_accepts", lambda backend, *args: backend != "efficient")
    q, short = _CudaStandIn(1, 8, 512, 64), _CudaStandIn(1, 8, 100, 64)
    assert resolve_backend("cudnn", q, q, q, False, 0.1) == "cudnn"
    with pytest.raises(ValueError, match="does not align a causal mask"):
        resolve_backend("aten_flash", short, q, q, True, 0.0)
    with pytest.raises(ValueError, match="torch cannot run backend 'efficient'"):
        resolve_backend("efficient", q, q, q, False, 0.0)
    with pytest.raises(ValueError, match="does not run on CUDA"):
        resolve_backend("native", q, q, q, False, 0.0)
    odd = _CudaStandIn(1, 8, 512, 20)
    for backend in ("cudnn", "aten_flash", "efficient"):
        with pytest.raises(ValueError, match=f"backend '{backend}' takes a head_dim that is a multiple of 8 on CUDA, got head_dim=20"):
            resolve_backend(backend, odd, odd, odd, False, 0.0)
    assert resolve_backend("cudnn", q, q, q, True, 0.0) == "cudnn"


# The argument names the CUDA and CPU branches pass by keyword, and the positional order of the
# backward ops, in this torch's schemas (checked on every torch CI runs, 2.11 to 2.14).
ATEN_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu": ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"],
    "_scaled_dot_product_flash_attention_for_cpu_backward": [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"],
    "_scaled_dot_product_flash_attention": [
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"],
    "_scaled_dot_product_flash_attention_backward": [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"],
    "_scaled_dot_product_cudnn_attention": [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask",
        "scale"],
    "_scaled_dot_product_cudnn_attention_backward": [
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
        "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"],
    "_scaled_dot_product_efficient_attention": [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"],
    "_scaled_dot_product_efficient_attention_backward": [
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
        "dropout_p", "grad_input_mask", "is_causal", "scale"],
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(ATEN_SCHEMAS))
def test_aten_op_schemas_match_the_calls(op):
    schema = getattr(torch.ops.aten, op).default._schema
    assert [a.name for a in schema.arguments] == ATEN_SCHEMAS[op], str(schema)


@pytest.mark.parametrize("backend", ["aten_flash", "cudnn", "efficient"])
def test_aten_philox_fields_are_the_seed_and_offset_the_backward_takes(backend):
    # The forward's outputs handed to the backward as its philox_seed and philox_offset (flash
    # calls them rng_state and unused from torch 2.14 on), by position, on every torch CI runs.
    op = {"aten_flash": "_scaled_dot_product_flash_attention", "cudnn": "_scaled_dot_product_cudnn_attention",
          "efficient": "_scaled_dot_product_efficient_attention"}[backend]  # fmt: skip
    returns = [r.name for r in getattr(torch.ops.aten, op).default._schema.returns]
    seed, offset = attention_ops._ATEN_PHILOX_FIELDS[backend]
    assert (returns[seed], returns[offset]) in {("philox_seed", "philox_offset"), ("rng_state", "unused")}, returns


@pytest.mark.parametrize("backend", ["aten_flash", "cudnn", "efficient"])
def test_aten_cuda_lse_layout_is_read_from_the_meta_kernels(backend):
    rank, rows = attention_ops._aten_lse_layout(backend)
    # 33 query rows: flash returns (B, H, Sq); cuDNN (B, H, Sq, 1) from torch 2.14 on (Sq before);
    # the memory-efficient kernel pads Sq to a multiple of 32.
    assert (rank, rows) in {"aten_flash": [(3, 33)], "cudnn": [(3, 33), (4, 33)], "efficient": [(3, 64)]}[backend]


@gpu
@pytest.mark.parametrize("backend", ["triton", "aten_flash", "cudnn", "efficient", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", [(2, 4, 4, 1024, 1024, 64), (1, 8, 2, 777, 777, 128), (1, 4, 4, 300, 1100, 32)], ids=_shape_id
)
def test_gpu_every_backend_matches_reference(backend, dtype, causal, shape):
    q, k, v = _inputs(shape, dtype=dtype, device="cuda")
    try:
        resolved = resolve_backend(backend, q, k, v, causal, 0.0)
    except ValueError as err:
        pytest.skip(str(err))
    out = memopt.attention(q, k, v, causal=causal, backend=backend)
    assert out.is_contiguous()
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    lse = torch.ops.memopt.attention_fwd(q, k, v, causal, 0.0, 1 / math.sqrt(shape[-1]), rng_key(0), resolved)[1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    group = shape[1] // shape[2]
    scores = q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(shape[-1])
    if causal:
        scores = scores.masked_fill(attention_ops._causal_hidden(0, shape[4], 0, shape[3], "cuda"), -math.inf)
    assert lse.shape == shape[:2] + (shape[3],) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=2e-2, rtol=0)
    kx, vx = (t.repeat_interleave(group, 1) for t in (k, v))
    sdpa = F.scaled_dot_product_attention(q, kx, vx, is_causal=causal)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), grad)
    for name, a, s_, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (sdpa, *sdpa_grads), (ref, *ref_grads)):
        ours, theirs = _max_error(a, r), _max_error(s_, r)
        assert ours <= 2 * theirs + 1e-3 * r.abs().max().item(), f"{resolved} {name}: {ours:.3e}, sdpa {theirs:.3e}"


@gpu
def test_gpu_backends_share_one_lse_and_dropout_goes_to_aten():
    q, k, v = _inputs((1, 8, 8, 512, 512, 64), dtype=torch.bfloat16, device="cuda")
    assert resolve_backend("auto", q, k, v, True, 0.1) in attention_ops.ATEN_CUDA_BACKENDS
    assert resolve_backend("auto", q, k[:, :2], v[:, :2], True, 0.1) == "triton"  # grouped-query heads
    lses = {}
    for backend in ("triton", "aten_flash", "cudnn", "efficient"):
        try:
            resolve_backend(backend, q, k, v, True, 0.0)
        except ValueError:
            continue
        lses[backend] = torch.ops.memopt.attention_fwd(q, k, v, True, 0.0, 0.125, rng_key(0), backend)[1]
    for backend, lse in lses.items():
        torch.testing.assert_close(lse, lses["triton"], atol=1e-2, rtol=0, msg=lambda m, n=backend: f"{n}: {m}")


class _RecordingCudaGenerator:
    """Stands in for torch's default CUDA generator: records what is set, hands back a state."""

    def __init__(self):
        self.state = torch.tensor([1, 2, 3], dtype=torch.uint8)
        self.calls = []

    def get_state(self):
        self.calls.append(("get_state",))
        return self.state.clone()

    def set_state(self, state):
        self.calls.append(("set_state", state.tolist()))

    def manual_seed(self, seed):
        self.calls.append(("manual_seed", seed))

    def set_offset(self, offset):
        self.calls.append(("set_offset", offset))


@pytest.mark.parametrize(
    "key,seed,offset",
    [((5, 3), 5, 12), ((-1, 0), 2**64 - 1, 0), ((2**62, 2**62 + 1), 2**62, (4 * (2**62 + 1)) % 2**64)],
    ids=["small", "negative-seed", "offset-wraps"],
)
def test_cuda_generator_is_set_to_the_key_and_put_back(monkeypatch, key, seed, offset):
    # ATen's dropout kernels draw from the default CUDA generator: memopt sets it to the key (seed
    # and 4 x offset, CUDA's Philox offsets come in steps of 4, both as uint64) for the call and
    # puts the saved state back after it, also when the call raises.
    generator = _RecordingCudaGenerator()
    monkeypatch.setattr(torch.cuda, "default_generators", (generator,))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    device = torch.device("cuda", 0)
    with attention_ops._cuda_generator_at(device, rng_key(*key)):
        assert generator.calls == [("get_state",), ("manual_seed", seed), ("set_offset", offset)]
    assert generator.calls[-1] == ("set_state", [1, 2, 3])
    generator.calls.clear()
    with pytest.raises(KeyError):
        with attention_ops._cuda_generator_at(device, rng_key(*key)):
            raise KeyError("the kernel failed")
    assert generator.calls[-1] == ("set_state", [1, 2, 3])


def test_cuda_generator_refuses_a_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "default_generators", (_RecordingCudaGenerator(),))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph is captured; pass backend='triton'"):
        with attention_ops._cuda_generator_at(torch.device("cuda", 0), rng_key(1)):
            pass


def _kept_entries(q, k, causal, dropout_p, key, backend):
    """The dropout mask a backend applied, read from its forward: with v the columns [n0, n0 + D)
    of the identity, out[..., i, d] is probability (i, n0 + d) times its dropout factor."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    keep = torch.zeros(batch, heads, seq_q, seq_k, dtype=torch.bool, device=q.device)
    for n0 in range(0, seq_k, head_dim):
        n1 = min(seq_k, n0 + head_dim)
        v = torch.zeros(batch, heads, seq_k, head_dim, dtype=q.dtype, device=q.device)
        for d in range(n1 - n0):
            v[:, :, n0 + d, d] = 1
        with torch.no_grad():
            out = memopt.attention(q, k, v, causal=causal, dropout_p=dropout_p, rng_key=key, backend=backend)
        keep[..., n0:n1] = out[..., : n1 - n0] != 0
    return keep


def _reference_with_mask(q, k, v, causal, dropout_p, keep):
    """float64 attention with the given dropout mask."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(attention_ops._causal_hidden(0, k.shape[2], 0, q.shape[2], q.device), -math.inf)
    probs = torch.softmax(scores, -1)
    return torch.where(keep, probs / (1 - dropout_p), torch.zeros_like(probs)) @ v


@gpu
@pytest.mark.parametrize("backend", ["aten_flash", "cudnn", "efficient"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 256, 256, 64), (1, 2, 2, 333, 333, 128)], ids=_shape_id)
def test_gpu_aten_dropout_replays_its_mask_from_the_key(backend, dtype, causal, shape):
    # ATen's fused kernels with dropout under memopt's contract: the mask is a function of the key
    # (the same mask in every forward and in the backward), the user's CUDA generator does not
    # move, and output and gradients match float64 attention with the mask the forward applied.
    q, k, v = _inputs(shape, dtype=dtype, device="cuda")
    p, key = 0.2, rng_key(1234, 56)
    try:
        resolve_backend(backend, q, k, v, causal, p)
    except ValueError as err:
        pytest.skip(str(err))
    generator_state = torch.cuda.get_rng_state()
    keep = _kept_entries(q.detach(), k.detach(), causal, p, key, backend)
    seen = ~attention_ops._causal_hidden(0, shape[4], 0, shape[3], "cuda") if causal else torch.ones_like(keep[0, 0])
    kept_fraction = keep.sum().item() / (seen.sum().item() * shape[0] * shape[1])
    assert abs(kept_fraction - (1 - p)) < 0.01, kept_fraction
    assert not torch.equal(keep[0, 0], keep[0, 1])  # each head draws its own
    assert torch.equal(keep, _kept_entries(q.detach(), k.detach(), causal, p, key, backend))
    assert not torch.equal(keep, _kept_entries(q.detach(), k.detach(), causal, p, rng_key(1234, 57), backend))
    assert torch.equal(
        attention_ops.aten_dropout_keep_mask(backend, q.detach(), k.detach(), causal, p, 1 / math.sqrt(shape[-1]), key), keep
    )

    out = memopt.attention(q, k, v, causal=causal, dropout_p=p, rng_key=key, backend=backend)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert torch.equal(torch.cuda.get_rng_state(), generator_state)
    assert torch.equal(out, memopt.attention(q, k, v, causal=causal, dropout_p=p, rng_key=key, backend=backend))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference_with_mask(q64, k64, v64, causal, p, keep)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert _max_error(a, r) <= tol * max(1.0, r.abs().max().item()), f"{name}: {_max_error(a, r):.3e}"


@gpu
@pytest.mark.parametrize("backend", ["aten_flash", "cudnn", "efficient"])
def test_gpu_aten_dropout_second_derivatives_use_the_kernels_mask(backend):
    q, k, v = _inputs((1, 2, 2, 96, 96, 64), dtype=torch.bfloat16, device="cuda")
    p, key = 0.3, rng_key(7)
    try:
        resolve_backend(backend, q, k, v, True, p)
    except ValueError as err:
        pytest.skip(str(err))
    keep = _kept_entries(q.detach(), k.detach(), True, p, key, backend)

    def penalty(fn, tensors):
        out = fn(*tensors)
        grad_q, grad_k, grad_v = torch.autograd.grad(out.float().square().sum(), tensors, create_graph=True)
        return torch.autograd.grad(grad_q.float().square().sum() + grad_v.float().sum(), tensors)

    got = penalty(lambda *t: memopt.attention(*t, causal=True, dropout_p=p, rng_key=key, backend=backend), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = penalty(lambda *t: _reference_with_mask(*t, True, p, keep), (q64, k64, v64))
    for name, a, e in zip(("q", "k", "v"), got, expected):
        assert _max_error(a, e) <= 3e-2 * max(1.0, e.abs().max().item()), f"{name}: {_max_error(a, e):.3e}"


def test_direct_op_calls_give_values_and_torch_warns_when_they_are_backpropagated():
    # The registered ops compute values (AttentionFunction differentiates them): a direct call on
    # tensors that require grad returns the values; backpropagating through it gets torch's
    # warning that the op has no autograd kernel, as for every op without a derivative formula.
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    key = rng_key(0)
    out, lse = torch.ops.memopt.attention_fwd(q, q, q, False, 0.0, 0.25, key)
    torch.testing.assert_close(out, attention_ref(q, q, q, scale=0.25).float())
    with pytest.warns(UserWarning, match="memopt::attention_fwd: an autograd kernel was not registered"):
        out.sum().backward()


@pytest.mark.parametrize(
    "backend,dropout_p", [("native", 0.0), ("native", 0.2), ("cpu_flash", 0.2), ("aten_flash", 0.0)]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_second_derivatives_match_the_reference(causal, backend, dropout_p):
    # Gradient penalty through attention (grouped-query heads): d/d(q, k, v) of |grad_q|^2 + sum(grad_v),
    # float64, against the same through the plain reference with the same dropout key.
    key = rng_key(11)
    q, k, v = (t.double() for t in _inputs((1, 4, 2, 13, 11, 16)))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    weight = torch.randn(1, 4, 13, 16, dtype=torch.float64)

    def penalty_grads(fn):
        out = fn(q, k, v)
        grad_q, grad_k, grad_v = torch.autograd.grad((out * weight).sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(grad_q.pow(2).sum() + grad_k.sum() + (grad_v * grad_v).sum(), (q, k, v))

    actual = penalty_grads(lambda *t: memopt.attention(*t, causal=causal, dropout_p=dropout_p, rng_key=key, backend=backend))
    expected = penalty_grads(lambda *t: attention_ref(*t, causal=causal, dropout_p=dropout_p, rng_key=key))
    for name, a, e in zip("qkv", actual, expected):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")
        assert a.abs().max() > 0


# -- attention_flash_cpu: memopt's CPU kernels under a C++ autograd node (csrc/attention_cpu.cpp) --


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_cpu_op_opcheck(causal, dtype):
    # Grouped-query heads, seq_q != seq_k; q, k, v require grad so the autograd kernel is checked.
    q = torch.randn(1, 4, 9, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, 11, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, 11, 16, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.memopt.attention_flash_cpu.default, (q, k, v, causal, 0.25))


def test_cpu_attention_without_dropout_runs_the_cpp_node_and_matches_the_reference():
    # memopt.attention's CPU path without dropout: one C++ node (no Python autograd Function), the
    # output and gradients of the float64 reference, and memopt's layouts: out contiguous for a
    # contiguous q, a view of a (B, S, H, D) buffer for q a view of a fused projection.
    q, k, v = (t.double() for t in _inputs((2, 4, 2, 13, 11, 16)))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = memopt.attention(q, k, v, causal=True)
    assert "FlashAttentionCpuFunction" in out.grad_fn.name()
    assert out.is_contiguous()
    grad = torch.randn_like(out)
    ref = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    actual = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)
        assert a.transpose(1, 2).is_contiguous()
    fused = torch.randn(2, 13, 3, 4, 16, dtype=torch.float64)  # (B, S, qkv, H, D)
    fq, fk, fv = fused.permute(2, 0, 3, 1, 4).unbind(0)
    fused_out = memopt.attention(fq, fk, fv, causal=True)
    assert fused_out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(fused_out, attention_ref(fq, fk, fv, causal=True), atol=1e-12, rtol=1e-12)


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# (q, k, v, scale): each wrong in one way memopt.attention's checks name.
_FLASH_CPU_BAD_INPUTS = {
    "q-3d": (_t(2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16), None),
    "v-5d": (_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 1, 2, 8, 16), None),
    "kv-shapes": (_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 9, 16), None),
    "batch": (_t(1, 2, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16), None),
    "head-dim-mismatch": (_t(1, 2, 8, 16), _t(1, 2, 8, 32), _t(1, 2, 8, 32), None),
    "heads-not-a-multiple": (_t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16), None),
    "kv-heads-zero": (_t(1, 2, 8, 16), _t(1, 0, 8, 16), _t(1, 0, 8, 16), None),
    "seq-zero": (_t(1, 2, 0, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16), None),
    "head-dim-300": (_t(1, 2, 8, 300), _t(1, 2, 8, 300), _t(1, 2, 8, 300), None),
    "head-dim-0": (_t(1, 2, 8, 0), _t(1, 2, 8, 0), _t(1, 2, 8, 0), None),
    "dtypes": (_t(1, 2, 8, 16), _t(1, 2, 8, 16, dtype=torch.float64), _t(1, 2, 8, 16), None),
    "float16": tuple(_t(1, 2, 8, 16).half() for _ in range(3)) + (None,),
    "bfloat16": tuple(_t(1, 2, 8, 16).bfloat16() for _ in range(3)) + (None,),
    "scale-nan": (_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16), math.nan),
    "scale-inf": (_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16), math.inf),
}


@pytest.mark.parametrize("case", list(_FLASH_CPU_BAD_INPUTS))
def test_flash_cpu_op_refuses_what_the_python_checks_refuse_with_their_message(case):
    # memopt.attention's CPU call without dropout goes straight to the C++ op, which checks the
    # tensors itself; naming the backend sends the same call through the Python checks
    # (_check_inputs): the same exception type and the same message, word for word.
    q, k, v, scale = _FLASH_CPU_BAD_INPUTS[case]
    with pytest.raises((TypeError, ValueError)) as python_error:
        memopt.attention(q, k, v, scale=scale, backend="aten_flash")
    with pytest.raises((TypeError, ValueError)) as op_error:
        memopt.attention(q, k, v, scale=scale)
    assert type(op_error.value) is type(python_error.value)
    assert str(op_error.value) == str(python_error.value)
    with pytest.raises(type(python_error.value)) as direct_error:  # the op called by itself
        torch.ops.memopt.attention_flash_cpu(q, k, v, False, scale)
    assert str(direct_error.value) == str(python_error.value)


def test_flash_cpu_op_default_scale_is_one_over_sqrt_head_dim():
    q, k, v = (t.double() for t in _inputs((1, 2, 1, 5, 7, 32)))
    out = torch.ops.memopt.attention_flash_cpu(q, k, v, True)
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True, scale=32**-0.5), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_cpu_gradcheck_and_gradgradcheck(causal):
    q, k, v = _inputs((1, 2, 1, 7, 9, 16), dtype=torch.float64)
    fn = lambda a, b, c: memopt.attention(a, b, c, causal=causal, scale=0.3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), **GRADCHECK_TOLERANCES)
    assert torch.autograd.gradgradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# "cpu_flash": memopt's C++ kernels (csrc/attention_cpu_kernels_impl.h), their own ops.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 65, 65, 64), (1, 2, 2, 1100, 1100, 32), (1, 2, 1, 600, 1030, 16), (1, 3, 3, 1030, 600, 64)],
    ids=_shape_id,
)
def test_cpu_flash_ops_match_the_float64_reference(causal, dropout_p, shape):
    # Tiles of 64 query rows (65: a one-row tile), keys in blocks of 512 with an online softmax
    # across them (seq_k > 512), grouped-query heads, causal masks of non-square shapes both ways,
    # q / k / v as strided views of one fused projection. With dropout: rows whose first element
    # index is not a multiple of 4 (seq_k 65, 1030), key blocks starting mid-row, against the mask
    # of memopt.ops._philox (plain PyTorch).
    batch, heads, kv_heads, seq_q, seq_k, head_dim = shape
    fused_q = torch.randn(batch, seq_q, heads, head_dim, dtype=torch.float64).transpose(1, 2)
    fused_kv = torch.randn(batch, seq_k, 2, kv_heads, head_dim, dtype=torch.float64).permute(2, 0, 3, 1, 4)
    q, (k, v) = fused_q, fused_kv.unbind(0)
    scale, key = 0.3, rng_key(19, 7)
    out, lse = torch.ops.memopt.cpu_flash_attention_fwd(q, k, v, causal, scale, dropout_p, key)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=causal, dropout_p=dropout_p, scale=scale, rng_key=key)
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q64, k64, v64), grad)
    group = heads // kv_heads
    scores = (q64 @ k64.repeat_interleave(group, 1).transpose(-2, -1) * scale).detach()
    if causal:
        scores = scores.masked_fill(torch.ones(seq_q, seq_k, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, ref.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-12, rtol=1e-12)
    actual = torch.ops.memopt.cpu_flash_attention_bwd(grad, q, k, v, out, lse, causal, scale, dropout_p, key)
    for name, a, e in zip(("grad_q", "grad_k", "grad_v"), actual, expected):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11, msg=lambda m, n=name: f"{n}: {m}")
        assert a.transpose(1, 2).is_contiguous()
    assert out.transpose(1, 2).is_contiguous()  # q is a view of a (B, S, H, D) buffer


def test_cpu_flash_float32_error_within_twice_the_eager_float32_error():
    # The flash-attention bar: at most 2x PyTorch's own float32 error against float64.
    q, k, v = _inputs((2, 8, 8, 256, 256, 64))
    grad = torch.randn(2, 8, 256, 64)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    results = {}
    for name, fn in (("memopt", lambda a, b, c: memopt.attention(a, b, c, causal=True, backend="cpu_flash")),
                     ("eager", lambda a, b, c: attention_ref(a, b, c, causal=True, upcast=False))):
        qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(qe, ke, ve)
        results[name] = (out, *torch.autograd.grad(out, (qe, ke, ve), grad))
    for i, name in enumerate(("out", "grad_q", "grad_k", "grad_v")):
        expected = (ref, *ref_grads)[i]
        memopt_error = (results["memopt"][i].double() - expected).abs().max().item()
        eager_error = (results["eager"][i].double() - expected).abs().max().item()
        assert memopt_error <= 2 * eager_error + 1e-7, f"{name}: memopt {memopt_error:.3g} vs eager {eager_error:.3g}"


def test_cpu_flash_gradcheck_float64():
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.autograd.gradcheck(lambda a, b, c: memopt.attention(a, b, c, causal=True, backend="cpu_flash"), (q, k, v))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
def test_cpu_flash_opcheck(dropout_p):
    q, k, v = (torch.randn(1, 2, 70, 32) for _ in range(3))
    key = rng_key(4)
    out, lse = torch.ops.memopt.cpu_flash_attention_fwd(q, k, v, True, 0.2, dropout_p, key)
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.memopt.cpu_flash_attention_fwd.default, (q, k, v, True, 0.2, dropout_p, key))
    torch.library.opcheck(
        torch.ops.memopt.cpu_flash_attention_bwd.default, (grad, q, k, v, out, lse, True, 0.2, dropout_p, key)
    )


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cpu_flash_packed_gradients_are_the_three_gradients_laid_out_as_qkv(kv_heads, dropout_p):
    # The block's backward takes grad_qkv from this op: (B, S, H + 2 Hkv, D), q's heads first.
    fused = torch.randn(2, 70, 4 + 2 * kv_heads, 32, dtype=torch.float64)
    q, k, v = fused.split((4, kv_heads, kv_heads), dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    key = rng_key(12, 5)
    out, lse = torch.ops.memopt.cpu_flash_attention_fwd(q, k, v, True, 0.2, dropout_p, key)
    grad = torch.randn_like(out)
    packed = torch.ops.memopt.cpu_flash_attention_bwd_packed(grad, q, k, v, out, lse, True, 0.2, dropout_p, key)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=True, dropout_p=dropout_p, scale=0.2, rng_key=key)
    expected = torch.autograd.grad(ref, (q64, k64, v64), grad)
    assert packed.shape == fused.shape and packed.is_contiguous()
    torch.testing.assert_close(packed, torch.cat([g.transpose(1, 2) for g in expected], dim=2), atol=1e-12, rtol=1e-12)
    torch.library.opcheck(
        torch.ops.memopt.cpu_flash_attention_bwd_packed.default, (grad, q, k, v, out, lse, True, 0.2, dropout_p, key)
    )


def test_cpu_flash_refuses_what_it_cannot_do():
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"cpu_flash_attention_fwd: dropout_p > 0 needs rng_key"):
        torch.ops.memopt.cpu_flash_attention_fwd(q, q, q, True, 0.2, 0.1)
    with pytest.raises(ValueError, match=r"cpu_flash_attention_bwd: dropout_p must be in \[0, 1\), got 1"):
        torch.ops.memopt.cpu_flash_attention_bwd(q, q, q, q, q, torch.randn(1, 2, 8), True, 0.2, 1.0, rng_key(1))
    with pytest.raises(RuntimeError, match="rng_key must be an int64 CPU tensor of 2 elements"):
        torch.ops.memopt.cpu_flash_attention_bwd_packed(q, q, q, q, q, torch.randn(1, 2, 8), True, 0.2, 0.1, torch.zeros(3))
    with pytest.raises(ValueError, match="head_dim must be between 1 and 256"):
        torch.ops.memopt.cpu_flash_attention_fwd(torch.randn(1, 2, 8, 257), torch.randn(1, 2, 8, 257), torch.randn(1, 2, 8, 257), True, 0.2)
    with pytest.raises(ValueError, match="cpu_flash_attention_bwd: lse must have shape"):
        torch.ops.memopt.cpu_flash_attention_bwd(q, q, q, q, q, torch.randn(1, 2, 7), True, 0.2)
    with pytest.raises(ValueError, match="cpu_flash_attention_bwd_packed: grad_out must have shape"):
        torch.ops.memopt.cpu_flash_attention_bwd_packed(q[:, :1], q, q, q, q, torch.randn(1, 2, 8), True, 0.2)


@pytest.mark.parametrize(
    "backend,dropout_p",
    [
        pytest.param("triton", 0.0, marks=needs_interpreter), pytest.param("triton", 0.2, marks=needs_interpreter),
        ("native", 0.2), ("cpu_flash", 0.2), ("aten_flash", 0.0), ("auto", 0.0),
    ],
)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_bwd_packed_op_is_the_three_gradients_laid_out_as_qkv(backend, dropout_p, kv_heads):
    # The block's backward takes grad_qkv from this op on CUDA and under torch.compile:
    # (B, S, H + 2 Hkv, D), q's heads first; the Triton kernels write it in place of three buffers.
    dtype = torch.float32 if backend == "triton" else torch.float64
    fused = torch.randn(2, 33, 4 + 2 * kv_heads, 32, dtype=dtype)
    q, k, v = (t.transpose(1, 2) for t in fused.split((4, kv_heads, kv_heads), dim=2))
    key = rng_key(12, 5)
    out, lse = torch.ops.memopt.attention_fwd(q, k, v, True, dropout_p, 0.2, key, backend)
    grad = torch.randn_like(out)
    args = (grad, q, k, v, out, lse, True, dropout_p, 0.2, key, backend)
    packed = torch.ops.memopt.attention_bwd_packed(*args)
    assert packed.shape == fused.shape and packed.is_contiguous()
    # Independent of the kernels: the float64 reference's gradients, laid out by hand.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=True, dropout_p=dropout_p, scale=0.2, rng_key=key)
    expected = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    for got, want in zip(packed.split((4, kv_heads, kv_heads), dim=2), expected):
        torch.testing.assert_close(got.double(), want.transpose(1, 2), atol=atol, rtol=rtol)
    # And what attention_bwd returns, to the bit: the packed layout changes where, not what.
    assert torch.equal(packed, torch.cat([g.transpose(1, 2) for g in torch.ops.memopt.attention_bwd(*args)], dim=2))
    torch.library.opcheck(torch.ops.memopt.attention_bwd_packed.default, args)


def test_bwd_packed_op_refuses_cross_attention_and_names_its_arguments():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 6, 16)
    out, lse = torch.ops.memopt.attention_fwd(q, k, k, False, 0.0, 0.25, rng_key(1), "auto")
    with pytest.raises(ValueError, match="attention_bwd_packed: packs the gradients .* seq_q must equal seq_k, got 8 and 6"):
        torch.ops.memopt.attention_bwd_packed(out, q, k, k, out, lse, False, 0.0, 0.25, rng_key(1))
    with pytest.raises(ValueError, match=r"memopt.attention_bwd_packed: lse must be torch.float32 of shape \(1, 2, 8\)"):
        torch.ops.memopt.attention_bwd_packed(out, q, q, q, out, lse[..., :7], False, 0.0, 0.25, rng_key(1))
    with pytest.raises(ValueError, match=r"memopt.attention_bwd_packed: grad_out must have q's shape"):
        torch.ops.memopt.attention_bwd_packed(out[:, :1], q, q, q, out, lse, False, 0.0, 0.25, rng_key(1))
