"""The decoded image cache split over 2 and 4 gloo processes on the CPU: each rank decodes and
holds about 1/N of the images, gets bit for bit the batches of a per-rank decoded cache in
torch's DistributedSampler order, handles a corrupt file as the unsplit path does on every
rank, falls back together when a share does not fit, and fails clearly (never hangs) when a
rank stops early."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import fake_peers
import images_job
import ranks_job


@pytest.fixture(scope="module", params=["two", pytest.param("four", marks=pytest.mark.slow)])
def job(request, tmp_path_factory):
    """Every rank's findings, the files, the world size and the node size."""
    world, local = ranks_job.JOBS[request.param]
    folder = tmp_path_factory.mktemp(f"images{world}")
    files = images_job.write_images(folder)
    (folder / "files.json").write_text(json.dumps(files))
    return ranks_job.findings(images_job.run, world, folder, local), files, world, local or world


def test_every_rank_gets_the_per_rank_caches_batches_in_torchs_order(job):
    ranks, _, _, _ = job
    for rank, found in enumerate(ranks):
        for key, result in [*found["compare"].items(), ("ahead0", found["ahead0"])]:
            assert result["equal"], f"rank {rank}, {key}: batches differ from cache_scope='rank'"
            assert result["in_order"], f"rank {rank}, {key}: not torch's DistributedSampler order"
            assert result["warnings"] == [], (rank, key)


def test_each_rank_holds_its_share_and_exchanges_the_rest(job):
    ranks, files, world, node = job
    total = files["total_bytes"]
    for scope, group in (("node", node), ("world", world)):
        held = 0
        for found in ranks:
            result = found["compare"][scope]
            assert result["path"] == f"sharded-{scope}"
            assert result["cache"]["mode"] == "decoded" and result["cache"]["scope"] == scope
            share = result["cache"]["bytes"]
            assert 0.5 * total / group < share < 1.5 * total / group, (scope, share, total)
            exchange = result["exchange"]
            assert exchange["ranks_per_copy"] == group and exchange["shard_bytes"] == share
            assert len(exchange["bytes_received_per_epoch"]) == 3
            assert all(b > 0 for b in exchange["bytes_received_per_epoch"]), scope
            assert len(exchange["loop_wait_s_per_epoch"]) == 3 and exchange["ahead"]
            held += share
        assert held == total * world // group  # one whole copy per group of ranks


def test_warm_decodes_the_share_before_the_first_epoch(job):
    for found in job[0]:
        seen = found["warm"]
        assert seen["equal"] and seen["in_order"] and seen["path"] == "sharded-world"
        assert seen["warmed"]["bytes"] == seen["cache"]["bytes"] > 0 and seen["warmed"]["read_s"] > 0


def test_in_the_loops_thread_the_exchange_does_not_run_ahead(job):
    for found in job[0]:
        assert found["ahead0"]["exchange"]["ahead"] is False


def test_a_corrupt_or_missing_file_is_skipped_as_on_the_unsplit_path(job):
    ranks, _, _, _ = job
    for rank, found in enumerate(ranks):
        seen = found["skip"]
        assert seen["equal"] and seen["in_order"] and seen["error"] is None, rank
        assert seen["skipped"] == seen["reference_skipped"], rank
        assert seen["skipped_files"] == seen["reference_skipped_files"], rank  # named, same reasons
        assert seen["cache"]["bad_files"] == 2
    assert sum(found["skip"]["skipped"] for found in ranks) == 4  # once per epoch, on the rank reading it
    named = {entry[1].rsplit("/", 1)[-1] for found in ranks for entry in found["skip"]["skipped_files"] or []}
    assert named == {"broken.jpg", "missing.jpg"}


