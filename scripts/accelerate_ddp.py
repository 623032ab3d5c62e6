"""The job of `scripts/plain_ddp.py`, written for HuggingFace Accelerate: a `make bench` peer.

Same model (MLP 64-256-256-10), data (digits, same split, scaled to 0..1), global batch,
optimizer (AdamW, lr 2e-3, weight decay 0.01, constant), seed and warm-up; Accelerate picks the
backend and wraps the model in DDP. Run with
`torchrun --nproc_per_node=2 scripts/accelerate_ddp.py --steps 2000 --warmup 100`; prints one
JSON line.
"""

import json
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from plain_ddp import arguments, digits_train_set, mlp  # the job's definition: the same for both
from torch.utils.data import DataLoader


def main() -> None:
    args = arguments()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(0)

    data = digits_train_set()
    # Accelerate shards the loader over the processes: each takes batch // world per step.
    loader = DataLoader(data, batch_size=args.batch // world, shuffle=True, drop_last=True)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step, start = 0, None
    while step < args.steps:
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == args.warmup:
                start = time.perf_counter()
            if step == args.steps:
                break
    elapsed = time.perf_counter() - start
    if accelerator.is_main_process:
        samples_per_s = args.batch * (args.steps - args.warmup) / elapsed
        print(json.dumps({"samples_per_s": samples_per_s, "loss": loss.item(),
                          "accelerate": accelerator.distributed_type.value}))
    del model, optimizer  # a DDP reducer freed after its gloo group can deadlock on the GIL
    accelerator.end_training()


if __name__ == "__main__":
    main()
