"""``gpuload plan``: print where a dataset's bytes would live, before running anything.

The dataset is an image folder (bytes per sample estimated from the decoded size of a few
images, 3*H*W uint8, plus an int64 label), an ``.npy``/``.npz`` file (read from its header, not
loaded) or a synthetic shape (``--synthetic cifar``, the default). ``--device-memory`` and
``--host-memory`` pretend a machine, so the plan for an 80 GiB card can be read on a laptop.

With ``--model pkg.module:factory --input-shape 3,224,224`` it prints the job's plan instead
(:func:`gpuload.plan_job`): the training step's peak, the prefetch slots and the cache on one
card, and the batch size that fits.

With ``--gpus-per-node N [--nodes M]`` it prints the scope plan of a torch.distributed job
(:func:`gpuload.distributed.plan_scopes`): for each ``cache_scope``, the share on each GPU,
the host memory per node and the bytes each epoch moves over PCIe, NVLink and the
network, and what ``auto`` picks. With ``--model`` too, the per-GPU cache room is what the
job plan's training step and prefetch slots leave.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuload.cache import MODES, CacheSettingError, CacheSettings, decide_images, format_bytes, make_plan
from gpuload.cli.arguments import device_argument, positive_int, setting_error, size_argument
from gpuload.device import MemoryInfo, cuda_available, device_memory, host_memory, resolve_device
from gpuload.distributed.scope_plan import ScopePlans, plan_scopes
from gpuload.job.dataset_size import SYNTHETIC, DatasetShape, estimate_dataset, image_folder

__all__ = ["add_plan_arguments", "run_plan", "load_factory", "parse_shape", "DatasetShape", "estimate_dataset"]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gpuload plan`` options, added to ``parser``."""
    parser.add_argument("dataset", nargs="?", default=None,
                        help="an image folder or an .npy/.npz file (default: --synthetic cifar)")
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                        help="a well-known dataset shape instead of a path (default cifar)")
    parser.add_argument("--cache", choices=MODES, default=None, help="cache mode (default: settings, else auto)")
    parser.add_argument("--cache-size", default=None, help="device budget: '40GiB', 0.8, 'auto', 'off'")
    parser.add_argument("--cache-reserve", default=None, help="device memory kept for the model (default max(2 GiB, 10%%))")
    parser.add_argument("--job", default=None, help="a [jobs.NAME] table of gpuload.toml")
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
                     help="a function returning the model, e.g. torchvision.models:resnet50 (built on fake tensors)")
    job.add_argument("--input-shape", default=None, metavar="C,H,W",
                     help="one float32 input without the batch dimension, e.g. 3,224,224")
    job.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "none"], default="adamw",
                     help="optimizer whose state the step holds (default adamw)")
    job.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                     help="mixed precision: the forward runs under torch.autocast with this dtype")
    job.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                     help="fix the batch size: the cache gets what it leaves (default: recommend one)")
    job.add_argument("--batch-multiple", type=positive_int, default=8, metavar="N",
                     help="a recommended batch size is a multiple of this (default 8)")


def _settings(args: argparse.Namespace) -> CacheSettings:
    return CacheSettings.resolve(cache=args.cache, cache_size=args.cache_size, cache_reserve=args.cache_reserve,
                                 job=args.job)


def _pretended_memory(args: argparse.Namespace) -> MemoryInfo | None:
    """The card ``--device-memory`` (and ``--device-free``) pretend, or None for the real one."""
    if args.device_memory is None:
        return None
    free = args.device_memory if args.device_free is None else args.device_free
    if free > args.device_memory:
        raise ValueError("--device-free cannot exceed --device-memory")
    return MemoryInfo(free=free, total=args.device_memory)


