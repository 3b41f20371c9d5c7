"""linear_cross_entropy: float64 reference at 1e-12 over ignore_index x reduction x label smoothing
x softcap x bias, low precision and autocast against twice the eager error, meta tensors, O(tokens) saved
tensors (counted), a chunk-bounded working set, gradcheck, opcheck, torch.compile, errors; the same
for a frozen head (note [a frozen LM head]: the hidden gradient formed in the forward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memopt
from memopt.ops import cross_entropy
from memopt.ops._common import autocast_off
from memopt.ops.cross_entropy import (
    IMPLEMENTATIONS,
    LinearCrossEntropyFunction,
    default_chunk_tokens,
    linear_cross_entropy_ref,
)
from tests.helpers import gpu

TOKENS, DIM, VOCAB, CHUNK = 97, 16, 1003, 32  # 97 = 3 chunks of 32 + 1; 1003 is no multiple of anything here
REDUCTIONS = ("mean", "sum", "none")
IGNORED = ("none", "some", "all")


def _inputs(tokens=TOKENS, dim=DIM, vocab=VOCAB, dtype=torch.float64, ignored="some", with_bias=True, device="cpu"):
    hidden = torch.randn(tokens, dim, dtype=dtype, device=device).requires_grad_()
    weight = (torch.randn(vocab, dim, dtype=dtype, device=device) / dim**0.5).requires_grad_()
    bias = (0.1 * torch.randn(vocab, dtype=dtype, device=device)).requires_grad_() if with_bias else None
    target = torch.randint(0, vocab, (tokens,), device=device)
    if ignored == "some":
        target[::3] = -100
    elif ignored == "all":
        target[:] = -100
    return hidden, weight, bias, target


def _leaves(hidden, weight, bias):
    """Those of the three that get a gradient (a frozen weight and bias do not)."""
    return [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]


def _frozen(weight, bias):
    """The LM head frozen (LoRA / PEFT): note [a frozen LM head]."""
    return weight.detach(), None if bias is None else bias.detach()


def _loss_and_grads(fn, hidden, weight, bias, target, upstream_seed=1, **kwargs):
    loss = fn(hidden, weight, target, bias=bias, **kwargs)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    grads = torch.autograd.grad(loss, _leaves(hidden, weight, bias), upstream.to(loss.dtype).to(loss.device))
    return loss, grads


def _assert_close_relative(actual, expected, rtol, what):
    """Elementwise |actual - expected| <= rtol * max|expected| (NaN where expected is NaN)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().nan_to_num(0.0).max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("logit_softcap", [None, 4.0])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignored", IGNORED)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float64_equals_reference(reduction, ignored, label_smoothing, logit_softcap):
    hidden, weight, bias, target = _inputs(ignored=ignored)
    options = dict(reduction=reduction, label_smoothing=label_smoothing, logit_softcap=logit_softcap)
    loss, grads = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=CHUNK, **options)
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    if ignored == "all" and reduction == "mean":
        assert ref_loss.isnan() and loss.isnan()  # torch's 0/0, kept
    _assert_close_relative(loss, ref_loss, 1e-12, "loss")
    for name, grad, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        _assert_close_relative(grad, ref, 1e-12, f"grad_{name}")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 7, None, 1000])
def test_float64_any_chunking_and_bias(chunk_tokens, with_bias):
    hidden, weight, bias, target = _inputs(with_bias=with_bias)
    options = dict(label_smoothing=0.2, logit_softcap=2.5)
    loss, grads = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=chunk_tokens, **options)
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    _assert_close_relative(loss, ref_loss, 1e-12, "loss")
    for grad, ref in zip(grads, ref_grads):
        _assert_close_relative(grad, ref, 1e-12, "grad")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("lead_shape", [(), (3, 33), (2, 1, 5)])
def test_leading_dimensions_and_integer_targets(lead_shape, reduction):
    hidden = torch.randn(*lead_shape, DIM, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, lead_shape, dtype=torch.int32)
    loss = memopt.linear_cross_entropy(hidden, weight, target, reduction=reduction, ignore_index=5, chunk_tokens=8)
    ref = linear_cross_entropy_ref(hidden, weight, target, reduction=reduction, ignore_index=5)
    _assert_close_relative(loss, ref, 1e-12, "loss")
    upstream = torch.randn_like(ref)
    for grad, ref_grad in zip(torch.autograd.grad(loss, (hidden, weight), upstream), torch.autograd.grad(ref, (hidden, weight), upstream)):
        _assert_close_relative(grad, ref_grad, 1e-12, "grad")


def test_no_tokens_gives_what_torch_gives():
    hidden, weight, bias, target = _inputs(tokens=0)
    for reduction in REDUCTIONS:
        loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, reduction=reduction)
        ref = linear_cross_entropy_ref(hidden, weight, target, bias=bias, reduction=reduction)
        torch.testing.assert_close(loss, ref, equal_nan=True)


