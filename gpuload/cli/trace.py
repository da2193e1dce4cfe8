"""``gpuload trace SOURCE``: run a user's loader for ``--steps`` steps with a stand-in training step
of ``--step-ms`` milliseconds, then print where the step waited: the stage table and the verdict
of ``loader.timeline`` (the waiting page of the docs).

``SOURCE`` names the loader: ``path/to/train.py:NAME`` or ``package.module:NAME``, where ``NAME``
is a ``gpuload.DataLoader`` or a function of no arguments that returns one, made with the
timeline on (``GPULOAD_TIMELINE=on`` unless the environment says otherwise). The stand-in step is a
host sleep on a CPU device and a GPU spin of that duration on CUDA (nothing for ``--step-ms 0``):
how long your model's step takes, without your model.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from gpuload.cli.arguments import non_negative_float, positive_int

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gpuload trace`` options, added to ``parser``."""
    parser.add_argument("source", metavar="SOURCE",
                        help="the loader: path/to/train.py:NAME or package.module:NAME, where NAME is a "
                             "gpuload.DataLoader or a function of no arguments returning one")
    parser.add_argument("--steps", type=positive_int, default=100, help="steps to run (default 100; epochs as needed)")
    parser.add_argument("--step-ms", type=non_negative_float, default=0.0, metavar="MS",
                        help="the stand-in training step, in milliseconds (default 0: the loader alone)")


def _load(source: str) -> Any:
    """The object ``source`` names; ValueError naming what is missing."""
    where, colon, name = source.rpartition(":")
    if not colon or not where or not name:
        raise ValueError(f"{source!r} must be written path/to/train.py:NAME or package.module:NAME")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{where} is not a file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a .py file always has a source loader
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))  # the file's own imports, as `python train.py` finds them
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"cannot import {where}: {error}") from None
    if not hasattr(module, name):
        raise ValueError(f"{where} has no {name!r}")
    return getattr(module, name)


@contextlib.contextmanager
def _timeline_on() -> Any:
    """``GPULOAD_TIMELINE=on`` while the user's loader is made, unless the environment sets it."""
    if "GPULOAD_TIMELINE" in os.environ:
        yield
        return
    os.environ["GPULOAD_TIMELINE"] = "on"
    try:
        yield
    finally:
        del os.environ["GPULOAD_TIMELINE"]


def _stand_in_step(device: Any, step_ms: float) -> Any:
    """A step of ``step_ms`` ms: a GPU spin on CUDA (no host wait), a host sleep elsewhere."""
    if step_ms <= 0:
        return lambda batch: None
    if device.type == "cuda":
        from gpuload.bench.steps import GpuSleepStep

        return GpuSleepStep(device, step_ms / 1000)
    return lambda batch: time.sleep(step_ms / 1000)


def run(args: argparse.Namespace) -> int:
    """Run the loader and print its stage table and verdict; 0 on success, 2 on a bad input."""
    import gpuload  # torch: only once the arguments hold

    try:
        with _timeline_on():
            found = _load(args.source)
            loader = found if isinstance(found, gpuload.DataLoader) else found() if callable(found) else found
        if not isinstance(loader, gpuload.DataLoader):
            raise ValueError(f"{args.source} gave a {type(loader).__name__}, not a gpuload.DataLoader")
        if not loader.timeline.enabled:
            raise ValueError("this loader's timeline is off (timeline_steps=0 or GPULOAD_TIMELINE=off)")
    except ValueError as error:
        print(f"gpuload trace: error: {error}", file=sys.stderr)
        return 2
    loader.timeline.sample_every = 1  # a diagnosis of a few steps: every step's stages, whatever they cost
    step = _stand_in_step(loader.device, args.step_ms)
    steps = 0
    with loader:
        while steps < args.steps:
            for batch in loader:
                step(batch)
                steps += 1
                if steps == args.steps:
                    break
            else:
                if not len(loader):
                    break
    timeline = loader.timeline
    print(f"{steps} steps of {loader.stats.path} on {loader.device}, stand-in step {args.step_ms:g} ms:")
    print(timeline.table())
    print(timeline.summary())
    return 0
