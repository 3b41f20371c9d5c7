"""linear_cross_entropy: ``F.cross_entropy(F.linear(hidden, weight, bias), target)`` without the logits.

A language model's last layer and loss make a ``(tokens, vocab)`` logits tensor (and its float32
upcast, and its gradient): at a 128k vocabulary about 1.3 MB per token, more than the rest of the
model's activations past a few thousand tokens. Here the tokens go through in chunks of
``chunk_tokens``: each chunk's logits exist only while its log-sum-exp (and, for the loss, the
target logit and the logit sum) are taken, then they are dropped.

The trade chosen: the logits are *rebuilt in the backward*. The forward saves the inputs
(``hidden``, ``weight``, ``bias``, ``target``, all of which exist anyway) and one log-sum-exp per
token, i.e. O(tokens) elements beyond the inputs; the backward recomputes each chunk's logits
with one more matmul and turns them into ``grad_hidden`` and ``grad_weight`` chunk by chunk. That
costs a fourth ``tokens x vocab x d`` matmul (eager PyTorch does three). Liger Kernel's other
choice, computing the gradients in the forward, needs no recompute but keeps ``grad_hidden``
(tokens x d) and a weight-sized ``grad_weight`` alive from the forward to the backward, and cannot
serve ``reduction="none"`` with an arbitrary upstream gradient; it is not offered. A frozen head
(only ``hidden`` needs a gradient: LoRA) is the exception, where forming the gradient in the
forward holds nothing extra: note [a frozen LM head] in ``linear_cross_entropy``.

Working set per chunk: the chunk's logits in the compute dtype and one float32 (float64)
``chunk x vocab`` buffer (two in a softcapped backward, which keeps ``tanh`` for its
derivative), plus a compute-dtype copy of ``weight`` when autocast casts it. When the weight's
gradient is needed the backward walks vocabulary blocks of about 2^24 elements (``block x d``,
outer) x token chunks of about ``2^24 / block`` tokens (inner), so that each update of the weight
gradient spans thousands of tokens (note [the weight gradient's sum] in
``_backward_vocab_blocks``); it adds the ``vocab x d`` weight gradient itself, under autocast one
compute-dtype ``block x d`` product per step, for float16/bfloat16 weights a float32 ``block x d``
sum cast into the gradient's rows when the block is done, and with several blocks a ``tokens x d``
sum of ``grad_hidden`` (float32 for a float16/bfloat16 hidden, cast once at the end); per (block,
chunk) the ``chunk x block`` logits buffers hold no more elements than ``chunk_tokens x vocab``,
nor than 2^24 unless ``chunk_tokens x block`` is.

Layers: one chunked PyTorch implementation shared by every device (matmuls through the device's
BLAS, cuBLAS on CUDA; the elementwise part in place on the chunk), registered as
``torch.ops.memopt.linear_cross_entropy_fwd`` / ``linear_cross_entropy_bwd`` (and, for a frozen
head, ``linear_cross_entropy_bwd_from_forward``) with fake impls;
``LinearCrossEntropyFunction`` decides what is saved; ``linear_cross_entropy`` validates and
reduces; ``linear_cross_entropy_ref`` is the plain PyTorch reference.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.nn.functional as F

from memopt.ops._common import autocast_off, autocast_state, check_fake_devices

_REDUCTIONS = ("mean", "sum", "none")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Default chunk: about 2^24 logits (64 MiB in float32) per chunk, a multiple of 16 tokens so the
# chunk's matmul keeps tensor-core-friendly shapes.
_CHUNK_ELEMENTS = 1 << 24
# Backward with float16/bfloat16 weights: rows per vocabulary block so that its float32
# weight-gradient sum (block x d) is about 2^24 elements (64 MiB, as a default chunk's logits).
# Larger blocks mean fewer passes over the float32 tokens x d grad_hidden sum, which every block
# reads and writes (Llama-3-8B's head at 8k tokens: 32 blocks of 4096 rows; at 2^22, 126 blocks,
# ~32 GB of that traffic per backward).
_GRAD_WEIGHT_BLOCK_ELEMENTS = 1 << 24
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk so that ``chunk x vocab`` is about 2^24 elements (64 MiB of float32)."""
    tokens = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    return tokens - tokens % 16 if tokens >= 16 else tokens


def _accumulate_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other compute dtype accumulates the loss and lse in float32."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# The chunked implementation (every device).
# ---------------------------------------------------------------------------------------------