def test_hidden_size_zero_gives_what_torch_gives():
    # Every logit is the bias (or 0): hidden.reshape(-1, 0) was ambiguous and raised.
    hidden = torch.randn(2, 3, 0, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 0, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[0, 3, 6], [2, 2, -100]])
    for reduction in REDUCTIONS:
        loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, reduction=reduction)
        ref = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), target.flatten(), reduction=reduction)
        torch.testing.assert_close(loss, ref.reshape(loss.shape), atol=1e-12, rtol=1e-12)
    loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias)
    ref = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), target.flatten())
    torch.testing.assert_close(torch.autograd.grad(loss, bias), torch.autograd.grad(ref, bias), atol=1e-12, rtol=1e-12)


def test_gradcheck_float64():
    hidden, weight, bias, target = _inputs(tokens=5, dim=3, vocab=7, ignored="none")
    target[1] = -100

    def fn(h, w, b):
        return LinearCrossEntropyFunction.apply(h, w, b, target, -100, 0.15, 1.5, 2, torch.float64)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_second_derivatives_are_refused_not_wrong():
    hidden, weight, bias, target = _inputs(tokens=5, dim=3, vocab=7)
    loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias)
    (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy_bwd"):
        grad_hidden.sum().backward()


def test_meta_tensors_give_the_shapes_and_dtypes_eager_gives():
    """Shape inference on ``meta`` (deferred init, FLOP counting): forward and backward run as
    ``F.linear`` + ``F.cross_entropy`` do there. Autocast does not exist for ``meta`` and
    ``torch.is_autocast_enabled("meta")`` raises; the op asked it and raised."""
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in REDUCTIONS:
            hidden, weight, bias, target = (
                t.detach().to("meta", dtype if t.is_floating_point() else None) for t in _inputs(tokens=6, dim=8, vocab=5)
            )
            leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
            options = dict(bias=bias, reduction=reduction, label_smoothing=0.1, logit_softcap=3.0)
            loss = memopt.linear_cross_entropy(hidden, weight, target, chunk_tokens=4, **options)
            eager = linear_cross_entropy_ref(hidden, weight, target, **options)
            grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss))
            eager_grads = torch.autograd.grad(eager, leaves, torch.ones_like(eager))
            for ours, theirs in zip((loss, *grads), (eager, *eager_grads)):
                assert (ours.device.type, ours.shape, ours.dtype) == ("meta", theirs.shape, theirs.dtype)
    # The op's bodies (and the fused block) enter autocast_off, which asked too; on meta the op
    # runs its fake impls instead, so it is checked directly.
    with autocast_off("meta"):
        pass


# --- low precision and autocast -------------------------------------------------------------


def _max_errors(loss, grads, ref_loss, ref_grads):
    return [(a.double() - r).abs().nan_to_num(0.0).max().item() for a, r in zip((loss, *grads), (ref_loss, *ref_grads))]


LOW_PRECISION = [
    # (parameter dtype, autocast dtype or None)
    pytest.param(torch.float32, None, id="float32"),
    pytest.param(torch.bfloat16, None, id="bfloat16"),
    pytest.param(torch.float32, torch.bfloat16, id="autocast-bfloat16"),
    pytest.param(torch.float32, torch.float16, id="autocast-float16"),
]


def _low_precision_check(device, dtype, autocast_dtype, tokens=TOKENS, dim=64, vocab=VOCAB, chunk=CHUNK, frozen=False):
    hidden, weight, bias, target = _inputs(tokens, dim, vocab, dtype=torch.float64, device=device)
    if frozen:
        weight, bias = _frozen(weight, bias)
    options = dict(label_smoothing=0.1, logit_softcap=8.0)
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    low = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in (hidden, weight, bias)]
    with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss, grads = _loss_and_grads(memopt.linear_cross_entropy, *low, target, chunk_tokens=chunk, **options)
        eager_loss, eager_grads = _loss_and_grads(linear_cross_entropy_ref, *low, target, **options)
    expected_dtype = torch.float32 if autocast_dtype is not None else dtype
    assert loss.dtype == eager_loss.dtype == expected_dtype
    assert [g.dtype for g in grads] == [t.dtype for t in _leaves(*low)]
    ours = _max_errors(loss, grads, ref_loss, ref_grads)
    eager = _max_errors(eager_loss, eager_grads, ref_loss, ref_grads)
    eps = torch.finfo(autocast_dtype or dtype).eps
    for name, mine, theirs, ref in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), ours, eager, (ref_loss, *ref_grads)):
        # Twice plain PyTorch's error in the same precision, with a floor of a few ulps of the
        # value's scale for the cases where eager happens to be almost exact.
        bound = 2 * theirs + 4 * eps * ref.abs().max().item()
        assert mine <= bound, f"{name}: error {mine:.3g} > bound {bound:.3g} (eager error {theirs:.3g})"


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("dtype,autocast_dtype", LOW_PRECISION)
def test_low_precision_within_twice_eager_error(dtype, autocast_dtype, frozen):
    _low_precision_check("cpu", dtype, autocast_dtype, frozen=frozen)


