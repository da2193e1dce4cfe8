"""Image files: read the encoded bytes, decode a batch at once, transform it on the device.

When the transform list starts with a crop, each sample's crop box is drawn from the image
size in the file's header before decoding, and only that window is decoded (DALI decodes just
the window; torchvision/PIL decode and crop); the result equals decoding the whole image.

With an image cache (``cache/decide.py`` chooses it), a cached decoded image is neither read
nor decoded, and cached encoded bytes are not read again; while the decoded cache fills, its
images are decoded whole (the cache keeps the image, not one epoch's crop of it). Only the
deterministic part is cached (file bytes, decoded pixels), never a transform's output, so an
epoch from the cache gives the same batches as one from the files. Encoded bytes stay in
pageable memory: DALI's ``external_source`` copies every input into its own staging buffers,
so a pinned copy of ours would add a pinned allocation per image without saving a transfer.

In a torch.distributed job whose ``cache_scope`` splits the dataset, the decoded images are
split over the ranks instead (``split_images`` in ``gpuload.distributed``): each rank decodes its
block once, and each batch's images held by other ranks come over the exchange, whole; the
transforms then run here as above. Either is the one store the source holds (``held``), and
says itself what the source reports of it.

Below the image cache, ``cache_dir``'s disk tier (:class:`~gpuload.cache.disk_tier.DiskImages`)
keeps every whole decoded image as it is decoded (in the first epoch, or by ``warm``); images the
image cache lacks are then read back from it, memory-mapped, instead of reading and decoding
their files, in later epochs and by later jobs with the same files and decoder. While it fills,
images are decoded whole, as for the image cache. A split over ranks reads each rank's block
from the same disk entry where it is published and writes what it decodes there, so the node's
ranks fill one copy between them and a later job's ranks decode nothing.

Serves gpuload's image datasets (``gpuload.datasets.ImageFolder``, ``ImageList``, or a
torchvision ImageFolder) with torch's default collation: batches have the structure
default_collate gives ``(image, label)`` samples, ``[images, labels]``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.data import default_collate, default_convert

from gpuload.augment import BatchAugmenter
from gpuload.cache import SampleStore, Store, decide_images, estimate_image_bytes
from gpuload.cache.disk_tier import DiskImages
from gpuload.datasets.images import ImageFiles, as_image_source
from gpuload.decode import BatchDecoder
from gpuload.device import device_memory, host_memory
from gpuload.distributed.image_shares import ExchangedImages, SplitImages, split_images
from gpuload.sources import FromRows, Indices, Schedule, Setup, Source, Work, ahead_on_device
from gpuload.sources.image_cache import CachedImages
from gpuload.sources.image_decoding import DecodedBatch, ImageReader
from gpuload.transfer import to_device

__all__ = ["ImageFileSource", "detect"]


def detect(setup: Setup, strict: bool) -> ImageFileSource | None:
    """An ImageFileSource for an image-file dataset gpuload can decode itself, else None.

    A torchvision dataset with its own ``transform`` stays on torch's path (so swapping the
    import changes nothing) unless ``transforms=`` asks gpuload to take over (``strict``), in
    which case the reason it cannot is raised. A ``worker_init_fn`` for worker processes keeps
    it on torch's path too (its workers run the function), unless ``transforms=`` is given.
    """
    if not setup.map_style or setup.collate_fn not in (default_collate, default_convert):
        return None
    if setup.worker_code and not strict:
        return None
    try:
        images = as_image_source(setup.dataset)
    except ValueError:
        if strict:
            raise
        return None
    return ImageFileSource(setup, images) if images is not None else None


class ImageFileSource(Source):
    """Batches of dataset indices turned into device batches of decoded (and transformed) images:
    its :class:`~gpuload.sources.image_decoding.ImageReader` (``reader``) reads and decodes them
    through the cache tiers this source decides, then the transforms run here."""

    # Batches are made on the device (the prefetcher only runs the work ahead, nothing staged).
    # Ahead of the loop, DEFAULT_DEPTH batches: one being made while the loop uses the one
    # before, one more to absorb jitter in file sizes. Each holds a finished batch (38 MiB at
    # 128 x 224^2 float16), so more buys nothing but memory.

    def __init__(self, setup: Setup, images: ImageFiles) -> None:
        super().__init__(setup)
        self.images = images
        self.augment = (
            BatchAugmenter(setup.transforms, setup.seed, setup.device, 0, setup.staging) if setup.transforms else None
        )
        # With transforms, DALI's HWC images go to them as they are (the transforms read any
        # layout); without, the batch is the images stacked, contiguous as torch's would be.
        decoder = BatchDecoder(
            setup.device, max_batch=setup.batch_size or 1, channels_last=self.augment is not None,
            staging=setup.staging,
        )
        self.reader = ImageReader(images, decoder, self.augment, device=setup.device, staging=setup.staging,
                                  on_error=setup.on_error)
        # What the cache decision chose: the image cache, this rank's share of images split over
        # the ranks, or nothing.
        self.held: CachedImages | SplitImages | None = None
        self.disk: DiskImages | None = None  # cache_dir's disk tier of whole decoded images
        self._disk_summary: dict[str, Any] | None = None  # the tier's stats once a share was read
        self._decided = False
        self._released: dict[str, Any] | None = None

    # -- the cache ---------------------------------------------------------------------------

    def _decide_cache(self) -> None:
        """Choose the image cache at first use (again after ``close``)."""
        if self._decided:
            return
        self._decided = True
        if not self.setup.settings.off_reason():
            self.disk = self._open_disk()
            if self.disk is not None:
                weakref.finalize(self, self.disk.close)
        self.reader.use(None, "", self.disk)
        share = self._split()  # its block is read from the disk tier where published, and fills it
        if share is not None and self.disk is not None:
            # The share holds every image this rank serves: no file is read again, nothing more to keep.
            self._disk_summary = self.disk.stats()
            self.disk.close()
            self.disk = None
        self.held = share if share is not None else self._image_cache()
        self.reader.use(self.cache, self.keeps, self.disk)

    def _open_disk(self) -> DiskImages | None:
        """``cache_dir``'s disk tier of these images' decoded pixels (None: none set)."""
        decoder = self.reader.decoder
        decode = {"backend": decoder.backend, "channels_last": decoder.channels_last}
        return DiskImages.open(self.images, self.setup.settings, decode)

    def _image_cache(self) -> CachedImages | None:
        """This rank's own image cache, when ``decide_images`` keeps one."""
        setup = self.setup
        decision = decide_images(self.images, setup.settings, setup.device, owner=setup.owner)
        setup.stats.extra["image_cache_decision"] = f"{decision.holds or 'none'}: {decision.reason}"
        if not decision.caches:
            return None
        cached = CachedImages(setup, decision, len(self.images))
        weakref.finalize(self, cached.store.close)
        return cached

    def _split(self) -> SplitImages | None:
        """This rank's share of the decoded images when ``cache_scope`` splits them over the
        ranks of torch.distributed (decoded now), else None."""
        setup = self.setup
        device, settings = setup.device, setup.settings

        def room() -> int:  # the budget decide_images gives decoded images
            if device.type == "cuda":
                return settings.device_room(device, device_memory(device), setup.owner)
            return settings.host_room(host_memory())

        share = split_images(
            len(self.images), settings, device, setup.batch_sampler, setup.owner,
            estimate=lambda: estimate_image_bytes(self.images)[0], room=room, read=self.reader.read_whole,
            chunk_size=setup.batch_size or 1, on_error=setup.on_error, name=self.images.path,
            failure=self.reader.failure,
        )
        if share is not None:
            setup.stats.extra["image_cache_decision"] = share.describe()
        return share

    @property
    def cache(self) -> SampleStore | None:
        """The image cache decoding reads from and fills (None: none here)."""
        return self.held.cache if self.held is not None else None

    @property
    def keeps(self) -> str:
        """What that cache keeps: ``"decoded"`` images or ``"encoded"`` bytes."""
        return self.held.keeps if self.held is not None else ""

    def begin_epoch(self) -> None:
        self._decide_cache()
        held = self.held
        if held is not None:
            held.begin_epoch(self.setup.settings.keepable)
        self.path = held.path if held is not None else "image-decode"

    def stats(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        skipped_files = self.reader.skipped_files
        if skipped_files:
            extra["skipped_files"] = [(position, *entry) for position, entry in skipped_files.items()]
        if self.held is not None:
            extra.update(self.held.entries())
        elif self._released is not None:
            extra["cache"] = self._released
        disk = self.disk.stats() if self.disk is not None else self._disk_summary
        if disk is not None:
            extra["cache"] = dict(extra.get("cache", {}), disk=disk)
        return extra

    def cache_store(self) -> Store | None:
        """This rank's share of the decoded images, or the image cache (the images cached last
        go first when it shrinks: they are read and decoded from their files again)."""
        return self.held.store if self.held is not None else None

    def close(self) -> None:
        if self.held is not None:
            self._released = self.held.close()
            self.held = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        self.reader.use(None, "", None)
        self._decided = False

    def warm(self, progress: bool) -> None:
        """Fill the image cache in one pass over the files not cached yet."""
        from tqdm import tqdm

        self._decide_cache()  # a share is decoded here already
        cache, disk = self.cache, self.disk
        filling_disk = disk is not None and disk.accepting
        if (cache is None or not cache.accepting) and not filling_disk:
            return
        on_disk = disk.present(list(range(len(self.images)))) if disk is not None and filling_disk \
            else [False] * len(self.images)
        todo = [i for i in range(len(self.images)) if not on_disk[i] and (cache is None or i not in cache)]
        batch_size = self.setup.batch_size or 1
        with tqdm(total=len(todo), unit="image", desc="gpuload warm", disable=not progress) as bar:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                if cache is not None and self.keeps == "encoded" and not filling_disk:
                    self.reader.read(chunk, epoch=0)
                else:
                    self.reader.decode(chunk, epoch=0)  # decodes whole while a cache accepts
                bar.update(len(chunk))
                if not (cache is not None and cache.accepting) and not (disk is not None and disk.accepting):
                    break

    # -- an epoch ----------------------------------------------------------------------------

    def schedule(self, indices: Indices) -> Schedule:
        """Decoding runs ahead (on a CPU device only when ``prefetch_depth`` asks)."""
        return Schedule(lambda ahead: self._work(indices, ahead), staged=False)

    def _work(self, request: Indices, ahead: bool) -> Work:
        number = request.number
        decoded = (self.reader.decode(index, number) for index in request.batches(ahead))
        if ahead_on_device(ahead, self.setup.device):
            return Work((self.finish(d) for d in decoded), self._deliver)
        return Work(decoded, lambda d: self._deliver(self.finish(d)))

    def from_rows(self, number: int, ahead: bool) -> FromRows:
        """Batches of whole decoded images gathered from a share of them; transforms as above
        (ahead of the loop only on a GPU)."""
        if ahead_on_device(ahead, self.setup.device):
            return FromRows(self._deliver, made=lambda item: self.finish(self._gathered(item, number)))
        return FromRows(lambda d: self._deliver(self.finish(d)), made=lambda item: self._gathered(item, number))

    def _gathered(self, item: ExchangedImages, epoch: int) -> DecodedBatch:
        """Gathered whole images as a decoded batch, its skipped files counted."""
        reader = self.reader
        if item.skipped:
            reader.note_skipped([(p, self.images.path(p), reader.skip_reason(p, backend, reason))
                                 for p, backend, reason in item.skipped], epoch)
        return DecodedBatch(
            images=item.images, positions=item.positions, labels=[self.images.label(p) for p in item.positions],
            epoch=epoch, windows=None, sizes=None, counters=reader.counters(epoch),
        )

    def _deliver(self, finished: tuple[Any, int, dict[str, Any]]) -> tuple[Any, int] | None:
        """In the loop's thread: the counters as of this batch (not of those decoded ahead)."""
        batch, count, counters = finished
        self.setup.stats.extra.update(counters)
        return (batch, count) if count else None

    def batch_images(self, decoded: DecodedBatch) -> torch.Tensor:
        """A decoded batch's images, transformed (or stacked, when no transforms are given)."""
        if self.augment is None:
            return torch.stack(decoded.images)  # differing sizes fail as in torch's collate
        return self.augment.apply_list(
            decoded.images, torch.tensor(decoded.positions), decoded.epoch, decoded.windows, decoded.sizes
        )

    def finish(self, decoded: DecodedBatch) -> tuple[Any, int, dict[str, Any]]:
        """Transform and collate a decoded batch: (batch, sample count, counters as of it);
        the batch is None and the count 0 when every file was skipped."""
        counters = dict(decoded.counters)
        kept, kept_labels = decoded.positions, decoded.labels
        batched = self.setup.batched
        if not kept:
            return None, 0, counters
        if self.augment is not None or batched:
            images = self.batch_images(decoded)
            if self.augment is not None:
                counters["transform_backend"] = self.augment.backend
        else:
            images = decoded.images[0]
            if self.cache is not None and self.keeps == "decoded":
                images = images.clone()  # the loop may change it in place; the cache keeps its own
        if not batched:
            return [images[0] if self.augment is not None else images, kept_labels[0]], 1, counters
        (labels,) = to_device([torch.tensor(kept_labels, dtype=torch.int64)], self.setup.device, self.setup.staging)
        return [images, labels], len(kept), counters


