"""The ``gpuload`` command: ``gpuload bench`` measures loaders side by side; ``gpuload plan``
prints where a dataset's bytes would live."""

from __future__ import annotations

import argparse

from gpuload.cli.arguments import device_argument, non_negative_float, non_negative_int, positive_int, size_argument
from gpuload.cli.bench import run_bench
from gpuload.cli.plan import add_plan_arguments, run_plan

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuload", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="time gpuload against torch's DataLoader, side by side")
    bench.add_argument("--quick", action="store_true", help="a smaller run, well under a minute on 2 cores")
    bench.add_argument("--scenario", default=None,
                       choices=["inmemory", "images", "partial", "samples", "augment", "distributed", "tokens"],
                       help="in-memory arrays (default), an image folder (default with a folder --data), "
                            "arrays larger than the cache budget (partial), many small samples of a generic "
                            "dataset through the sample cache (samples), or in-memory images with crop + flip "
                            "+ normalize augmentation (augment), N processes on torch.distributed (distributed), "
                            "or LLM token windows from a 100M-token shard (tokens)")
    bench.add_argument("--data", default=None, metavar="PATH",
                       help="your own .npy/.npz (rows = samples) or image folder (class subfolders); only read")
    bench.add_argument("--save-images", default=None, metavar="DIR",
                       help="images: write the generated photographs to this new or empty folder and keep them "
                            "(default: a temporary folder, removed after the run)")
    bench.add_argument("--cache-size", type=size_argument, default=None, metavar="SIZE",
                       help="partial: the device cache budget, e.g. 12MiB (default: half the data)")
    bench.add_argument("--device-memory", type=size_argument, default=None, metavar="SIZE",
                       help="on a CPU: the card the modelled host-to-device bytes pretend (default 16GiB)")
    bench.add_argument("--image-size", type=positive_int, default=224, help="crop size of the images scenario")
    bench.add_argument("--device", type=device_argument, default=None,
                       help="cuda, cuda:N or cpu (default: cuda if present)")
    bench.add_argument("--samples", type=positive_int, default=None,
                       help="synthetic dataset size (default 50000 arrays, 1024 images)")
    bench.add_argument("--batch-size", type=positive_int, default=None, help="default 512 (arrays), 128 (images)")
    bench.add_argument("--epochs", type=positive_int, default=None, help="timed epochs after the warm-up (default 5)")
    bench.add_argument("--torch-workers", type=non_negative_int, nargs="+", default=None,
                       help="num_workers to try for torch (default 0 2; distributed: 0)")
    bench.add_argument("--processes", type=positive_int, default=None, metavar="N",
                       help="distributed: ranks to run (default 2), gloo on the CPU, NCCL with one GPU each")
    bench.add_argument("--scopes", default=None, metavar="LIST",
                       help="distributed: gpuload's cache_scope values to run, comma-separated (default "
                            "rank,node,world; auto also)")
    bench.add_argument("--step", choices=["none", "sleep", "cnn"], default="none",
                       help="training step per batch: none, a synthetic one of --step-ms, or a small CNN")
    bench.add_argument("--step-ms", type=non_negative_float, default=5.0, help="duration of the sleep step")
    bench.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch's intra-op threads for the run (default: 1 on 2 cores or fewer, else torch's "
                            "choice; in the JSON)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="bench-results", metavar="DIR", help="where bench.json and bench.png go")
    bench.add_argument("--quiet", action="store_true", help="print only the closing line (no progress, no tables)")
    bench.set_defaults(run=run_bench)

    plan = commands.add_parser("plan", help="print where a dataset's bytes would live under a cache budget")
    add_plan_arguments(plan)
    plan.set_defaults(run=run_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpuload`` console script."""
    args = _parser().parse_args(argv)
    return args.run(args)

