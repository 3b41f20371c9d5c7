"""Worker for tests/test_distributed.py, run as ``torchrun --nproc-per-node 2`` on CPU with gloo.

Each rank trains on its half of a batch under DDP and under FSDP2 and checks every parameter
gradient against a single-process, unwrapped run on the whole batch:

* a memopt-wrapped ``nn.TransformerEncoder`` whose layers memopt checkpoints as they are
  (a SiLU activation, which the fused block does not take) and one whose layers it swaps for
  ``memopt.torch_interop.FusedTransformerEncoderLayer`` (a fused block, head_dim 16);
* a ``FusedCheckpointStack``;
* the offload policy (of ``wrap`` and of the block, with an engine that takes CPU tensors), also
  with gradient accumulation under DDP's ``no_sync``.

Prints one ``CHECK <name> ok`` line per check on rank 0; any mismatch raises.
"""

import copy
import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import memopt  # noqa: E402
from helpers import leave_without_gloo_teardown  # noqa: E402  (the script's folder is on sys.path)

D_MODEL, HEADS, FFN, LAYERS, SEQ, BATCH_PER_RANK = 32, 4, 64, 3, 8, 2


class Net(nn.Module):
    def __init__(self, heads=HEADS, activation=nn.SiLU()):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D_MODEL, heads, FFN, dropout=0.0, activation=activation, batch_first=True)
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


def wrap_keeping_names(model, **kwargs):
    """memopt.wrap, plus a map from the wrapped model's parameter names to the plain model's
    (swapped blocks rename the parameters they share with the torch layers)."""
    plain_names = {id(p): name for name, p in model.named_parameters()}
    memopt.wrap(model, **kwargs)
    return model, {name: plain_names[id(p)] for name, p in model.named_parameters()}


def check(name, model, reference, full_tensor=False, names=None):
    for param_name, p in model.named_parameters():
        grad = p.grad.full_tensor() if full_tensor else p.grad
        key = param_name.removeprefix("module.")
        key = names[key] if names else key
        torch.testing.assert_close(grad, reference[key], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # An explicit CPU mesh: without one FSDP2 builds its mesh on the accelerator when the machine
    # has one (the GPU check runs this file too) and moves the parameters there, away from these
    # CPU inputs and out of gloo's reach.
    shard = functools.partial(fully_shard, mesh=init_device_mesh("cpu", (world,)))
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
        shard(layer)
    shard(model)
    loss_of(model, local).backward()
    check("fsdp2-wrap-then-shard-selective", model, reference, full_tensor=True)

    # FSDP2, sharding first and wrapping the sharded model.
    model = copy.deepcopy(base)
    for layer in model.encoder.layers:
        shard(layer)
    shard(model)
    memopt.wrap(model, policy="full")
    loss_of(model, local).backward()
    check("fsdp2-shard-then-wrap-full", model, reference, full_tensor=True)

    # Layers swapped for a FusedCheckpointBlock (head_dim 16), under DDP and FSDP2.
    torch.manual_seed(0)
    swappable = Net(heads=2, activation="relu")
    swapped_reference = reference_grads(swappable, batch)
    model, names = wrap_keeping_names(copy.deepcopy(swappable), policy="selective")
    assert all(isinstance(layer, memopt.torch_interop.FusedTransformerEncoderLayer) for layer in model.encoder.layers)
    ddp = DistributedDataParallel(model)
    loss_of(ddp, local).backward()
    check("ddp-swapped-selective", ddp, swapped_reference, names=names)
    model, names = wrap_keeping_names(copy.deepcopy(swappable), policy="full")
    for layer in model.encoder.layers:
        shard(layer)
    shard(model)
    loss_of(model, local).backward()
    check("fsdp2-swapped-full", model, swapped_reference, full_tensor=True, names=names)

    # A FusedCheckpointStack with mixed policies, under DDP and FSDP2.
    torch.manual_seed(0)
    stack = nn.Sequential(memopt.FusedCheckpointStack(LAYERS, D_MODEL, 2, FFN, policy="none"), nn.Linear(D_MODEL, 1))
    stack_reference = reference_grads(stack, batch)
    model = copy.deepcopy(stack)
    model[0].policy = ["selective", "full", "none"]
    ddp = DistributedDataParallel(model)
    loss_of(ddp, local).backward()
    check("ddp-stack-mixed", ddp, stack_reference)
    model = copy.deepcopy(stack)
    model[0].policy = "full"
    for layer in model[0].layers:
        shard(layer)
    shard(model)
    loss_of(model, local).backward()
    check("fsdp2-stack-full", model, stack_reference, full_tensor=True)

    # Offload (an engine that takes CPU tensors, so it really moves them) under DDP, with two
    # micro-batches accumulated under no_sync: the gradients equal one step on the whole batch.
    cpu_offload = memopt.offload(min_bytes=0, allow_cpu_source=True, pin_memory=False)
    half = BATCH_PER_RANK // 2
    micro_batches = [local[:half], local[half:]]

    def accumulate(ddp):
        with ddp.no_sync():
            (loss_of(ddp, micro_batches[0]) / 2).backward()
        (loss_of(ddp, micro_batches[1]) / 2).backward()

    model = memopt.wrap(copy.deepcopy(base), policy="none", offload=cpu_offload)
    before = cpu_offload.stats()["bytes_to_host"]
    accumulate(DistributedDataParallel(model))
    assert cpu_offload.stats()["bytes_to_host"] > before, "wrap's offload moved nothing"
    check("ddp-no-sync-wrap-offload", model, reference)

    model = copy.deepcopy(stack)
    model[0].policy = "selective"
    model[0].offload = cpu_offload
    before = cpu_offload.stats()["bytes_to_host"]
    ddp = DistributedDataParallel(model)
    accumulate(ddp)
    assert cpu_offload.stats()["bytes_to_host"] > before, "the blocks' offload moved nothing"
    check("ddp-no-sync-stack-offload", ddp, stack_reference)

    leave_without_gloo_teardown()  # every check has passed


if __name__ == "__main__":
    main()
