"""memopt.AdaptiveBatch: OOM back-off that keeps the gradient of the whole batch."""

from __future__ import annotations

import collections
import copy
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.adaptive import MicroBatchFloorError
from tests.helpers import gpu

DT = torch.float64


class _BackwardBomb(torch.autograd.Function):
    """Identity whose backward raises OOM, after the later layers' gradients have accumulated."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.record["ok"] = False
        raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")


class FlakyModel(torch.nn.Module):
    """A small MLP that 'runs out of memory' when a micro-batch exceeds ``limit``.

    ``where`` picks whether the failure happens in the forward (after computing an activation)
    or in the backward (after part of the gradient has been accumulated into ``.grad``). Every
    attempt is logged with its sample ids; failed attempts are marked, and weak references to the
    failed attempts' activations are kept.
    """

    def __init__(self, limit: int, where: str = "backward"):
        super().__init__()
        self.l1 = torch.nn.Linear(5, 16, dtype=DT)
        self.l2 = torch.nn.Linear(16, 16, dtype=DT)
        self.l3 = torch.nn.Linear(16, 1, dtype=DT)
        self.limit, self.where = limit, where
        self.attempts: list[dict] = []
        self.failed_activations: list[weakref.ref] = []

    def forward(self, x, ids):
        record = {"ids": ids.tolist(), "ok": True}
        self.attempts.append(record)
        h = torch.tanh(self.l1(x))
        if x.shape[0] > self.limit:
            self.failed_activations.append(weakref.ref(h))
            if self.where == "forward":
                record["ok"] = False
                raise torch.OutOfMemoryError("CUDA out of memory (simulated in forward)")
            h = _BackwardBomb.apply(h, record)
        return self.l3(torch.tanh(self.l2(h))).squeeze(-1)

    def consumed(self) -> list[int]:
        return [i for a in self.attempts if a["ok"] for i in a["ids"]]


def mse(model, batch):
    x, y, ids = batch
    return F.mse_loss(model(x, ids), y)


def make_batch(n: int):
    return torch.randn(n, 5, dtype=DT), torch.randn(n, dtype=DT), torch.arange(n)


def reference_grads(model, batch, loss_fn=mse):
    ref = copy.deepcopy(model)
    ref.limit = 10**9
    loss_fn(ref, batch).backward()
    return [p.grad for p in ref.parameters()], ref


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("n,limit", [(16, 5), (10, 3), (7, 1)])
def test_oom_backoff_gives_full_batch_gradient(where, n, limit):
    model = FlakyModel(limit, where)
    batch = make_batch(n)
    expected, ref = reference_grads(model, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    stepper = memopt.AdaptiveBatch(model, opt, mse, micro_batch=n)
    result = stepper.step(batch)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    assert sorted(model.consumed()) == list(range(n))
    assert len(model.consumed()) == n
    assert result.micro_batch <= limit and result.oom_retries >= 1
    assert stepper.oom_count == result.oom_retries
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_loss_is_the_batch_mean():
    model = FlakyModel(limit=3)
    batch = make_batch(10)
    with torch.no_grad():
        expected = mse(copy.deepcopy(model), batch).float()
    model.attempts.clear()
    result = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, micro_batch=4).step(batch)
    torch.testing.assert_close(result.loss, expected)


def test_uneven_last_micro_batch_is_weighted_by_its_share():
    model = FlakyModel(limit=100)
    batch = make_batch(10)  # micro-batches 4, 4, 2
    expected, _ = reference_grads(model, batch)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), mse, micro_batch=4)
    assert stepper.step(batch).micro_steps == 3
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    # The snippet everyone copies (loss / number of micro-steps) gets this case wrong.
    naive = copy.deepcopy(model)
    naive.zero_grad(set_to_none=True)
    for start in range(0, 10, 4):
        (mse(naive, tuple(t[start:start + 4] for t in batch)) / 3).backward()
    assert not torch.allclose(next(naive.parameters()).grad, expected[0])


def test_failed_attempt_activations_are_freed():
    for where in ("forward", "backward"):
        model = FlakyModel(limit=2, where=where)
        memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, micro_batch=8).step(make_batch(8))
        assert model.failed_activations, "the simulated OOM did not fire"
        assert all(ref() is None for ref in model.failed_activations), where


def test_token_weighted_accumulation_with_variable_lengths():
    torch.manual_seed(1)
    n, t = 9, 6
    lin = torch.nn.Linear(4, 1, dtype=DT)
    x = torch.randn(n, t, 4, dtype=DT)
    y = torch.randn(n, t, dtype=DT)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 1, 4, 2])
    mask = torch.arange(t)[None, :] < lengths[:, None]

    def loss_fn(model, batch):  # mean over the micro-batch's valid tokens
        x, y, mask = batch
        err = (model(x).squeeze(-1) - y) ** 2
        return err[mask].mean()

    ref = copy.deepcopy(lin)
    loss_fn(ref, (x, y, mask)).backward()
    stepper = memopt.AdaptiveBatch(lin, torch.optim.SGD(lin.parameters(), lr=0.0), loss_fn, micro_batch=2,
                                   num_tokens=lambda b: int(b[2].sum()))
    stepper.step((x, y, mask))
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    # Weighting by samples instead of tokens is measurably wrong here.
    by_samples = copy.deepcopy(lin)
    by_samples.zero_grad(set_to_none=True)
    memopt.AdaptiveBatch(by_samples, torch.optim.SGD(by_samples.parameters(), lr=0.0), loss_fn,
                         micro_batch=2).step((x, y, mask))
    assert not torch.allclose(by_samples.weight.grad, ref.weight.grad)


def test_floor_error_leaves_model_and_optimizer_unchanged():
    model = FlakyModel(limit=0, where="backward")
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    entry = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), entry):
        p.grad = g
    before = copy.deepcopy(model.state_dict())
    stepper = memopt.AdaptiveBatch(model, opt, mse, micro_batch=4, min_micro_batch=2)
    with pytest.raises(MicroBatchFloorError, match=r"micro-batch 2 \(min_micro_batch 2\).*unchanged"):
        stepper.step(make_batch(4))
    for p, g in zip(model.parameters(), entry):
        assert p.grad is g and torch.equal(g, torch.full_like(p, 7.0))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert opt.state_dict()["state"] == {}


def test_single_sample_that_does_not_fit():
    model = FlakyModel(limit=0, where="forward")
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse)
    with pytest.raises(MicroBatchFloorError, match="micro-batch 1"):
        stepper.step(make_batch(1))
    assert all(p.grad is None for p in model.parameters())


def test_micro_batch_grows_back_and_logs(caplog):
    model = FlakyModel(limit=2)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, micro_batch=8,
                                   grow_after=2)
    with caplog.at_level(logging.INFO, logger="memopt.adaptive"):
        assert stepper.step(make_batch(8)).micro_batch == 2
        assert "out of memory at micro-batch 8" in caplog.text and "retrying at 4" in caplog.text
        model.limit = 100
        stepper.step(make_batch(8))
        assert stepper.micro_batch == 2  # one step without OOM is not yet grow_after=2
        stepper.step(make_batch(8))
        assert stepper.micro_batch == 4 and "2 steps without OOM; micro-batch 2 -> 4" in caplog.text
        stepper.step(make_batch(8))
        stepper.step(make_batch(8))
        assert stepper.micro_batch == 8
        stepper.step(make_batch(8))
        stepper.step(make_batch(8))
        assert stepper.micro_batch == 8  # never above the requested micro-batch


def test_fp16_scaler_skip_is_counted_and_logged(caplog):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    poison = {"on": False}

    def loss_fn(model, batch):
        loss = model(batch).float().pow(2).mean()
        return loss * float("inf") if poison["on"] else loss

    stepper = memopt.AdaptiveBatch(model, opt, loss_fn, micro_batch=2, amp_dtype=torch.float16)
    assert isinstance(stepper.grad_scaler, torch.amp.GradScaler)
    x = torch.randn(4, 4)
    assert not stepper.step(x).skipped
    before = [p.detach().clone() for p in model.parameters()]
    poison["on"] = True
    with caplog.at_level(logging.WARNING, logger="memopt.adaptive"):
        result = stepper.step(x)
    assert result.skipped and stepper.skipped_steps == 1
    assert "optimizer step skipped" in caplog.text
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    poison["on"] = False
    assert not stepper.step(x).skipped and stepper.skipped_steps == 1


def test_fp16_scaled_gradients_are_unscaled():
    model = torch.nn.Linear(8, 1)
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)

    def loss_fn(model, batch):
        return model(batch).float().pow(2).mean()

    loss_fn(ref, x).backward()
    memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn, micro_batch=4,
                         amp_dtype=torch.float16).step(x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-2, rtol=2e-2)


def test_bf16_autocast_runs_forward_in_bf16():
    model = torch.nn.Linear(8, 1)
    seen = []

    def loss_fn(model, batch):
        out = model(batch)
        seen.append(out.dtype)
        return out.float().pow(2).mean()

    memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                         amp_dtype=torch.bfloat16).step(torch.randn(4, 8))
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("kwargs,match", [
    (dict(micro_batch=-1), "micro_batch must be a positive int"),
    (dict(micro_batch=2, min_micro_batch=4), r"min_micro_batch \(4\) must not exceed micro_batch \(2\)"),
    (dict(min_micro_batch=0), "min_micro_batch must be a positive int"),
    (dict(grow_after=0), "grow_after must be a positive int"),
    (dict(amp_dtype=torch.float32), "amp_dtype must be"),
])
def test_bad_arguments(kwargs, match):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=match):
        memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, **kwargs)


def test_bad_batch_and_loss_leave_model_unchanged():
    model = FlakyModel(limit=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepper = memopt.AdaptiveBatch(model, opt, mse, micro_batch=2)
    before = copy.deepcopy(model.state_dict())
    x, y, ids = make_batch(4)
    with pytest.raises(ValueError, match="share their leading"):
        stepper.step((x, y[:3], ids))
    with pytest.raises(ValueError, match="empty"):
        stepper.step(make_batch(0))
    bad = memopt.AdaptiveBatch(model, opt, lambda m, b: m(b[0], b[2]), micro_batch=2)  # not a scalar
    with pytest.raises(TypeError, match="0-d tensor"):
        bad.step(make_batch(4))
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert opt.state_dict()["state"] == {}


def test_ddp_two_ranks_agree_and_match_global_gradient(tmp_path):
    """Two gloo ranks on CPU; rank 1 runs out of memory above 2 samples, rank 0 never."""
    worker = Path(__file__).with_name("ddp_adaptive_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
         str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.ok").read_text() == "micro_batch=1 retries=2"  # 6 -> 3 -> 1 on both ranks


@gpu
def test_real_cuda_oom_is_recovered_from():
    """A 512 MiB cap: micro-batch 16384 (about 1 GiB of activations) cannot fit, smaller ones do."""
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 1))
    x, y = torch.randn(16384, 256), torch.randn(16384)
    ref = copy.deepcopy(model).double()
    F.mse_loss(ref(x.double()).squeeze(-1), y.double()).backward()

    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stepper = memopt.AdaptiveBatch(model, opt, lambda m, b: F.mse_loss(m(b[0]).squeeze(-1), b[1]), micro_batch=16384)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(512 * 2**20 / total)
    try:
        batch = (x.cuda(), y.cuda())
        result = stepper.step(batch)
        report = memopt.memory_report()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert result.oom_retries >= 1 and result.micro_batch < 16384
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double().cpu(), q.grad, rtol=1e-4, atol=1e-6)
    assert report.allocated <= report.reserved and report.largest_free_block <= report.reserved


@gpu
def test_diagnose_a_real_cuda_oom():
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as err:
        diag = memopt.diagnose_oom(err)
    assert diag.requested_bytes is not None and diag.requested_bytes >= 1.9 * total


# --- Where the batch is: sequence-first models (nn.TransformerEncoderLayer(batch_first=False)) ---

SEQ, NB, DM = 6, 4, 16


def _seq_first_layer():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(DM, 2, 32, dropout=0.0, batch_first=False).double()


def _pow2_mean(m, batch):
    if isinstance(batch, dict):
        return m(batch["src"], src_key_padding_mask=batch["mask"]).pow(2).mean()
    if isinstance(batch, tuple):
        return m(batch[0], src_key_padding_mask=batch[1]).pow(2).mean()
    return m(batch).pow(2).mean()


def _whole_batch_grads(model, batch):
    """The reference: plain PyTorch, the whole batch's mean loss in one backward."""
    model.zero_grad(set_to_none=True)
    _pow2_mean(model, batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _padding_mask():
    mask = torch.zeros(NB, SEQ, dtype=torch.bool)  # (batch, seq): a seq-first model's mask holds the batch in dim 0
    mask[1, 4:] = True
    mask[3, 2:] = True
    return mask


def test_seq_first_model_without_batch_dim_is_refused():
    # It split dimension 0 of a (seq, batch, d) input: the sequence, 0.024 off the whole-batch gradient.
    model = _seq_first_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match=r"'self_attn'.*batch_first=False.*batch_dim="):
        memopt.AdaptiveBatch(model, opt, _pow2_mean, micro_batch=2)
    stack = torch.nn.TransformerEncoder(_seq_first_layer(), num_layers=3, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"'layers.0.self_attn', 'layers.1.self_attn', 'layers.2.self_attn' have "
                                         r"batch_first=False"):
        memopt.AdaptiveBatch(stack, torch.optim.SGD(stack.parameters(), lr=0.0), _pow2_mean)


