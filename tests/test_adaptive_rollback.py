"""AdaptiveBatch rollback: a micro-step that runs out of memory leaves no trace.

A model with BatchNorm (running statistics, ``num_batches_tracked``), ``nn.Dropout`` (the CPU
generator) and ``memopt.dropout_add`` (a key drawn from it) that "runs out of memory" above a
micro-batch size (simulated, as in the README example), after its forward has updated the
statistics and drawn its masks, must end each step with the parameters, buffers, losses and RNG
state of a run that used the small micro-batch from the start and never ran out of memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import memopt

DT = torch.float64


class _BackwardBomb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")


class BatchNormDropoutNet(torch.nn.Module):
    """Linear -> BatchNorm -> Dropout -> memopt.dropout_add -> Linear, out of memory above
    ``limit`` samples, either at the end of the forward or in the backward."""

    def __init__(self, limit: int, where: str):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 12, dtype=DT)
        self.bn = torch.nn.BatchNorm1d(12, dtype=DT)
        self.drop = torch.nn.Dropout(0.3)
        self.l2 = torch.nn.Linear(12, 1, dtype=DT)
        self.limit, self.where = limit, where

    def forward(self, x):
        h = self.drop(self.bn(self.l1(x)))
        h = memopt.dropout_add(h, h.tanh(), 0.2, training=self.training)
        if x.shape[0] > self.limit:
            if self.where == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (simulated in forward)")
            h = _BackwardBomb.apply(h)
        return self.l2(h).squeeze(-1)


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _train(model, micro_batch, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stepper = memopt.AdaptiveBatch(model, opt, mse, micro_batch=micro_batch)
    torch.manual_seed(1234)
    results = []
    for batch in batches:
        results.append(stepper.step(batch))
        opt.zero_grad(set_to_none=True)
    return results, torch.get_rng_state()


def _batches(n_steps, size):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 6, dtype=DT, generator=gen), torch.randn(size, dtype=DT, generator=gen))
            for _ in range(n_steps)]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_retried_micro_step_sees_the_model_as_before(where):
    torch.manual_seed(0)
    flaky = BatchNormDropoutNet(limit=4, where=where)
    never_oom = copy.deepcopy(flaky)
    never_oom.limit = 10**9
    batches = _batches(3, 10)

    results, rng = _train(flaky, 8, batches)      # 8 fails, 4 retried: samples 0:4, 4:8, 8:10
    ref_results, ref_rng = _train(never_oom, 4, batches)

    assert results[0].oom_retries == 1 and results[0].micro_batch == 4
    assert all(r.oom_retries == 0 for r in ref_results)
    for r, e in zip(results, ref_results):
        torch.testing.assert_close(r.loss, e.loss, rtol=0, atol=0)
    for (name, a), (_, b) in zip(flaky.state_dict().items(), never_oom.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs from the run that never ran out of memory"
    assert int(flaky.bn.num_batches_tracked) == 3 * 3  # three micro-steps per step, none counted twice
    assert torch.equal(rng, ref_rng)
    flaky.eval(), never_oom.eval()
    x = torch.randn(3, 6, dtype=DT)
    torch.testing.assert_close(flaky(x), never_oom(x), rtol=0, atol=0)


class ReplacedCache(torch.nn.Module):
    """Replaces a buffer object in its forward (a cache), then runs out of memory above 2."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1, dtype=DT)
        self.register_buffer("last_mean", torch.zeros(3, dtype=DT))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.last_mean = x.mean(0).detach()
        self.calls += 1
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.lin(x).squeeze(-1)


def test_replaced_buffer_is_put_back_and_floor_error_restores_the_step_start():
    model = ReplacedCache()
    original = model.last_mean
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, micro_batch=4)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, dtype=DT)
    stepper.step((x, y))
    assert int(model.calls) == 2  # the failed call at 4 samples was rolled back
    torch.testing.assert_close(model.last_mean, x[2:].mean(0), rtol=0, atol=0)

    floor = memopt.AdaptiveBatch(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, micro_batch=4,
                                 min_micro_batch=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = model.last_mean
    with pytest.raises(memopt.MicroBatchFloorError):
        floor.step((x, y))
    assert model.last_mean is kept and model.last_mean is not original
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class TwoHeads(torch.nn.Module):
    """``a(x) + b(x)``; above ``limit`` samples the backward runs out of memory right after
    ``a.weight``'s gradient is accumulated (a post-accumulate hook), before ``b``'s."""

    def __init__(self, limit: int):
        super().__init__()
        self.a = torch.nn.Linear(4, 1, dtype=DT)
        self.b = torch.nn.Linear(4, 1, dtype=DT)
        self.limit, self.bomb = limit, False
        self.a.weight.register_post_accumulate_grad_hook(self._explode)

    def _explode(self, param):
        if self.bomb:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated after a.weight.grad is written)")

    def forward(self, x):
        self.bomb = x.shape[0] > self.limit
        return (self.a(x) + self.b(x)).squeeze(-1)


@pytest.mark.parametrize("entry_grad", [False, True])
@pytest.mark.parametrize("call", ["step", "accumulate"])
def test_failed_micro_step_drops_gradients_of_parameters_outside_the_optimizer(call, entry_grad):
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=DT), torch.randn(8, dtype=DT)
    grads = {}
    for limit, micro in [(2, 8), (10**9, 2)]:  # OOM at 8 and 4, retried at 2 / never OOM, 2 from the start
        torch.manual_seed(1)
        model = TwoHeads(limit)
        if entry_grad:  # the caller's gradient of a: kept and added to (a backward would), by both
            model.a.weight.grad = torch.full_like(model.a.weight, 0.5)
        opt = torch.optim.SGD(model.b.parameters(), lr=0.1)  # a: not the optimizer's, still requires grad
        stepper = memopt.AdaptiveBatch(model, opt, mse, micro_batch=micro)
        result = getattr(stepper, call)((x, y))
        assert result.oom_retries == (2 if limit == 2 else 0)
        grads[limit] = {name: p.grad.clone() for name, p in model.named_parameters()}

    for name, ref in grads[10**9].items():
        assert torch.equal(grads[2][name], ref), f"{name}.grad differs from the run that never ran out of memory"
    # Independent reference: the whole batch's mean-loss gradient of a, in one backward.
    torch.manual_seed(1)
    plain = TwoHeads(10**9)
    wa = torch.autograd.grad(mse(plain, (x, y)), plain.a.weight)[0] + (0.5 if entry_grad else 0.0)
    torch.testing.assert_close(grads[2]["a.weight"], wa, rtol=1e-12, atol=1e-12)


def test_floor_error_restores_gradients_of_parameters_outside_the_optimizer():
    model = TwoHeads(limit=1)
    model.a.weight.grad = torch.full_like(model.a.weight, 0.5)
    stepper = memopt.AdaptiveBatch(model, torch.optim.SGD(model.b.parameters(), lr=0.1), mse, micro_batch=2,
                                   min_micro_batch=2)
    with pytest.raises(memopt.MicroBatchFloorError):
        stepper.step((torch.randn(4, 4, dtype=DT), torch.randn(4, dtype=DT)))
    assert torch.equal(model.a.weight.grad, torch.full_like(model.a.weight, 0.5))
    assert model.a.bias.grad is None and model.b.weight.grad is None
