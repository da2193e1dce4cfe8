"""``gpuload bench``: run the benchmark scenarios side by side with torch's DataLoader, report them.

Every argument is checked before anything is measured or written: a bad value, a ``--data``
that is missing, empty or not usable arrays, a ``--device`` this machine lacks, or an ``--out``
that cannot be written is one line naming the argument and exit 2, and ``--out`` is created
only once all of them hold. ``--data`` is only read; generated images go to a temporary folder
unless ``--save-images`` names one. torch is imported only once the arguments have parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuload.cli.arguments import (
    command_device,
    cuda_missing,
    device_argument,
    non_negative_float,
    non_negative_int,
    positive_int,
    size_argument,
)

__all__ = ["add_arguments", "run", "run_bench", "UsageError"]

SCENARIOS = ("inmemory", "images", "partial", "samples", "augment", "distributed", "tokens", "packing", "disk", "arrow")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gpuload bench`` options, added to ``parser``."""
    parser.add_argument("--quick", action="store_true", help="a smaller run, well under a minute on 2 cores")
    parser.add_argument("--scenario", choices=SCENARIOS, default=None,
                        help="in-memory arrays (default), an image folder (default with a folder --data), "
                             "arrays larger than the cache budget (partial), many small samples of a generic "
                             "dataset through the sample cache (samples), or in-memory images with crop + flip "
                             "+ normalize augmentation (augment), N processes on torch.distributed (distributed), "
                             "or LLM token windows from a 100M-token shard (tokens), or documents packed into rows "
                             "against padding and collators (packing), or decoded JPEGs spilled to "
                             "cache_dir's disk tier (disk), or a 1M-row datasets.Dataset and Parquet file (arrow)")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="your own .npy/.npz (rows = samples) or image folder (class subfolders); only read")
    parser.add_argument("--save-images", default=None, metavar="DIR",
                        help="images: write the generated photographs to this new or empty folder and keep them "
                             "(default: a temporary folder, removed after the run)")
    parser.add_argument("--cache-size", type=size_argument, default=None, metavar="SIZE",
                        help="partial: the device cache budget, e.g. 12MiB (default: half the data)")
    parser.add_argument("--device-memory", type=size_argument, default=None, metavar="SIZE",
                        help="on a CPU: the card the modelled host-to-device bytes pretend (default 16GiB)")
    parser.add_argument("--image-size", type=positive_int, default=224, help="crop size of the images scenario")
    parser.add_argument("--device", type=device_argument, default=None,
                        help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--samples", type=positive_int, default=None,
                        help="synthetic dataset size (default 50000 arrays, 1024 images)")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="default 512 (arrays), 128 (images)")
    parser.add_argument("--epochs", type=positive_int, default=None, help="timed epochs after the warm-up (default 5)")
    parser.add_argument("--torch-workers", type=non_negative_int, nargs="+", default=None,
                        help="num_workers to try for torch (default 0 2; distributed: 0)")
    parser.add_argument("--processes", type=positive_int, default=None, metavar="N",
                        help="distributed: ranks to run (default 2), gloo on the CPU, NCCL with one GPU each")
    parser.add_argument("--scopes", default=None, metavar="LIST",
                        help="distributed: gpuload's cache_scope values to run, comma-separated (default "
                             "rank,node,world; auto also)")
    parser.add_argument("--step", choices=["none", "sleep", "cnn"], default="none",
                        help="training step per batch: none, a synthetic one of --step-ms, or a small CNN")
    parser.add_argument("--step-ms", type=non_negative_float, default=5.0, help="duration of the sleep step")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch's intra-op threads for the run (default: 1 on 2 cores or fewer, else torch's "
                             "choice; in the JSON)")
    parser.add_argument("--contention", type=non_negative_int, default=0, metavar="N",
                        help="busy neighbours: N processes that each spin on a core while the loaders are timed "
                             "(started and stopped by the bench), to measure the ratios under contention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results", metavar="DIR", help="where bench.json and bench.png go")
    parser.add_argument("--quiet", action="store_true",
                        help="print two lines only: the result in words, then where bench.json and bench.png are "
                             "(no settings line, no progress, no tables)")


