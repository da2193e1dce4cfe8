"""Resume at 90% of an ImageNet-sized epoch: how long until the first batch after load_state_dict.

The index space is ImageNet-1k's (1,281,167 samples), batch 256, shuffled with a generator.
gpuload recomputes the epoch's order and skips to the position without reading a sample; the
side-by-side baseline is what a stateless loader (torch's DataLoader, and StatefulDataLoader's
default) must do: iterate the skipped batches, reading their samples. The baseline is timed on
a slice of the skipped batches and extrapolated, so the script runs in seconds.

    python benchmarks/bench_resume.py
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.utils.data as tud

import gpuload

SAMPLES = 1_281_167
BATCH = 256
AT = 0.9
BASELINE_BATCHES = 200


class Indexed(tud.Dataset):
    """A map-style dataset of cheap samples that counts its reads."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        return torch.full((4,), float(index)), index


def resume_time(dataset: tud.Dataset) -> tuple[float, int]:
    """Seconds from load_state_dict to the first batch after a position at AT of the epoch,
    and the samples read in that time."""

    def make() -> gpuload.DataLoader:
        return gpuload.DataLoader(dataset, batch_size=BATCH, shuffle=True,
                                  generator=torch.Generator().manual_seed(0), device="cpu")

    saving = make()
    next(iter(saving))
    state = saving.state_dict()
    state["batches"] = int(AT * len(saving))  # a position is a count of batches done
    resumed = make()
    reads = getattr(dataset, "reads", 0)
    started = time.perf_counter()
    resumed.load_state_dict(state)
    next(iter(resumed))
    return time.perf_counter() - started, getattr(dataset, "reads", 0) - reads


def main() -> None:
    arrays = tud.TensorDataset(torch.arange(SAMPLES))
    generic = Indexed(SAMPLES)
    rows = []
    for name, dataset in (("in-memory arrays", arrays), ("map-style dataset", generic)):
        seconds, reads = resume_time(dataset)
        rows.append((f"gpuload, {name} ({reads} samples read)", seconds))
    skipped = int(AT * (SAMPLES // BATCH + 1))
    torch_loader = tud.DataLoader(generic, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    for _ in itertools.islice(iter(torch_loader), BASELINE_BATCHES):
        pass
    per_batch = (time.perf_counter() - started) / BASELINE_BATCHES
    rows.append((f"torch DataLoader, iterating {skipped} batches (from {BASELINE_BATCHES})", per_batch * skipped))
    print(f"resume at {AT:.0%} of a {SAMPLES:,}-sample epoch, batch {BATCH}, shuffled:")
    for name, seconds in rows:
        print(f"  {name:<66} {seconds:8.3f} s")


if __name__ == "__main__":
    main()