@pytest.mark.parametrize("chunk", [64, 16], ids=["64-chunks", "256-chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_weight_gradient_over_many_chunks_within_twice_eager_error(dtype, chunk):
    """float16/bfloat16 weights (no autocast): the weight gradient, a sum over every token, is
    summed over the chunks in float32 and cast once. Summed in the weight's dtype, each chunk
    added one rounding of the whole sum (bf16, 4096 tokens: 3.6x eager's error at 64 chunks,
    7.7x at 256)."""
    tokens, dim, vocab = 4096, 64, 512
    hidden, weight, bias, target = _inputs(tokens, dim, vocab, ignored="none")
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, reduction="sum")
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    _, grads = _loss_and_grads(memopt.linear_cross_entropy, *low, target, reduction="sum", chunk_tokens=chunk)
    _, eager_grads = _loss_and_grads(linear_cross_entropy_ref, *low, target, reduction="sum")
    for name, ours, theirs, ref in zip(("grad_weight", "grad_bias"), grads[1:], eager_grads[1:], ref_grads[1:]):
        assert ours.dtype == dtype
        error = ((ours.double() - ref).norm() / ref.norm()).item()
        eager_error = ((theirs.double() - ref).norm() / ref.norm()).item()
        assert error <= 2 * eager_error, f"{name}: relative error {error:.3g} > twice eager's {eager_error:.3g}"


def test_autocast_keeps_float64_in_float64():
    hidden, weight, bias, target = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=CHUNK)
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target)
    _assert_close_relative(loss, ref_loss, 1e-12, "loss")
    for grad, ref in zip(grads, ref_grads):
        _assert_close_relative(grad, ref, 1e-12, "grad")


# --- memory ---------------------------------------------------------------------------------


def test_saved_tensors_are_o_tokens():
    hidden, weight, bias, target = _inputs(dtype=torch.float32)
    inputs = [hidden, weight, bias, target]
    with memopt.SavedTensorCounter(exclude=inputs) as counter:
        memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=CHUNK, label_smoothing=0.1, logit_softcap=3.0)
    assert counter.total_bytes == TOKENS * 4 + 8  # the float32 lse, and the mean's int64 token count
    with memopt.SavedTensorCounter(exclude=inputs) as eager:
        linear_cross_entropy_ref(hidden, weight, target, bias=bias, label_smoothing=0.1, logit_softcap=3.0)
    assert eager.total_bytes >= TOKENS * VOCAB * 4  # the counter sees the logits when they are saved


def test_saved_bytes_under_autocast_and_int32_targets():
    hidden, weight, bias, target = _inputs(dtype=torch.float32)
    target32 = target.int()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = memopt.saved_bytes(
            lambda h, w, b, t: memopt.linear_cross_entropy(h, w, t, bias=b, chunk_tokens=CHUNK), hidden, weight, bias, target32
        )
    assert saved == TOKENS * (4 + 8) + 8  # lse, the int64 copy of the targets, the count: no bf16 casts kept


