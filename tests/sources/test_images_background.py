"""Image batches made off the loop's thread: same batches, errors in order, no leaked threads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from equivalence import assert_same

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageFolder, ImageList, make_sample_image_folder
from gpuload.decode import ImageDecodeError
from gpuload.decode._dali import dali_installed
from gpuload.sources.image_decoding import ImageReader

OPS = [T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToDtype(torch.float16)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> ImageFolder:
    return make_sample_image_folder(tmp_path_factory.mktemp("bg"), num_images=14, num_classes=2, seed=3)


def prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "gpuload-prefetch"]


def wait_no_prefetch_threads(deadline_s: float = 5.0) -> list[str]:
    end = time.monotonic() + deadline_s
    while prefetch_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return prefetch_threads()


def broken_list(folder: ImageFolder, tmp_path: Path, at: int) -> ImageList:
    samples = list(folder.samples)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(Path(samples[at][0]).read_bytes()[:300])  # header intact, pixels cut
    samples[at] = (str(bad), samples[at][1])
    return ImageList(samples)


def loader(dataset, **kw) -> gpuload.DataLoader:
    kw.setdefault("transforms", OPS)
    kw.setdefault("prefetch_depth", 2)  # on the CPU the default (None) keeps batches in the loop
    return gpuload.DataLoader(dataset, batch_size=4, shuffle=True, device="cpu",
                              generator=torch.Generator().manual_seed(9), **kw)


@pytest.mark.parametrize("batch_size, transforms", [(4, OPS), (None, None)])  # None: whole images
def test_background_batches_equal_the_loops_own(folder: ImageFolder, batch_size, transforms) -> None:
    ahead, inline = (
        gpuload.DataLoader(folder, batch_size=batch_size, shuffle=True, device="cpu", transforms=transforms,
                           generator=torch.Generator().manual_seed(9), prefetch_depth=depth)
        for depth in (2, 0)
    )
    for epoch in range(2):
        assert_same(list(ahead), list(inline), f"epoch {epoch}")
    ahead.set_epoch(7), inline.set_epoch(7)
    assert_same(list(ahead), list(inline), "after set_epoch(7)")
    assert ahead.stats.samples == inline.stats.samples == 3 * len(folder)
    assert ahead.stats.extra["decode_backend"] == inline.stats.extra["decode_backend"]
    assert ahead.stats.extra["roi"] == inline.stats.extra["roi"]
    ahead.close()
    assert not wait_no_prefetch_threads()


def test_batches_are_decoded_in_a_background_thread_with_a_depth_on_the_cpu(
    folder: ImageFolder, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    original = ImageReader.decode

    def recording(self, *args, **kw):
        seen.append(threading.current_thread().name)
        return original(self, *args, **kw)

    monkeypatch.setattr(ImageReader, "decode", recording)
    loop = threading.current_thread().name
    for depth, expected in ((1, "gpuload-prefetch"), (2, "gpuload-prefetch"), (0, loop), (None, loop)):
        seen.clear()
        with loader(folder, prefetch_depth=depth) as ahead:
            assert len(list(ahead)) == 4
        assert seen == [expected] * 4, (depth, seen)
    assert not wait_no_prefetch_threads()


def test_a_bad_file_raises_after_the_batches_before_it(folder: ImageFolder, tmp_path: Path) -> None:
    broken = broken_list(folder, tmp_path, at=9)
    plain = gpuload.DataLoader(broken, batch_size=4, device="cpu", transforms=OPS, prefetch_depth=2)
    iterator = iter(plain)
    assert len(next(iterator)[1]) == 4 and len(next(iterator)[1]) == 4  # samples 0-7
    with pytest.raises(ImageDecodeError, match=r"broken\.jpg.*sample index 9") as error:
        next(iterator)
    assert error.value.index == 9 and error.value.name.endswith("broken.jpg")
    assert not wait_no_prefetch_threads()


def test_skip_counts_match_the_batches_delivered_so_far(folder: ImageFolder, tmp_path: Path) -> None:
    broken = broken_list(folder, tmp_path, at=9)
    skipping = gpuload.DataLoader(broken, batch_size=4, device="cpu", transforms=OPS, on_error="skip", prefetch_depth=2)
    counts = []
    for _, labels in skipping:
        time.sleep(0.05)  # let the thread run ahead past the bad file
        counts.append((len(labels), skipping.stats.extra["skipped"]))
    assert counts == [(4, 0), (4, 0), (3, 1), (2, 1)]


def test_early_break_and_close_leave_no_threads(folder: ImageFolder) -> None:
    ahead = loader(folder)
    for _ in range(3):
        for i, _ in enumerate(ahead):
            if i == 1:
                break
    ahead.close()
    assert not wait_no_prefetch_threads()
    dropped = loader(folder)
    iterator = iter(dropped)
    next(iterator)
    del iterator  # an abandoned epoch stops its thread too
    assert not wait_no_prefetch_threads()
    assert len(list(dropped)) == 4  # and the loader still works
    dropped.close()
    assert not wait_no_prefetch_threads()


@pytest.mark.gpu
@pytest.mark.skipif(not dali_installed(), reason="needs nvidia.dali (DALI), which is not installed here")
def test_on_cuda_batches_are_decoded_and_transformed_ahead_on_the_side_stream(folder: ImageFolder) -> None:
    """CUDA: the thread runs DALI mixed and the kernels on the prefetcher's stream; the loop's
    stream waits on an event per batch. Same batches as made in the loop, and as on the CPU
    within the kernels' and nvJPEG's tolerance (test_decode.py, test_transforms_kernels.py)."""
    make = lambda depth, device: gpuload.DataLoader(  # noqa: E731
        folder, batch_size=4, shuffle=True, device=device, transforms=OPS, prefetch_depth=depth,
        generator=torch.Generator().manual_seed(9))
    ahead, inline, cpu = make(None, "cuda"), make(0, "cuda"), make(0, "cpu")
    for epoch in range(2):
        theirs, on_cpu = list(inline), list(cpu)
        for k, (images, labels) in enumerate(ahead):
            torch.cuda.current_stream().synchronize()
            assert images.is_cuda and torch.equal(images, theirs[k][0]) and torch.equal(labels, theirs[k][1])
            diff = (images.float().cpu() - on_cpu[k][0].float()).abs()
            assert float(diff.mean()) <= 1e-2, (epoch, k, float(diff.mean()))
    assert ahead.stats.extra["roi"] == "decoder" and ahead.stats.extra["decode_backend"] == "dali-mixed"
    ahead.close()
    assert not wait_no_prefetch_threads()
