"""The ``gpuload`` command: ``gpuload bench`` measures loaders side by side; ``gpuload plan``
prints where a dataset's bytes would live."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

__all__ = ["main"]


def _bench(args: argparse.Namespace) -> int:
    from gpuload.bench.inmemory import InMemoryConfig, environment, run_inmemory
    from gpuload.bench.report import format_table, write_json
    from gpuload.device import resolve_device

    device = resolve_device(args.device)
    config = InMemoryConfig(
        num_samples=args.samples or (10_000 if args.quick else 50_000),
        batch_size=args.batch_size,
        epochs=args.epochs or (2 if args.quick else 5),
        seed=args.seed,
    )
    print(
        f"gpuload bench: in-memory, {config.num_samples} x {'x'.join(map(str, config.image_shape))} "
        f"uint8 + int64 labels, batch {config.batch_size}, shuffle, {config.epochs} epochs "
        f"(+1 warm-up) each, on {device}",
        flush=True,
    )
    results = run_inmemory(config, device, progress=lambda name: print(f"  running {name} ...", flush=True))
    baseline, ideal = results[0].name, results[-1].name
    print()
    print(format_table(results, baseline=baseline, ideal=ideal))
    if args.json:
        write_json(
            Path(args.json),
            {
                "scenario": "inmemory",
                "config": dataclasses.asdict(config),
                "environment": environment(device),
                "results": [r.as_dict() for r in results],
            },
        )
        print(f"\nwrote {args.json}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuload", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="time gpuload against torch's DataLoader")
    bench.add_argument("--quick", action="store_true", help="a smaller run, well under a minute")
    bench.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    bench.add_argument("--samples", type=int, default=None, help="dataset size (default 50000)")
    bench.add_argument("--batch-size", type=int, default=512)
    bench.add_argument("--epochs", type=int, default=None, help="timed epochs after the warm-up")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", default=None, metavar="PATH", help="also write all numbers as JSON")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpuload`` console script."""
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
