"""The tokens source: gpuload's batches of TokenWindows equal torch's DataLoader's, on every path."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from equivalence import assert_resumes_exactly, assert_same, assert_same_epochs
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler, default_collate

import gpuload
from gpuload.cache import CacheSettings
from gpuload.datasets.tokens import TokenFileError, TokenWindows, write_shard
from gpuload.device import MemoryInfo, host_memory
from gpuload.sources.tokens import TokenRows, TokenSource


def _ids(n: int, high: int = 65535, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, size=n).astype(np.int64)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shard(tmp_path / "train_000.bin", _ids(5000))


def _pair(ds: Any, seed: int | None = 1, **kwargs: Any) -> tuple[gpuload.DataLoader, TorchDataLoader]:
    gen = (lambda: torch.Generator().manual_seed(seed)) if seed is not None else (lambda: None)
    ours = gpuload.DataLoader(ds, generator=gen(), **kwargs)
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "prefetch_depth", "device")}
    return ours, TorchDataLoader(ds, generator=gen(), **torch_kwargs)


@pytest.mark.parametrize("source_kind", ["shard", "npy", "array", "tensor", "two_shards", "joined"])
def test_shuffled_batches_equal_torchs(tmp_path: Path, source_kind: str) -> None:
    ids = _ids(4000)
    if source_kind == "shard":
        ds = TokenWindows(write_shard(tmp_path / "a.bin", ids), 64)
    elif source_kind == "npy":
        np.save(tmp_path / "a.npy", ids.astype(np.uint32))
        ds = TokenWindows(tmp_path / "a.npy", 64, stride=33)
    elif source_kind == "array":
        ds = TokenWindows(ids.astype(np.uint16), 64, stride=17)
    elif source_kind == "tensor":
        ds = TokenWindows(torch.from_numpy(ids), 64)
    else:
        paths = [write_shard(tmp_path / "s0.bin", ids[:2500]), write_shard(tmp_path / "s1.bin", ids[2500:])]
        ds = TokenWindows(paths, 64, concatenate=source_kind == "joined")
    ours, theirs = _pair(ds, batch_size=16, shuffle=True)
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "device-gather"


@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_and_drop_last(shard: Path, drop_last: bool) -> None:
    ds = TokenWindows(shard, 100, stride=50)
    ours, theirs = _pair(ds, seed=None, batch_size=7, drop_last=drop_last)
    assert len(ours) == len(theirs)
    assert_same_epochs(ours, theirs, epochs=1)


def test_unbatched_items(shard: Path) -> None:
    ds = TokenWindows(shard, 32)
    ours, theirs = _pair(ds, batch_size=None, shuffle=True)
    assert_same_epochs(ours, theirs, epochs=1)
    assert isinstance(ours._source, TokenSource)


def test_distributed_sampler_with_set_epoch(shard: Path) -> None:
    ds = TokenWindows(shard, 40)
    for rank in range(2):
        sampler_ours = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        sampler_theirs = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        ours = gpuload.DataLoader(ds, batch_size=8, sampler=sampler_ours)
        theirs = TorchDataLoader(ds, batch_size=8, sampler=sampler_theirs)

        def set_epoch(epoch: int) -> None:  # called only by this iteration's assert_same_epochs
            sampler_ours.set_epoch(epoch)  # noqa: B023
            sampler_theirs.set_epoch(epoch)  # noqa: B023

        assert_same_epochs(ours, theirs, epochs=2, before_epoch=set_epoch)


@pytest.mark.parametrize("prefetch_depth", [None, 2])
def test_resume_mid_epoch_gives_the_rest_of_the_run(shard: Path, prefetch_depth: int | None) -> None:
    ds = TokenWindows(shard, 50)

    def loader() -> gpuload.DataLoader:
        return gpuload.DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  prefetch_depth=prefetch_depth)

    assert_resumes_exactly(loader, batches=5)


def test_set_batch_size_keeps_the_epochs_order(shard: Path) -> None:
    ds = TokenWindows(shard, 20)
    ours = gpuload.DataLoader(ds, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2))
    theirs = TorchDataLoader(ds, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2))
    order = torch.cat([x for x, _ in theirs])  # every window once, in torch's order
    it = iter(ours)
    got = [next(it)[0] for _ in range(3)]
    ours.set_batch_size(25)
    rest = list(it)
    assert all(x.shape[0] == 25 for x, _ in rest[:-1])
    assert torch.equal(torch.cat(got + [x for x, _ in rest]), order)


def test_cache_off_streams_through_the_prefetcher(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, cache="off", prefetch_depth=2)
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "host-gather"
    assert ours.stats.extra["prefetch"]["bytes_staged"] == 2 * len(ds) * 65 * 2  # uint16 ids, not int64 windows


@pytest.mark.parametrize("dtype", [np.uint16, np.int64])
def test_x_and_y_are_contiguous_and_apart(dtype: type) -> None:
    for batch_size in (1, 4):
        x, y = next(iter(gpuload.DataLoader(TokenWindows(_ids(500).astype(dtype), 16), batch_size=batch_size)))
        assert x.is_contiguous() and y.is_contiguous() and y.view(-1).shape == (batch_size * 16,)
        assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


def test_cpu_device_serves_the_memmap_in_place(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    loader = gpuload.DataLoader(ds, batch_size=8)
    next(iter(loader))
    source = loader._source
    assert source.buffer.data_ptr() == ds.tokens().data_ptr()  # no copy of the token buffer
    info = loader.stats.extra["tokens"]
    assert info["token_bytes"] == 5000 * 2 and info["tokens"] == 5000 and info["windows"] == len(ds)


def test_a_file_that_changes_between_epochs_fails_naming_it(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    loader = gpuload.DataLoader(ds, batch_size=8)
    list(loader)
    write_shard(shard, _ids(6000))
    with pytest.raises(TokenFileError, match=r"train_000\.bin: the token file changed since it was opened"):
        list(loader)


def test_other_collate_or_subclass_takes_torchs_path(shard: Path) -> None:
    ds = TokenWindows(shard, 16)

    def collate(batch: list[Any]) -> torch.Tensor:
        return torch.stack([x for x, _ in batch])

    ours = gpuload.DataLoader(ds, batch_size=4, collate_fn=collate)
    assert not isinstance(ours._source, TokenSource)
    assert torch.equal(next(iter(ours)), next(iter(TorchDataLoader(ds, batch_size=4, collate_fn=collate))))

    class Masked(TokenWindows):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = super().__getitem__(index)
            return x, y * 0

    assert not isinstance(gpuload.DataLoader(Masked(shard, 16), batch_size=4)._source, TokenSource)
    # Unbatched, torch's default_collate stacks a window's x and y into one tensor: torch's path too.
    unbatched = gpuload.DataLoader(ds, batch_size=None, collate_fn=default_collate)
    assert not isinstance(unbatched._source, TokenSource)
    want = next(iter(TorchDataLoader(ds, batch_size=None, collate_fn=default_collate)))
    assert want.shape == (2, 16) and torch.equal(next(iter(unbatched)), want)


def test_bad_sampler_index_fails_like_torch(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    loader = gpuload.DataLoader(ds, batch_size=2, sampler=[0, len(ds)])
    with pytest.raises(IndexError, match=f"index {len(ds)} is out of bounds"):
        list(loader)


def test_a_split_over_ranks_is_declined_with_the_reason(shard: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    ds = TokenWindows(shard, 64)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ours = gpuload.DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, seed=1), cache_scope="node")
        theirs = TorchDataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, seed=1))
        with pytest.warns(UserWarning, match="cache_scope='node'.*is not used: token windows keep a whole copy"):
            assert_same_epochs(ours, theirs, epochs=1)
        assert ours.stats.extra["tokens"]["cache_scope"].startswith("rank: token windows keep a whole copy")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------- the row store (CPU stands in)


def _served_from_rows(loader: gpuload.DataLoader, mode: str, share: float) -> TokenRows:
    """Place the loader's tokens in a row store as a card's plan would, ``share`` of the rows in
    its device tier (on a CPU the tiers are the store's views and copies: the same gathers)."""
    source = loader._source
    source.close()
    rows = TokenRows(loader.dataset.tokens(), loader.dataset.seq_len)
    row_bytes = rows.row_tokens * rows.rows.element_size()
    settings = CacheSettings.resolve(cache=mode, cache_size=max(row_bytes, int(rows.full_rows * row_bytes * share)))
    card = MemoryInfo(free=16 << 30, total=16 << 30)
    plan = settings.array_plan(row_bytes, rows.full_rows, card, host_memory(), device="a pretended card", shared=False)
    source.place_rows(rows, plan)
    source.begin_epoch = source.dataset.check_unchanged  # keep this placement for the epochs
    return rows


@pytest.mark.parametrize(("mode", "share"), [("auto", 1.0), ("auto", 0.4), ("device", 0.4)])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64])
def test_row_store_batches_equal_torchs(tmp_path: Path, mode: str, share: float, dtype: type) -> None:
    ids = _ids(9000)  # 35 rows of 256 tokens and a tail of 40 that windows reach into
    paths = [tmp_path / "a.npy", tmp_path / "b.npy"]
    np.save(paths[0], ids[:5000].astype(dtype))
    np.save(paths[1], ids[5000:].astype(dtype))
    ds = TokenWindows(paths, 100, stride=37)
    ours, theirs = _pair(ds, batch_size=16, shuffle=True)
    rows = _served_from_rows(ours, mode, share)
    assert rows.row_tokens == 256 and rows.full_rows == 35 and rows.tail.numel() == 40 and rows.span == 2
    assert_same_epochs(ours, theirs, epochs=2)
    cache = ours._source.store.stats
    assert cache.device_samples == (35 if share == 1.0 else 14)
    assert (cache.host_samples > 0) == (mode == "auto" and share < 1.0)
    assert cache.device_hits + cache.host_hits + cache.source_hits == 2 * len(ds) * rows.span


