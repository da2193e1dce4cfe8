"""``gpuload bench``: run the benchmark scenarios side by side with torch's DataLoader, report them."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

__all__ = ["run_bench"]


def _progress_bar():
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def progress(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = tqdm(total=total, desc=f"{name:<40}", unit="epoch", leave=True, file=sys.stderr)
        bars[name].update(done - bars[name].n)
        if done == total:
            bars.pop(name).close()

    return progress


def run_bench(args: argparse.Namespace) -> int:
    """Run ``gpuload bench`` with parsed arguments; 0 on success, 2 on a bad argument."""
    from gpuload.bench.ceilings import measure_ceilings
    from gpuload.bench.report import add_ratios, format_details, format_table, write_chart, write_json
    from gpuload.bench.run import environment, run_loaders, steady_host_allocator
    from gpuload.bench.scenarios import BenchConfig, inmemory_loaders, load_arrays
    from gpuload.bench.partial import DEFAULT_PRETENDED_CARD, dataset_nbytes
    from gpuload.bench.steps import make_step
    from gpuload.cache import format_bytes
    from gpuload.device import resolve_device

    device = resolve_device(args.device)
    fixed_allocator = steady_host_allocator()
    if args.threads is not None:
        import torch

        if args.threads < 1:
            print(f"gpuload bench: error: --threads {args.threads} must be at least 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    config = BenchConfig(
        num_samples=args.samples or (10_000 if args.quick else 50_000),
        batch_size=args.batch_size or (128 if args.scenario == "images" else 512),
        epochs=args.epochs or (2 if args.quick else 5),
        torch_workers=tuple(args.torch_workers),
        step=args.step,
        step_ms=args.step_ms,
        seed=args.seed,
    )
    scenario = args.scenario or ("images" if args.data and Path(args.data).is_dir() else "inmemory")
    problem = _partial_options_problem(args, scenario, device)
    if problem:
        print(f"gpuload bench: error: {problem}", file=sys.stderr)
        return 2
    extra: dict[str, object] = {}
    if scenario == "images":
        from gpuload.bench.images import image_loaders

        root = Path(args.data) if args.data else out_dir(args) / "sample-images"
        root.mkdir(parents=True, exist_ok=True)
        num_images = args.samples or (256 if args.quick else 1024)
        specs = image_loaders(config, device, root, num_images, args.image_size)
        described = f"image folder {root} -> RandomResizedCrop({args.image_size}) + flip + float16 normalize"
    else:
        dataset = load_arrays(args.data) if args.data else None
        if scenario == "partial":
            from gpuload.bench.partial import partial_loaders

            try:
                dataset, cache_size, specs = partial_loaders(
                    config, device, args.cache_size, dataset, args.device_memory or DEFAULT_PRETENDED_CARD
                )
            except ValueError as error:
                print(f"gpuload bench: error: {error}", file=sys.stderr)
                return 2
            extra["cache_size_bytes"] = cache_size
        elif scenario == "augment":
            from gpuload.bench.augment import augment_loaders

            try:
                dataset, specs = augment_loaders(config, device, dataset)
            except ValueError as error:
                print(f"gpuload bench: error: {error}", file=sys.stderr)
                return 2
        else:
            dataset, specs = inmemory_loaders(config, device, dataset)
        described = "in-memory arrays [" + ", ".join(
            f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in dataset.tensors
        ) + "]"
        if scenario == "partial":
            described += f", cache_size {format_bytes(cache_size)} (the data: {format_bytes(dataset_nbytes(dataset))})"
    print(
        f"gpuload bench: {described}, batch {config.batch_size}, shuffled, "
        f"{config.epochs} timed epochs after 1 warm-up, step={config.step}"
        f"{f' ({config.step_ms} ms)' if config.step == 'sleep' else ''}, on {device}",
        flush=True,
    )
    ceilings = measure_ceilings(device)
    step = make_step(config.step, device, config.step_ms)
    results = run_loaders(specs, device, config.epochs, step, _progress_bar())
    add_ratios(results)
    print()
    print(format_table(results))
    model_memory = results.model_memory.as_dict() if results.model_memory else None
    details = format_details(results, model_memory)
    if details:
        print(details)
    if ceilings:
        print("machine ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    out = out_dir(args)
    document = {
        "scenario": scenario if not args.data else f"{scenario}:{args.data}",
        "config": dataclasses.asdict(config),
        "environment": {**environment(device), "fixed_malloc_thresholds": fixed_allocator},
        "ceilings_gbps": ceilings,
        **extra,
        "model_memory": model_memory,
        "results": results,
    }
    write_json(out / "bench.json", document)
    write_chart(out / "bench.png", results, f"gpuload bench: {scenario}, batch {config.batch_size}, {device}")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def _partial_options_problem(args: argparse.Namespace, scenario: str, device) -> str | None:
    """Why --cache-size / --device-memory do not fit this run, or None when they do."""
    if scenario != "partial":
        given = [flag for flag, value in (("--cache-size", args.cache_size), ("--device-memory", args.device_memory))
                 if value is not None]
        return f"{' and '.join(given)} only apply to --scenario partial" if given else None
    if args.device_memory is not None and device.type == "cuda":
        return ("--device-memory models the plan on a CPU; on a GPU the real card decides, and "
                "--cache-size gives the cache less of it")
    return None


def out_dir(args: argparse.Namespace) -> Path:
    return Path(args.out)