class UsageError(ValueError):
    """A command-line argument the benchmark cannot run with; the message names it."""


def _tqdm_progress() -> Callable[[str, int, int], None]:
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def progress(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = tqdm(total=total, desc=f"{name:<40}", unit="epoch", leave=True, file=sys.stderr)
        bars[name].update(done - bars[name].n)
        if done == total:
            bars.pop(name).close()

    return progress


def _line_progress() -> Callable[[str, int, int], None]:
    """One line per loader when it is done: what a log file should get instead of bars."""
    since = [time.perf_counter()]

    def progress(name: str, done: int, total: int) -> None:
        if done == total:
            now = time.perf_counter()
            print(f"  measured {name}: {total} epochs in {now - since[0]:.1f} s", file=sys.stderr, flush=True)
            since[0] = now

    return progress


def _progress(quiet: bool) -> Callable[[str, int, int], None]:
    """Bars on a terminal, a line per loader in a log, nothing with ``--quiet``."""
    if quiet:
        return lambda name, done, total: None
    return _tqdm_progress() if sys.stderr.isatty() else _line_progress()


def out_problem(text: str) -> str | None:
    """Why ``--out`` cannot be written, found without creating anything; None when it looks writable."""
    existing = Path(text)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"argument --out: cannot write in {text}: {existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"argument --out: cannot write in {text}: permission denied in {existing}"
    return None


def writable_out(text: str) -> Path:
    """The ``--out`` folder, created if needed; ``UsageError`` when nothing can be written in it."""
    out = Path(text)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise UsageError(f"argument --out: cannot write in {text}: {error.strerror or error}") from None
    return out


def default_threads() -> int | None:
    """1 on a machine of at most 2 cores, else None (torch's choice).

    There, two intra-op threads wait on each other's barrier whenever anything else runs: an
    ``index_select`` of one batch was measured 10-25x slower, which swamps what is compared.
    torch's DataLoader workers run one thread each anyway.
    """
    return 1 if (os.cpu_count() or 1) <= 2 else None


def _scenario(args: argparse.Namespace) -> str:
    if args.scenario:
        return args.scenario
    if args.data is None:
        return "inmemory"
    data = Path(args.data)
    if not data.exists():
        raise UsageError(f"argument --data: {args.data}: no such file or folder")
    return "images" if data.is_dir() else "inmemory"


def _data_problem(args: argparse.Namespace, scenario: str) -> str | None:
    """What is wrong with ``--data`` that shows without torch (an array file's headers, a folder
    without class subfolders), or None; the image folder's files are checked when it is opened."""
    if args.data is None or scenario not in ("inmemory", "partial", "augment", "images"):
        return None
    if scenario == "images":
        folder = Path(args.data)
        if folder.is_dir() and not any(entry.is_dir() for entry in folder.iterdir()):
            return (f"argument --data: {args.data} holds no class subfolders; the images scenario reads "
                    "root/<class>/<images>")
        return None
    from gpuload.array_files import read_array_file

    if Path(args.data).is_dir():
        return (f"argument --data: {args.data} is a folder; --scenario {scenario} reads an .npy/.npz file "
                "(an image folder: --scenario images)")
    try:
        read_array_file(args.data)
    except ValueError as error:
        return f"argument --data: {error}"
    return None


def _options_problem(args: argparse.Namespace, scenario: str, device=None) -> str | None:
    """Why --cache-size / --device-memory do not fit this run (``device``: once it is known), or None."""
    if scenario != "partial" and args.cache_size is not None:
        return "argument --cache-size: only applies to --scenario partial"
    if args.device_memory is not None and device is not None and device.type == "cuda":
        return ("argument --device-memory: it models the bytes on a CPU; on a GPU the real card decides "
                "(--cache-size gives the cache less of it)")
    return None


#: What each scenario that takes no --data makes for itself (its refusal of --data says so).
_MAKES_ITS_OWN_DATA = {
    "samples": "dataset (--samples N)", "disk": "JPEG folder (--samples N)", "tokens": "100M-token shard",
    "packing": "corpus of documents", "arrow": "table (--samples N rows)",
}


def _distributed_problem(args: argparse.Namespace, scenario: str) -> str | None:
    """Why an option does not fit the distributed scenario (or its options another), or None."""
    if scenario != "distributed":
        given = [flag for flag, value in (("--processes", args.processes), ("--scopes", args.scopes)) if value]
        if given:
            return f"argument {given[0]}: only applies to --scenario distributed"
        if scenario in _MAKES_ITS_OWN_DATA and args.data is not None:
            return f"argument --data: the {scenario} scenario makes its own {_MAKES_ITS_OWN_DATA[scenario]}"
        if scenario == "disk" and importlib.util.find_spec("torchvision") is None:
            return ("argument --scenario disk: it reads its JPEGs with torchvision's ImageFolder, and torchvision "
                    "is not installed: pip install 'gpuload[torchvision]'")
        if scenario == "arrow" and importlib.util.find_spec("datasets") is None:
            return ("argument --scenario arrow: it needs pyarrow and datasets, which are not installed: "
                    "pip install 'gpuload[arrow]'")
        return None
    if args.data is not None:
        return "argument --data: the distributed scenario makes its own CIFAR-shaped arrays (--samples N)"
    if args.device_memory is not None:
        return "argument --device-memory: the distributed scenario reports what each rank really holds"
    if args.processes is not None and args.processes < 2:
        return f"argument --processes: {args.processes} must be at least 2 (ranks that exchange batches)"
    return None


def _distributed_config(args: argparse.Namespace, config) -> Any:
    """The scenario's configuration from the arguments (checked here, before any rank starts)."""
    from gpuload.bench.distributed import (
        DEFAULT_SCOPES,
        DistributedConfig,
        choose_device,
        parse_scopes,
    )
    from gpuload.device import usable_cpu_count

    processes = args.processes or 2
    scopes = _checked(lambda: parse_scopes(args.scopes), "--scopes") if args.scopes else DEFAULT_SCOPES
    device = _checked(lambda: choose_device(args.device, processes), "--device")
    threads = args.threads or max(1, usable_cpu_count() // processes)
    return DistributedConfig(config, processes, scopes, device, threads)


def run(args: argparse.Namespace) -> int:
    """Run ``gpuload bench`` with parsed arguments; 0 on success, 2 on a bad argument, 130 when
    interrupted (Ctrl-C: one line, and an ``--out`` this run created is removed)."""
    created = _first_missing(Path(args.out))
    try:
        with contextlib.ExitStack() as cleanup:
            return _run(args, cleanup)
    except UsageError as error:
        print(f"gpuload bench: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if created is not None and created.is_dir():
            shutil.rmtree(created, ignore_errors=True)
        print(f"\ngpuload bench: interrupted; {'nothing written' if created else f'{args.out} left as it was'}",
              file=sys.stderr)
        return 130


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (what a run would create), or None."""
    missing = None
    while not os.path.lexists(path) and path != path.parent:
        missing, path = path, path.parent
    return missing


run_bench = run


def _checked(make: Callable[[], Any], argument: str = "") -> Any:
    """``make()``, its ValueError (a bad --data, --cache-size, --device) turned into a UsageError."""
    try:
        return make()
    except ValueError as error:
        raise UsageError(f"argument {argument}: {error}" if argument else str(error)) from None


def _scenario_loaders(
    args: argparse.Namespace, scenario: str, config, device, cleanup: contextlib.ExitStack
) -> tuple[list, str, dict[str, object]]:
    """The scenario's loaders, a description of its data, and what the JSON records about it."""
    from gpuload.bench.modelled import DEFAULT_PRETENDED_CARD, dataset_nbytes
    from gpuload.bench.scenarios import inmemory_loaders, load_arrays
    from gpuload.cache import format_bytes

    card = args.device_memory or DEFAULT_PRETENDED_CARD
    extra: dict[str, object] = {}
    if scenario == "images":
        from gpuload.bench.images import (
            image_loaders,
            open_image_folder,
            sample_image_folder,
        )

        if args.data is not None:
            folder = _checked(lambda: open_image_folder(args.data), "--data")
        else:
            keep = Path(args.save_images) if args.save_images else None
            num_images = args.samples or (256 if args.quick else 1024)
            folder = _checked(lambda: cleanup.enter_context(sample_image_folder(num_images, config.seed, keep)),
                              "--save-images")
        specs = image_loaders(config, device, folder, args.image_size, card,
                              say=(lambda line: None) if args.quiet else print)
        where = args.data or args.save_images or f"{len(folder)} generated photographs (temporary)"
        described = f"image folder {where} -> RandomResizedCrop({args.image_size}) + flip + float16 normalize"
    else:
        dataset = _checked(lambda: load_arrays(args.data), "--data") if args.data else None
        if scenario == "partial":
            from gpuload.bench.partial import partial_loaders

            dataset, cache_size, specs = _checked(
                lambda: partial_loaders(config, device, args.cache_size, dataset, card)
            )
            extra["cache_size_bytes"] = cache_size
        elif scenario == "augment":
            from gpuload.bench.augment import augment_loaders

            dataset, specs = _checked(lambda: augment_loaders(config, device, dataset, card), "--data")
        else:
            dataset, specs = inmemory_loaders(config, device, dataset, card)
        described = "in-memory arrays [" + ", ".join(
            f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in dataset.tensors
        ) + "]"
        if scenario == "partial":
            described += f", cache_size {format_bytes(cache_size)} (the data: {format_bytes(dataset_nbytes(dataset))})"
    return specs, described, extra


def _run(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> int:
    scenario = _scenario(args)
    if args.save_images is not None and scenario != "images":
        raise UsageError("argument --save-images: only applies to --scenario images")
    if args.save_images is not None and args.data is not None:
        raise UsageError("argument --save-images: it writes generated images; with --data your own are used")
    problem = (cuda_missing(args.device) or _distributed_problem(args, scenario) or _options_problem(args, scenario)
               or _data_problem(args, scenario) or out_problem(args.out))
    if problem:
        raise UsageError(problem)
    import torch

    from gpuload.bench.ceilings import measure_ceilings
    from gpuload.bench.contention import busy_neighbours
    from gpuload.bench.report import (
        WIDTH,
        add_ratios,
        busy_note,
        format_details,
        format_table,
        headline,
        write_chart,
        write_json,
    )
    from gpuload.bench.run import environment, run_loaders, steady_host_allocator
    from gpuload.bench.scenarios import BenchConfig
    from gpuload.bench.steps import make_step

    device = _checked(lambda: command_device(args.device))
    problem = _options_problem(args, scenario, device)
    if problem:
        raise UsageError(problem)
    fixed_allocator = steady_host_allocator()
    threads = args.threads or default_threads()
    if threads is not None:
        cleanup.callback(torch.set_num_threads, torch.get_num_threads())  # as it was, for in-process callers
        torch.set_num_threads(threads)
    config = BenchConfig(
        num_samples=args.samples or (10_000 if args.quick else 50_000),
        batch_size=args.batch_size or (128 if scenario == "images" else 512),
        epochs=args.epochs or (2 if args.quick else 5),
        torch_workers=tuple(args.torch_workers) if args.torch_workers is not None
        else (0,) if scenario == "distributed" else (0, 2),
        step=args.step,
        step_ms=args.step_ms,
        seed=args.seed,
    )
    if scenario == "samples":
        from gpuload.bench.samples import run_samples_bench

        return run_samples_bench(args.quick, args.samples, args.batch_size, device, writable_out(args.out),
                                 environment(device), quiet=args.quiet)
    if scenario == "tokens":
        from gpuload.bench.tokens import run_tokens_bench

        return run_tokens_bench(args.quick, args.batch_size, device, writable_out(args.out), environment(device),
                                quiet=args.quiet, torch_workers=args.torch_workers, card=args.device_memory)
    if scenario == "packing":
        from gpuload.bench.packing import run_packing_bench

        return run_packing_bench(args.quick, args.batch_size, device, writable_out(args.out), environment(device),
                                 quiet=args.quiet)
    if scenario == "arrow":
        from gpuload.bench.arrow import run_arrow_bench

        return run_arrow_bench(args.quick, args.batch_size, device, writable_out(args.out), environment(device),
                               quiet=args.quiet, torch_workers=args.torch_workers, rows=args.samples,
                               epochs=args.epochs)
    if scenario == "disk":
        from gpuload.bench.disk import run_disk_bench

        return run_disk_bench(args.quick, args.samples, args.batch_size, writable_out(args.out), environment(device),
                              quiet=args.quiet)
    if scenario == "distributed":
        from gpuload.bench.distributed import run_distributed_bench

        distributed = _distributed_config(args, config)
        return run_distributed_bench(distributed, writable_out(args.out), environment(device), quiet=args.quiet)
    specs, described, extra = _scenario_loaders(args, scenario, config, device, cleanup)
    out = writable_out(args.out)  # only now: a run refused above leaves nothing behind
    say = (lambda *lines: None) if args.quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    say(*textwrap.wrap(
        f"gpuload bench: {described}, batch {config.batch_size}, shuffled, "
        f"{config.epochs} timed epochs after 1 warm-up, step={config.step}"
        f"{f' ({config.step_ms} ms)' if config.step == 'sleep' else ''}, on {device}, "
        f"{torch.get_num_threads()} torch thread(s)"
        + (" (the default on 2 cores or fewer; --threads N to choose)" if args.threads is None and threads else ""),
        WIDTH, subsequent_indent="    ",
    ))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ceilings = measure_ceilings(device)
    step = make_step(config.step, device, config.step_ms)
    if args.contention:
        say(f"busy neighbours: {args.contention} process(es) spinning on a core each while the loaders run")
    with busy_neighbours(args.contention):
        results = run_loaders(specs, device, config.epochs, step, _progress(args.quiet))
        load_during = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    add_ratios(results)
    model_memory = results.model_memory.as_dict() if results.model_memory else None
    say("", format_table(results))
    details = format_details(results, model_memory)
    if details:
        say(details)
    if ceilings:
        say("machine ceilings, GB/s: " + ", ".join(f"{k.removesuffix('_gbps')} {v:.1f}" for k, v in ceilings.items()))
    document: dict[str, Any] = {
        "scenario": scenario if not args.data else f"{scenario}:{args.data}",
        "config": dataclasses.asdict(config),
        "contention": {"busy_neighbours": args.contention, "load_before": load_before, "load_after_run": load_during},
        "environment": {**environment(device), "fixed_malloc_thresholds": fixed_allocator},
        "ceilings_gbps": ceilings,
        **extra,
        "model_memory": model_memory,
        "results": results,
    }
    write_json(out / "bench.json", document)
    write_chart(out / "bench.png", results, f"gpuload bench: {scenario}, batch {config.batch_size}, on {device}")
    say("")
    load_after = document["environment"]["load_average"]
    busy = busy_note(max(load_before or 0, load_after[0] if load_after else 0) or None, os.cpu_count(),
                     torch.get_num_threads())
    if busy:
        say(busy)
    summary = headline(results)
    if summary:
        print(summary)
    print(f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}")
    return 0