@pytest.mark.parametrize(("key", "file"), [("raise", "broken.jpg"), ("raise_missing", "missing.jpg")])
def test_a_bad_file_with_on_error_raise_stops_every_rank_at_that_batch(job, key, file):
    ranks, _, _, _ = job
    holders = [rank for rank, found in enumerate(ranks) if found[key]["reference_error"]]
    assert len(holders) == 1  # the unsplit path raises on the rank whose batch holds the file
    holder = holders[0]
    expected = ranks[holder][key]["reference_error"]
    for rank, found in enumerate(ranks):
        seen = found[key]
        assert seen["equal"], rank  # the batches before it
        assert seen["batches"] == ranks[holder][key]["batches"], rank  # every rank stops at that batch
        kind, message = seen["error"]
        if rank == holder:
            assert [kind, message] == expected and kind == "ImageDecodeError" and file in message
        else:
            assert kind == "ExchangeError" and file in message and f"rank {holder}" in message


def test_shares_that_do_not_fit_fall_back_on_every_rank_with_a_warning(job):
    for found in job[0]:
        seen = found["too_big"]
        assert seen["equal"] and seen["exchange"] is None and not seen["path"].startswith("sharded")
        assert any("does not fit" in w and "cache_scope='world'" in w for w in seen["warnings"]), seen["warnings"]


def test_all_ranks_stopping_at_one_batch_then_resuming_give_the_whole_epoch(job):
    ranks, _, world, _ = job
    for rank, found in enumerate(ranks):
        seen = found["resume"]
        assert seen["equal"] and seen["batches"] > 2, rank
        assert seen["exchange"]["ranks_per_copy"] == world


def test_rank_that_stops_early_makes_the_others_fail_within_the_timeout(job):
    ranks, _, _, _ = job
    ranks_job.others_failed_within_the_timeout(ranks, "stop_early")