def test_the_cache_plan_counts_token_bytes_not_windows() -> None:
    ds = TokenWindows(np.zeros(1_000_000, dtype=np.uint16), 1024, stride=1)  # 1.9 MiB of tokens
    assert len(ds) * 2 * 1024 * 2 > 3.8 * 2**30  # x and y windows of uint16: the 3.81 GiB the array path planned
    rows = TokenRows(ds.tokens(), 1024)
    card = MemoryInfo(free=16 << 30, total=16 << 30)
    plan = CacheSettings.resolve().array_plan(rows.row_tokens * 2, rows.full_rows, card, host_memory(),
                                              device="a pretended card", shared=False)
    assert plan.device_samples == rows.full_rows
    assert ds.nbytes - 1024 < plan.fill_bytes == rows.full_rows * rows.row_tokens * 2 <= ds.nbytes


def test_token_rows_span_every_window() -> None:
    for seq_len, row in ((1024, 512), (64, 256), (8191, 4096), (2000, 512)):
        rows = TokenRows(torch.zeros(100_000, dtype=torch.int16), seq_len)
        assert rows.row_tokens == row and rows.row_tokens * rows.span >= row - 1 + seq_len + 1
        assert rows.row_tokens * rows.span <= 2 * (seq_len + 1) + 2 * row  # at most ~2x the window gathered
    small = TokenRows(torch.arange(100, dtype=torch.int16), 50)
    assert small.row_tokens == 100 and small.full_rows == 1 and small.tail.numel() == 0


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64])
def test_device_tier_holds_the_tokens_and_copies_nothing_per_step(tmp_path: Path, dtype: type) -> None:
    ids = _ids(50_000)
    ds = TokenWindows(ids.astype(dtype), 128)
    ours = gpuload.DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1),
                              device="cuda", cache_size="1GiB")
    theirs = TorchDataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
            assert all(t.is_cuda for t in ours_batch)
            assert_same([t.cpu() for t in ours_batch], theirs_batch)
    assert ours.stats.path == "device-gather"
    itemsize = np.dtype(dtype).itemsize
    rows = 50_000 // 256  # the tail's 80 tokens ride in one padded row
    assert ours.stats.bytes_h2d == (rows + 1) * 256 * itemsize  # the one fill; no batch bytes
    assert ours.stats.extra["cache"]["device_bytes"] == rows * 256 * itemsize


