"""The machine's own copy ceilings, measured in the same run: what a loader could reach at best."""

from __future__ import annotations

import torch

__all__ = ["measure_ceilings"]


def _copy_gbps(source: torch.Tensor, target: torch.Tensor, repeats: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    target.copy_(source, non_blocking=True)  # warm-up
    best_ms = float("inf")
    for _ in range(repeats):
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    return source.numel() * source.element_size() / (best_ms / 1000) / 1e9


def measure_ceilings(device: torch.device, nbytes: int = 256 * 2**20) -> dict[str, float]:
    """Pinned and pageable host-to-device and device-to-device bandwidth, GB/s (GPU only)."""
    if device.type != "cuda":
        return {}
    with torch.cuda.device(device):
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        other = torch.empty_like(on_device)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        ceilings = {
            "h2d_pinned_gbps": _copy_gbps(pinned, on_device),
            "h2d_pageable_gbps": _copy_gbps(pageable, on_device),
            "d2d_gbps": _copy_gbps(on_device, other),
        }
        del on_device, other, pinned, pageable
        torch.cuda.empty_cache()
    return ceilings