def test_mixed_layouts_are_refused_without_batch_dim():
    model = torch.nn.ModuleDict({"a": torch.nn.MultiheadAttention(8, 2, batch_first=True),
                                 "b": torch.nn.LSTM(8, 8)})
    with pytest.raises(ValueError, match=r"disagree.*'b' has batch_first=False.*'a' batch_first=True.*batch_dim="):
        memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), _pow2_mean)


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_seq_first_batch_dim_1_matches_whole_batch(micro):
    model = _seq_first_layer()
    torch.manual_seed(1)
    x = torch.randn(SEQ, NB, DM, dtype=DT)
    ref = _whole_batch_grads(model, x)
    seen = []

    def loss_fn(m, batch):
        seen.append(tuple(batch.shape))
        return _pow2_mean(m, batch)

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stepper = memopt.AdaptiveBatch(model, opt, loss_fn, micro_batch=micro, batch_dim=1)
    result = stepper.step(x)
    sizes = [micro] * (NB // micro) + ([NB % micro] if NB % micro else [])
    assert seen == [(SEQ, n, DM) for n in sizes]
    assert result.micro_steps == len(sizes)
    assert max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref)) < 1e-12
    # The whole-batch micro-batch (the default) is dimension 1's size.
    seen.clear()
    assert memopt.AdaptiveBatch(model, opt, loss_fn, batch_dim=1).step(x).micro_batch == NB
    assert seen == [(SEQ, NB, DM)]


