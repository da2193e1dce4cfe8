"""``gpuload plan``: print where a dataset's bytes would live, before running anything.

The dataset is an image folder (bytes per sample estimated from the decoded size of a few
images, 3*H*W uint8, plus an int64 label), an ``.npy``/``.npz`` file (read from its header, not
loaded), a ``.bin`` token shard or a glob of them (their tokens, as ``TokenWindows`` reads them),
Parquet files, an Arrow file or a ``save_to_disk`` folder (the fixed-width columns the cache
holds, from the schema), or a synthetic shape (``--synthetic cifar``, the default). ``--device-memory`` and
``--host-memory`` pretend a machine, so the plan for an 80 GiB card can be read on a laptop.

With ``--model pkg.module:factory --input-shape 3,224,224`` it prints the job's plan instead
(:func:`gpuload.plan_job`): the training step's peak, the prefetch slots and the cache on one
card, and the batch size that fits. The model is built and traced on fake tensors: nothing of
the planned size is allocated.

With ``--gpus-per-node N [--nodes M]`` it prints the scope plan of a torch.distributed job
(:func:`gpuload.distributed.plan_scopes`): for each ``cache_scope``, the share on each GPU,
the host memory per node and the bytes each epoch moves over PCIe, NVLink and the
network, and what ``auto`` picks. With ``--model`` too, the per-GPU cache room is what the
job plan's training step and prefetch slots leave.

This module only defines and checks the arguments (no torch: ``--help`` and a bad argument
answer at once); :mod:`gpuload.cli.plan_print` computes and prints the plans.
"""

from __future__ import annotations

import argparse
import sys

from gpuload.cli.arguments import cuda_missing, device_argument, parse_shape, positive_int, size_argument, size_choice

__all__ = ["add_arguments", "run", "CACHE_MODES", "SYNTHETIC_NAMES", "MAX_RANKS"]

# gpuload.cache.MODES, gpuload.job.dataset_size.SYNTHETIC's names and scope_plan.MAX_RANKS, here without importing torch
# (tests/cli/test_plan.py checks that they agree).
CACHE_MODES = ("auto", "device", "host", "off")
SYNTHETIC_NAMES = ("cifar", "imagenet")
# The most ranks a scope plan takes: past today's largest clusters (about 100,000 GPUs); the plan
# keeps a few numbers per rank (2**17 ranks: under a second, a few MB), 10**10 would take 80 GB.
MAX_RANKS = 1 << 17


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gpuload plan`` options, added to ``parser``."""
    parser.add_argument("dataset", nargs="?", default=None,
                        help="an image folder, an .npy/.npz file, a .bin token shard or a quoted glob of shards "
                             "('data/train_*.bin'), a Parquet file or quoted glob of them, an .arrow file or a "
                             "datasets save_to_disk folder (default: --synthetic cifar)")
    parser.add_argument("--synthetic", choices=SYNTHETIC_NAMES, default=None,
                        help="a well-known dataset shape instead of a path (default cifar)")
    parser.add_argument("--cache", choices=CACHE_MODES, default=None,
                        help="cache mode (default: settings, else auto)")
    parser.add_argument("--cache-size", type=size_choice, default=None, metavar="SIZE",
                        help="device budget: '40GiB', 0.8, 'auto', 'off'")
    parser.add_argument("--cache-reserve", type=size_choice, default=None, metavar="SIZE",
                        help="device memory kept for the model (default max(2 GiB, 10%%))")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="the disk tier's folder (default: settings, GPULOAD_CACHE_DIR); planned, nothing written")
    parser.add_argument("--disk-cache-size", type=size_choice, default=None, metavar="SIZE",
                        help="the disk tier's budget: '200GiB', 0.5 of the free space, 'auto', 'off'")
    parser.add_argument("--job", default=None, metavar="NAME",
                        help="the settings of a [jobs.NAME] table of gpuload.toml (in this folder, or the file "
                             "GPULOAD_CONFIG names)")
    parser.add_argument("--device", type=device_argument, default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--device-memory", type=size_argument, default=None, metavar="SIZE",
                        help="pretend a card of this size, e.g. 80GiB")
    parser.add_argument("--device-free", type=size_argument, default=None, metavar="SIZE",
                        help="with --device-memory: pretend this much is free (default: all of it)")
    parser.add_argument("--host-memory", type=size_argument, default=None, metavar="SIZE",
                        help="pretend this much host RAM, all available")
    parser.add_argument("--probe-images", type=positive_int, default=16, metavar="N",
                        help="images opened to estimate an image folder's sample size")
    scopes = parser.add_argument_group(
        "scope plan (torch.distributed): each cache_scope's share per GPU, host memory per node, bytes per epoch")
    scopes.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="N",
                        help="plan a job of N ranks per node (one GPU each, of --device-memory)")
    scopes.add_argument("--nodes", type=positive_int, default=None, metavar="M",
                        help="with --gpus-per-node: the number of nodes (default 1)")
    job = parser.add_argument_group("job plan (with --model): the training step, the prefetch slots and the cache")
    job.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                     help="a function returning the model, e.g. torchvision.models:resnet50 (built on fake tensors; "
                          "torchvision: pip install 'gpuload[torchvision]')")
    job.add_argument("--input-shape", default=None, metavar="C,H,W",
                     help="one float32 input without the batch dimension, e.g. 3,224,224 (a fake tensor: "
                          "nothing of that size is allocated)")
    job.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "none"], default="adamw",
                     help="optimizer whose state the step holds (default adamw)")
    job.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                     help="mixed precision: the forward runs under torch.autocast with this dtype")
    job.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                     help="fix the batch size: the cache gets what it leaves (default: recommend one)")
    job.add_argument("--batch-multiple", type=positive_int, default=8, metavar="N",
                     help="a recommended batch size is a multiple of this (default 8)")


def _problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of arguments, found without torch; None when they fit."""
    if args.device_free is not None and args.device_memory is None:
        return "--device-free needs --device-memory (the card it is part of)"
    if args.device_free is not None and args.device_free > args.device_memory:
        return "--device-free cannot exceed --device-memory"
    if args.nodes is not None and args.gpus_per_node is None:
        return "--nodes needs --gpus-per-node (the ranks on each node)"
    ranks = (args.gpus_per_node or 1) * (args.nodes or 1)
    if ranks > MAX_RANKS:
        return (f"--gpus-per-node {args.gpus_per_node} x --nodes {args.nodes or 1} = {ranks:,} ranks: plan at most "
                f"{MAX_RANKS:,}")
    if args.model is not None or args.input_shape is not None:
        if args.model is None or args.input_shape is None:
            return "a job plan needs both --model and --input-shape"
        module, colon, attribute = args.model.partition(":")
        if not colon or not module or not attribute:
            return f"--model {args.model!r} must be written pkg.module:factory, e.g. torchvision.models:resnet50"
        try:
            parse_shape(args.input_shape)
        except ValueError as error:
            return str(error)
    if args.device_memory is None:  # the machine's own device is planned for: it must exist
        return cuda_missing(args.device)
    return None


def run(args: argparse.Namespace) -> int:
    """Print the plan the arguments ask for; 0 on success, 2 on a bad input (one line naming it)."""
    problem = _problem(args)
    if problem:
        print(f"gpuload plan: error: {problem}", file=sys.stderr)
        return 2
    from gpuload.cli.plan_print import print_plan  # torch and the cache: only once the arguments hold

    return print_plan(args)
