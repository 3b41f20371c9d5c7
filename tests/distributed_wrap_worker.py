"""Worker for tests/test_distributed.py, run as ``torchrun --nproc-per-node 2`` on CPU with gloo.

Each rank trains a memopt-wrapped nn.TransformerEncoder on its half of a batch under DDP and
under FSDP2 and checks every parameter gradient against a single-process, unwrapped run on the
whole batch. Prints one ``CHECK <name> ok`` line per check on rank 0; any mismatch raises.
"""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import memopt  # noqa: E402

D_MODEL, HEADS, FFN, LAYERS, SEQ, BATCH_PER_RANK = 32, 4, 64, 3, 8, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def loss_of(model, x):
    return model(x).square().mean()


def reference_grads(model, batch):
    model = copy.deepcopy(model)
    loss_of(model, batch).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def check(name, model, reference, full_tensor=False):
    for param_name, p in model.named_parameters():
        grad = p.grad.full_tensor() if full_tensor else p.grad
        key = param_name.removeprefix("module.")
        torch.testing.assert_close(grad, reference[key], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Net()
    batch = torch.randn(world * BATCH_PER_RANK, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
    local = batch[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
    reference = reference_grads(base, batch)

    for policy in ["selective", "full"]:
        model = memopt.wrap(copy.deepcopy(base), policy=policy)
        ddp = DistributedDataParallel(model)
        loss_of(ddp, local).backward()
        check(f"ddp-{policy}", ddp, reference)

    # FSDP2, wrapping before sharding.
    model = memopt.wrap(copy.deepcopy(base), policy="selective")
    for layer in model.encoder.layers:
        fully_shard(layer)
    fully_shard(model)
    loss_of(model, local).backward()
    check("fsdp2-wrap-then-shard-selective", model, reference, full_tensor=True)

    # FSDP2, sharding first and wrapping the sharded model.
    model = copy.deepcopy(base)
    for layer in model.encoder.layers:
        fully_shard(layer)
    fully_shard(model)
    memopt.wrap(model, policy="full")
    loss_of(model, local).backward()
    check("fsdp2-shard-then-wrap-full", model, reference, full_tensor=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