def _chunk_logits(hidden_chunk, weight_c, bias_c, accumulate_dtype, softcap, keep_tanh):
    """``(logits, tanh_part)`` of one chunk in the accumulate dtype.

    ``logits`` is ``softcap * tanh(u / softcap)`` (or ``u``) for ``u = hidden_chunk @ weight_c^T
    + bias_c`` computed in the compute dtype and then upcast, as eager PyTorch does under
    autocast. With ``keep_tanh`` and a softcap, ``tanh_part = tanh(u / softcap)`` is returned in
    a second buffer for the derivative ``1 - tanh^2``; otherwise it is None and the chunk costs
    one ``chunk x vocab`` buffer in the accumulate dtype.
    """
    if bias_c is None:
        u = torch.mm(hidden_chunk, weight_c.t())
    else:
        u = torch.addmm(bias_c, hidden_chunk, weight_c.t())
    logits = u.to(accumulate_dtype)
    if softcap is None:
        return logits, None
    logits.div_(softcap).tanh_()
    if keep_tanh:
        return logits * softcap, logits
    return logits.mul_(softcap), None


def _softmax_to_grad_logits_(probs, tanh_part, target_chunk, valid, first_class, vocab, label_smoothing):
    """Turn ``probs = softmax(z)`` (``chunk x rows``, classes ``[first_class, first_class + rows)``)
    into ``d loss / d z`` for a unit loss gradient, in place: ``softmax(z)_c - (1 - eps)
    [c == target] - eps / vocab``, times ``1 - tanh^2`` under a softcap (``tanh_part``, consumed)."""
    if label_smoothing > 0.0:
        probs.sub_(label_smoothing / vocab)
    # The target's -(1 - eps) where the target is one of these classes (elsewhere 0 is taken
    # off, at a clamped column): no host sync.
    rows, classes = probs.shape
    inside = valid & (target_chunk >= first_class) & (target_chunk < first_class + classes)
    columns = (target_chunk - first_class).clamp_(0, classes - 1)
    take = inside.to(probs.dtype).mul_(1.0 - label_smoothing)
    probs[torch.arange(rows, device=probs.device), columns] -= take
    if tanh_part is not None:
        probs.mul_(tanh_part.square_().neg_().add_(1.0))
    return probs


def _chunk_grad_logits(
    hidden_chunk, weight_rows, bias_rows, first_class, vocab, lse_chunk, target_chunk, grad_loss_chunk,
    ignore_index, label_smoothing, logit_softcap, accumulate_dtype,
):
    """``d loss / d z`` (accumulate dtype, ``chunk x rows``) of one chunk of tokens for the classes
    ``[first_class, first_class + rows)`` whose weights (and bias) are ``weight_rows`` (``bias_rows``):
    ``softmax(z)_c - (1 - eps) [c == target] - eps / vocab``, times ``1 - tanh^2`` under a softcap,
    times the token's loss gradient, zero for ignored tokens. The softmax comes from the saved
    ``lse_chunk`` over the whole vocabulary, so any block of classes gets its exact share."""
    valid = target_chunk != ignore_index
    logits, tanh_part = _chunk_logits(
        hidden_chunk, weight_rows, bias_rows, accumulate_dtype, logit_softcap, keep_tanh=True
    )
    probs = logits.sub_(lse_chunk.unsqueeze(1)).exp_()
    grad_logits = _softmax_to_grad_logits_(probs, tanh_part, target_chunk, valid, first_class, vocab, label_smoothing)
    return grad_logits.mul_(_loss_coefficient(grad_loss_chunk, valid, accumulate_dtype).unsqueeze(1))


def _loss_coefficient(grad_loss, valid, dtype):
    """Each token's loss gradient, 0 at ignored tokens. A where, not a product: an all-ignored
    mean sends grad_loss = 1/0 = inf, and the ignored tokens' gradient must stay 0 as in torch."""
    return torch.where(valid, grad_loss.to(dtype), 0.0)


