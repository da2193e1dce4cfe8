"""Checks that the swap reaches this process and a child of every start method; exits 1 if not.

Run by ``run.py`` under a gpuload run's environment before the suite: if a spawned or
forkserver worker got torch's own class, the gpuload numbers would silently be torch's.
Usage: check_swap.py SUITE_DIR (the folder of test_dataloader.py, for the ``import`` swap).
"""

import multiprocessing as mp
import os
import sys

import torch.utils.data
import torch.utils.data.dataloader


def where() -> str:
    """Which class the code under test gets, as module names."""
    if os.environ.get("GPULOAD_TORCH_SUITE_SWAP") == "import":
        import test_dataloader

        return test_dataloader.DataLoader.__module__
    return f"{torch.utils.data.DataLoader.__module__}/{torch.utils.data.dataloader.DataLoader.__module__}"


def report(queue: "mp.Queue[str]") -> None:
    queue.put(where())


def main() -> int:
    sys.path.insert(0, sys.argv[1])
    seen = {"main": where()}
    for method in mp.get_all_start_methods():
        context = mp.get_context(method)
        queue = context.Queue()
        child = context.Process(target=report, args=(queue,))
        child.start()
        try:
            seen[method] = queue.get(timeout=120)
        except Exception as error:  # queue.Empty, or the child died before answering
            seen[method] = f"no answer ({type(error).__name__}, exit code {child.exitcode})"
        child.join(10)
        if child.is_alive():
            child.kill()
    print(seen)
    return 0 if all(set(value.split("/")) == {"gpuload.loader"} for value in seen.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