def test_seq_first_batch_dim_per_tensor_matches_whole_batch_with_oom_retry():
    # (src (seq, batch, d), key_padding_mask (batch, seq)): each tensor split where it holds the batch.
    class Flaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = _seq_first_layer()

        def forward(self, src, src_key_padding_mask=None):
            if src.shape[1] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return self.layer(src, src_key_padding_mask=src_key_padding_mask)

    model = Flaky()
    torch.manual_seed(2)
    x, mask = torch.randn(SEQ, NB, DM, dtype=DT), _padding_mask()
    ref = [r for r in _whole_batch_grads(model.layer, (x, mask))]
    for batch, dims in [((x, mask), (1, 0)), ({"src": x, "mask": mask}, {"src": 1, "mask": 0})]:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stepper = memopt.AdaptiveBatch(model, opt, _pow2_mean, micro_batch=4, batch_dim=dims)
        result = stepper.step(batch)
        assert (result.micro_batch, result.micro_steps, result.oom_retries) == (1, NB, 2)
        assert max((p.grad - r).abs().max().item() for p, r in zip(model.layer.parameters(), ref)) < 1e-12
        model.zero_grad(set_to_none=True)
        stepper.accumulate(batch)  # accumulate slices the same way
        assert max((p.grad - r).abs().max().item() for p, r in zip(model.layer.parameters(), ref)) < 1e-12
        model.zero_grad(set_to_none=True)


