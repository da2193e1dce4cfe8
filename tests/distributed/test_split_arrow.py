"""Tables split over 2 gloo processes (``cache_scope="node"``/``"world"``): each rank holds a share
of the fixed-width columns and gets exactly torch's batches; a table's image column follows the
split: each rank decodes only its share of the images (ArrowTable, Parquet, datasets.Dataset),
the exchange brings the rest, and with ``cache_dir`` the ranks fill one disk entry between them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuload.distributed.partition import Partition

pytest.importorskip("datasets")
sys.path.insert(0, str(Path(__file__).parent))
import arrow_job  # noqa: E402
import ranks_job  # noqa: E402

KINDS = ("arrow", "parquet", "datasets")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return ranks_job.findings(arrow_job.run, 2, tmp_path_factory.mktemp("arrow"))


def share(rank: int) -> set[int]:
    """Rank ``rank``'s rows of the image tables: a contiguous half (the partition of arrays)."""
    bounds = Partition(arrow_job.NUM_IMAGES, 2, 2).rows_of(rank)
    return set(range(*bounds))


@pytest.mark.slow  # two processes import torch and datasets (about 20 s at load 4 on 2 cores)
def test_each_rank_gets_torch_s_batches_and_holds_a_share_of_the_columns(ranks: list[dict]) -> None:
    for rank, found in enumerate(ranks):
        for scope, result in found["columns"].items():
            assert result["equal"], f"rank {rank}, {scope}: batches differ from torch's"
            assert result["batches"] == 2 * 7
        assert found["columns"]["world"]["path"] == "sharded-world"
        assert found["columns"]["rank"]["shard_bytes"] is None
    held = sum(found["columns"]["world"]["shard_bytes"] for found in ranks)
    assert held == arrow_job.whole_bytes()


def test_the_ranks_shares_of_the_images_are_every_row_once() -> None:
    assert share(0) | share(1) == set(range(arrow_job.NUM_IMAGES)) and not share(0) & share(1)
    assert share(0) and share(1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_an_image_column_split_over_ranks_gives_torch_s_batches_each_rank_decoding_its_share(
        ranks: list[dict], kind: str) -> None:
    for rank, found in enumerate(ranks):
        result = found["images"][kind]
        assert result["equal"], f"rank {rank}, {kind}: batches differ from torch's"
        assert result["path"] == "sharded-node" and result["warnings"] == []
        assert sorted(result["decoded"]) == sorted(share(rank)), f"rank {rank}, {kind}: decoded another rank's rows"
        assert result["cache"]["rows"] == [min(share(rank)), max(share(rank)) + 1]
        assert result["cache"]["entries"] == len(share(rank))
        assert result["exchange"]["bytes_received"] > 0  # the other rank's images came over the exchange


@pytest.mark.slow
def test_transforms_apply_to_exchanged_images_as_on_the_unsplit_path(ranks: list[dict]) -> None:
    for rank, found in enumerate(ranks):
        result = found["images"]["transforms"]
        assert result["equal"], f"rank {rank}: transformed batches differ from the unsplit path's"
        assert result["path"] == "sharded-world" and result["unsplit_path"] != "sharded-world"
        assert sorted(result["decoded"]) == sorted(share(rank))


@pytest.mark.slow
def test_two_ranks_fill_one_disk_entry_of_an_image_column_and_a_later_job_decodes_nothing(ranks: list[dict]) -> None:
    for rank, found in enumerate(ranks):
        disk = found["images"]["disk"]
        assert disk["equal"]
        filled, again = disk["filled"], disk["again"]
        assert filled["warnings"] == again["warnings"] == []
        assert sorted(filled["decoded"]) == sorted(share(rank))
        assert filled["cache"]["disk"]["rows_written"] == len(share(rank))  # its own share only
        assert again["decoded"] == [] and again["cache"]["disk"]["rows_written"] == 0
        assert again["cache"]["disk"]["published_rows"] == arrow_job.NUM_IMAGES


@pytest.mark.slow
def test_a_bad_image_in_a_split_table_stops_every_rank_at_its_batch_naming_it(ranks: list[dict]) -> None:
    found = [found["images"]["bad"] for found in ranks]
    assert all(bad["path"] == "sharded-node" for bad in found)
    assert found[0]["received"] == found[1]["received"] < 5  # the same batch on both ranks
    kinds = {bad["error"][0] for bad in found}
    assert "ImageDecodeError" in kinds and kinds <= {"ImageDecodeError", "ExchangeError"}
    assert all(f"column 'image', row {arrow_job.BAD}" in bad["error"][1] for bad in found)


@pytest.mark.slow
def test_image_shares_that_do_not_fit_leave_each_rank_its_own_image_cache_and_the_arrays_split(
        ranks: list[dict]) -> None:
    for rank, found in enumerate(ranks):
        result = found["images"]["too_big"]
        assert result["equal"] and result["path"] == "sharded-node"
        assert any("does not fit its room" in warning for warning in result["warnings"])
        assert (result["cache"] or {}).get("scope") is None  # no share: its own image cache (none in 4 KiB)
        assert set(result["decoded"]) - share(rank)  # it decoded rows of the other rank's share itself


@pytest.mark.slow
def test_a_split_image_table_resumes_mid_epoch_as_torch_s_epoch(ranks: list[dict]) -> None:
    for found in ranks:
        resumed = found["images"]["resume"]
        assert resumed["equal"] and resumed["path"] == "sharded-world" and resumed["batches"] == 5
