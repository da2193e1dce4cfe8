"""Data-parallel training with torch's DDP on several processes, fed by gpuload.DataLoader.

One machine, 2 processes (gloo on CPUs; NCCL with one GPU per process when there are enough):

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py

Two machines of 8 GPUs each (run on both; NODE_RANK is 0 on the first, 1 on the second, HOST
is the first's address):

    torchrun --nnodes 2 --node-rank NODE_RANK --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 examples/ddp_train.py

Without torchrun (``python examples/ddp_train.py``) it runs as a job of one process.

The dataset (uint8 images whose brightness gives the class) is split over the ranks by torch's
``DistributedSampler``; ``cache_scope="node"`` keeps one copy of it per node, split over the
node's ranks, instead of one per rank. Stopping an epoch early must happen at the same batch on
every rank (each batch is an exchange between them): ``--max-steps`` is a limit every rank
shares, ``--stop-after-seconds`` a stop flag the ranks agree on with ``all_reduce`` before the
next batch. The agreed stop saves a checkpoint per rank (model, optimizer, the loader's
position); ``--resume`` continues from it exactly where it stopped.

It writes files only with ``--checkpoint DIR`` (``DIR/rank<r>.pt``, kept for ``--resume``); a
job of one process meets in memory, with no rendezvous file. ``python examples/ddp_train.py``
takes about 55 s on the shared 2-core CPU machine the tests run on (load average 10 when
measured).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gpuload


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4_096)
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--max-steps", type=int, default=None, help="batches per epoch, the same on every rank")
    parser.add_argument("--stop-after-seconds", type=float, default=None,
                        help="stop every rank at the same batch once any rank has trained this long")
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="where each rank saves rank<r>.pt")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints in --checkpoint")
    parser.add_argument("--cache-scope", default="node", choices=["rank", "node", "world", "auto"])
    return parser.parse_args()


def join_process_group() -> torch.device:
    """Join the job torchrun started (or a job of one process), on this rank's GPU or the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    backend = "nccl" if on_gpus else "gloo"
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK
        dist.init_process_group(backend)
    else:  # a job of one process: an in-memory store, no file or port to leave behind
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if on_gpus:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def brightness_classes(samples: int) -> TensorDataset:
    """The same data on every rank (a fixed seed): class c images are about 12 c brighter."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    noise = torch.randint(0, 128, (samples, 3, 32, 32), generator=generator)
    return TensorDataset((noise + 12 * labels.view(-1, 1, 1, 1)).to(torch.uint8), labels)


def agreed_stop(over_budget: bool, device: torch.device) -> bool:
    """True on every rank when it is True on any: all ranks then stop at the same batch."""
    flag = torch.tensor([float(over_budget)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    args = arguments()
    device = join_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    dataset = brightness_classes(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = gpuload.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, device=device,
                                cache_scope=args.cache_scope)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10)).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    checkpoint = Path(args.checkpoint, f"rank{rank}.pt") if args.checkpoint else None
    start_epoch = 0
    if args.resume:
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = saved["epoch"]
        if "loader" in saved:  # stopped mid-epoch: the first iter() finishes that epoch
            sampler.set_epoch(start_epoch)
            loader.load_state_dict(saved["loader"])
        say(f"resumed at epoch {start_epoch}")

    began = time.monotonic()
    stopped = False
    epoch = start_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # on every rank, before iterating: the epoch's order
        batches, loss_sum = 0, torch.zeros((), device=device)
        for images, labels in loader:  # uint8 on `device`; convert there
            loss = nn.functional.cross_entropy(model(images.float() / 255), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            batches, loss_sum = batches + 1, loss_sum + loss.detach()
            if batches == args.max_steps:  # the same limit on every rank: all stop after this batch
                break
            if args.stop_after_seconds is not None and agreed_stop(
                time.monotonic() - began > args.stop_after_seconds, device
            ):
                stopped = True
                break
        mean_loss = loss_sum / max(batches, 1)
        dist.all_reduce(mean_loss)
        exchange = loader.stats.extra.get("exchange")
        dataset_mib = sum(t.nbytes for t in dataset.tensors) / 2**20
        held = (f"; each rank holds {exchange['shard_bytes'] / 2**20:.1f} of the dataset's {dataset_mib:.1f} MiB "
                f"and received {exchange['bytes_received_per_epoch'][-1] / 2**20:.1f} MiB"
                if exchange else "")
        say(f"epoch {epoch}: loss {mean_loss.item() / world:.3f} (mean over {world} rank(s), {batches} batches "
            f"each{', stopped' if stopped else ''}){held}")
        if stopped:
            break
    if checkpoint is not None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch if stopped else args.epochs}
        if stopped:
            state["loader"] = loader.state_dict()  # the position after the last batch trained on
        torch.save(state, checkpoint)
        say(f"saved {args.checkpoint}/rank<r>.pt for {world} rank(s)")
    loader.close()
    # End the process group before the interpreter does: left to exit, gloo's threads can be
    # torn down during static destruction and abort the process after the work is done.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
