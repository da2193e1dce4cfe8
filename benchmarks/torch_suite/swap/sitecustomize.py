"""Puts gpuload.DataLoader in place of torch's DataLoader in this process, at interpreter start.

``benchmarks/torch_suite/run.py`` puts this folder first on ``PYTHONPATH`` and sets
``GPULOAD_TORCH_SUITE_SWAP``, so every Python process the suite starts runs this: the test
process itself, spawned and forkserver DataLoader workers, and ``sys.executable -c ...``
subprocesses (forked workers inherit the swap from their parent).

- ``global``: ``torch.utils.data.DataLoader = torch.utils.data.dataloader.DataLoader =
  gpuload.DataLoader`` (putting a loader under code one does not own);
- ``import``: only the name ``DataLoader`` in the suite's module ``test_dataloader``, set right
  after that module runs, wherever it is imported (what changing the import line does); in the
  pytest process, whose assertion rewriter imports the module ahead of this hook, the
  harness's plugin ``torch_suite_report`` sets it after collection;
- anything else (the torch baseline): nothing.
"""

import importlib.abc
import importlib.util
import os
import sys

SUITE_MODULE = "test_dataloader"


class _SwapAfterImport(importlib.abc.MetaPathFinder):
    """Finds the suite module as usual, then rebinds its ``DataLoader`` once it has run."""

    def find_spec(self, name, path, target=None):
        if name != SUITE_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_and_swap(module):
            run_module(module)
            import gpuload

            module.DataLoader = gpuload.DataLoader

        spec.loader.exec_module = run_and_swap
        return spec


_mode = os.environ.get("GPULOAD_TORCH_SUITE_SWAP", "")
if _mode == "global":
    import torch.utils.data
    import torch.utils.data.dataloader

    import gpuload

    torch.utils.data.DataLoader = gpuload.DataLoader
    torch.utils.data.dataloader.DataLoader = gpuload.DataLoader
elif _mode == "import":
    sys.meta_path.insert(0, _SwapAfterImport())