def run_plan(args: argparse.Namespace) -> int:
    """Print the settings, the dataset's size and the cache plan; 0 on success, 2 on a bad input."""
    if args.model is not None or args.input_shape is not None:
        return _run_job_plan(args)
    if args.gpus_per_node is not None or args.nodes is not None:
        return _run_scope_plan(args)
    try:
        settings = _settings(args)
        shape = estimate_dataset(args.dataset, args.synthetic, args.probe_images)
        pretended = _pretended_memory(args)
        if pretended is not None:
            device_name, target, memory = f"a pretended {format_bytes(pretended.total)} card", "cuda", pretended
        else:
            device = resolve_device(args.device)
            if device.type == "cuda":
                device_name, target, memory = str(device), "cuda", device_memory(device)
            else:
                device_name, target, memory = "cpu", "cpu", MemoryInfo(free=0, total=0)
        host = _host(args)
        if target == "cuda":
            plan = settings.array_plan(shape.bytes_per_sample, shape.num_samples, memory, host,
                                       device=device_name, shared=False)
        else:
            plan = make_plan(shape.bytes_per_sample, shape.num_samples, 0, host.free, 0, 0, settings.mode.value,
                             host_total=host.total, target="cpu")
    except CacheSettingError as error:
        print(f"gpuload plan: error: {setting_error(error)}", file=sys.stderr)
        return 2
    except ValueError as error:  # DeviceError and bad datasets are ValueErrors
        print(f"gpuload plan: error: {error}", file=sys.stderr)
        return 2
    print("settings:")
    print("  " + settings.describe().replace("\n", "\n  "))
    print(f"dataset: {shape.description}")
    print(f"  {shape.num_samples} samples x {format_bytes(shape.bytes_per_sample)} "
          f"({shape.bytes_per_sample} bytes per sample)")
    print(f"device: {device_name}")
    if target == "cpu" and not cuda_available() and args.device_memory is None:
        print("  no CUDA device here: pass --device-memory 80GiB to plan for a card")
    print(plan.describe())
    if args.dataset is not None and Path(args.dataset).is_dir():
        print(_image_cache_line(Path(args.dataset), settings, target, memory, host))
    return 0


def _scope_device(args: argparse.Namespace) -> MemoryInfo:
    """One GPU of the planned job: the pretended card, else this machine's CUDA device."""
    if args.nodes is not None and args.gpus_per_node is None:
        raise ValueError("--nodes needs --gpus-per-node (the ranks on each node)")
    pretended = _pretended_memory(args)
    if pretended is not None:
        return pretended
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise ValueError("--gpus-per-node plans a job on GPUs and this machine has none: pass --device-memory "
                         "with one GPU's memory (e.g. --device-memory 141GiB)")
    return device_memory(device)


def _host(args: argparse.Namespace) -> MemoryInfo:
    return MemoryInfo(args.host_memory, args.host_memory) if args.host_memory is not None else host_memory()


def _scope_plan(
    args: argparse.Namespace, shape: DatasetShape, settings: CacheSettings, memory: MemoryInfo, **room: Any
) -> ScopePlans:
    """The scope plan of ``--gpus-per-node`` x ``--nodes`` GPUs of ``memory`` each (``room``: given
    per-GPU cache room, reserve and its note, else resolved from ``settings``)."""
    return plan_scopes(shape.num_samples, shape.bytes_per_sample, gpus_per_node=args.gpus_per_node,
                       nodes=args.nodes or 1, device_memory=memory, host_memory_per_node=_host(args),
                       settings=settings, **room)


