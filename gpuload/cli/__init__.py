"""The ``gpuload`` command line: ``main`` (the entry point), ``bench`` and ``plan``."""

from gpuload.cli.main import main

__all__ = ["main"]
