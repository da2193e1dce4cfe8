"""Which Source serves a loader's dataset: token windows, packed documents, arrays, image files,
else torch's own path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gpuload.cache import CacheSettings
from gpuload.sampling import DrawState
from gpuload.sources import Setup, Source, arrays, arrow, images, packed, tokens
from gpuload.sources.samples import SampleSource, TorchLoading
from gpuload.sources.torch_fetch import EpochPlaces
from gpuload.stats import LoaderStats
from gpuload.transfer import Staging

__all__ = ["choose_source"]


def choose_source(loader: Any, draw: DrawState, settings: CacheSettings, stats: LoaderStats, seed: int,
                  torch_epoch: Callable[[], Iterator[Any]],
                  epoch_places: Callable[[], EpochPlaces] = EpochPlaces,
                  staging: Staging | None = None) -> Source:
    """The Source for ``loader``'s dataset: token windows, in-memory arrays, Arrow tables
    (``ArrowTable``, ``Parquet``, ``datasets.Dataset``), else image files, else any dataset
    through torch's fetch, collate and workers (``torch_epoch``: the loader's own torch
    iterator for one epoch; ``epoch_places``: where the batches of the epoch being started sit
    in it, for torch's workers handing them over out of order). ``draw``, ``settings``, ``stats``,
    ``seed``: the loader's draw state, cache settings, counters and transforms' seed; ``staging``: its
    copy route to the device."""
    setup = Setup(
        dataset=loader.dataset, map_style=draw.map_style, device=loader.device,
        settings=settings, batched=draw.batched, batch_size=loader.batch_size,
        collate_fn=loader.collate_fn, stats=stats, owner=f"loader-{id(loader)}", transforms=loader.transforms,
        seed=seed, on_error=loader.on_error, batch_sampler=loader.batch_sampler,
        worker_code=loader.num_workers > 0 and loader.worker_init_fn is not None, staging=staging,
    )
    source = (tokens.detect(setup) or packed.detect(setup) or arrays.detect(setup) or arrow.detect(setup)
              or images.detect(setup, strict=bool(setup.transforms)))
    if source is not None:
        return source
    if setup.transforms:
        raise ValueError(
            "transforms= runs on images gpuload serves itself: uint8 arrays (TensorDataset, "
            "gpuload.ArrayDataset, a tensor or numpy array) or image files "
            "(gpuload.datasets.ImageFolder/ImageList, torchvision's ImageFolder), with the "
            f"default collate_fn; for a {type(setup.dataset).__name__}, apply transforms inside the dataset"
        )
    options = {
        "worker_init_fn": loader.worker_init_fn, "multiprocessing_context": loader.multiprocessing_context,
        "timeout": loader.timeout, "generator": loader.generator, "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers, "pin_memory": loader.pin_memory,
        "pin_memory_device": loader.pin_memory_device, "in_order": loader.in_order,
    }
    torch_loading = TorchLoading(torch_epoch, draw.index_sampler, loader.num_workers, options,
                                 seed_drawn=lambda: draw.seed_drawn,  # keeps the draw state, not the loader
                                 epoch_places=epoch_places)
    return SampleSource(setup, torch_loading)