@pytest.mark.gpu
def test_nccl_ranks_get_the_per_rank_caches_batches(tmp_path):
    world = ranks_job.nccl_world()
    files = images_job.write_images(tmp_path)
    (tmp_path / "files.json").write_text(json.dumps(files))
    mp.spawn(images_job.run_nccl, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for rank in range(world):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key, result in found.items():
            assert result["equal"] and result["in_order"], f"rank {rank}, {key}"
            assert result["path"] == f"sharded-{key.split('/')[0] if key != 'skip' else 'world'}"
            assert result["exchange"]["ahead"] is False, key  # NCCL's is issued from the loop's thread
            assert result["cache"]["bytes"] > 0


def test_set_batch_size_on_every_rank_at_the_same_batch_cuts_the_rest_of_the_epoch(job):
    for rank, found in enumerate(job[0]):
        seen = found["resized"]
        assert seen["path"] == "sharded-world"
        assert seen["equal"], f"rank {rank}: batches differ from the per-rank cache's after the change"
        assert seen["in_order"], f"rank {rank}: not torch's order cut at the new size"


# ---------------------------------------------------------------- one rank's block, without ranks


def test_a_rank_reads_its_block_in_chunks_and_stops_at_its_room_or_a_bad_decoder():
    import torch

    from gpuload.distributed.image_shares import _OK, _TOO_BIG, DecodedShare, WholeImages, _read_block

    def read(positions):  # position 2 is a bad file; the chunk [4, 6) has only bad files
        kept = [p for p in positions if p not in (2, 4, 5)]
        hwc = [torch.full((2, 3, 3), p, dtype=torch.uint8).permute(2, 0, 1) for p in kept]  # DALI-like CHW views
        return WholeImages(kept, hwc, [(p, "cpu", "not a JPEG") for p in positions if p in (2, 4, 5)])

    outcome, why, (chunks, views, shapes, bad) = _read_block(read, 0, 6, 2, 1 << 20, torch.device("cpu"))
    assert (outcome, why, len(chunks), sorted(bad)) == (_OK, "", 2, [2, 4, 5])
    share = DecodedShare(chunks, views, shapes, torch.device("cpu"), start=10, name=lambda p: f"img{p}.jpg", owner="t")
    image = share.gather([3])[0]
    assert image.shape == (3, 2, 3) and bool((image == 3).all())
    with pytest.raises(IndexError, match="dataset index 12 is a bad file: img12.jpg"):
        share.gather([2])
    assert share.shrink(0) == 0  # one rank cannot shrink a share the others read
    share.close()
    share.close()
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        share.gather([0])
    outcome, why, block = _read_block(read, 0, 6, 2, 20, torch.device("cpu"))
    assert (outcome, block) == (_TOO_BIG, None) and why == "36 B read so far"

    def four_dims(positions):
        return WholeImages(positions, [torch.zeros(1, 3, 2, 2, dtype=torch.uint8) for _ in positions])

    with pytest.raises(ValueError, match=r"the decoder gave an image that is not \(channels, height, width\)"):
        _read_block(four_dims, 0, 2, 2, 1 << 20, torch.device("cpu"))


# ---------------------------------------------------------------- rank 0's split, its peer pretended


def _split(monkeypatch, read, answers=(), num_images: int = 8):
    """``split_images`` on rank 0 of two (``fake_peers``), images of 12 bytes, room for all of
    them; returns (what it returned, the warnings, the collectives it made)."""
    import warnings

    import torch

    from gpuload.cache import CacheSettings
    from gpuload.cache.budget import BudgetLedger
    from gpuload.distributed.image_shares import split_images

    peers = fake_peers.FakePeers(monkeypatch, list(answers))
    settings = CacheSettings.resolve(cache_scope="world", environ={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = split_images(num_images, settings, torch.device("cpu"), fake_peers.batches(num_images), "t",
                             estimate=lambda: 12 * num_images, room=lambda: 1 << 20, read=read, chunk_size=2,
                             on_error="raise", name=str, failure=RuntimeError, context=fake_peers.CONTEXT,
                             ledger=BudgetLedger())
    return found, [str(w.message) for w in caught], peers.calls


def _read_all(positions):
    import torch

    from gpuload.distributed.image_shares import WholeImages

    return WholeImages(positions, [torch.full((3, 2, 2), p, dtype=torch.uint8) for p in positions])


def test_a_rank_whose_read_raised_makes_both_fall_back_saying_what_it_was(monkeypatch):
    def read(positions):
        raise OSError("the disk went away")

    found, said, calls = _split(monkeypatch, read)
    assert found is None and calls == 2  # the agreement, then the tables with every rank's outcome
    assert said == ["gpuload: cache_scope='world' (keyword cache_scope=) is not used: rank 0 could not read its "
                    "share of the images (rows [0, 4)): OSError: the disk went away; each rank caches the whole "
                    "dataset"]


def test_a_peer_whose_share_does_not_fit_its_room_makes_both_fall_back(monkeypatch):
    from gpuload.distributed.image_shares import _TOO_BIG

    def too_big(mine):
        mine[0] = _TOO_BIG  # its outcome; its rows stay empty
        return mine

    found, said, _ = _split(monkeypatch, _read_all, answers=[None, too_big])
    assert found is None
    assert len(said) == 1 and "rank 1's share of the decoded images (rows [4, 8)) does not fit its room (1" in said[0]
    assert said[0].endswith("MiB); each rank caches the whole dataset")  # the peer's own detail is not known here


def test_a_peer_that_died_before_reporting_its_read_is_an_exchange_error(monkeypatch):
    from gpuload.distributed import ExchangeError

    with pytest.raises(ExchangeError, match=r"rank 0 read its share of the images but another rank did not report "
                                            r"its own \(it stopped or died\)\. Cause: Connection closed by peer"):
        _split(monkeypatch, _read_all, answers=[None, RuntimeError("Connection closed by peer")])


def test_an_empty_dataset_is_not_split_and_no_rank_is_asked(monkeypatch):
    found, said, calls = _split(monkeypatch, _read_all, num_images=0)
    assert found is None and calls == 0
    assert len(said) == 1 and "is not used: the dataset is empty" in said[0]
