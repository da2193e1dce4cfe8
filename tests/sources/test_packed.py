"""The packed source: gpuload's batches of PackedTokens equal torch's DataLoader's (with
``collate_fn=PackedTokens.collate``), whatever the workers, after a resume, and split over ranks."""

from __future__ import annotations

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
from gpuload.datasets.packed_rows import packed_rows
from gpuload.datasets.packing import PackedTokens
from gpuload.datasets.tokens import TokenFileError, write_shard
from gpuload.device import MemoryInfo, host_memory
from gpuload.sources.packed import PackedSource
from gpuload.sources.samples import SampleSource

SEQ_LEN = 64


def _stream(documents: int = 200, seed: int = 0) -> np.ndarray:
    """Documents of log-normal lengths, each beginning with the end-of-text id 0, as uint16."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.0, 1.0, size=documents), 1, 400).astype(int)
    return np.concatenate([np.concatenate([[0], rng.integers(1, 60000, size=n)]) for n in lengths]).astype(np.uint16)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shard(tmp_path / "train_000.bin", _stream())


def _pair(ds: PackedTokens, seed: int | None = 1, **kwargs: Any) -> tuple[gpuload.DataLoader, TorchDataLoader]:
    gen = (lambda: torch.Generator().manual_seed(seed)) if seed is not None else (lambda: None)
    ours = gpuload.DataLoader(ds, generator=gen(), collate_fn=ds.collate, **kwargs)
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "prefetch_depth", "device")}
    return ours, TorchDataLoader(ds, generator=gen(), collate_fn=ds.collate, **torch_kwargs)


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
@pytest.mark.parametrize("long_documents", ["split", "truncate"])
def test_shuffled_batches_equal_torchs(shard: Path, strategy: str, long_documents: str) -> None:
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0, strategy=strategy, long_documents=long_documents, window=64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True)
    assert_same_epochs(ours, theirs, epochs=2)
    assert isinstance(ours._source, PackedSource) and ours.stats.path == "device-gather"
    packing = ours.stats.extra["packing"]
    assert packing["strategy"] == strategy and packing["rows"] == len(ds)
    assert packing["fill"] == ds.packing_stats()["fill"] > 0.9


@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_and_drop_last_with_prompts(drop_last: bool) -> None:
    rng = np.random.default_rng(4)
    documents = [rng.integers(0, 1000, size=n) for n in rng.integers(1, 150, size=120)]
    prompts = [int(rng.integers(0, len(d) + 1)) for d in documents]
    ds = PackedTokens(documents, SEQ_LEN, prompt_lengths=prompts, strategy="best_fit", pad_id=7)
    ours, theirs = _pair(ds, seed=None, batch_size=7, drop_last=drop_last)
    assert len(ours) == len(theirs)
    assert_same_epochs(ours, theirs, epochs=1)


def test_the_same_batches_whatever_the_workers(shard: Path) -> None:
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0, strategy="best_fit")
    expected = list(_pair(ds, batch_size=8, shuffle=True)[1])
    for workers in (0, 2):
        ours, theirs = _pair(ds, batch_size=8, shuffle=True, num_workers=workers)
        assert_same(list(ours), expected)
        assert_same(list(theirs), expected)


@pytest.mark.parametrize("prefetch_depth", [None, 2])
def test_resume_mid_epoch_gives_the_rest_with_the_same_packing(shard: Path, prefetch_depth: int | None) -> None:
    def loader() -> gpuload.DataLoader:
        ds = PackedTokens(shard, SEQ_LEN, eot_id=0, strategy="best_fit", window=50)  # built anew, as after a restart
        return gpuload.DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  collate_fn=ds.collate, prefetch_depth=prefetch_depth)

    assert_resumes_exactly(loader, batches=5)


def _rows(documents: list[np.ndarray], world: int) -> PackedTokens:
    """Greedy rows whose count is a multiple of ``world`` (DistributedSampler then repeats none)."""
    ds = PackedTokens(documents, SEQ_LEN)
    assert len(ds) % world == 0
    return ds


def _split_documents(rows: int) -> list[np.ndarray]:
    rng = np.random.default_rng(6)
    total = rows * SEQ_LEN
    cuts = np.sort(rng.choice(np.arange(1, total), size=rows * 3, replace=False))
    return [1 + np.arange(b, e) for b, e in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [total]]))]


def test_ranks_of_a_distributed_sampler_use_every_document_token_once() -> None:
    documents = _split_documents(48)
    ds = _rows(documents, 4)
    batches: list[dict[str, Any]] = []
    for rank in range(4):
        sampler = DistributedSampler(ds, num_replicas=4, rank=rank, shuffle=True, seed=3)
        theirs_sampler = DistributedSampler(ds, num_replicas=4, rank=rank, shuffle=True, seed=3)
        ours = gpuload.DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=ds.collate)
        theirs = TorchDataLoader(ds, batch_size=4, sampler=theirs_sampler, collate_fn=ds.collate)
        got = list(ours)
        assert_same(got, list(theirs))
        batches += got
    ids = torch.cat([batch["input_ids"].reshape(-1) for batch in batches])
    assert sorted(ids.tolist()) == sorted(np.concatenate(documents).tolist())  # each token once, no padding


def test_an_elastic_resume_continues_the_epochs_rows_at_another_world_size() -> None:
    documents = _split_documents(48)
    ds = _rows(documents, 4)

    def loader(world: int, rank: int, batch_size: int) -> gpuload.DataLoader:
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
        return gpuload.DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=ds.collate)

    before, states = [], []
    for rank in range(2):  # 2 ranks, 2 batches of 4 rows each: the epoch's first 16 rows
        first = loader(2, rank, 4)
        it = iter(first)
        before += [next(it) for _ in range(2)]
        states.append(first.state_dict())
    after = []
    for rank in range(4):  # taken up by 4 ranks with batches of 2: 8 rows a step, 2 steps done
        resumed = loader(4, rank, 2)
        resumed.load_state_dict(states[0])
        after += list(resumed)
    assert len(after) == 4 * (48 // 4 - 4) // 2
    ids = torch.cat([batch["input_ids"].reshape(-1) for batch in before + after])
    assert sorted(ids.tolist()) == sorted(np.concatenate(documents).tolist())


def test_another_collate_takes_torchs_path(shard: Path) -> None:
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0)
    ours = gpuload.DataLoader(ds, batch_size=4, collate_fn=default_collate)
    theirs = TorchDataLoader(ds, batch_size=4, collate_fn=default_collate)
    assert isinstance(ours._source, SampleSource)
    assert_same_epochs(ours, theirs, epochs=1)


def test_a_file_that_changes_between_epochs_fails_naming_it(shard: Path) -> None:
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0)
    loader = gpuload.DataLoader(ds, batch_size=4, collate_fn=ds.collate)
    list(loader)
    write_shard(shard, _stream(seed=1))
    with pytest.raises(TokenFileError, match=f"{shard}: the token file changed.*build a new PackedTokens"):
        list(loader)


def test_a_bad_sampler_index_fails_like_torch_and_a_closed_loader_says_so(shard: Path) -> None:
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0)
    loader = gpuload.DataLoader(ds, batch_size=None, collate_fn=ds.collate)  # unbatched: torch's path
    assert isinstance(loader._source, SampleSource)
    ours = gpuload.DataLoader(ds, batch_sampler=[[0, len(ds)]], collate_fn=ds.collate)
    with pytest.raises(IndexError, match=f"index {len(ds)} is out of bounds"):
        list(ours)
    ours = gpuload.DataLoader(ds, batch_size=4, collate_fn=ds.collate)
    it = iter(ours)
    next(it)
    ours.close()
    with pytest.raises(RuntimeError, match="was closed"):
        next(it)


@pytest.mark.parametrize(("strategy", "long_documents"), [("best_fit", "split"), ("greedy", "truncate")])
def test_the_device_tier_path_equals_torchs_and_moves_only_row_indices_and_edges(
        shard: Path, strategy: str, long_documents: str) -> None:
    """The store path (a CUDA device's) with the CPU standing in for the card: the same batches
    from the tier's packed rows, and per step only the batch's row indices and its ``cu_seqlens``
    counted as moved: nothing per token (the labels of truncated documents are in the rows)."""
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0, strategy=strategy, long_documents=long_documents)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True)
    source = ours._source
    assert isinstance(source, PackedSource)
    source.begin_epoch()  # places the rows in place (a CPU device)
    rows = packed_rows(ds)
    assert rows.nbytes == len(ds) * SEQ_LEN * (4 + 4 + 2)  # ids up to 60,000: int32 labels and ids, int16 positions
    settings = CacheSettings.resolve(cache="auto")
    plan = settings.array_plan(rows.nbytes // len(ds), len(ds), MemoryInfo(free=16 << 30, total=16 << 30),
                               host_memory(), device="a pretended card", shared=False)
    source.place_on_device(plan)
    assert source.store is not None and source.store.stats.device_samples == len(ds)
    batches = list(ours)
    assert_same(batches, list(theirs))
    segments = sum(len(batch["cu_seqlens"]) - 1 for batch in batches)
    assert ours.stats.extra["packing"]["index_bytes_h2d"] == 8 * len(ds) + 4 * (segments + len(ours))
    source.store.shrink(0)  # the device tier let go: the host rows serve the same batches
    assert source.store.stats.device_samples == 0
    assert_same_epochs(ours, theirs, epochs=1)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["auto", "off"])
def test_on_cuda_the_batches_equal_torchs(shard: Path, cache: str) -> None:
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0, strategy="best_fit")
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, device="cuda", cache=cache)
    for _ in range(2):
        for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
            assert all(t.is_cuda for k, t in ours_batch.items() if k != "max_seqlen")
            assert_same({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ours_batch.items()},
                        theirs_batch)
    assert ours.stats.path == ("device-gather" if cache == "auto" else "host-gather")
    if cache == "auto":  # the one fill of the packed rows; per step only row indices and cu_seqlens
        assert ours.stats.bytes_h2d == packed_rows(ds).nbytes


@pytest.mark.parametrize(("high", "dtype", "token_bytes"), [
    (30_000, np.uint16, 2 + 2 + 2),  # ids and labels (-100) fit int16
    (60_000, np.uint16, 4 + 4 + 2),  # GPT-2-sized ids: int32 labels and ids
    (1 << 40, np.int64, 8 + 8 + 2),
])
def test_rows_keep_each_field_at_the_width_its_values_need(high: int, dtype: type, token_bytes: int) -> None:
    """A row holds labels, ids and positions at their narrowest signed width (what the docs say it
    costs), and its batches equal torch's: three contiguous int64 tensors of their own."""
    rng = np.random.default_rng(3)
    documents = [np.concatenate([[0], rng.integers(1, high, size=n)]).astype(dtype) for n in rng.integers(1, 150, 60)]
    ds = PackedTokens(documents, SEQ_LEN, strategy="greedy", long_documents="truncate")
    ours, theirs = _pair(ds, batch_size=4, shuffle=True)
    assert_same_epochs(ours, theirs, epochs=1)
    assert packed_rows(ds).nbytes == len(ds) * SEQ_LEN * token_bytes
    batch = next(iter(ours))
    fields = [batch[name] for name in ("input_ids", "labels", "position_ids")]
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in fields)
    assert len({t.untyped_storage().data_ptr() for t in fields}) == 3


@pytest.mark.parametrize(("strategy", "long_documents"), [("greedy", "split"), ("best_fit", "truncate")])
def test_a_batchs_cu_seqlens_come_from_a_table_of_each_rows_segments(shard: Path, strategy: str,
                                                                    long_documents: str) -> None:
    """The host side of a batch: one int32 table row per packed row (its segment starts, -1 past
    its last, then its longest segment), from which any batch's ``cu_seqlens`` and ``max_seqlen``
    equal the plan's segments."""
    ds = PackedTokens(shard, SEQ_LEN, eot_id=0, strategy=strategy, long_documents=long_documents, window=64)
    rows = packed_rows(ds)
    widest = max(len(ds.plan.segments(np.array([row])).cu_seqlens) - 1 for row in range(len(ds)))
    assert rows.segments.dtype == np.int32 and rows.segments.shape == (len(ds), widest + 1)
    rng = np.random.default_rng(5)
    for count in (1, 3, 8, len(ds)):
        batch = rng.permutation(len(ds))[:count]
        edges, max_seqlen = rows.cu_seqlens(batch)
        expected = ds.plan.segments(batch)
        assert edges.dtype == np.int32 and np.array_equal(edges, expected.cu_seqlens)
        assert max_seqlen == expected.max_seqlen
