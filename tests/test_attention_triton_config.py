"""Which GPU launch configuration the Triton attention launcher picks: from the strides and
pointers it passes (Triton's 16-divisibility hints), not from head_dim; and the kernels on such
strided views against the float64 reference, in the interpreter."""

import inspect

import pytest
import torch

import memopt
from memopt.ops._rng import rng_key
from memopt.ops.attention import attention_ref, attention_triton, cpu_backend

from helpers import needs_triton_interpreter as needs_interpreter

pytestmark = pytest.mark.skipif(attention_triton is None, reason="triton is not installed (CPU-only torch wheels lack it)")

KERNELS = ("fwd", "bwd_delta", "bwd_dkdv", "bwd_dq")
# The kernels' element-tensor arguments (lse and delta, fresh float32 buffers, are not checked).
ELEMENT_POINTERS = {"Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV"}
# (atol, rtol) against the float64 reference, as tests/test_attention.py.
TOLERANCES = {torch.float32: (3e-5, 3e-5)}


def _rows(batch, heads, seq, head_dim, row, dtype=torch.float32, offset=0):
    """(B, H, S, head_dim) view of a (B, S, H, row) buffer, starting ``offset`` elements into each row."""
    buffer = torch.randn(batch, seq, heads, row, dtype=dtype)
    return buffer[..., offset:offset + head_dim].transpose(1, 2)


def test_args_aligned_follows_strides_and_pointers_not_head_dim():
    aligned = attention_triton.args_aligned
    q = torch.empty(2, 4, 32, 64, dtype=torch.bfloat16)
    assert aligned((q,), q.stride()[:3])
    # head_dim 64, but rows of 72: the head and row strides are not multiples of 16.
    sliced = _rows(2, 4, 32, 64, 72, torch.bfloat16)
    assert not aligned((sliced,), sliced.stride()[:3])
    # Rows of 80 elements: strides that are multiples of 16, the view 8 elements (16 bytes) in is
    # aligned, 1 element (2 bytes) in is not; 4 float32 elements are 16 bytes.
    assert aligned((_rows(1, 2, 8, 64, 80, torch.bfloat16, 8),), (1280, 80, 160))
    assert not aligned((_rows(1, 2, 8, 64, 80, torch.bfloat16, 1),), (1280, 80, 160))
    assert aligned((_rows(1, 2, 8, 64, 80, torch.float32, 4),), (1280, 80, 160))
    # A head_dim that is not a multiple of 16 gives a stride that is not (one is head_dim itself).
    q24 = torch.empty(1, 2, 8, 24, dtype=torch.bfloat16)
    assert not aligned((q24,), q24.stride()[:3])
    # Any one argument without the hint is enough.
    assert not aligned((q, _rows(1, 2, 8, 64, 80, torch.bfloat16, 1)), q.stride()[:3])
    assert not aligned((q,), (*q.stride()[:3], 24))


@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_config_takes_the_unaligned_table_by_the_hints_for_any_head_dim(kernel):
    table = attention_triton.GPU_CONFIGS[kernel]
    unaligned = attention_triton.UNALIGNED_GPU_CONFIGS[kernel]
    for (block, dropout), config in table.items():
        for head_dim in (block, block - 8):
            expected = unaligned.get((block, dropout), config)
            assert attention_triton.gpu_config(kernel, head_dim, dropout, False) == expected
            assert attention_triton.gpu_config(kernel, head_dim, dropout, True) == config


