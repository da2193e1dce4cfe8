"""How often a 2-rank gloo DDP job aborts as its processes exit, for each way of ending it.

Each run starts two ranks (``torch.multiprocessing`` with ``spawn``: each rank is a whole
interpreter that finalizes as it exits), takes a few DDP steps of a tiny model on the CPU, and
ends one of three ways:

- ``none``: returns right after its steps;
- ``destroy``: ``torch.distributed.destroy_process_group()``, the DDP model still held;
- ``pause``: ``time.sleep(--pause)`` before returning (the GIL released).

A run whose rank ended with a signal (SIGABRT: "terminate called without an active exception")
counts as an abort. The cause, from a core dump: a gloo worker thread frees a finished
allreduce's thread state (Python objects: it takes the GIL) just after the rank's own thread
moved on; once the interpreter finalizes, taking the GIL ends that thread by unwinding through
C++, and the process aborts. gpuload's troubleshooting page and ``tests/clients/lightning_job.py``
end their ranks with the group destroyed and a pause.

Usage: python benchmarks/exit_abort.py [--runs 20] [--endings none destroy pause] [--pause 0.2]
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

STEPS = 5


def rank_job(rank: int, port: int, ending: str, pause_s: float) -> None:
    """A few DDP steps on rank ``rank`` of 2, then the ending."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
    if ending == "destroy":
        dist.destroy_process_group()
    elif ending == "pause":
        time.sleep(pause_s)


def aborted(ending: str, pause_s: float) -> bool:
    """One 2-rank job; True when a rank ended with a signal."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        mp.start_processes(rank_job, args=(port, ending, pause_s), nprocs=2, start_method="spawn")
    except ProcessExitedException as error:
        if error.signal_name is None:  # a non-zero exit status is a failed job, not an abort
            raise
        return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="jobs per ending")
    parser.add_argument("--endings", nargs="+", choices=["none", "destroy", "pause"],
                        default=["none", "destroy", "pause"])
    parser.add_argument("--pause", type=float, default=0.2, help="seconds the pause ending sleeps")
    args = parser.parse_args()
    counts = dict.fromkeys(args.endings, 0)
    for _ in range(args.runs):  # the endings interleaved, so that the machine's load falls on each alike
        for ending in args.endings:
            counts[ending] += aborted(ending, args.pause)
    print(json.dumps({"runs": args.runs, "pause_s": args.pause, "torch": torch.__version__, "aborted": counts}))


if __name__ == "__main__":
    main()