def _logsumexp_(logits: torch.Tensor, keep_softmax: bool = False):
    """Row-wise log-sum-exp that overwrites ``logits`` instead of allocating a second buffer; with
    ``keep_softmax``, ``(lse, softmax)`` where the softmax is that buffer, normalised in place."""
    row_max = logits.amax(1, keepdim=True)
    # A row of -inf only: 0, so that its log-sum-exp is -inf (and its loss NaN or inf as
    # F.cross_entropy's), not -inf - -inf. A +inf maximum stays: the row's log-sum-exp is NaN, as
    # log_softmax gives there, so its loss and every gradient it reaches are NaN as PyTorch's
    # (torch.logsumexp's inf would give a finite-looking share of the weight gradient). The
    # softmax of either row is NaN (0 / 0, NaN / NaN), as exp(z - lse) is.
    row_max = torch.where(row_max == -math.inf, 0.0, row_max)
    exps = logits.sub_(row_max).exp_()
    total = exps.sum(1)
    if not keep_softmax:
        return total.log_().add_(row_max.squeeze(1))
    lse = total.log().add_(row_max.squeeze(1))
    return lse, exps.div_(total.unsqueeze(1))


def _check_target_values(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every target is a class in ``[0, vocab)`` or ``ignore_index`` (as torch requires)."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if target.device.type == "cpu":
        if bool(bad.any()):
            value = int(target[bad][0])
            raise ValueError(
                f"memopt.linear_cross_entropy: target must hold class indices in [0, {vocab}) or "
                f"ignore_index ({ignore_index}), got {value}"
            )
    else:
        torch._assert_async(~bad.any(), "memopt.linear_cross_entropy: target out of [0, vocab) and not ignore_index")


def _forward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_softcap: float | None,
    chunk_tokens: int,
    compute_dtype: torch.dtype,
    grad_hidden_in_forward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss and log-sum-exp, chunk by chunk over the tokens; with
    ``grad_hidden_in_forward``, also each token's ``d loss_i / d hidden_i``.

    Args: ``hidden (N, d)``, ``weight (V, d)``, ``bias (V,)`` or None, ``target (N,)`` int64; the
    matmul runs in ``compute_dtype``. Returns ``loss (N,)`` (0 where ``target == ignore_index``)
    and ``lse (N,)`` of the (capped) logits, both float64 for a float64 compute dtype, float32
    otherwise. ``loss = lse - (1 - eps) * z_target - eps / V * sum(z)`` with ``eps`` the label
    smoothing: torch's ``(1 - eps) * nll + eps / V * sum(-log_softmax)``. The third result is
    ``(N, d)`` in hidden's dtype with ``grad_hidden_in_forward`` (the gradient of each token's own
    loss, for a loss gradient of 1, ignored tokens included), otherwise empty.
    """
    tokens, vocab = hidden.shape[0], weight.shape[0]
    _check_target_values(target, vocab, ignore_index)
    accumulate_dtype = _accumulate_dtype(compute_dtype)
    loss = hidden.new_empty(tokens, dtype=accumulate_dtype)
    lse = hidden.new_empty(tokens, dtype=accumulate_dtype)
    unit_grad_hidden = hidden.new_empty((tokens, hidden.shape[1]) if grad_hidden_in_forward else (0,))
    with autocast_off(hidden.device.type):
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        for start in range(0, tokens, chunk_tokens):
            stop = min(start + chunk_tokens, tokens)
            target_chunk = target[start:stop]
            valid = target_chunk != ignore_index
            logits, tanh_part = _chunk_logits(
                hidden[start:stop].to(compute_dtype), weight_c, bias_c, accumulate_dtype, logit_softcap,
                keep_tanh=grad_hidden_in_forward,
            )  # fmt: skip
            target_logit = logits.gather(1, torch.where(valid, target_chunk, 0).unsqueeze(1)).squeeze(1)
            logit_sum = logits.sum(1) if label_smoothing > 0.0 else None
            if grad_hidden_in_forward:
                lse_chunk, probs = _logsumexp_(logits, keep_softmax=True)  # the logits are gone after this
                grad_logits = _softmax_to_grad_logits_(probs, tanh_part, target_chunk, valid, 0, vocab, label_smoothing)
                _mm_into(unit_grad_hidden[start:stop], grad_logits.to(compute_dtype), weight_c)
                del probs, grad_logits, tanh_part
            else:
                lse_chunk = _logsumexp_(logits)  # the logits are gone after this
            chunk_loss = lse_chunk - target_logit
            if logit_sum is not None:
                smooth = vocab * lse_chunk - logit_sum
                chunk_loss = (1.0 - label_smoothing) * chunk_loss + (label_smoothing / vocab) * smooth
            loss[start:stop] = torch.where(valid, chunk_loss, 0.0)
            lse[start:stop] = lse_chunk
            del logits  # before the next chunk's matmul, so two chunks never coexist
    return loss, lse, unit_grad_hidden


linear_cross_entropy_fwd = torch.library.custom_op(
    "memopt::linear_cross_entropy_fwd", _forward_chunks, mutates_args=()
)


@linear_cross_entropy_fwd.register_fake
def _linear_cross_entropy_fwd_fake(
    hidden, weight, bias, target, ignore_index, label_smoothing, logit_softcap, chunk_tokens, compute_dtype,
    grad_hidden_in_forward=False,
):
    check_fake_devices("linear_cross_entropy", "hidden", hidden, weight=weight, bias=bias, target=target)
    accumulate_dtype = _accumulate_dtype(compute_dtype)
    tokens = hidden.shape[0]
    unit_grad_hidden = hidden.new_empty((tokens, hidden.shape[1]) if grad_hidden_in_forward else (0,))
    return hidden.new_empty(tokens, dtype=accumulate_dtype), hidden.new_empty(tokens, dtype=accumulate_dtype), unit_grad_hidden


def _backward_chunks(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    logit_softcap: float | None,
    chunk_tokens: int,
    compute_dtype: torch.dtype,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients from the saved lse, rebuilding each chunk's logits.

    ``grad_loss (N,)`` is the gradient of the per-token loss. For token i and class c,
    ``d loss_i / d z_ic = softmax(z_i)_c - (1 - eps) [c == target_i] - eps / V``, times
    ``1 - tanh^2`` under a softcap, zero for ignored tokens. Returns ``grad_hidden (N, d)`` in
    hidden's dtype, ``grad_weight (V, d)`` in weight's dtype and ``grad_bias (V,)`` in bias's
    dtype; a gradient not asked for (``need_grad_*`` False, or no bias) is an empty tensor.
    """
    if need_grad_weight:
        return _backward_vocab_blocks(
            grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing, logit_softcap,
            chunk_tokens, compute_dtype, need_grad_hidden,
        )
    # No weight gradient (a frozen weight with a trainable bias, or hidden's gradient alone): each
    # chunk's grad_hidden is one matmul over the whole vocabulary.
    tokens, vocab = hidden.shape[0], weight.shape[0]
    accumulate_dtype = _accumulate_dtype(compute_dtype)
    grad_hidden = hidden.new_empty((tokens, hidden.shape[1]) if need_grad_hidden else (0,))
    grad_bias_acc = hidden.new_zeros(vocab if bias is not None else 0, dtype=accumulate_dtype)
    with autocast_off(hidden.device.type):
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        for start in range(0, tokens, chunk_tokens):
            stop = min(start + chunk_tokens, tokens)
            hidden_chunk = hidden[start:stop].to(compute_dtype)
            grad_logits = _chunk_grad_logits(
                hidden_chunk, weight_c, bias_c, 0, vocab, lse[start:stop], target[start:stop], grad_loss[start:stop],
                ignore_index, label_smoothing, logit_softcap, accumulate_dtype,
            )  # fmt: skip
            if bias is not None:
                grad_bias_acc += grad_logits.sum(0)
            if need_grad_hidden:
                grad_hidden[start:stop] = torch.mm(grad_logits.to(compute_dtype), weight_c)
            del grad_logits  # before the next chunk's matmul
    grad_bias = grad_bias_acc if bias is None else grad_bias_acc.to(bias.dtype)
    return grad_hidden, weight.new_empty((0,)), grad_bias