def test_batch_dim_0_takes_a_batch_first_input_to_a_model_that_transposes_inside():
    class BatchFirstOutside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = _seq_first_layer()

        def forward(self, x):  # (batch, seq, d)
            return self.layer(x.transpose(0, 1)).transpose(0, 1)

    model = BatchFirstOutside()
    torch.manual_seed(3)
    x = torch.randn(NB, SEQ, DM, dtype=DT)
    ref = _whole_batch_grads(model, x)
    with pytest.raises(ValueError, match="batch_first=False"):
        memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), _pow2_mean)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), _pow2_mean,
                                   micro_batch=3, batch_dim=0)
    assert stepper.step(x).micro_steps == 2
    assert max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref)) < 1e-12


@pytest.mark.parametrize("batch_dim", [-1, True, 1.0, "1", (1, -1), {"src": 1.5}, [None, "0"]])
def test_bad_batch_dim(batch_dim):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="batch_dim must be"):
        memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, batch_dim=batch_dim)


def test_batch_dim_that_does_not_fit_the_batch_raises_and_leaves_model_unchanged():
    model = _seq_first_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, mask = torch.randn(SEQ, NB, DM, dtype=DT), _padding_mask()
    before = copy.deepcopy(model.state_dict())
    cases = [
        (1, (x, mask), r"agree on their batch size.*sizes \{0: 4, 1: 6\}"),  # the mask's dim 1 is the sequence
        ((1,), (x, mask), r"batch_dim \(1,\) has 1 entries, the batch 2"),
        ((None, None), (x, mask), r"passes every tensor of the batch whole"),
        ((1, 0, 0), (x, mask, False), r"batch_dim\[2\] is 0, but the batch's item 2 is not a tensor"),
        ({"src": 1}, {"src": x, "mask": mask}, r"batch_dim has no entry for the batch's tensor 'mask'"),
        ({"src": 1, "mask": 0, "msk": 0}, {"src": x, "mask": mask}, r"batch_dim names 'msk', not in the batch"),
        ((1, 0), x, r"batch is a tensor: batch_dim must be an int"),
        ({"src": 1}, (x, mask), r"batch is a tuple: batch_dim must be an int or a tuple/list"),
        (3, x, r"has 3 dimensions, no dimension 3"),
        (1, torch.randn(SEQ, 0, DM, dtype=DT), r"empty \(batch dimension 1 is 0\)"),
    ]
    for dims, batch, match in cases:
        stepper = memopt.AdaptiveBatch(model, opt, _pow2_mean, micro_batch=2, batch_dim=dims)
        with pytest.raises(ValueError, match=match):
            stepper.step(batch)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_short_batch_runs_whole_and_keeps_the_micro_batch():
    """An epoch's short last batch is no out-of-memory: it ran whole, and the next full batch
    runs at the micro-batch it had before (not one micro-step per sample of the short one)."""
    model = FlakyModel(limit=100)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), mse, micro_batch=8)
    for n in (8, 3, 8):
        batch = make_batch(n)
        expected, _ = reference_grads(model, batch)
        result = stepper.step(batch)
        assert (result.micro_steps, result.oom_retries, stepper.micro_batch) == (1, 0, 8), n
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    model.limit = 2  # an OOM on a short batch still lowers it
    assert stepper.step(make_batch(3)).oom_retries == 1 and stepper.micro_batch == 1