class _LargestIntermediate(TorchDispatchMode):
    """The largest numel of any tensor an aten op returns while active, inside memopt's
    cross-entropy ops too (their Python bodies run under the mode)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops_entered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = IMPLEMENTATIONS.get(func._opname) if func.namespace == "memopt" else None
        if body is not None:
            self.ops_entered += 1
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("autocast", [False, True])
def test_no_intermediate_exceeds_a_chunk_of_logits(autocast, frozen):
    chunk, dim = 16, 8  # dim < chunk: the vocab x dim weight-sized buffers are below chunk x vocab
    hidden, weight, bias, target = _inputs(dim=dim, dtype=torch.float32)
    if frozen:
        weight, bias = _frozen(weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with _LargestIntermediate() as ours:
            loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=chunk, label_smoothing=0.1, logit_softcap=3.0)
            loss.backward()
        with _LargestIntermediate() as eager:
            linear_cross_entropy_ref(hidden, weight, target, bias=bias, label_smoothing=0.1, logit_softcap=3.0).backward()
    assert ours.ops_entered == 2  # forward and backward op bodies were looked into
    assert chunk * VOCAB // 2 < ours.largest <= chunk * VOCAB
    assert eager.largest >= TOKENS * VOCAB  # the check sees full logits when they exist


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("logit_softcap", [None, 3.0])
def test_peak_live_bytes_hold_one_chunk_of_logits(logit_softcap, autocast, frozen):
    """Tracked peak of forward + backward: one float32 chunk x vocab buffer (two in a softcapped
    backward, or a softcapped forward with a frozen head), the weight gradient and O(tokens x d); a
    second chunk alive at once would not fit."""
    from bench.cross_entropy import ChunkAwareTracker

    chunk, dim = 16, 8
    hidden, weight, bias, target = _inputs(dim=dim, dtype=torch.float32)
    if frozen:
        weight, bias = _frozen(weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with ChunkAwareTracker(exclude=[hidden, weight, bias, target]) as tracker:
            loss = memopt.linear_cross_entropy(
                hidden, weight, target, bias=bias, chunk_tokens=chunk, label_smoothing=0.1, logit_softcap=logit_softcap
            )
            loss.backward()
    chunk_buffers = 2 if logit_softcap is not None else 1
    bound = chunk_buffers * chunk * VOCAB * 4 + VOCAB * dim * 4 + 2 * TOKENS * dim * 4 + 3 * VOCAB * 4 + 2048
    if autocast:  # the bf16 chunk matmul output, the bf16 weight copy and one bf16 weight-gradient product
        bound += chunk * VOCAB * 2 + 2 * VOCAB * dim * 2
    assert tracker.peak_bytes() <= bound
    assert tracker.peak_bytes() > chunk_buffers * chunk * VOCAB * 4  # the tracker does see inside the op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_peak_live_bytes_with_half_weights(dtype):
    """float16/bfloat16 weights: the working set adds the float32 weight-gradient sum of one
    vocabulary block (here, d = 8, the whole vocabulary: twice the gradient's bytes) and one
    half-precision product per step, nothing more."""
    from bench.cross_entropy import ChunkAwareTracker

    chunk, dim = 16, 8
    hidden, weight, bias, target = (t.detach().to(dtype) if t.is_floating_point() else t for t in _inputs(dim=dim))
    for t in (hidden, weight, bias):
        t.requires_grad_()
    with ChunkAwareTracker(exclude=[hidden, weight, bias, target]) as tracker:
        memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=chunk, label_smoothing=0.1).backward()
    # One float32 chunk buffer and the half chunk matmul; float32 accumulator, one half product and
    # the half gradient; the hidden gradient and per-token/per-class vectors.
    bound = chunk * VOCAB * (4 + 2) + VOCAB * dim * (4 + 2 + 2) + 2 * TOKENS * dim * 2 + 3 * VOCAB * 4 + 2048
    assert chunk * VOCAB * 4 < tracker.peak_bytes() <= bound



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_weight_backward_holds_one_vocab_block_in_float32(dtype, monkeypatch):
    """float16/bfloat16 weights, where the weight dominates (vocab 4096 x d 256, 512 tokens): the
    backward's float32 weight-gradient sum is one vocabulary block, cast into the half gradient's
    rows when the block is done. A float32 vocab x d sum (2x the weight's bytes), one half vocab x d
    product per chunk (1x) and the final cast (1x) peaked at 6.97 MB here, 3.3x the weight's
    2 MiB; now 3.43 MB, 1.6x: the weight's gradient plus block-, step- and token-sized buffers."""
    from bench.cross_entropy import ChunkAwareTracker

    tokens, dim, vocab, chunk, block = 512, 256, 4096, 16, 256
    monkeypatch.setattr(cross_entropy, "_GRAD_WEIGHT_BLOCK_ELEMENTS", block * dim)
    hidden, weight, bias, target = (
        t.detach().to(dtype) if t.is_floating_point() else t for t in _inputs(tokens, dim, vocab, ignored="some")
    )
    for t in (hidden, weight, bias):
        t.requires_grad_()
    loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=chunk, label_smoothing=0.1)
    with ChunkAwareTracker(exclude=[hidden, weight, bias, target]) as tracker:
        loss.backward()
    weight_bytes = vocab * dim * 2
    step = min(tokens, chunk * vocab // block)  # tokens per (block, chunk) step: 256
    bound = (
        weight_bytes  # the half weight gradient
        + block * dim * (4 + 2)  # the float32 block sum and one half block product
        + tokens * dim * (4 + 2)  # the float32 grad_hidden sum and its half cast
        + step * block * (2 + 4 + 2) + step * dim * 2  # a step's logits, their float32 gradient, its half copy; a grad_hidden product
        + 4 * vocab * 4 + 8 * tokens * 8  # per-class and per-token vectors
    )
    assert weight_bytes < tracker.peak_bytes() <= bound
    assert bound < 2 * weight_bytes  # a2d00fe's float32 vocab x d sum alone was 2x
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == dtype


@pytest.mark.parametrize("need_hidden", [True, False])
@pytest.mark.parametrize("logit_softcap", [None, 2.5])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_vocab_blocked_backward_equals_reference_in_float64(chunk_tokens, with_bias, label_smoothing, logit_softcap, need_hidden, monkeypatch):
    """The vocab-blocked backward (every weight gradient's path) is exact: run in float64 with
    blocks of 7 rows (1003 = 143 x 7 + 2: a ragged last block; targets in every block, ignored
    tokens) and steps of at least 20 tokens (97 = 4 x 20 + 17) it gives the float64 reference's
    gradients (autograd through F.linear + F.cross_entropy, reduction "none", a random loss
    gradient) to 1e-12."""
    monkeypatch.setattr(cross_entropy, "_GRAD_WEIGHT_BLOCK_ELEMENTS", 7 * DIM)
    monkeypatch.setattr(cross_entropy, "_CHUNK_ELEMENTS", 7 * 20)
    hidden, weight, bias, target = _inputs(with_bias=with_bias)
    hidden.requires_grad_(need_hidden)
    options = (-100, label_smoothing, logit_softcap)
    _, lse, _ = cross_entropy._forward_chunks(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                                              target, *options, CHUNK, torch.float64)
    grad_loss = torch.randn(TOKENS, dtype=torch.float64)
    got = cross_entropy._backward_chunks(
        grad_loss, hidden.detach(), weight.detach(), None if bias is None else bias.detach(), target, lse, *options,
        chunk_tokens, torch.float64, need_hidden, True,
    )  # fmt: skip
    ref = linear_cross_entropy_ref(hidden, weight, target, bias=bias, reduction="none", label_smoothing=label_smoothing,
                                   logit_softcap=logit_softcap)
    want = torch.autograd.grad(ref, _leaves(hidden, weight, bias), grad_loss)
    got = [g for g, t in zip(got, (hidden, weight, bias)) if t is not None and t.requires_grad]
    assert len(got) == len(want) == 1 + with_bias + need_hidden
    for ours, theirs in zip(got, want):
        _assert_close_relative(ours, theirs, 1e-12, "grad")


@pytest.mark.parametrize("autocast", [False, True])
def test_weight_gradient_updates_span_thousands_of_tokens(autocast, monkeypatch):
    """Note [the weight gradient's sum]: a weight-gradient update's inner dimension is a block's
    token chunk, ``2^24 // block`` tokens (scaled down here: 2^16 // 128 rows = 512 tokens), not
    ``chunk_tokens`` (16), so the float32 gradient is read and written once per 512 tokens, not
    once per 16; under autocast the compute-dtype product added per step is ``block x d``, not
    ``vocab x d``."""
    monkeypatch.setattr(cross_entropy, "_CHUNK_ELEMENTS", 2**16)
    monkeypatch.setattr(cross_entropy, "_GRAD_WEIGHT_BLOCK_ELEMENTS", 128 * 64)
    tokens, dim, vocab, block, step = 1024, 64, 4096, 128, 512
    hidden, weight, bias, target = _inputs(tokens, dim, vocab, dtype=torch.float32)
    products = []

    class _Products(TorchDispatchMode):
        """(op, first operand's shape) of every matmul into d columns, inside the op's body too."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            body = IMPLEMENTATIONS.get(func._opname) if func.namespace == "memopt" else None
            if body is not None:
                with self:
                    return body(*args, **(kwargs or {}))
            if func in (torch.ops.aten.addmm_.default, torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                a, b = (args[1], args[2]) if func is torch.ops.aten.addmm_.default else (args[0], args[1])
                if b.shape[-1] == dim:
                    products.append((func.__name__, tuple(a.shape)))
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=16)
    with _Products():
        loss.backward()
    weight_updates = [name for name, shape in products if shape == (block, step)]  # (block x step) @ (step x d)
    assert len(weight_updates) == (vocab // block) * (tokens // step)
    assert set(weight_updates) == ({"mm.default"} if autocast else {"addmm_.default"})  # autocast: a bf16 block product
    assert all(shape[0] in (block, step) for _, shape in products), products  # nothing of vocab rows
    (want,) = torch.autograd.grad(linear_cross_entropy_ref(hidden, weight, target, bias=bias), weight)
    _assert_close_relative(weight.grad, want, 2e-2 if autocast else 1e-5, "grad_weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_weight_blocked_backward_within_twice_eager_error(dtype, monkeypatch):
    """Many vocabulary blocks (32 rows: 32 blocks of 1024 classes, grad_hidden summed over them in
    float32) and many chunks: the gradients stay within twice eager's error."""
    monkeypatch.setattr(cross_entropy, "_GRAD_WEIGHT_BLOCK_ELEMENTS", 32 * 64)
    tokens, dim, vocab = 2048, 64, 1024
    hidden, weight, bias, target = _inputs(tokens, dim, vocab, ignored="some")
    options = dict(reduction="sum", label_smoothing=0.1, logit_softcap=20.0)
    _, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    _, grads = _loss_and_grads(memopt.linear_cross_entropy, *low, target, chunk_tokens=16, **options)
    _, eager_grads = _loss_and_grads(linear_cross_entropy_ref, *low, target, **options)
    for name, ours, theirs, ref in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, eager_grads, ref_grads):
        assert ours.dtype == dtype
        error = ((ours.double() - ref).norm() / ref.norm()).item()
        eager_error = ((theirs.double() - ref).norm() / ref.norm()).item()
        assert error <= 2 * eager_error, f"{name}: relative error {error:.3g} > twice eager's {eager_error:.3g}"

# --- a frozen LM head: d loss / d hidden formed in the forward (note [a frozen LM head]) --------


class _OpsCalled(TorchDispatchMode):
    """Names of the memopt ops the dispatcher runs while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "memopt":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("logit_softcap", [None, 4.0])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignored", IGNORED)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_frozen_head_float64_equals_reference(reduction, ignored, label_smoothing, logit_softcap):
    """Only hidden needs a gradient: the forward forms it, the backward scales its rows by each
    token's loss gradient (random here, reduction "none" included) and rebuilds no logits."""
    hidden, weight, bias, target = _inputs(ignored=ignored)
    weight, bias = _frozen(weight, bias)
    options = dict(reduction=reduction, label_smoothing=label_smoothing, logit_softcap=logit_softcap)
    with _OpsCalled() as called:
        loss, (grad,) = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=CHUNK, **options)
    assert called.names == ["linear_cross_entropy_fwd", "linear_cross_entropy_bwd_from_forward"]
    ref_loss, (ref,) = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    _assert_close_relative(loss, ref_loss, 1e-12, "loss")
    _assert_close_relative(grad, ref, 1e-12, "grad_hidden")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 7, None, 1000])
