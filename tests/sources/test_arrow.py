"""Arrow tables and Hugging Face datasets served column by column: every batch equals torch's
DataLoader over the same dataset (same sampler and generator, default collate), dtypes included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from equivalence import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader as TorchDataLoader

import gpuload

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

from gpuload.cache.chunked_rows import ChunkedRows  # noqa: E402
from gpuload.datasets import ArrowTable, Parquet  # noqa: E402
from gpuload.sources.arrow import ArrowSource  # noqa: E402


def columns(n: int = 12) -> dict[str, Any]:
    return {
        "label": pa.array(range(n), pa.int32()),
        "score": [i / 4 for i in range(n)],
        "flag": [i % 3 == 0 for i in range(n)],
        "vector": pa.array([[i, -i, 2 * i] for i in range(n)], pa.list_(pa.float32(), 3)),
        "tokens": [[i, i + 1] for i in range(n)],
        "text": [f"row {i}" for i in range(n)],
        "meta": [{"id": i, "name": str(i)} for i in range(n)],
    }


def hf_dataset(n: int = 12, **extra: Any) -> Any:
    return datasets.Dataset.from_dict({**columns(n), **extra})


GPULOAD_ONLY = ("cache", "prefetch_depth")


def loaders(dataset: Any, seed: int = 0, **kwargs: Any) -> tuple[gpuload.DataLoader, TorchDataLoader]:
    ours = gpuload.DataLoader(dataset, generator=torch.Generator().manual_seed(seed), device="cpu", **kwargs)
    kwargs = {key: value for key, value in kwargs.items() if key not in GPULOAD_ONLY}
    theirs = TorchDataLoader(dataset, generator=torch.Generator().manual_seed(seed), **kwargs)
    return ours, theirs


def assert_same_batches(ours: Any, theirs: Any, epochs: int = 2) -> None:
    """Every batch equal, or both loaders failing at the same batch."""
    for epoch in range(epochs):
        our_batches, their_batches = iter(ours), iter(theirs)
        for number in range(len(theirs)):
            try:
                expected = next(their_batches)
            except Exception:
                with pytest.raises(Exception):  # noqa: B017 - torch's collate raises TypeError or RuntimeError
                    next(our_batches)
                return
            assert_same(next(our_batches), expected, f"epoch {epoch} batch {number}")
        assert next(our_batches, None) is None and next(their_batches, None) is None  # both samplers run out


def mapped(dataset: Any, mapping: str) -> Any:
    if mapping == "shuffle":
        return dataset.shuffle(seed=3)
    if mapping == "select":
        return dataset.select([5, 2, 2, 9, 0, 7, 11])
    if mapping == "filter":
        return dataset.filter(lambda row: row["label"] % 4 != 1)
    return dataset


@pytest.mark.parametrize("mapping", ["none", "shuffle", "select", "filter"])
@pytest.mark.parametrize("format", [None, "numpy", "torch"])
def test_a_datasets_dataset_is_served_by_columns_in_each_format_and_index_mapping(format, mapping) -> None:
    dataset = mapped(hf_dataset(), mapping).with_format(format)
    ours, theirs = loaders(dataset, batch_size=3, shuffle=True)
    assert_same_batches(ours, theirs)
    assert isinstance(ours._source, ArrowSource) and ours.stats.path == "device-gather"


@pytest.mark.parametrize("kwargs", [dict(cache="off"), dict(prefetch_depth=2), dict(prefetch_depth=0),
                                    dict(drop_last=True), dict(sampler=[4, 0, 7, 7, 11])])
def test_every_way_of_serving_the_arrays_gives_torch_s_batches(kwargs) -> None:
    dataset = hf_dataset().with_format("torch")
    ours, theirs = loaders(dataset, batch_size=4, shuffle="sampler" not in kwargs, **kwargs)
    assert_same_batches(ours, theirs)
    assert isinstance(ours._source, ArrowSource)


def test_an_arrow_table_a_save_to_disk_folder_and_parquet_files_equal_torch(tmp_path: Path) -> None:
    table = hf_dataset(20).data.table
    hf_dataset(20).save_to_disk(tmp_path / "saved")
    pq.write_table(table.slice(0, 7), tmp_path / "a.parquet")
    pq.write_table(table.slice(7), tmp_path / "b.parquet")
    for dataset in (ArrowTable(table), ArrowTable(tmp_path / "saved"), Parquet(str(tmp_path / "*.parquet")),
                    datasets.load_from_disk(str(tmp_path / "saved")).with_format("torch")):
        ours, theirs = loaders(dataset, batch_size=6, shuffle=True)
        assert_same_batches(ours, theirs)
        assert isinstance(ours._source, ArrowSource), dataset


def test_a_file_s_fixed_width_columns_are_views_of_the_mapped_file(tmp_path: Path) -> None:
    hf_dataset(50).save_to_disk(tmp_path / "saved")
    dataset = ArrowTable(tmp_path / "saved")
    loader = gpuload.DataLoader(dataset, batch_size=8, device="cpu")
    next(iter(loader))
    assert isinstance(loader._source, ArrowSource)
    label = loader._source.columns.columns[0]
    buffer = dataset.table.column("label").chunks[0].buffers()[1]
    assert label.data_ptr() == buffer.address  # no copy: the batch gathers from the file's pages


@pytest.mark.parametrize("cache", ["device", "off"])
def test_several_chunks_are_served_from_the_chunks_where_they_lie(cache: str) -> None:
    table = pa.concat_tables([hf_dataset(5).data.table, hf_dataset(7).data.table])
    assert table.column("vector").num_chunks == 2
    ours, theirs = loaders(ArrowTable(table), batch_size=5, shuffle=True, cache=cache)
    assert_same_batches(ours, theirs)
    vector = ours._source.columns.columns[3]  # label, score, flag, vector
    assert isinstance(vector, ChunkedRows) and vector.shape == (12, 3)
    assert vector.chunks[1].data_ptr() == table.column("vector").chunks[1].values.buffers()[1].address  # no copy


@pytest.mark.parametrize("mapping", ["shuffle", "select", "filter"])
def test_several_chunks_under_an_index_mapping_are_gathered_in_sample_order(mapping: str) -> None:
    parts = [hf_dataset(n, small=pa.array(range(n), pa.uint16())).data.table for n in (5, 4, 3)]
    dataset = mapped(datasets.Dataset(pa.concat_tables(parts)), mapping).with_format("torch")
    assert dataset.data.table.column("vector").num_chunks == 3
    ours, theirs = loaders(dataset, batch_size=3, shuffle=True)
    assert_same_batches(ours, theirs)
    assert isinstance(ours._source, ArrowSource)


_PEAK_SCRIPT = """
import sys, datasets, numpy as np, pyarrow as pa, torch
from gpuload.cache import BudgetLedger, TieredArrayStore
from gpuload.cache.plan import CachePlan, TierPlan
from gpuload.sources.arrow import table_view
from gpuload.sources.table_columns import table_columns