def test_namedtuple_batch_is_cut_into_namedtuples():
    Batch = collections.namedtuple("Batch", "x y ids")
    model = FlakyModel(limit=2)
    seen = []

    def loss_fn(model, batch):
        seen.append(type(batch))
        return F.mse_loss(model(batch.x, batch.ids), batch.y)

    batch = Batch(*make_batch(5))
    expected, _ = reference_grads(model, tuple(batch))
    result = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn).step(batch)
    assert result.oom_retries == 1 and result.micro_steps == 3 and set(seen) == {Batch}  # 5 -> 2 + 2 + 1
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)


class _Features(collections.UserDict):
    """A mapping that is not a dict, as transformers' BatchEncoding."""


@pytest.mark.parametrize("make,micro_type", [
    (_Features, _Features),
    (lambda pairs: collections.defaultdict(list, pairs), dict),  # not built from a dict: a plain dict
])
def test_mapping_batch_is_cut_into_its_type_or_a_dict(make, micro_type):
    model = FlakyModel(limit=2)
    seen = []

    def loss_fn(model, batch):
        seen.append(type(batch))
        return F.mse_loss(model(batch["x"], batch["ids"]), batch["y"])

    x, y, ids = make_batch(5)
    expected, _ = reference_grads(model, (x, y, ids))
    batch = make({"x": x, "y": y, "ids": ids, "note": "passed whole"})
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn)
    assert stepper.step(batch).micro_steps == 3 and set(seen) == {micro_type}
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)