def _vocab_block_rows(vocab: int, dim: int) -> int:
    """Rows per vocabulary block: ``block x d`` about ``_GRAD_WEIGHT_BLOCK_ELEMENTS``, in [1, vocab]."""
    return max(1, min(vocab, _GRAD_WEIGHT_BLOCK_ELEMENTS // max(dim, 1)))


def _backward_vocab_blocks(
    grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing, logit_softcap,
    chunk_tokens, compute_dtype, need_grad_hidden,
):
    """``_backward_chunks`` when the weight's gradient is needed: vocabulary blocks (outer) x
    token chunks (inner).

    Note: [the weight gradient's sum] the weight gradient is a sum over every token, and how it
    is summed sets both its precision and its speed. Summed token chunk by token chunk (as memopt
    did before 2026-12-07 for float32 weights), each update of the ``vocab x d`` gradient has the
    chunk as its inner dimension: at Llama-3's head (d 4096, vocab 128,256) the default chunk is
    128 tokens, so each update reads and writes the whole float32 gradient (2 GiB) for 134 GFLOP
    of matmul, and under autocast first makes a compute-dtype ``vocab x d`` product (1 GiB) to
    add: memory traffic, not the matmuls, would bound the backward. Here the vocabulary goes in
    blocks of ``block`` rows (``block x d`` about 2^24 elements, 4096 rows at d 4096) and, per
    block, the tokens in chunks of ``min(2^24, chunk_tokens x vocab) // block`` (at least
    ``chunk_tokens``): no more logits per step than a ``chunk_tokens`` chunk of the whole
    vocabulary, and thousands of tokens as each update's inner dimension. Per (block, chunk) the
    logits are rebuilt for the block's classes only; the saved lse is over the whole vocabulary,
    so the softmax gradient is exact; ``-(1 - eps)`` goes to the targets inside the block. The
    block's rows of the weight gradient are summed over every chunk in the gradient itself for
    float32/float64 weights, and for float16/bfloat16 ones in a float32 ``block x d`` buffer cast
    once into the gradient's rows (summed chunk by chunk in half precision, each chunk added one
    rounding of the whole sum: bf16, 4096 tokens, relative error 9.3e-3 at 64 chunks, 2.1e-2 at
    256, eager's 2.9e-3). ``grad_hidden`` is written once per chunk when the vocabulary is one
    block, else summed over the blocks in the accumulate dtype and cast once into hidden's.
    """
    tokens, dim = hidden.shape
    vocab = weight.shape[0]
    accumulate_dtype = _accumulate_dtype(compute_dtype)
    block = _vocab_block_rows(vocab, dim)
    one_block = block >= vocab
    chunk = max(1, min(tokens, max(chunk_tokens, min(_CHUNK_ELEMENTS, chunk_tokens * vocab) // block)))
    half_weight = weight.dtype in _HALF_DTYPES
    grad_weight = weight.new_empty(weight.shape) if half_weight else weight.new_zeros(weight.shape)
    if not need_grad_hidden:
        grad_hidden_acc = hidden.new_empty((0,))
    elif one_block:
        grad_hidden_acc = hidden.new_empty((tokens, dim))
    else:
        grad_hidden_acc = hidden.new_zeros((tokens, dim), dtype=accumulate_dtype)
    grad_bias_acc = hidden.new_zeros(vocab if bias is not None else 0, dtype=accumulate_dtype)
    with autocast_off(hidden.device.type):
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            weight_block = weight_c[v0:v1]
            bias_block = None if bias_c is None else bias_c[v0:v1]
            # A row slice of the contiguous gradient: the updates below write straight into it.
            grad_weight_acc = weight.new_zeros((v1 - v0, dim), dtype=accumulate_dtype) if half_weight else grad_weight[v0:v1]
            for start in range(0, tokens, chunk):
                stop = min(start + chunk, tokens)
                hidden_chunk = hidden[start:stop].to(compute_dtype)
                grad_logits = _chunk_grad_logits(
                    hidden_chunk, weight_block, bias_block, v0, vocab, lse[start:stop], target[start:stop],
                    grad_loss[start:stop], ignore_index, label_smoothing, logit_softcap, accumulate_dtype,
                )  # fmt: skip
                if bias is not None:
                    grad_bias_acc[v0:v1] += grad_logits.sum(0)
                grad_logits_c = grad_logits.to(compute_dtype)
                if need_grad_hidden:
                    rows = grad_hidden_acc[start:stop]
                    if one_block:
                        _mm_into(rows, grad_logits_c, weight_block)
                    else:
                        _add_product_(rows, grad_logits_c, weight_block)
                _add_product_(grad_weight_acc, grad_logits_c.t(), hidden_chunk)
                del grad_logits, grad_logits_c  # before the next step's matmul
            if half_weight:
                grad_weight[v0:v1] = grad_weight_acc  # cast once into the gradient's rows
            del grad_weight_acc
    grad_hidden = grad_hidden_acc.to(hidden.dtype) if need_grad_hidden else hidden.new_empty((0,))
    grad_bias = grad_bias_acc if bias is None else grad_bias_acc.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out[...] = a @ b``: written in place (``out=``) when ``out`` has the matmul's dtype, else
    through a product in the matmul's dtype cast on the copy."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))


def _add_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b``: in place (``addmm_``, no temporary) when ``out`` has the matmul's dtype,
    else through an ``a @ b`` product in the matmul's dtype (autocast: a bf16 product added to a
    float32 sum)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out += torch.mm(a, b)


linear_cross_entropy_bwd = torch.library.custom_op(
    "memopt::linear_cross_entropy_bwd", _backward_chunks, mutates_args=()
)


@linear_cross_entropy_bwd.register_fake
def _linear_cross_entropy_bwd_fake(
    grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing, logit_softcap,
    chunk_tokens, compute_dtype, need_grad_hidden, need_grad_weight,
):
    check_fake_devices("linear_cross_entropy", "hidden", hidden, grad_loss=grad_loss, weight=weight, bias=bias,
                       target=target, lse=lse)
    grad_hidden = hidden.new_empty((hidden.shape[0], hidden.shape[1]) if need_grad_hidden else (0,))
    grad_weight = weight.new_empty(weight.shape if need_grad_weight else (0,))
    if bias is None:
        grad_bias = hidden.new_empty(0, dtype=_accumulate_dtype(compute_dtype))
    else:
        grad_bias = bias.new_empty(bias.shape)
    return grad_hidden, grad_weight, grad_bias


def _backward_from_forward(
    grad_loss: torch.Tensor,
    unit_grad_hidden: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    hidden_anchor: torch.Tensor,
) -> torch.Tensor:
    """``grad_hidden (N, d)`` in hidden's dtype from the forward's per-token gradients: row i is
    ``grad_loss_i * unit_grad_hidden_i``, 0 at ignored tokens, the product taken in the loss's
    dtype (float32 for a float16/bfloat16 hidden: one rounding, into hidden's dtype).

    ``hidden_anchor`` is not read: an empty tensor in hidden's autograd graph. Under
    ``create_graph`` it makes the result require grad through this op, which has no autograd
    formula, so differentiating the gradient again raises; without it the result would be a
    constant and a second derivative would silently miss every term through hidden."""
    coefficient = _loss_coefficient(grad_loss, target != ignore_index, grad_loss.dtype).unsqueeze(1)
    if unit_grad_hidden.dtype == coefficient.dtype:
        return unit_grad_hidden * coefficient
    # float16/bfloat16 hidden: the product in float32 a block of rows at a time (no float32
    # tokens x d temporary), each block cast into the result.
    grad_hidden = torch.empty_like(unit_grad_hidden)
    tokens, dim = unit_grad_hidden.shape
    rows = max(1, _CHUNK_ELEMENTS // max(dim, 1))
    for start in range(0, tokens, rows):
        grad_hidden[start : start + rows] = unit_grad_hidden[start : start + rows] * coefficient[start : start + rows]
    return grad_hidden


linear_cross_entropy_bwd_from_forward = torch.library.custom_op(
    "memopt::linear_cross_entropy_bwd_from_forward", _backward_from_forward, mutates_args=()
)


@linear_cross_entropy_bwd_from_forward.register_fake
def _linear_cross_entropy_bwd_from_forward_fake(grad_loss, unit_grad_hidden, target, ignore_index, hidden_anchor):
    check_fake_devices(
        "linear_cross_entropy", "unit_grad_hidden", unit_grad_hidden, grad_loss=grad_loss, target=target,
        hidden_anchor=hidden_anchor,
    )  # fmt: skip
    return torch.empty_like(unit_grad_hidden)


# The Python bodies of the registered ops, by op name: a TorchDispatchMode sees only a custom
# op's outputs, so the tests and bench.cross_entropy run these under their mode to see every
# intermediate of the chunk loop.
IMPLEMENTATIONS = {
    "linear_cross_entropy_fwd": _forward_chunks,
    "linear_cross_entropy_bwd": _backward_chunks,
    "linear_cross_entropy_bwd_from_forward": _backward_from_forward,
}


# ---------------------------------------------------------------------------------------------
# Autograd and the public function.
# ---------------------------------------------------------------------------------------------


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss ``(N,)``; saves hidden, weight, bias, target and the lse, never the logits.

    ``apply(hidden (N, d), weight (V, d), bias (V,) or None, target (N,) int64, ignore_index,
    label_smoothing, logit_softcap, chunk_tokens, compute_dtype, hidden_anchor=None)``.
    With a ``hidden_anchor`` (only ``hidden`` needs a gradient, a frozen LM head: note [a frozen
    LM head]; an empty tensor in hidden's graph, see ``_backward_from_forward``) the forward also
    forms each token's ``d loss_i / d hidden_i`` and saves that and the target instead, and the
    backward scales its rows by the loss gradient: no recompute.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, ignore_index, label_smoothing, logit_softcap, chunk_tokens, compute_dtype,
        hidden_anchor=None,
    ):  # fmt: skip
        grad_hidden_in_forward = hidden_anchor is not None
        loss, lse, unit_grad_hidden = torch.ops.memopt.linear_cross_entropy_fwd(
            hidden, weight, bias, target, ignore_index, label_smoothing, logit_softcap, chunk_tokens, compute_dtype,
            grad_hidden_in_forward,
        )  # fmt: skip
        ctx.options = (ignore_index, label_smoothing, logit_softcap, chunk_tokens, compute_dtype)
        ctx.grad_hidden_in_forward = grad_hidden_in_forward
        if grad_hidden_in_forward:
            ctx.save_for_backward(unit_grad_hidden, target, hidden_anchor)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        nones = (None,) * 7
        if ctx.grad_hidden_in_forward:
            unit_grad_hidden, target, hidden_anchor = ctx.saved_tensors
            grad_hidden = torch.ops.memopt.linear_cross_entropy_bwd_from_forward(
                grad_loss.contiguous(), unit_grad_hidden, target, ctx.options[0], hidden_anchor
            )
            return (grad_hidden if ctx.needs_input_grad[0] else None, None, None, *nones)
        hidden, weight, bias, target, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden, grad_weight, grad_bias = torch.ops.memopt.linear_cross_entropy_bwd(
            grad_loss.contiguous(), hidden, weight, bias, target, lse, *ctx.options, need_hidden, need_weight
        )
        return (
            grad_hidden if need_hidden else None,
            grad_weight if need_weight else None,
            grad_bias if need_bias else None,
            *nones,
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_arguments(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap, chunk_tokens):
    name = "memopt.linear_cross_entropy"
    for arg, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name}: bias must be a tensor or None, got {type(bias).__name__}")
    if hidden.dim() < 1:
        raise ValueError(f"{name}: hidden must have shape (..., d), got a 0-dim tensor")
    d = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"{name}: weight must have shape (vocab, {d}) (hidden.shape[-1] = {d}), got {tuple(weight.shape)}")
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError(f"{name}: weight must have at least one row (class), got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"{name}: bias must have shape ({vocab},) (weight.shape[0]), got {tuple(bias.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{name}: target must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), got {tuple(target.shape)}")
    for arg, value in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if value is not None and value.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: {arg} must be float16, bfloat16, float32 or float64, got {value.dtype}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(f"{name}: target must be an integer tensor of class indices, got {target.dtype}")
    for arg, value in (("weight", weight), ("target", target), ("bias", bias)):
        if value is not None and value.device != hidden.device:
            raise ValueError(f"{name}: {arg} must be on hidden's device ({hidden.device}), got {value.device}")
    if not _is_int(ignore_index):
        raise TypeError(f"{name}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not _is_real(label_smoothing) or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if logit_softcap is not None and (
        not _is_real(logit_softcap) or not math.isfinite(float(logit_softcap)) or float(logit_softcap) <= 0.0
    ):
        raise ValueError(f"{name}: logit_softcap must be None or a finite float > 0, got {logit_softcap!r}")
    if chunk_tokens is not None and (not _is_int(chunk_tokens) or chunk_tokens <= 0):
        raise ValueError(f"{name}: chunk_tokens must be None or a positive int, got {chunk_tokens!r}")


def _compute_dtype(hidden, weight, bias) -> tuple[torch.dtype, bool]:
    """(dtype of the matmul, whether autocast chose it), as ``F.linear`` would decide."""
    # autocast_state, not torch.is_autocast_enabled: asking about a device type without autocast
    # (meta) raises, and F.linear runs there with autocast off.
    _, autocast_enabled, autocast_dtype = autocast_state(hidden.device.type)
    if autocast_enabled and hidden.dtype != torch.float64:
        return autocast_dtype, True
    for arg, value in (("weight", weight), ("bias", bias)):
        if value is not None and value.dtype != hidden.dtype:
            raise TypeError(
                f"memopt.linear_cross_entropy: {arg} must have hidden's dtype ({hidden.dtype}) outside "
                f"autocast, as F.linear requires, got {value.dtype}"
            )
    return hidden.dtype, False


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    chunk_tokens: int | None = None,
    _accumulated: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the logits.

    The tokens go through in chunks of ``chunk_tokens``; one log-sum-exp per token is kept, and
    the backward rebuilds each chunk's logits (see the module docstring for the trade). Saved for
    backward besides the inputs: ``lse``, one float32 (float64) per token. With a frozen head
    (``weight`` and ``bias`` need no gradient, ``hidden`` does) the forward forms the hidden
    gradient instead and saves it (``tokens x d``, hidden's dtype) in place of ``hidden`` and the
    lse; the backward recomputes nothing.

    Args:
        hidden: ``(..., d)`` float16/bfloat16/float32/float64.
        weight: ``(vocab, d)``, hidden's dtype outside autocast.
        target: ``hidden.shape[:-1]``, integer class indices in ``[0, vocab)`` or ``ignore_index``.
        bias: ``(vocab,)`` or None.
        ignore_index: targets equal to it add no loss and no gradient, and do not count in the mean.
        reduction: ``"mean"`` (over the non-ignored tokens; NaN when all are ignored, as torch),
            ``"sum"`` or ``"none"`` (per-token, 0 at ignored tokens).
        label_smoothing: in ``[0, 1]``, torch's definition: ``(1 - eps) * nll + eps / vocab *
            sum_c(-log p_c)``.
        logit_softcap: Gemma-2's cap ``logits = cap * tanh(logits / cap)`` before the loss, or None.
        chunk_tokens: tokens per chunk; None picks about 2^24 logits per chunk (64 MiB in float32).

    Under ``torch.autocast`` the matmul runs in the autocast dtype and the loss and lse in
    float32 (as eager autocast would run ``F.linear`` then ``F.cross_entropy``); float64 inputs
    compute in float64.

    Returns:
        The loss: a scalar, or ``target.shape`` for ``reduction="none"``; float32 under autocast,
        otherwise the dtype of the logits ``F.linear`` would make.
    """
    _check_arguments(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap, chunk_tokens)
    compute_dtype, autocast_on = _compute_dtype(hidden, weight, bias)
    out_dtype = torch.float32 if autocast_on else compute_dtype
    if _accumulated:
        # Private (memopt.causal_lm_loss): the float32 (float64) loss as accumulated, not rounded to
        # a float16/bfloat16 compute dtype, as Hugging Face's loss on upcast logits is.
        out_dtype = _accumulate_dtype(compute_dtype)
    vocab = weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab)
    target_flat = target.reshape(-1).to(torch.int64)
    # Note [a frozen LM head]: when only hidden needs a gradient (LoRA / PEFT fine-tuning keeps
    # the head frozen), each token's loss depends on its own row of hidden alone, so
    # grad_hidden_i = grad_loss_i * (d loss_i / d hidden_i) for any upstream gradient, reduction
    # "none" included. The forward forms d loss_i / d hidden_i from its softmax while the chunk's
    # logits exist, and saves it (tokens x d in hidden's dtype) in place of hidden and the lse:
    # the same bytes, two tokens x vocab x d matmuls in all (eager's two) instead of three.
    hidden_2d = hidden.reshape(target_flat.numel(), hidden.shape[-1])  # (not -1: ambiguous when hidden_size is 0)
    grad_hidden_in_forward = (
        torch.is_grad_enabled()
        and hidden.requires_grad
        and not weight.requires_grad
        and (bias is None or not bias.requires_grad)
    )
    loss = LinearCrossEntropyFunction.apply(
        hidden_2d,
        weight,
        bias,
        target_flat,
        int(ignore_index),
        float(label_smoothing),
        None if logit_softcap is None else float(logit_softcap),
        int(chunk_tokens),
        compute_dtype,
        hidden_2d[:0].clone() if grad_hidden_in_forward else None,  # no bytes of hidden's: see the op
    )
    if reduction == "none":
        return loss.reshape(target.shape).to(out_dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / (target_flat != ignore_index).sum()
    return total.to(out_dtype)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Plain PyTorch reference: materialises the ``(..., vocab)`` logits.

    ``F.linear``, the softcap, then ``F.cross_entropy`` on the logits flattened to ``(N, vocab)``.
    With ``upcast`` every input is cast to float64 first and the result is float64. Differentiable,
    so its gradients are the reference gradients.
    """
    if upcast:
        hidden, weight = hidden.double(), weight.double()
        bias = None if bias is None else bias.double()
    logits = F.linear(hidden, weight, bias)
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    loss = F.cross_entropy(
        logits.reshape(-1, weight.shape[0]),
        target.reshape(-1).long(),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