def test_frozen_head_any_chunking_and_bias(chunk_tokens, with_bias):
    hidden, weight, bias, target = _inputs(with_bias=with_bias)
    weight, bias = _frozen(weight, bias)
    options = dict(label_smoothing=0.2, logit_softcap=2.5, reduction="none")
    loss, (grad,) = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=chunk_tokens, **options)
    ref_loss, (ref,) = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    _assert_close_relative(loss, ref_loss, 1e-12, "loss")
    _assert_close_relative(grad, ref, 1e-12, "grad_hidden")


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_a_head_half_frozen_rebuilds_the_logits(frozen):
    """A frozen weight with a trainable bias (or the other way round) still needs the logits in
    the backward: the recomputing path, asked only for the gradients wanted."""
    hidden, weight, bias, target = _inputs()
    (weight if frozen == "weight" else bias).requires_grad_(False)
    with _OpsCalled() as called:
        loss, grads = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=CHUNK)
    assert called.names == ["linear_cross_entropy_fwd", "linear_cross_entropy_bwd"]
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target)
    assert len(grads) == len(ref_grads) == 2
    for grad, ref in zip(grads, ref_grads):
        _assert_close_relative(grad, ref, 1e-12, "grad")


def test_frozen_head_saves_one_gradient_row_per_token_in_place_of_hidden_and_the_lse():
    hidden, weight, bias, target = _inputs(dtype=torch.float32)
    for requires_grad, expected in ((False, TOKENS * DIM * 4 + 8), (True, TOKENS * DIM * 4 + TOKENS * 4 + 8)):
        weight.requires_grad_(requires_grad)
        bias.requires_grad_(requires_grad)
        # hidden counted: the trainable head saves it and the lse, the frozen one d loss_i / d
        # hidden_i (float32, tokens x d) instead; both the mean's int64 count.
        with memopt.SavedTensorCounter(exclude=[weight, bias, target]) as counter:
            memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=CHUNK, logit_softcap=3.0)
        assert counter.total_bytes == expected, requires_grad
    hidden_bf16 = hidden.detach().bfloat16().requires_grad_()
    with memopt.SavedTensorCounter(exclude=[target]) as counter:
        memopt.linear_cross_entropy(hidden_bf16, weight.detach().bfloat16(), target, reduction="sum")
    assert counter.total_bytes == TOKENS * DIM * 2  # in hidden's dtype, as hidden itself would be


