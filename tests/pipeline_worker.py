"""Worker for tests/test_distributed.py's pipeline test (torchrun, 2 processes, gloo, CPU).

A stack of four MLP layers (float64) split into two ``PipelineStage``s of two layers each, whose
layers ``memopt.wrap`` checkpoints ("selective", "full", and "full" with an offload engine that
copies CPU tensors), run by ``ScheduleGPipe`` and ``Schedule1F1B`` over 4 micro-batches:

* without dropout, the loss and every gradient equal a single process running the micro-batches
  one after another (float64, 1e-12);
* with dropout, the wrapped pipeline equals the unwrapped pipeline bit for bit (each rank draws
  its masks from its own generator, so a single process draws others; recomputing a layer in the
  stage's backward must replay the masks of that micro-batch's forward, whatever the schedule's
  order).

Prints ``CHECK <name> ok`` on rank 0; any mismatch raises.
"""

import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import memopt
from helpers import leave_without_gloo_teardown  # the script's folder is on sys.path

WIDTH, LAYERS, BATCH, MICRO_BATCHES = 16, 4, 8, 4


def make_model(dropout: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.float64), nn.GELU(), nn.Dropout(dropout),
                      nn.Linear(2 * WIDTH, WIDTH, dtype=torch.float64))
        for _ in range(LAYERS)])


def loss_fn(out, target):
    return F.mse_loss(out, target)


def run_pipeline(model, rank, schedule, x, y, policy=None, offload=None):
    """This rank's stage of ``model``, wrapped with ``policy`` when given, stepped once; returns
    (the stage module, the loss on the last rank or None)."""
    per_stage = LAYERS // 2
    stage_module = nn.Sequential(*list(model)[per_stage * rank : per_stage * (rank + 1)])
    if policy is not None:
        memopt.wrap(stage_module, policy=policy, offload=offload)
        assert set(importlib.import_module("memopt.wrap").wrapped_policies(stage_module).values()) == {policy}
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    runner = schedule(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    torch.manual_seed(100 + rank)
    if rank == 0:
        runner.step(x)
        return stage_module, None
    losses = []
    runner.step(target=y, losses=losses)
    return stage_module, torch.stack(losses).mean()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    micro = BATCH // MICRO_BATCHES

    # The single-process reference: the micro-batches one after another, their mean loss.
    reference = make_model(0.0)
    ref_loss = sum(loss_fn(reference(x[i : i + micro]), y[i : i + micro]) for i in range(0, BATCH, micro)) / MICRO_BATCHES
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    offset = (LAYERS // 2) * rank

    for schedule in (ScheduleGPipe, Schedule1F1B):
        for policy, offload in [("selective", None), ("full", None), ("full", "cpu")]:
            engine = memopt.offload(min_bytes=0, allow_cpu_source=True, pin_memory=False) if offload else None
            stage_module, loss = run_pipeline(make_model(0.0), rank, schedule, x, y, policy, engine)
            name = f"{schedule.__name__}-{policy}{'-offload' if offload else ''}"
            if engine is not None:
                assert engine.stats()["bytes_to_host"] > 0, f"{name}: the offload moved nothing"
            if loss is not None:
                torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-14)
            for param_name, p in stage_module.named_parameters():
                layer, rest = param_name.split(".", 1)
                key = f"{int(layer) + offset}.{rest}"
                torch.testing.assert_close(p.grad, ref_grads[key], rtol=1e-12, atol=1e-14,
                                           msg=lambda m: f"{name} {key}: {m}")
            if rank == 0:
                print(f"CHECK {name} ok", flush=True)

        # Dropout: the wrapped stages replay each micro-batch's masks in their backward.
        plain, plain_loss = run_pipeline(make_model(0.2), rank, schedule, x, y)
        for policy in ("selective", "full"):
            wrapped, loss = run_pipeline(make_model(0.2), rank, schedule, x, y, policy)
            if loss is not None:
                torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
            for (key, p), q in zip(wrapped.named_parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0,
                                           msg=lambda m: f"{schedule.__name__} dropout {policy} {key}: {m}")
            if rank == 0:
                print(f"CHECK {schedule.__name__}-dropout-{policy} ok", flush=True)

    leave_without_gloo_teardown()  # every check has passed


if __name__ == "__main__":
    main()
