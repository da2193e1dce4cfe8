"""A host array held in chunks (an Arrow column's), read where it lies: every gather, slice and
copy equals the same on the array joined into one tensor, and the array tiers fill from it."""

from __future__ import annotations

import pytest
import torch
from store_cases import bytes_per_sample, planned

import gpuload.cache.chunked_rows as chunked_rows
from gpuload.cache import TieredArrayStore
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.chunked_rows import ChunkedRows, copy_rows, gatherable, take_rows

N = 240


def whole(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(N * 6).reshape(N, 2, 3) % 251).to(dtype)


def chunked(data: torch.Tensor, sizes: tuple[int, ...] = (100, 1, 0, 39, 100), rows: torch.Tensor | None = None
            ) -> ChunkedRows:
    return ChunkedRows(list(data.split(list(sizes))), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint16, torch.bool])
@pytest.mark.parametrize("mapped", [False, True])
def test_gathers_slices_and_copies_equal_the_joined_array(dtype: torch.dtype, mapped: bool) -> None:
    data = whole(dtype)
    rows = torch.randperm(N, generator=torch.Generator().manual_seed(1)) if mapped else None
    expected = data if rows is None else data[rows]
    source = chunked(data, rows=rows)
    assert source.shape == expected.shape and source.dtype == dtype and len(source) == N
    index = torch.randint(0, N, (64,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(source.index_select(0, index), expected[index])
    assert torch.equal(source.index_select(0, torch.tensor([5, 6, 7])), expected[5:8])  # one chunk
    assert torch.equal(source[-1], expected[-1]) and torch.equal(source[0], expected[0])
    part = source[90:150]
    assert isinstance(part, ChunkedRows) and part.shape == (60, 2, 3)
    assert torch.equal(part.index_select(0, torch.tensor([0, 59, 10])), expected[90:150][[0, 59, 10]])
    assert torch.equal(part.clone(), expected[90:150]) and torch.equal(source.to("cpu"), expected)
    out = torch.empty(64, 2, 3, dtype=dtype)
    assert torch.equal(take_rows(source, index, out), expected[index]) and torch.equal(out, expected[index])
    if dtype == torch.uint16:
        signed = gatherable(source)
        assert signed.dtype == torch.int16
        assert torch.equal(signed.index_select(0, index), expected[index].view(torch.int16))


@pytest.mark.parametrize("mapped", [False, True])
def test_a_copy_to_a_device_takes_a_piece_at_a_time(mapped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a mapping each piece is gathered on the host (at most PIECE_BYTES); in table order
    each chunk's rows go straight in: no host tensor of the whole column either way."""
    data = whole()
    rows = torch.randperm(N) if mapped else None
    monkeypatch.setattr(chunked_rows, "PIECE_BYTES", 24 * 50)  # 50 rows of 24 bytes
    source = chunked(data, rows=rows)
    largest: list[int] = []
    index_select = ChunkedRows.index_select

    def recorded(self: ChunkedRows, dim: int, index: torch.Tensor) -> torch.Tensor:
        largest.append(index.numel())
        return index_select(self, dim, index)

    monkeypatch.setattr(ChunkedRows, "index_select", recorded)
    on_meta = source.to("meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (N, 2, 3)
    assert torch.equal(copy_rows(torch.empty(N, 2, 3), source), data if rows is None else data[rows])
    assert (max(largest) == 50) if mapped else largest == []


def test_rows_out_of_range_and_other_keys_fail_clearly() -> None:
    source = chunked(whole())
    with pytest.raises(IndexError, match="reach past the 240 rows"):
        source.index_select(0, torch.tensor([3, 240]))
    with pytest.raises(IndexError, match="row 240 is out of range"):
        source[240]
    with pytest.raises(TypeError, match="a row or a slice of rows"):
        source[::2]
    with pytest.raises(ValueError, match="at least one chunk"):
        ChunkedRows([])


@pytest.mark.parametrize("mapped", [False, True])
def test_a_tiered_store_over_chunks_serves_what_it_serves_over_the_joined_arrays(mapped: bool) -> None:
    """Device, host and source tiers (the last gathering from the chunks) give the joined arrays' rows."""
    rows = torch.randperm(N) if mapped else None
    data = [whole(), whole(torch.uint16)[:, 0, 0].contiguous()]
    expected = data if rows is None else [column[rows] for column in data]
    sources = [chunked(column, rows=rows) for column in data]
    plan = planned(expected, [("device", 60), ("host", 70)])
    store = TieredArrayStore(sources, plan, "cpu", ledger=BudgetLedger(), stage_host_rows=True)
    assert bytes_per_sample(expected) == plan.bytes_per_sample
    assert [counts.samples for counts in store.stats.tiers.values()] == [60, 70, N - 130]
    index = torch.randint(0, N, (100,), generator=torch.Generator().manual_seed(4))
    request = store.request(index)
    staged = [torch.empty(shape, dtype=dtype) for shape, dtype in request.staged_shapes]
    request.fill_staged(staged)
    for got, want in zip(request.assemble(request.on_device, staged), expected):
        assert torch.equal(got, want[index])
    store.close()
