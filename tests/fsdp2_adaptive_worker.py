"""Worker for tests/test_distributed.py's FSDP2 AdaptiveBatch test (torchrun, 2 processes, gloo, CPU).

A two-layer float64 MLP sharded with ``fully_shard`` (each layer, then the root) steps its half of a
global batch of 12 with ``AdaptiveBatch``; rank 1 runs out of memory in the loss (after the
model's forward, as an LM head's logits would) when a micro-batch exceeds 2 samples, rank 0
never. Both ranks must agree on the halvings (6 -> 3 -> 1) and end with the gradient of the mean
loss over all 12 samples, computed here in one process without FSDP; then once more without OOM
(one micro-step), and with ``accumulate`` added to the gradient already held.

Prints ``CHECK <name> ok <micro_batch> <retries>`` on rank 0; any mismatch raises.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import memopt
from helpers import leave_without_gloo_teardown  # the script's folder is on sys.path


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(5, 8, dtype=torch.float64)
        self.l2 = torch.nn.Linear(8, 1, dtype=torch.float64)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def check(name, model, reference, result):
    for (key, p), q in zip(model.named_parameters(), reference):
        torch.testing.assert_close(p.grad.full_tensor(), q, rtol=1e-12, atol=1e-14, msg=lambda m: f"{name} {key}: {m}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok {result.micro_batch} {result.oom_retries}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.randn(12, dtype=torch.float64)
    ref = copy.deepcopy(net)
    F.mse_loss(ref(x).squeeze(-1), y).backward()
    reference = [p.grad for p in ref.parameters()]

    model = copy.deepcopy(net)
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    limit = 2 if rank == 1 else 10**9

    def loss_fn(model, batch):
        out = model(batch[0]).squeeze(-1)
        if out.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in the loss)")
        return F.mse_loss(out, batch[1])

    local = (x[6 * rank : 6 * rank + 6], y[6 * rank : 6 * rank + 6])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stepper = memopt.AdaptiveBatch(model, opt, loss_fn, micro_batch=6)
    check("fsdp2-adaptive-oom-rank1", model, reference, stepper.step(local))

    model.zero_grad(set_to_none=True)
    limit = 10**9
    stepper = memopt.AdaptiveBatch(model, opt, loss_fn, micro_batch=6)
    check("fsdp2-adaptive-one-micro-step", model, reference, stepper.step(local))

    # accumulate adds to the gradient already held: twice the batch's gradient.
    limit = 2 if rank == 1 else 10**9
    check("fsdp2-accumulate-oom-rank1", model, [2 * g for g in reference], stepper.accumulate(local))

    leave_without_gloo_teardown()  # every check has passed


if __name__ == "__main__":
    main()
