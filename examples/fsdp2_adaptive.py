# OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/fsdp2_adaptive.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import memopt

dist.init_process_group("gloo")  # "nccl" on GPUs
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = memopt.wrap(torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                          for _ in range(4)]), policy="full")
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
stepper = memopt.AdaptiveBatch(model, optimizer, lambda m, b: F.mse_loss(m(b[0]), b[1]), micro_batch=16)
generator = torch.Generator().manual_seed(dist.get_rank())   # each rank its own samples
for _ in range(3):
    batch = (torch.randn(16, 64, generator=generator), torch.randn(16, 64, generator=generator))
    result = stepper.step(batch)                 # the gradient of the global batch's mean loss
    optimizer.zero_grad(set_to_none=True)
if dist.get_rank() == 0:
    print(f"loss {result.loss.item():.4f}, micro-batch {result.micro_batch}")
dist.barrier()                                    # every rank done before the teardown
dist.destroy_process_group()