def test_frozen_head_without_gradients_saves_nothing_and_forms_none():
    hidden, weight, bias, target = _inputs()
    weight, bias = _frozen(weight, bias)
    with torch.no_grad(), _LargestIntermediate() as seen:
        loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=CHUNK)
    assert not loss.requires_grad
    assert seen.largest <= CHUNK * VOCAB  # and no tokens x d gradient: d = 16 makes it 1552 elements anyway
    with memopt.SavedTensorCounter() as counter:
        memopt.linear_cross_entropy(hidden.detach(), weight, target, bias=bias, chunk_tokens=CHUNK)
    assert counter.total_bytes == 0


def test_frozen_head_half_hidden_scales_in_row_blocks_rounding_once(monkeypatch):
    """bf16 hidden: each row of d loss_i / d hidden_i times the token's float32 loss gradient,
    rounded once into bf16, a block of rows at a time (blocks of 3 rows here, not dividing 97)."""
    hidden, weight, _, target = _inputs(dtype=torch.float32)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16()
    _, _, unit = torch.ops.memopt.linear_cross_entropy_fwd(hidden, weight, None, target, -100, 0.0, None, CHUNK, torch.bfloat16, True)
    monkeypatch.setattr(cross_entropy, "_CHUNK_ELEMENTS", 3 * DIM)
    loss = memopt.linear_cross_entropy(hidden, weight, target, reduction="none", chunk_tokens=CHUNK)
    upstream = torch.randn(TOKENS, dtype=torch.float64).float()
    (grad,) = torch.autograd.grad(loss.float(), hidden, upstream)
    # loss is bf16 here (reduction "none" in hidden's dtype): its gradient reaches the op as the
    # bf16-rounded upstream, upcast to the loss's float32
    coefficient = torch.where(target != -100, upstream.bfloat16().float(), 0.0)
    expected = (unit.float() * coefficient.unsqueeze(1)).bfloat16()
    assert grad.dtype == torch.bfloat16
    assert torch.equal(grad, expected)


