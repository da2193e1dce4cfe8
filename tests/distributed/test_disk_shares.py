"""``cache_dir``'s disk tier under a split (``cache_scope="node"``), 2 gloo processes on the
CPU: the ranks fill one entry between them, each writing only its own share's rows; a later
job, split or not, reads its samples and images from that entry and nothing from the dataset;
the batches are those of a run without ``cache_dir``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuload.cache.probe import probed_indices

sys.path.insert(0, str(Path(__file__).parent))
import disk_shares_job
import ranks_job
import samples_job
from images_job import NUM_IMAGES


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return ranks_job.findings(disk_shares_job.run, 2, tmp_path_factory.mktemp("disk_shares"), None)


def test_the_ranks_of_a_split_fill_one_entry_each_with_its_own_share_of_samples(ranks):
    reads = [set(found["samples_fill"]["read"]) for found in ranks]
    assert reads[0] and reads[1] and not reads[0] & reads[1]  # each rank read its own rows only
    probed = set(probed_indices(samples_job.NUM_SAMPLES))
    assert reads[0] | reads[1] | probed == set(range(samples_job.NUM_SAMPLES))
    for found in ranks:
        fill = found["samples_fill"]
        assert fill["equal"] and fill["path"] == "sharded-node" and fill["warnings"] == []
    written = [found["samples_fill"]["disk"]["rows_written"] for found in ranks]
    assert all(written) and sum(written) == samples_job.NUM_SAMPLES  # one copy: no row written twice


def test_a_later_job_of_either_scope_reads_no_sample_from_the_dataset(ranks):
    for found in ranks:
        for key in ("samples_again", "samples_rank"):
            run = found[key]
            assert run["equal"] and run["warnings"] == [], key
            assert run["read"] == [], key
            assert run["disk"]["published_rows"] == samples_job.NUM_SAMPLES, key
        assert found["samples_again"]["path"] == "sharded-node"
        assert found["samples_again"]["disk"]["rows_written"] == 0
    assert ranks[0]["samples_without"]["disk"] is None and ranks[0]["samples_without"]["read"]


def test_image_shares_fill_one_entry_and_a_later_job_reads_no_file(ranks):
    for found in ranks:
        images = found["images"]
        assert all(images["same_as_without"]) and len(images["same_as_without"]) == 8
        assert images["filled_path"] == images["again_path"] == "sharded-node"
        assert images["again_reads"] == 0 and images["filled_reads"] == images["without_reads"]
        assert images["without_disk"] is None
        assert images["again_disk"]["published_rows"] == NUM_IMAGES
        assert images["filled_warnings"] == images["again_warnings"] == []
    assert sum(found["images"]["filled_reads"] for found in ranks) == NUM_IMAGES  # one copy, no file twice
    for found in ranks:  # torchvision's deprecation of its decoders, which pyproject.toml ignores, is no failure
        by_torchvision = found["images_by_torchvision"]
        assert by_torchvision["path"] == "sharded-node" and by_torchvision["warnings"] == []
    assert sum(found["images_by_torchvision"]["reads"] for found in ranks) == NUM_IMAGES


def test_a_damaged_block_is_named_and_only_its_rows_are_read_again_then_refilled(ranks):
    damaged = ranks[0]["samples_damaged"]
    warned = [found["samples_after_damage"]["warnings"] for found in ranks]
    assert any(damaged in warning for warnings in warned for warning in warnings)
    again = set().union(*(found["samples_after_damage"]["read"] for found in ranks))
    # The block's ~20 rows, in the chunks of 8 of a share that overlap it: one run of rows (a
    # probed row in it was read by the probe: not counted as read).
    run = again | {i for i in probed_indices(samples_job.NUM_SAMPLES) if min(again) < i < max(again)}
    assert 20 <= len(run) < 40 and run == set(range(min(again), max(again) + 1))
    for found in ranks:
        assert found["samples_after_damage"]["equal"] and found["samples_refilled"]["equal"]
        assert found["samples_refilled"]["read"] == [] and found["samples_refilled"]["warnings"] == []
    image_reads = [found["images"]["after_damage_reads"] for found in ranks]
    assert 0 < sum(image_reads) < NUM_IMAGES // 2
    assert any(ranks[0]["images_damaged"] in warning for found in ranks
               for warning in found["images"]["after_damage_warnings"])
    assert all(found["images"]["refilled_reads"] == 0 for found in ranks)