def _run_scope_plan(args: argparse.Namespace) -> int:
    """``gpuload plan --gpus-per-node N``: print the scope plan; 0 on success, 2 on a bad input."""
    try:
        settings = _settings(args)
        shape = estimate_dataset(args.dataset, args.synthetic, args.probe_images)
        plans = _scope_plan(args, shape, settings, _scope_device(args))
    except CacheSettingError as error:
        print(f"gpuload plan: error: {setting_error(error)}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"gpuload plan: error: {error}", file=sys.stderr)
        return 2
    print("settings:")
    print("  " + settings.describe().replace("\n", "\n  "))
    print(f"dataset: {shape.description}")
    print(plans.describe())
    return 0


def _room_beside_step(plan: Any) -> dict[str, Any]:
    """The per-GPU cache room a job plan leaves beside its step and prefetch slots, for ``plan_scopes``."""
    cache = plan.cache
    if cache is None:
        room, note = 0, f"the step at batch {plan.batch_size} alone does not fit"
    else:
        room = min(cache.budget, max(0, cache.device_free - cache.reserve)) if cache.mode in ("auto", "device") else 0
        note = f"beside the job plan's step at batch {plan.batch_size} and its prefetch slots"
    return {"room": room, "room_note": note, "reserve": plan.reserve}


def _image_cache_line(path: Path, settings: CacheSettings, target: str, memory: MemoryInfo, host: MemoryInfo) -> str:
    """What the loader's image cache would keep for this folder: decoded images or file bytes."""
    decision = decide_images(
        image_folder(path), settings, torch.device(target), owner="gpuload plan",
        device_memory_info=memory, host_memory_info=host,
    )
    return f"image cache (for gpuload.DataLoader on this folder): {decision.holds or 'none'}: {decision.reason}"


def load_factory(text: str) -> Callable[[], Any]:
    """The function named by ``pkg.module:factory`` (``factory`` may be dotted), or a ValueError."""
    module_name, colon, attribute = text.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"--model {text!r} must be written pkg.module:factory, e.g. torchvision.models:resnet50")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--model {text!r}: cannot import {module_name!r}: {error}") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"--model {text!r}: {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"--model {text!r} is a {type(found).__name__}, not a function returning a model")
    return found


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,224,224"`` -> ``(3, 224, 224)``; a ValueError for anything but positive integers."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"--input-shape {text!r} must be positive integers separated by commas, e.g. 3,224,224")
    return shape


def _run_job_plan(args: argparse.Namespace) -> int:
    """``gpuload plan --model ...``: print the job's plan; 0 on success, 2 on a bad input."""
    from gpuload.job.plan import plan_job  # fake-tensor tracing: loaded only for a job plan

    try:
        if args.model is None or args.input_shape is None:
            raise ValueError("a job plan needs both --model and --input-shape")
        factory = load_factory(args.model)
        shape = parse_shape(args.input_shape)
        settings = _settings(args)
        dataset = (estimate_dataset(args.dataset, args.synthetic, args.probe_images)
                   if args.dataset is not None or args.synthetic is not None else None)
        scoped = args.gpus_per_node is not None or args.nodes is not None
        if scoped and dataset is None:
            raise ValueError("a scope plan (--gpus-per-node) with --model needs a dataset: a path or --synthetic")
        if scoped:
            _scope_device(args)  # on a machine without a GPU: asks for --device-memory
        memory = _pretended_memory(args)
        try:
            plan = plan_job(
                factory, torch.empty(shape), optimizer=None if args.optimizer == "none" else args.optimizer,
                autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast),
                dataset=dataset, device_memory=memory, cache=settings, batch_size=args.batch_size,
                batch_multiple=args.batch_multiple,
                host_memory=MemoryInfo(args.host_memory, args.host_memory) if args.host_memory is not None else None,
            )
        except RuntimeError as error:  # raised by the model's own code on the fake input
            raise RuntimeError(
                f"the training step of {args.model} failed on a {args.input_shape} input: {error}") from None
        scopes = _scope_plan(args, dataset, settings, plan.memory, **_room_beside_step(plan)) if scoped else None
    except (ValueError, TypeError, RuntimeError) as error:  # bad input, or a step the trace cannot run
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"gpuload plan: error: {message}", file=sys.stderr)
        return 2
    print("settings:")
    print("  " + settings.describe().replace("\n", "\n  "))
    precision = f", autocast {args.autocast}" if args.autocast else ""
    print(f"model: {args.model}, input {'x'.join(map(str, shape))} float32, optimizer {args.optimizer}{precision}")
    if dataset is not None:
        print(f"dataset: {dataset.description}")
    print(plan.describe())
    if scopes is not None:
        print(scopes.describe())
    return 0