def test_frozen_head_second_derivatives_are_refused_not_wrong():
    hidden, weight, bias, target = _inputs(tokens=5, dim=3, vocab=7)
    weight, bias = _frozen(weight, bias)
    loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias)
    (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy_bwd_from_forward"):
        grad_hidden.sum().backward()


def test_frozen_head_gradcheck_float64():
    hidden, weight, bias, target = _inputs(tokens=5, dim=3, vocab=7, ignored="none")
    weight, bias = _frozen(weight, bias)
    target[1] = -100

    def fn(h):
        return LinearCrossEntropyFunction.apply(h, weight, bias, target, -100, 0.15, 1.5, 2, torch.float64, h[:0].clone())

    assert torch.autograd.gradcheck(fn, (hidden,))


def test_default_chunk_is_about_64_mib_of_float32_logits():
    for vocab in (32000, 128256, 262144):
        chunk = default_chunk_tokens(vocab)
        assert chunk % 16 == 0 and 32 * 2**20 <= chunk * vocab * 4 <= 64 * 2**20
    assert default_chunk_tokens(2**25) == 1


# --- registration ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias,logit_softcap,label_smoothing", [(True, 3.0, 0.1), (False, None, 0.0)])
def test_opcheck(with_bias, logit_softcap, label_smoothing):
    hidden, weight, bias, target = _inputs(tokens=21, dim=8, vocab=37, dtype=torch.float32, with_bias=with_bias)
    hidden, weight = hidden.detach(), weight.detach()
    bias = None if bias is None else bias.detach()
    options = (-100, label_smoothing, logit_softcap, 8, torch.float32)
    torch.library.opcheck(torch.ops.memopt.linear_cross_entropy_fwd.default, (hidden, weight, bias, target, *options))
    _, lse, _ = torch.ops.memopt.linear_cross_entropy_fwd(hidden, weight, bias, target, *options)
    grad_loss = torch.randn(21)
    for need_hidden, need_weight in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(
            torch.ops.memopt.linear_cross_entropy_bwd.default,
            (grad_loss, hidden, weight, bias, target, lse, *options, need_hidden, need_weight),
        )
    torch.library.opcheck(torch.ops.memopt.linear_cross_entropy_fwd.default, (hidden, weight, bias, target, *options, True))
    _, _, unit_grad_hidden = torch.ops.memopt.linear_cross_entropy_fwd(hidden, weight, bias, target, *options, True)
    assert unit_grad_hidden.shape == hidden.shape
    torch.library.opcheck(
        torch.ops.memopt.linear_cross_entropy_bwd_from_forward.default,
        (grad_loss, unit_grad_hidden, target, -100, hidden[:0].clone()),
    )


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_equals_eager(reduction, autocast, frozen, compile_cache):
    hidden, weight, bias, target = _inputs(dtype=torch.float32)
    if frozen:
        weight, bias = _frozen(weight, bias)

    def fn(h, w, t, bias):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return memopt.linear_cross_entropy(
                h, w, t, bias=bias, reduction=reduction, label_smoothing=0.1, logit_softcap=5.0, chunk_tokens=CHUNK
            )

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss, grads = _loss_and_grads(compiled, hidden, weight, bias, target)
    eager_loss, eager_grads = _loss_and_grads(fn, hidden, weight, bias, target)
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    for grad, ref in zip(grads, eager_grads):
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)


# --- errors ---------------------------------------------------------------------------------


