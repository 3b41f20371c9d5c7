"""A memopt-wrapped model under Hugging Face Accelerate (CPU): accelerator.prepare, accumulate with
gradient accumulation, bf16 mixed precision, and AdaptiveBatch on a prepared model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")

import memopt  # noqa: E402

D, SAMPLES, BATCH = 16, 24, 6


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[_Layer() for _ in range(3)], nn.Linear(D, 1))


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 5, D, generator=generator), torch.randn(SAMPLES, 5, 1, generator=generator))


@pytest.fixture
def fresh_accelerate_state():
    # Accelerate keeps one process-wide state and refuses a second mixed_precision; there is no
    # public reset (its own test base class, accelerate.test_utils.AccelerateTestCase, calls this).
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _train(model, mixed_precision, accumulation_steps=2):
    accelerator = accelerate.Accelerator(
        cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=accumulation_steps
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model)


def _params(model):
    return [p.detach().double() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_prepare_and_accumulate_match_the_unwrapped_run(fresh_accelerate_state, policy):
    plain = _train(_model(), "no")
    wrapped = memopt.wrap(_model(), policy=policy)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    trained = _train(wrapped, "no")
    assert trained is wrapped
    for got, want in zip(_params(trained), _params(plain)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_precision_is_as_close_to_float64_as_eager_bf16(fresh_accelerate_state):
    """The rule for low precision: the wrapped run's error against a float64 run is at most about
    twice the error of the unwrapped run in the same precision."""
    from accelerate.state import AcceleratorState

    results = {}
    for name, make in (("eager", _model), ("wrapped", lambda: memopt.wrap(_model(), policy="selective"))):
        AcceleratorState._reset_state(True)
        results[name] = _params(_train(make(), "bf16"))
    AcceleratorState._reset_state(True)
    exact = _params(_train_float64())
    eager_error = max((a - b).abs().max().item() for a, b in zip(results["eager"], exact))
    wrapped_error = max((a - b).abs().max().item() for a, b in zip(results["wrapped"], exact))
    assert eager_error > 0  # bf16 really ran
    assert wrapped_error <= 2 * eager_error + 1e-6


def _train_float64():
    model = _model().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    for step, (x, y) in enumerate(loader):
        (F.mse_loss(model(x.double()), y.double()) / 2).backward()
        if step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    return model


class _OutOfMemoryAbove(nn.Module):
    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return x


def test_adaptive_batch_with_an_accelerate_prepared_model(fresh_accelerate_state):
    from accelerate.state import AcceleratorState

    results = []
    for limit in (SAMPLES, 2):
        AcceleratorState._reset_state(True)
        accelerator = accelerate.Accelerator(cpu=True)
        model = memopt.wrap(_model(), policy="selective")
        model.insert(0, _OutOfMemoryAbove(limit))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        stepper = memopt.AdaptiveBatch(
            model, optimizer, lambda m, batch: F.mse_loss(m(batch[0]), batch[1]), backward=accelerator.backward
        )
        x, y = _data().tensors
        for start in range(0, SAMPLES, 12):
            result = stepper.step((x[start : start + 12], y[start : start + 12]))
            optimizer.zero_grad()
        results.append((_params(accelerator.unwrap_model(model)), stepper.oom_count, result.micro_batch))
    (never, no_oom, _), (flaky, ooms, micro) = results
    assert no_oom == 0 and ooms == 3 and micro == 1  # 12 -> 6 -> 3 -> 1 on the first batch, then 1
    for got, want in zip(flaky, never):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