@pytest.mark.gpu
@pytest.mark.parametrize(("cache", "path"), [("off", "host-gather"), ("host", "host-gather (host tier)")])
def test_host_path_on_cuda_equals_torch(shard: Path, cache: str, path: str) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, cache=cache, device="cuda")
    for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
        assert all(t.is_cuda for t in ours_batch)
        assert_same([t.cpu() for t in ours_batch], theirs_batch)
    assert ours.stats.path == path
    assert ours.stats.bytes_h2d == len(ds) * 65 * 2  # each batch's uint16 windows, staged in pinned slots


@pytest.mark.gpu
def test_shrinking_the_device_tier_keeps_the_batches(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, device="cuda", cache_size="1GiB")
    ours.warm(progress=False)
    assert ours._source.shrink_cache(1000) == 18 * 512  # 19 rows of 256 uint16 tokens; 1 kept
    for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
        assert_same([t.cpu() for t in ours_batch], theirs_batch)
    assert ours.stats.extra["cache"]["device_bytes"] == 512


def test_a_worker_init_fn_keeps_torchs_path_and_warm_places_the_tokens(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, num_workers=1, worker_init_fn=print)
    assert_same_epochs(ours, theirs, epochs=1)
    assert ours.stats.path == "torch"  # the worker process runs the worker_init_fn
    ours.close()
    warmed = gpuload.DataLoader(ds, batch_size=8)
    warmed.warm(progress=False)
    assert warmed.stats.path == "device-gather"
    warmed.close()


