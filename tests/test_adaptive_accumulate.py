"""memopt.AdaptiveBatch.accumulate: the batch's gradient added to .grad, no optimizer step;
pre_weighted losses and backward=."""

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.adaptive import MicroBatchFloorError

DT = torch.float64


class _OutOfMemoryAbove(torch.nn.Module):
    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8, dtype=DT), torch.nn.Tanh(), torch.nn.Linear(8, 1, dtype=DT))

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.net(x).squeeze(-1)


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(7, 5, dtype=DT, generator=generator), torch.randn(7, dtype=DT, generator=generator)) for _ in range(2)]


def _mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("pre_weighted", [False, True])
def test_accumulate_adds_the_batch_gradient_to_grad(pre_weighted):
    model = _OutOfMemoryAbove(limit=2)
    batches = _batches()
    # Reference: plain autograd, the two batches' mean losses summed into .grad.
    reference = _OutOfMemoryAbove(limit=10**9)
    reference.load_state_dict(model.state_dict())
    for batch in batches:
        _mse(reference, batch).backward()
    total = len(batches[0][1])
    # pre_weighted: the loss is the micro-batch's sum divided by the whole batch's count.
    loss_fn = (lambda m, b: F.mse_loss(m(b[0]), b[1], reduction="sum") / total) if pre_weighted else _mse
    backward_calls = []
    stepper = memopt.AdaptiveBatch(
        model, torch.optim.SGD(model.parameters(), lr=1.0), loss_fn, pre_weighted=pre_weighted,
        backward=lambda loss: backward_calls.append(loss.item()) or loss.backward(),
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    results = [stepper.accumulate(batch) for batch in batches]
    assert results[0].oom_retries == 2 and results[0].micro_batch == 1 and results[1].oom_retries == 0
    assert len(backward_calls) == 14  # one per sample at micro-batch 1
    for p, ref, start in zip(model.parameters(), reference.parameters(), before):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-12, atol=1e-12)
        assert torch.equal(p.detach(), start)  # no optimizer step
    for result, batch in zip(results, batches):
        torch.testing.assert_close(result.loss.double(), _mse(reference, batch).detach(), rtol=1e-6, atol=1e-7)


def test_floor_error_leaves_grad_as_before():
    model = _OutOfMemoryAbove(limit=0)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=1.0), _mse)
    with pytest.raises(MicroBatchFloorError):
        stepper.accumulate(_batches()[0])
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())


def test_backward_with_a_grad_scaler_raises():
    model = _OutOfMemoryAbove(limit=1)
    with pytest.raises(ValueError, match="backward= runs the backward itself"):
        memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=1.0), _mse, backward=lambda loss: None,
                             grad_scaler=torch.amp.GradScaler("cpu"))


def _fp16_loss(model, batch):
    return model(batch).float().pow(2).mean()


def test_accumulate_refuses_the_grad_scaler_amp_dtype_float16_makes():
    """Its gradient would stay multiplied by the scale (65536) with nothing to unscale it: the
    caller, stepping the optimizer itself, never sees that scaler."""
    model = torch.nn.Linear(8, 1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), _fp16_loss,
                                   amp_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"amp_dtype=torch.float16 made a GradScaler.*x65536.*grad_scaler="):
        stepper.accumulate(torch.randn(6, 8))
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())


def test_accumulate_with_a_grad_scaler_steps_through_it():
    """With the caller's GradScaler, .grad is scaled as scaler.scale(loss).backward() leaves it,
    and grad_scaler.step/update make the step of the float64 full-batch gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    batches = [torch.randn(6, 8), torch.randn(5, 8)]
    reference = torch.nn.Linear(8, 1, dtype=DT)
    reference.load_state_dict(model.state_dict())
    for batch in batches:
        _fp16_loss(reference, batch.double()).backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = memopt.AdaptiveBatch(model, opt, _fp16_loss, micro_batch=4, amp_dtype=torch.float16,
                                   grad_scaler=scaler)
    for batch in batches:
        stepper.accumulate(batch)
    # fp16 autocast: the tolerance of a float16 matmul of 8 terms against float64
    tol = dict(rtol=2e-2, atol=2e-3)
    for p, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.double() / 2.0**10, ref.grad, **tol)
    start = [p.detach().double().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    for p, ref, p0 in zip(model.parameters(), reference.parameters(), start):
        torch.testing.assert_close(p.detach().double(), p0 - 0.5 * ref.grad, **tol)
