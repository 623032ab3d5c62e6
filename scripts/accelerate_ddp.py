"""The job of `scripts/plain_ddp.py`, written for HuggingFace Accelerate: a `make bench` peer.

Same model (MLP 64-256-256-10), data (digits, same split, scaled to 0..1), global batch,
optimizer (AdamW, lr 2e-3, weight decay 0.01, constant), seed and warm-up; Accelerate picks the
backend and wraps the model in DDP. Run with
`torchrun --nproc_per_node=2 scripts/accelerate_ddp.py --steps 2000 --warmup 100`; prints one
JSON line.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(0)

    images, labels = load_digits(return_X_y=True)
    x, _, y, _ = train_test_split(images, labels, test_size=0.2, stratify=labels, random_state=0)
    data = TensorDataset(
        torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0, torch.tensor(y)
    )
    # Accelerate shards the loader over the processes: each takes batch // world per step.
    loader = DataLoader(data, batch_size=args.batch // world, shuffle=True, drop_last=True)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )
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