def test_an_empty_batch_fails_like_torch_and_a_closed_loaders_iterator_says_why(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, seed=None, batch_sampler=[[]])
    with pytest.raises(IndexError, match="list index out of range"):
        next(iter(theirs))
    with pytest.raises(IndexError, match="list index out of range"):
        next(iter(ours))
    loader = gpuload.DataLoader(ds, batch_size=8)
    batches = iter(loader)
    next(batches)
    loader.close()
    with pytest.raises(RuntimeError, match=r"stopped before its end .* the loader was closed"):
        next(batches)


def test_a_batch_begun_as_another_thread_closes_the_loader_stops_naming_the_close(shard: Path, monkeypatch) -> None:
    """The loop's thread has checked for a stop and gathers a batch when another thread's
    ``close()`` frees the token buffer: the gather says the loader was closed, and ``next()``
    raises the loader's stop with that as its cause (arranged with events, in order)."""
    loader = gpuload.DataLoader(TokenWindows(shard, 64), batch_size=8)
    batches = iter(loader)
    next(batches)
    source = loader._source
    gather, close = source._gather_here, source.close
    source_closed = threading.Event()

    def close_and_tell() -> None:
        close()
        source_closed.set()

    def gather_once_closed(*args: Any) -> Any:
        closer.start()  # close() frees the source first, then waits for this next() to return
        source_closed.wait()
        return gather(*args)

    monkeypatch.setattr(source, "close", close_and_tell)
    monkeypatch.setattr(source, "_gather_here", gather_once_closed)
    closer = threading.Thread(target=loader.close)
    with pytest.raises(RuntimeError, match=r"stopped before its end .* the loader was closed") as stopped:
        next(batches)
    closer.join()
    assert "this gpuload.DataLoader was closed" in str(stopped.value.__cause__)


def test_a_gather_whose_buffer_is_freed_after_its_check_says_the_loader_was_closed(shard: Path, monkeypatch) -> None:
    """Another thread's ``close()`` lands between the gather's check that the buffer is there
    and its read of it (arranged by closing inside ``_flat``): the gather names the close, not
    an AttributeError on the freed buffer."""
    loader = gpuload.DataLoader(TokenWindows(shard, 64), batch_size=8, device="cpu")
    next(iter(loader))  # the buffer is placed
    source = loader._source
    flat = source._flat

    def flat_then_closed(*args: Any) -> Any:
        found = flat(*args)
        source.close()
        return found

    monkeypatch.setattr(source, "_flat", flat_then_closed)
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        source._gather_here(torch.arange(8), False, None)
    source._place()  # again, for the fill into the staging (a host buffer's batch made ahead)
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        source._fill(torch.arange(8))
    loader.close()