class _SharedBias(torch.nn.Module):
    """Attention with a (seq, seq) bias every sample shares; 'out of memory' above 2 samples."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, dtype=DT)
        self.limit = 2

    def forward(self, x, bias):  # x (batch, seq, 4), bias (seq, seq)
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return (torch.softmax(self.proj(x) @ x.transpose(1, 2) + bias, -1) @ x).sum(-1).mean(-1)


def test_tensor_shared_by_every_sample_is_passed_whole_with_batch_dim_none():
    torch.manual_seed(0)
    model = _SharedBias()
    x, y = torch.randn(5, 6, 4, dtype=DT), torch.randn(5, dtype=DT)
    bias = torch.triu(torch.full((6, 6), -1e9, dtype=DT), 1)

    def loss_fn(model, batch):
        x, y, bias = batch
        assert bias.shape == (6, 6)
        return F.mse_loss(model(x, bias), y)

    expected, _ = reference_grads(model, (x, y, bias), loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = memopt.AdaptiveBatch(model, opt, loss_fn, batch_dim=(0, 0, None)).step((x, y, bias))
    assert result.oom_retries == 1 and result.micro_steps == 3
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    # Cut by default, it does not share the batch dimension; the error says how to pass it whole.
    with pytest.raises(ValueError, match=r"sizes \{0: 5, 1: 5, 2: 6\}; a tensor shared by every sample is passed "
                                         r"whole .* None for it"):
        memopt.AdaptiveBatch(model, opt, loss_fn).step((x, y, bias))


def _weighted_mse(model, batch):
    """Per-sample weights one and two levels down the batch, as a collator's nested items are."""
    weight = batch["extra"]["weight"] * batch["extra"]["scales"][1]["s"]
    return ((model(batch["x"], batch["ids"]) - batch["y"]) ** 2 * weight).mean()


