"""A rank's share as a source holds it (``SplitImages``, ``SplitSamples``): what it reports,
with no rank's process group (the share's groups are none)."""

from __future__ import annotations

import warnings

from store_cases import N, split_arrays_case, split_images_case

from gpuload.cache import format_bytes
from gpuload.distributed.image_shares import SplitImages
from gpuload.distributed.sample_shares import SplitSamples


def test_an_image_share_reports_its_rows_and_after_close_says_it_was_released():
    share = SplitImages(split_images_case().store)
    start, stop = share.store.plan.partition.rows_of(1)
    assert share.path == "sharded-world" and share.cache is None and share.keeps == ""
    assert share.describe() == (f"sharded-world: {share.store.plan.describe()}; decoded here: "
                                f"{format_bytes(share.store.share_bytes)}")
    held = share.entries()["cache"]
    assert held == {"kind": "images", "mode": "decoded", "scope": "world", "entries": stop - start,
                    "bytes": share.store.share_bytes, "rows": [start, stop], "num_samples": N, "bad_files": 0,
                    "hits": 0, "read_s": 0.0, "complete": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        share.begin_epoch(lambda device, memory, held: 0)  # a share never shrinks on one rank
    released = share.close()
    assert share.store.closed
    assert released == dict(held, entries=0, bytes=0, complete=False, released=True)


def test_a_sample_share_counts_its_copy_once_and_reports_nothing_once_closed():
    store = split_arrays_case().store
    share = SplitSamples(store, template=None)
    assert share.path == "sharded-world" and share.h2d_bytes == store.stats.device_bytes
    assert set(share.entries()) == {"cache", "cache_plan", "sample_cache_decision"}
    assert share.entries()["sample_cache_decision"] == store.plan.describe()
    assert share.warm(False, 0, {}) == 0
    assert share.close() is None and store.closed
