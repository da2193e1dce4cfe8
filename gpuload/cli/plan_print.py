"""The plans ``gpuload plan`` prints (cache, scope, job), from arguments :mod:`gpuload.cli.plan` checked.

Imported only once the arguments have parsed: this module imports torch and the cache.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuload.cache import CacheSettingError, CacheSettings, decide_images, format_bytes, make_plan
from gpuload.cli.arguments import command_device, parse_shape, setting_error
from gpuload.device import MemoryInfo, cuda_available, device_memory, host_memory
from gpuload.distributed.scope_plan import ScopePlans, plan_scopes
from gpuload.job.dataset_size import DatasetShape, arrow_path, estimate_dataset, image_folder

__all__ = ["print_plan", "load_factory"]


def _settings(args: argparse.Namespace) -> CacheSettings:
    return CacheSettings.resolve(cache=args.cache, cache_size=args.cache_size, cache_reserve=args.cache_reserve,
                                 job=args.job, cache_dir=getattr(args, "cache_dir", None),
                                 disk_cache_size=getattr(args, "disk_cache_size", None))


def _pretended_memory(args: argparse.Namespace) -> MemoryInfo | None:
    """The card ``--device-memory`` (and ``--device-free``) pretend, or None for the real one."""
    if args.device_memory is None:
        return None
    free = args.device_memory if args.device_free is None else args.device_free
    return MemoryInfo(free=free, total=args.device_memory)


def print_plan(args: argparse.Namespace) -> int:
    """Print the job plan (``--model``), the scope plan (``--gpus-per-node``) or the cache plan;
    0 on success, 2 on a bad input (one line naming it)."""
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
            device = command_device(args.device)
            if device.type == "cuda":
                device_name, target, memory = str(device), "cuda", device_memory(device)
            else:
                device_name, target, memory = "cpu", "cpu", MemoryInfo(free=0, total=0)
        host = _host(args)
        if target == "cuda":
            plan = settings.array_plan(shape.bytes_per_sample, shape.num_samples, memory, host,
                                       device=device_name, shared=False, disk=True)
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
    if args.dataset is not None and Path(args.dataset).is_dir() and not arrow_path(args.dataset):
        print(_image_cache_line(Path(args.dataset), settings, target, memory, host))
    return 0


def _scope_device(args: argparse.Namespace) -> MemoryInfo:
    """One GPU of the planned job: the pretended card, else this machine's CUDA device."""
    pretended = _pretended_memory(args)
    if pretended is not None:
        return pretended
    device = command_device(args.device)
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
    line = f"image cache (for gpuload.DataLoader on this folder): {decision.holds or 'none'}: {decision.reason}"
    folder = settings.disk_dir.value
    if folder is not None and settings.disk_size.value.kind != "off":
        line += (f"\n  disk tier: {folder}, up to {format_bytes(settings.disk_room())}: every decoded image, written "
                 "in the first epoch, read back by later epochs and jobs when the memory cache lacks it")
    return line


def load_factory(text: str) -> Callable[[], Any]:
    """The function named by ``pkg.module:factory`` (``factory`` may be dotted), or a ValueError.
    The form is checked with the other arguments, before torch is imported (``plan._problem``)."""
    module_name, _, attribute = text.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as error:
        missing = (getattr(error, "name", None) or "").partition(".")[0]
        install = (" (pip install 'gpuload[torchvision]', or pip install torchvision)" if missing == "torchvision"
                   else f" (install the package that provides {missing!r})" if missing else "")
        raise ValueError(f"--model {text!r}: cannot import {module_name!r}: {error}{install}") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"--model {text!r}: {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"--model {text!r} is a {type(found).__name__}, not a function returning a model")
    return found


def _run_job_plan(args: argparse.Namespace) -> int:
    """``gpuload plan --model ...``: print the job's plan; 0 on success, 2 on a bad input."""
    from gpuload.job.plan import plan_job  # fake-tensor tracing: loaded only for a job plan

    try:
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
        if memory is None and not cuda_available():
            raise ValueError("a job plan needs a card and this machine has no CUDA device: pass --device-memory "
                             "with one GPU's memory (e.g. --device-memory 80GiB)")
        try:
            plan = plan_job(
                factory, torch.empty(shape, device="meta"),
                optimizer=None if args.optimizer == "none" else args.optimizer,
                autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast),
                dataset=dataset, device_memory=memory, cache=settings, batch_size=args.batch_size,
                batch_multiple=args.batch_multiple,
                host_memory=MemoryInfo(args.host_memory, args.host_memory) if args.host_memory is not None else None,
            )
        except RuntimeError as error:  # raised by the model's own code on the fake input
            raise RuntimeError(
                f"the training step of {args.model} failed on a {args.input_shape} input: {error}") from None
        scopes = _scope_plan(args, dataset, settings, plan.memory, **_room_beside_step(plan)) \
            if scoped and dataset is not None else None
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