def _nested_batch(n: int, gen: torch.Generator):
    x, y, ids = torch.randn(n, 5, dtype=DT, generator=gen), torch.randn(n, dtype=DT, generator=gen), torch.arange(n)
    weight, s = torch.rand(n, dtype=DT, generator=gen), torch.rand(n, dtype=DT, generator=gen)
    return {"x": x, "y": y, "ids": ids, "extra": {"weight": weight, "scales": ("none", {"s": s}), "tag": ["a"]}}


@pytest.mark.parametrize("micro", [1, 3, 6])
def test_tensors_nested_in_batch_items_are_cut_like_the_items(micro):
    """Every tensor of the batch is cut, at any depth of its tuples/lists/mappings, as estimate
    looks inside them too. Before, a tensor nested in an item went whole to every micro-batch:
    a per-sample weight broadcast against a smaller micro-batch and the gradient was silently
    wrong (max difference 0.77 at micro-batch 1)."""
    model = FlakyModel(limit=micro)
    batch = _nested_batch(6, torch.Generator().manual_seed(0))
    expected, _ = reference_grads(model, batch, _weighted_mse)
    seen = []

    def loss_fn(model, piece):
        seen.append(piece["extra"])
        return _weighted_mse(model, piece)

    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn, micro_batch=6)
    result = stepper.step(batch)
    assert result.micro_batch == micro and (result.oom_retries > 0) == (micro < 6)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    assert sorted(model.consumed()) == list(range(6))
    # Containers keep their types; values that are not tensors pass as they are.
    for extra in seen:
        assert isinstance(extra["scales"], tuple) and extra["scales"][0] == "none"
        assert extra["tag"] is batch["extra"]["tag"]


def test_nested_tensors_follow_their_items_batch_dim_and_name_their_path():
    model = FlakyModel(limit=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batch = _nested_batch(6, torch.Generator().manual_seed(1))
    expected, _ = reference_grads(model, batch, _weighted_mse)
    # A per-item batch_dim's entry for an item cuts every tensor in it.
    dims = {"x": 0, "y": 0, "ids": 0, "extra": 0}
    result = memopt.AdaptiveBatch(model, opt, _weighted_mse, batch_dim=dims).step(batch)
    assert result.micro_steps == 2
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    # An item holding a tensor needs an entry, as a tensor does.
    with pytest.raises(ValueError, match=r"batch_dim has no entry for the batch's item 'extra'"):
        memopt.AdaptiveBatch(model, opt, _weighted_mse, batch_dim={"x": 0, "y": 0, "ids": 0}).step(batch)
    # A nested tensor that does not share the batch size is named by its path.
    bad = copy.deepcopy(batch)
    bad["extra"]["scales"][1]["s"] = torch.ones(4, dtype=DT)
    with pytest.raises(ValueError, match=r"share their leading .*'extra'\['scales'\]\[1\]\['s'\]: 4"):
        memopt.AdaptiveBatch(model, opt, _weighted_mse).step(bad)
    bad["extra"]["scales"][1]["s"] = torch.tensor(1.0, dtype=DT)
    with pytest.raises(ValueError, match=r"batch tensor 'extra'\['scales'\]\[1\]\['s'\] must have a leading batch "):
        memopt.AdaptiveBatch(model, opt, _weighted_mse).step(bad)
    # None passes the item whole, as for a tensor every sample shares.
    one = torch.ones((), dtype=DT)
    shared = {**batch, "extra": {"weight": 2 * one, "scales": ("none", {"s": one})}}
    expected, _ = reference_grads(model, shared, _weighted_mse)
    model.zero_grad(set_to_none=True)
    dims["extra"] = None
    assert memopt.AdaptiveBatch(model, opt, _weighted_mse, batch_dim=dims).step(shared).micro_steps == 2
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    assert all(p.grad is not None for p in model.parameters())
