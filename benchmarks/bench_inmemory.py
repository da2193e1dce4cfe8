"""In-memory CIFAR-shaped benchmark: gpuload vs torch's DataLoader vs an ideal gather.

Targets on a 2-core CPU machine: gpuload >= 8x torch's DataLoader (num_workers=0) and >= 80%
of the ideal gather's speed. Usage: python benchmarks/bench_inmemory.py [--quick] [--json PATH]
"""

import sys

from gpuload.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
