# OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/pipeline_parallel.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import memopt

dist.init_process_group("gloo")  # "nccl" on GPUs
rank, stages = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                              # the same model on every rank; each keeps its part
layers = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(8)]
per_stage = len(layers) // stages
stage_module = memopt.wrap(torch.nn.Sequential(*layers[rank * per_stage:(rank + 1) * per_stage]), policy="full")
optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
schedule = Schedule1F1B(PipelineStage(stage_module, rank, stages, torch.device("cpu")),
                        n_microbatches=4, loss_fn=F.mse_loss)
data = torch.Generator().manual_seed(1)
for _ in range(3):
    x, y = torch.randn(16, 64, generator=data), torch.randn(16, 64, generator=data)
    losses = []
    if rank == 0:
        schedule.step(x)                          # the first stage takes the inputs
    elif rank == stages - 1:
        schedule.step(target=y, losses=losses)    # the last one the targets
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
if rank == stages - 1:
    print(f"loss {torch.stack(losses).mean().item():.4f}")
dist.barrier()                                    # every rank done before the teardown
dist.destroy_process_group()