def _call(**overrides):
    hidden, weight, bias, target = _inputs(tokens=6, dim=4, vocab=9, dtype=torch.float32)
    args = dict(hidden=hidden, weight=weight, target=target, bias=bias)
    args.update(overrides)
    return memopt.linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("target"), **args)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(hidden=torch.randn(())), ValueError, "hidden must have shape"),
        (dict(hidden=[1.0]), TypeError, "hidden must be a tensor"),
        (dict(weight=torch.randn(9, 5)), ValueError, "weight must have shape"),
        (dict(weight=torch.randn(0, 4)), ValueError, "weight must have at least one row"),
        (dict(bias=torch.randn(8)), ValueError, "bias must have shape"),
        (dict(target=torch.zeros(5, dtype=torch.long)), ValueError, "target must have shape"),
        (dict(target=torch.zeros(6)), TypeError, "target must be an integer tensor"),
        (dict(target=torch.zeros(6, dtype=torch.bool)), TypeError, "target must be an integer tensor"),
        (dict(hidden=torch.randn(6, 4, dtype=torch.float64)), TypeError, "weight must have hidden's dtype"),
        (dict(bias=torch.randn(9, dtype=torch.float64)), TypeError, "bias must have hidden's dtype"),
        (dict(hidden=torch.randn(6, 4).to(torch.int32)), TypeError, "hidden must be float16"),
        (dict(target=torch.tensor([0, 1, 2, 9, 0, 1])), ValueError, r"target must hold class indices in \[0, 9\)"),
        (dict(target=torch.tensor([0, 1, 2, -1, 0, 1])), ValueError, "ignore_index"),
        (dict(ignore_index=True), TypeError, "ignore_index must be an int"),
        (dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be a float in \[0, 1\]"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(label_smoothing=True), ValueError, "label_smoothing"),
        (dict(logit_softcap=0.0), ValueError, "logit_softcap must be None or a finite float > 0"),
        (dict(logit_softcap=float("inf")), ValueError, "logit_softcap"),
        (dict(logit_softcap=True), ValueError, "logit_softcap"),
        (dict(chunk_tokens=0), ValueError, "chunk_tokens must be None or a positive int"),
        (dict(chunk_tokens=True), ValueError, "chunk_tokens"),
        (dict(chunk_tokens=4.0), ValueError, "chunk_tokens"),
        (dict(weight=torch.randn(9, 4, device="meta")), ValueError, "weight must be on hidden's device"),
    ],
)
def test_bad_arguments_are_named(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_label_smoothing_of_one_and_integer_arguments_are_accepted():
    hidden, weight, bias, target = _inputs()
    loss = memopt.linear_cross_entropy(hidden, weight, target, bias=bias, label_smoothing=1, logit_softcap=3, chunk_tokens=CHUNK)
    ref = linear_cross_entropy_ref(hidden, weight, target, bias=bias, label_smoothing=1.0, logit_softcap=3.0)
    _assert_close_relative(loss, ref, 1e-12, "loss")


# --- benchmark --------------------------------------------------------------------------------


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
def test_benchmark_runs_on_tiny_shapes(tmp_path, frozen):
    from bench import cross_entropy

    assert cross_entropy.main(["--preset", "tiny", "--out", str(tmp_path)] + (["--frozen-weight"] if frozen else [])) == 0
    (path,) = tmp_path.glob("cross_entropy-tiny-cpu-*.json")
    import json

    result = json.loads(path.read_text())
    assert result["arguments"]["frozen_weight"] is frozen
    rows = result["rows"]
    assert all(r["frozen_weight"] is frozen for r in rows)
    peaks = {(r["provider"], r["x"]): r["median"] for r in rows if r["metric"] == "peak_tracked_bytes"}
    assert peaks and all(v is not None for v in peaks.values())
    for (provider, tokens), peak in peaks.items():
        if provider == "memopt":
            assert peak < peaks[("eager", tokens)]


# --- GPU --------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("dtype,autocast_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, None), (torch.float32, None)])
def test_cuda_within_twice_eager_error(dtype, autocast_dtype, frozen, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means float32 on both sides
    _low_precision_check("cuda", dtype, autocast_dtype, tokens=1031, dim=256, vocab=32003, chunk=256, frozen=frozen)


@gpu
def test_cuda_float64_equals_reference():
    hidden, weight, bias, target = _inputs(device="cuda")
    options = dict(label_smoothing=0.1, logit_softcap=4.0)
    loss, grads = _loss_and_grads(memopt.linear_cross_entropy, hidden, weight, bias, target, chunk_tokens=CHUNK, **options)
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_ref, hidden, weight, bias, target, **options)
    _assert_close_relative(loss, ref_loss, 1e-12, "loss")
    for grad, ref in zip(grads, ref_grads):
        _assert_close_relative(grad, ref, 1e-12, "grad")


_INF = float("inf")


@pytest.mark.parametrize(
    "bias_values, hidden_values, target, reduction, label_smoothing",
    [
        ({6: _INF}, {}, [0, 1, 2, 3], "none", 0.0),  # a +inf logit of another class
        ({1: _INF}, {}, [0, 1, 2, 3], "none", 0.0),  # a +inf logit of the target
        ({6: _INF}, {}, [0, -100, 2, 3], "mean", 0.0),
        ({6: _INF}, {}, [0, 1, 2, 3], "none", 0.1),
        ({2: -_INF, 3: -_INF}, {}, [0, 1, 2, 3], "none", 0.0),  # -inf logits: an infinite loss on their targets
        ({2: -_INF}, {}, [0, 1, 2, 3], "none", 0.1),
        (dict.fromkeys(range(7), -_INF), {}, [0, 1, 2, 3], "none", 0.0),  # rows of -inf only
        ({}, {(1, 2): _INF}, [0, 1, 2, 3], "none", 0.0),  # one row of logits with both infinities
        ({}, {(1, 2): _INF}, [0, -100, 2, 3], "mean", 0.0),  # ... and that row ignored
        ({}, {(2, 0): -_INF}, [0, 1, 2, 3], "sum", 0.1),
    ],
)
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-head", "frozen-head"])
def test_infinite_logits_give_pytorchs_nan_and_inf(bias_values, hidden_values, target, reduction, label_smoothing, frozen):
    """Overflowed logits (fp16 products under autocast): the loss and every gradient are NaN, inf
    and finite where F.cross_entropy's are, with the same finite values. A +inf logit gave a +inf
    loss where PyTorch's is NaN, and a weight gradient that was finite in most entries. With a
    frozen head the forward's softmax (exp(z - max) / sum) must give what exp(z - lse) gives."""
    hidden = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for index, value in hidden_values.items():
        hidden[index] = value
    weight = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(7, dtype=torch.float64)
    for index, value in bias_values.items():
        bias[index] = value
    target = torch.tensor(target)
    inputs = [t.requires_grad_() for t in ((hidden,) if frozen else (hidden, weight, bias))]
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)

    def loss_and_grads(loss):
        return (loss.detach(), *torch.autograd.grad(loss.sum(), inputs))

    got = loss_and_grads(memopt.linear_cross_entropy(hidden, weight, target, bias=bias, **kwargs))
    want = loss_and_grads(F.cross_entropy(F.linear(hidden, weight, bias), target, **kwargs))
    for name, g, w in zip(("loss", "grad hidden", "grad weight", "grad bias"), got, want):
        assert torch.equal(g.isnan(), w.isnan()), f"{name}: NaN at {g.isnan().nonzero().tolist()}, PyTorch's at {w.isnan().nonzero().tolist()}"
        assert torch.equal(g.isinf() & (g > 0), w.isinf() & (w > 0)), f"{name}: +inf differs from PyTorch's"
        assert torch.equal(g.isinf() & (g < 0), w.isinf() & (w < 0)), f"{name}: -inf differs from PyTorch's"
        finite = w.isfinite()
        torch.testing.assert_close(g[finite], w[finite], atol=1e-12, rtol=1e-10, msg=name)