datasets.disable_progress_bars()
rows, width, chunks = 1 << 16, 256, 32  # a 64 MiB float32 column in 32 record batches (2 MiB each)
values = pa.array(np.arange(rows * width, dtype=np.float32))
table = pa.Table.from_batches(pa.table({"x": pa.FixedSizeListArray.from_arrays(values, width),
                                        "y": pa.array(np.arange(rows))}).to_batches(max_chunksize=rows // chunks))
dataset = datasets.Dataset(table)
if sys.argv[1] == "shuffled":
    dataset = dataset.shuffle(seed=0)
dataset = dataset.with_format("torch")
del values
view = table_view(dataset)
small = dataset.select(range(100))
table_columns(small, table_view(small))  # the modules and caches it uses on first call, loaded

def kib(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

open("/proc/self/clear_refs", "w").write("5")  # VmHWM, the peak resident set, starts again from now
before = kib("VmRSS")
columns = table_columns(dataset, view).arrays.columns
# Placed as on a GPU whose device tier holds every row ("meta": a device with no memory of its own,
# so the host's resident set shows only what placing took on the host).
bps = sum(column[0].numel() * column.element_size() for column in columns)
tier = TierPlan("device", 0, rows, bps)
plan = CachePlan(mode="device", target="meta", bytes_per_sample=bps, num_samples=rows, tiers=(tier,),
                 budget=tier.bytes, reserve=0, host_reserve=0, device_free=0, device_total=None, host_free=0,
                 host_total=None)
store = TieredArrayStore(columns, plan, "meta", ledger=BudgetLedger())
assert store.stats.device_samples == rows
growth = (kib("VmHWM") - before) * 1024
expected = dataset[[0, 1, rows - 1]]["x"]
assert torch.equal(columns[0].index_select(0, torch.tensor([0, 1, rows - 1])), expected), "rows out of order"
print(growth, rows * width * 4, rows // chunks * width * 4)
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["table", "shuffled"])
def test_placing_a_chunked_mapped_column_on_a_device_takes_no_host_copy_of_it(order: str) -> None:
    """A save_to_disk-like table (many record batches), in table order or under a shuffle, placed
    in a device tier: its rows are copied out of the chunks a piece at a time, so host memory grows
    by about a chunk, not the column (it used to be joined into one host tensor first: 64 MiB more)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure the peak resident memory")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(gpuload.__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, order], capture_output=True, text=True, env=env,
                         check=True)
    growth, column, chunk = map(int, out.stdout.split())
    # A chunk's piece (2 MiB), the store's maps and the mapping's lookups (17 bytes a sample) take
    # about 4 MiB; the rest is the allocator's and datasets' own (measured 0-12 MiB).
    assert chunk + 17 * (1 << 16) < column // 16
    assert growth <= column // 4, (growth, column)


@pytest.mark.parametrize("format", [None, "numpy", "torch"])
def test_a_null_with_no_tensor_form_fails_naming_its_column(format) -> None:
    dataset = hf_dataset(6, maybe=[True, True, None, True, True, True]).with_format(format)
    ours, theirs = loaders(dataset, batch_size=3)
    with pytest.raises((TypeError, RuntimeError)):
        list(theirs)
    with pytest.raises(TypeError, match="column 'maybe' is null at sample 2: the dataset gives None there"):
        list(ours)
    assert isinstance(ours._source, ArrowSource)


@pytest.mark.parametrize("format", ["numpy", "torch"])
def test_null_numbers_are_nan_where_datasets_gives_nan(format) -> None:
    extra = {"count": pa.array([1, None, 3, 4, 5, 6], pa.int16()),
             "weight": pa.array([0.5, 1.5, None, 2.5, 3.5, 4.5], pa.float64())}
    dataset = hf_dataset(6, **extra).with_format(format)
    ours, theirs = loaders(dataset, batch_size=2)
    assert_same_batches(ours, theirs)  # the first batch's counts become floats with NaN; the others stay ints
    assert isinstance(ours._source, ArrowSource)


def test_lists_of_different_lengths_in_one_batch_fail_as_torch_s_collate_does() -> None:
    dataset = hf_dataset(6, ragged=[[1], [1], [2, 3], [4, 5], [6, 7], [8]]).with_format("torch")
    ours, theirs = loaders(dataset, batch_size=2)
    assert_same(next(iter(ours)), next(iter(theirs)))
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(theirs)
    with pytest.raises(RuntimeError, match="column 'ragged' holds lists of 3 and 1 values in one batch|"
                                           "column 'ragged' holds lists of 2 and 1 values in one batch"):
        list(ours)


def test_a_format_changed_in_place_is_refused_at_the_next_epoch() -> None:
    dataset = hf_dataset().with_format("torch")
    loader = gpuload.DataLoader(dataset, batch_size=4, device="cpu")
    list(loader)
    dataset.set_format("numpy")
    with pytest.raises(ValueError, match="changed since the DataLoader was built"):
        list(loader)


def test_tables_gpuload_cannot_reproduce_stay_on_torch_s_path() -> None:
    only_text = datasets.Dataset.from_dict({"text": ["a", "b", "c"]})
    custom = hf_dataset().with_transform(lambda batch: batch)
    kwargs = hf_dataset().with_format("torch", columns=["label"], output_all_columns=True)
    for dataset in (only_text, custom, kwargs):
        ours, theirs = loaders(dataset, batch_size=2, shuffle=True)
        assert_same_batches(ours, theirs, epochs=1)
        assert ours.stats.path == "torch"


# Column types and the values of row i (None where the row is null).
NUMBERS = {
    "int8": (pa.int8(), lambda i: i - 3), "int16": (pa.int16(), lambda i: 300 * i), "int32": (pa.int32(), lambda i: i),
    "int64": (pa.int64(), lambda i: 2**40 + i), "uint8": (pa.uint8(), lambda i: 250 - i),
    "float16": (pa.float16(), lambda i: np.float16(i / 8)), "float32": (pa.float32(), lambda i: i / 3),
    "float64": (pa.float64(), lambda i: i / 7), "bool": (pa.bool_(), lambda i: i % 2 == 1),
}


def column(kind: str, rows: int, nulls: list[bool]) -> Any:
    if kind in NUMBERS:
        arrow_type, value = NUMBERS[kind]
        values = [value(i) for i in range(rows)]
    elif kind == "fixed_list":
        arrow_type, values = pa.list_(pa.float32(), 2), [[i / 2, -i] for i in range(rows)]
    elif kind == "fixed_grid":
        arrow_type, values = pa.list_(pa.list_(pa.int16(), 2), 2), [[[i, 1], [2, -i]] for i in range(rows)]
    elif kind == "tokens":
        arrow_type, values = pa.list_(pa.int32()), [[i, i * 2, 7] for i in range(rows)]
    elif kind == "text":
        arrow_type, values = pa.string(), [f"t{i}" for i in range(rows)]
    else:
        arrow_type = pa.struct([("id", pa.int64()), ("name", pa.string())])
        values = [{"id": i, "name": f"n{i}"} for i in range(rows)]
    return pa.array([None if null else value for value, null in zip(values, nulls)], arrow_type)


KINDS = [*NUMBERS, "fixed_list", "fixed_grid", "tokens", "text", "struct"]


@pytest.mark.slow  # about 10 s on 2 idle cores
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), rows=st.integers(1, 14), format=st.sampled_from([None, "numpy", "torch"]),
       mapping=st.sampled_from(["none", "shuffle", "select"]), batch_size=st.integers(1, 5),
       shuffle=st.booleans(), seed=st.integers(0, 2**31))
def test_random_schemas_equal_torch(data, rows, format, mapping, batch_size, shuffle, seed) -> None:
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5))
    table, with_nulls = {}, False
    for number, kind in enumerate(kinds):
        nulls = data.draw(st.lists(st.booleans() if data.draw(st.booleans()) else st.just(False),
                                   min_size=rows, max_size=rows))
        table[f"{kind}_{number}"] = column(kind, rows, nulls)
        with_nulls |= any(nulls)
    dataset = datasets.Dataset.from_dict(table)
    if mapping == "shuffle":
        dataset = dataset.shuffle(seed=seed)
    elif mapping == "select":
        dataset = dataset.select(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=10)))
    for served in (dataset.with_format(format), ArrowTable(dataset.flatten_indices().data.table)):
        ours, theirs = loaders(served, seed=seed, batch_size=batch_size, shuffle=shuffle)
        assert_same_batches(ours, theirs, epochs=1)
        if not with_nulls and not set(kinds) <= {"tokens", "text"}:  # a fixed-width column to place
            assert isinstance(ours._source, ArrowSource)


def test_a_state_saved_mid_epoch_resumes_exactly() -> None:
    dataset = hf_dataset(20).shuffle(seed=2).with_format("torch")

    def make() -> gpuload.DataLoader:
        return gpuload.DataLoader(dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7),
                                  device="cpu")

    whole = [batch for loader in [make()] for _ in range(2) for batch in loader]
    first = make()
    before = []
    for number, batch in enumerate(first):
        before.append(batch)
        if number == 2:
            break
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    after = list(second) + list(second)
    assert isinstance(second._source, ArrowSource)
    assert len(before) + len(after) == len(whole)
    for number, (ours, theirs) in enumerate(zip(before + after, whole)):
        assert_same(ours, theirs, f"batch {number}")


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [{}, dict(cache="off"), dict(prefetch_depth=0), dict(cache_size="8KiB")])
def test_on_cuda_every_tensor_is_on_the_device_and_equals_torch_s(kwargs) -> None:
    """The device tier, the pinned staging of host rows (``cache="off"``, or a device budget of
    about a third of the columns), and batches made in the loop's thread (``prefetch_depth=0``);
    nulls made NaN on the device."""
    extra = {"count": pa.array([None if i % 7 == 3 else i for i in range(300)], pa.int16())}
    dataset = hf_dataset(300, **extra).shuffle(seed=4).with_format("torch")
    ours = gpuload.DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1),
                              device="cuda", **kwargs)
    theirs = TorchDataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for number, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            leaves = [leaf for leaf in torch.utils._pytree.tree_flatten(a)[0] if isinstance(leaf, torch.Tensor)]
            assert all(leaf.device.type == "cuda" for leaf in leaves)
            assert_same(a, b, f"batch {number}")
    assert isinstance(ours._source, ArrowSource)


def test_a_leading_batch_datasets_cannot_format_leaves_the_check_to_each_batch() -> None:
    """datasets' numpy format raises AttributeError on a batch holding a null token list (found
    by the schema test): the loader is still built, and fails at that batch as torch's does."""
    dataset = datasets.Dataset.from_dict({"number": pa.array([1, 2], pa.int8()),
                                          "ragged": pa.array([None, [2, 3]], pa.list_(pa.int32()))})
    ours, theirs = loaders(dataset.with_format("numpy"), batch_size=2)
    assert isinstance(ours._source, ArrowSource)
    with pytest.raises(AttributeError):
        list(theirs)
    with pytest.raises(TypeError, match="column 'ragged' is null at sample 0"):
        list(ours)
