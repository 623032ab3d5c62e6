"""A plain, hand-written DDP training script: the baseline `make bench` holds mgpu against.

Same model (MLP 64-256-256-10), data (digits, same split), global batch, optimizer and steps as
`python -m mgpu strategy=ddp optim.schedule=constant`. Run with
`torchrun --nproc_per_node=2 scripts/plain_ddp.py --steps 2000 --warmup 100`; prints one JSON line.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def arguments() -> argparse.Namespace:
    """The job's settings, shared with the other peers (`scripts/accelerate_ddp.py`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    return parser.parse_args()


def digits_train_set() -> TensorDataset:
    """mgpu's digits training split: the same stratified split, scaled to 0..1."""
    images, labels = load_digits(return_X_y=True)
    x, _, y, _ = train_test_split(images, labels, test_size=0.2, stratify=labels, random_state=0)
    return TensorDataset(
        torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0, torch.tensor(y)
    )


def mlp() -> nn.Module:
    """mgpu's default model: MLP 64-256-256-10."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(0)

    data = digits_train_set()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch // world, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(mlp(), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    step, epoch, start = 0, 0, None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == args.warmup:
                start = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    if rank == 0:
        samples_per_s = args.batch * (args.steps - args.warmup) / elapsed
        print(json.dumps({"samples_per_s": samples_per_s, "loss": loss.item()}))
    del model, optimizer  # a DDP reducer freed after its gloo group can deadlock on the GIL
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