class _RecordedKernel:
    """Stands in for a @triton.jit kernel: records each launch's arguments, then runs it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches
        self.arg_names = list(inspect.signature(kernel.fn).parameters)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(dict(zip(self.arg_names, args)))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _launch_choices(monkeypatch, q, k, v, dropout_p):
    """{kernel: (the launcher's choice, the choice the kernel's own arguments call for)} of one
    forward and backward through the Triton kernels."""
    chosen, launches = {}, {name: [] for name in KERNELS}

    def recording_launch_config(kernel, head_dim, dropout, tensors, strides):
        aligned = attention_triton.args_aligned(tensors, strides)
        chosen[kernel] = (attention_triton.gpu_config(kernel, head_dim, dropout, aligned), head_dim, dropout)
        return attention_triton.INTERPRETER_CONFIG

    monkeypatch.setattr(attention_triton, "launch_config", recording_launch_config)
    for name, attr in zip(KERNELS, ("_attn_fwd_kernel", "_attn_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")):
        monkeypatch.setattr(attention_triton, attr, _RecordedKernel(getattr(attention_triton, attr), launches[name]))
    with cpu_backend("triton"):
        out = memopt.attention(q, k, v, causal=True, dropout_p=dropout_p, rng_key=rng_key(5, 0))
        out.sum().backward()
    choices = {}
    for name in KERNELS:
        (args,) = launches[name]
        strides = [value for arg, value in args.items() if arg.startswith("stride_")]
        tensors = [value for arg, value in args.items() if arg in ELEMENT_POINTERS]
        config, head_dim, dropout = chosen[name]
        from_args = attention_triton.gpu_config(name, head_dim, dropout, attention_triton.args_aligned(tensors, strides))
        choices[name] = (config, from_args)
    return choices


@needs_interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize(
    "row,head_dim",
    [(64, 64), (72, 64), (128, 128), (136, 128), (24, 24), (40, 24)],
    ids=lambda x: str(x),
)
def test_launcher_chooses_the_table_from_the_strides_the_kernels_get(monkeypatch, row, head_dim, dropout_p):
    q, k, v = (_rows(1, 2, 20, head_dim, row).requires_grad_() for _ in range(3))
    choices = _launch_choices(monkeypatch, q, k, v, dropout_p)
    hinted = row % 16 == 0 and head_dim % 16 == 0
    for kernel, (config, from_args) in choices.items():
        assert config == from_args, kernel
        dropout = dropout_p > 0.0
        assert config == attention_triton.gpu_config(kernel, head_dim, dropout, hinted), kernel
    # head_dim 64 in rows of 72 runs the unaligned table's bwd_dkdv, whose aligned tile spills there.
    if (row, head_dim) == (72, 64) and not dropout_p:
        assert choices["bwd_dkdv"][0] == attention_triton.UNALIGNED_GPU_CONFIGS["bwd_dkdv"][(64, False)]
        assert choices["bwd_dkdv"][0] != attention_triton.GPU_CONFIGS["bwd_dkdv"][(64, False)]


# (batch, heads, kv_heads, seq_q, seq_k, head_dim, row): q, k and v are head_dim-wide views of
# (B, S, H, row) buffers, so no stride is a multiple of 16 where row is not; odd lengths cross the
# interpreter's tiles; grouped-query heads.
STRIDED_SHAPES = [
    (1, 2, 2, 19, 19, 64, 72),
    (2, 4, 2, 17, 23, 24, 40),
    (1, 2, 1, 21, 13, 16, 20),
]


@needs_interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", STRIDED_SHAPES, ids=lambda s: "b{}h{}kv{}q{}k{}d{}row{}".format(*s))
def test_triton_on_views_of_wider_rows_matches_float64_reference(shape, causal, dropout_p):
    batch, heads, kv_heads, seq_q, seq_k, head_dim, row = shape
    q = _rows(batch, heads, seq_q, head_dim, row).requires_grad_()
    k = _rows(batch, kv_heads, seq_k, head_dim, row, offset=row - head_dim).requires_grad_()
    v = _rows(batch, kv_heads, seq_k, head_dim, row, offset=1).requires_grad_()
    assert q.stride(2) == heads * row and not q.is_contiguous()
    key = rng_key(77, 3)
    with cpu_backend("triton"):
        out = memopt.attention(q, k, v, causal=causal, dropout_p=dropout_p, rng_key=key)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal, dropout_p, None, key)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    atol, rtol = TOLERANCES[torch.float32]
    for name, actual, expected in zip(("out", "grad_q", "grad_k", "grad_v"), (out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
