"""gpuload loaders under HF Accelerate, without patching Accelerate's DataLoader class.

``Accelerator.prepare`` rebuilds every loader it is given as torch's class (bound when Accelerate
is imported) from torch's constructor arguments only: a gpuload loader comes back as torch's,
its device, cache and ``cache_scope`` dropped. Accelerate's one per-object hook is the
``_is_accelerate_prepared`` flag: ``prepare`` returns a loader that carries it as it is (and
registers it for ``save_state``/``load_state``). :func:`prepare_data_loader` uses that hook.
Accelerate's own ``prepare_data_loader`` decides the sharding from the Accelerator's settings
(``split_batches``, ``even_batches``, its seedable sampler, the generator it keeps in sync over
processes) and builds its ``DataLoaderShard``; gpuload keeps that shard and puts under it a
gpuload loader over the same dataset and batch sampler, with the original loader's gpuload
options, and marks it prepared. A later ``accelerator.prepare(model, optimizer, loader)`` keeps it.

One exception to Accelerate's sharding: a loader whose sampler is torch's ``DistributedSampler``
over exactly this Accelerator's processes is split already (Accelerate would deal its batches
out a second time, each rank seeing a 1/N² slice); it is kept, and with it ``cache_scope="node"``
or ``"world"`` splits one copy of the data over the ranks as under torchrun. With Accelerate's
own sharding (any other sampler) each rank caches what it reads, and a ``node``/``world`` scope
warns and falls back to ``rank``, as gpuload does for any sampler other than DistributedSampler.

``dispatch_batches=True`` (rank 0 reads every batch and sends each rank its slice) is refused:
gpuload serves each rank's batches on the rank that uses them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard, SeedableRandomSampler
from accelerate.data_loader import (
    prepare_data_loader as _accelerate_prepare_data_loader,
)
from accelerate.state import GradientState
from accelerate.utils import DistributedType
from torch.utils.data import BatchSampler, IterableDataset
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.elastic import distributed_layout
from gpuload.loader import OPTIONS
from gpuload.resume import ResumeError

__all__ = ["GPULOAD_OPTIONS", "POSITION_FILE", "GpuloadShard", "prepare", "prepare_data_loader", "serve_from_gpuload"]

#: Where ``accelerator.save_state`` puts each process's position of each gpuload loader (``loader``:
#: its number among the Accelerator's loaders, as in Accelerate's ``dl_state_dict_{i}.bin``).
POSITION_FILE = "gpuload_loader_{loader}_{process}.pt"

#: gpuload's own options (``gpuload.loader.OPTIONS``), carried from a loader to the one that
#: replaces it; all but ``device``, which is the shard's (the Accelerator's device).
GPULOAD_OPTIONS = tuple(name for name in OPTIONS if name != "device")

# torch's arguments that do not choose the batches (those come from the prepared batch sampler).
_TORCH_OPTIONS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                  "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


class GpuloadShard(DataLoaderShard):
    """Accelerate's ``DataLoaderShard`` serving from a gpuload loader (``base_dataloader``).

    It is the shard Accelerate built (its sharding, generator sync, device placement and
    gradient-accumulation bookkeeping), adopted: only the loader under it is gpuload's. Besides,
    ``set_epoch`` reaches the gpuload loader (the transforms' randomness follows the epoch),
    ``state_dict``/``load_state_dict`` are gpuload's exact position (``accelerator.save_state``
    and ``load_state`` carry it, one file per process: see :func:`prepare_data_loader`), and a
    loaded state sets the epoch the shard goes on with. ``isinstance(shard, gpuload.DataLoader)`` holds, as
    Accelerate's shards answer ``isinstance`` for the loader they wrap.
    """

    @classmethod
    def adopt(cls, shard: DataLoaderShard, loader: gpuload.DataLoader) -> GpuloadShard:
        """``shard`` (as Accelerate built it) with ``loader`` under it."""
        _give_seedable_samplers_their_generator(loader)
        adopted = cls.__new__(cls)
        adopted.__dict__.update(shard.__dict__)
        adopted.base_dataloader = loader
        # Accelerate's save_state would write every process's state_dict() to one dl_state_dict.bin
        # (the processes' positions differ with uneven batches): saved per process instead
        # (_keep_positions_per_process)
        adopted.use_stateful_dataloader = False
        adopted.dl_state_dict = loader.state_dict()
        return adopted

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.base_dataloader.set_epoch(epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a gpuload ``state_dict()`` (see ``gpuload.DataLoader.load_state_dict``);
        the next ``iter()`` is the saved epoch (or the one after it, when it had ended)."""
        self.base_dataloader.load_state_dict(state_dict)
        self.iteration = self.base_dataloader.next_epoch
        self.dl_state_dict = self.base_dataloader.state_dict()

    def __reduce__(self) -> tuple[Any, ...]:
        # Accelerate's GradientState is a per-process singleton (it lists the loaders being
        # iterated): the copy joins its own process's.
        attributes = {name: value for name, value in self.__dict__.items() if name != "gradient_state"}
        return (_unpickled_shard, (attributes,))


def _unpickled_shard(attributes: dict[str, Any]) -> GpuloadShard:
    shard = GpuloadShard.__new__(GpuloadShard)
    shard.__dict__.update(attributes)
    shard.gradient_state = GradientState()
    return shard


def prepare_data_loader(
    accelerator: Accelerator, loader: gpuload.DataLoader, device_placement: bool | None = None
) -> GpuloadShard:
    """``loader`` prepared by ``accelerator`` as ``accelerator.prepare_data_loader`` would
    prepare torch's loader with the same arguments (the same batches on each process), served
    by gpuload with ``loader``'s options; marked prepared, so ``accelerator.prepare`` keeps it.

    Batches are delivered on ``accelerator.device`` when device placement is on (Accelerate's
    default), so Accelerate's own move to the device finds them there and copies nothing.

    ``accelerator.save_state`` then writes each process's position of each gpuload loader
    (:data:`POSITION_FILE`), and ``accelerator.load_state`` loads each process its own; a
    checkpoint saved by another number of processes, or without these files, raises
    :class:`~gpuload.resume.ResumeError`.
    """
    if not isinstance(loader, gpuload.DataLoader):
        raise TypeError(
            f"prepare_data_loader takes a gpuload.DataLoader, got a {type(loader).__name__}; "
            "pass other loaders to accelerator.prepare"
        )
    if getattr(loader, "_is_accelerate_prepared", False):
        return accelerator.prepare_data_loader(loader)
    if accelerator.distributed_type == DistributedType.XLA:
        raise ValueError("gpuload.integrations.accelerate does not run on XLA devices (TPU): "
                         "Accelerate wraps the loader in torch_xla's MpDeviceLoader")
    placement = accelerator.device_placement if device_placement is None else device_placement
    dispatch = accelerator.dispatch_batches
    if dispatch is None:  # Accelerate's default: dispatch an IterableDataset's batches from rank 0
        dispatch = bool(placement) and isinstance(loader.dataset, IterableDataset) and accelerator.num_processes > 1
    if dispatch:
        raise ValueError(
            "dispatch_batches=True: Accelerate would read every batch on rank 0 and send each rank its slice, "
            "but gpuload serves each rank's batches on that rank; build the Accelerator with "
            "dataloader_config=DataLoaderConfiguration(dispatch_batches=False) (an IterableDataset is then "
            "read as one shard of the stream per rank)"
        )
    num_processes, process_index = accelerator.num_processes, accelerator.process_index
    if _split_by_its_sampler(loader, num_processes, process_index):
        num_processes, process_index = 1, 0  # Accelerate would deal the rank's batches out again
    shard = _accelerate_prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=accelerator.split_batches,
        put_on_device=placement,
        rng_types=list(accelerator.rng_types),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=False,  # the state is gpuload's own
        torch_device_mesh=accelerator.torch_device_mesh,
    )
    prepared = serve_from_gpuload(shard, loader)
    prepared._is_accelerate_prepared = True
    _keep_positions_per_process(accelerator)
    return accelerator.prepare_data_loader(prepared)  # registers it (save_state, join_uneven_inputs)


def _keep_positions_per_process(accelerator: Accelerator) -> None:
    """Have ``accelerator``'s ``save_state``/``load_state`` save and load each process's position
    of its gpuload loaders (once per Accelerator)."""
    if getattr(accelerator, "_gpuload_positions_kept", False):
        return
    accelerator._gpuload_positions_kept = True
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: _save_positions(accelerator, folder))
    accelerator.register_load_state_pre_hook(lambda models, folder: _load_positions(accelerator, folder))


def _gpuload_loaders(accelerator: Accelerator) -> list[tuple[int, GpuloadShard]]:
    """The gpuload loaders among those ``accelerator`` holds, with their number there (the ``i``
    of Accelerate's own ``dl_state_dict_{i}.bin``)."""
    return [(number, loader) for number, loader in enumerate(accelerator._dataloaders)
            if isinstance(loader, GpuloadShard)]


def _save_positions(accelerator: Accelerator, folder: str | os.PathLike[str]) -> None:
    for number, loader in _gpuload_loaders(accelerator):
        path = Path(folder, POSITION_FILE.format(loader=number, process=accelerator.process_index))
        torch.save(loader.state_dict(), path)


def _load_positions(accelerator: Accelerator, folder: str | os.PathLike[str]) -> None:
    for number, loader in _gpuload_loaders(accelerator):
        path = _position_file(Path(folder), number, loader, accelerator.process_index, accelerator.num_processes)
        loader.load_state_dict(torch.load(path, weights_only=False))


def _position_file(folder: Path, number: int, loader: GpuloadShard, process: int, processes: int) -> Path:
    """The file in ``folder`` that holds this process's position of gpuload loader ``number``;
    ResumeError when it holds none, or positions of another number of processes that cannot be
    taken up at this one."""
    own = folder / POSITION_FILE.format(loader=number, process=process)
    saved = len(list(folder.glob(POSITION_FILE.format(loader=number, process="*"))))
    if saved == processes and own.is_file():
        return own
    if saved and distributed_layout(loader.base_dataloader) is not None:
        # split by its DistributedSampler: every process saved the same point of the epoch's
        # order, which gpuload.elastic takes up at this number of processes
        return folder / POSITION_FILE.format(loader=number, process=0)
    if saved:
        raise ResumeError(
            f"{folder} holds the positions of gpuload loader {number} for {saved} processes, but this job has "
            f"{processes}: Accelerate deals each epoch's batches out over the processes, so a position saved at "
            f"one number of processes is another point of the epoch at another; resume with {saved} processes "
            "(or give the loader torch's DistributedSampler, whose position gpuload takes up at any number)"
        )
    shared = folder / ("dl_state_dict.bin" if number == 0 else f"dl_state_dict_{number}.bin")
    if processes == 1 and shared.is_file():
        return shared  # one process: Accelerate's own file is its position (a checkpoint of an earlier gpuload)
    found = f" (its {shared.name} holds one process's position, written by all)" if shared.is_file() else ""
    raise ResumeError(
        f"{folder} holds no position of gpuload loader {number} for this process, {own.name}{found}: save the "
        "checkpoint with a loader prepared by gpuload.integrations.accelerate, which saves each process's position"
    )


def prepare(accelerator: Accelerator, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)``, with every gpuload loader among them prepared by
    :func:`prepare_data_loader` (models, optimizers, schedulers and other loaders as Accelerate
    prepares them); returns what ``accelerator.prepare`` returns."""
    placements = device_placement if device_placement is not None else [None] * len(objects)
    if len(placements) != len(objects):
        raise ValueError(
            f"device_placement should be a list with {len(objects)} elements (the number of objects passed)")
    objects = tuple(
        prepare_data_loader(accelerator, obj, placement) if isinstance(obj, gpuload.DataLoader) else obj
        for obj, placement in zip(objects, placements)
    )
    return accelerator.prepare(*objects, device_placement=device_placement)


def serve_from_gpuload(
    shard: DataLoaderShard, template: gpuload.DataLoader | None = None, **options: Any
) -> GpuloadShard:
    """``shard`` (a ``DataLoaderShard`` Accelerate prepared, over torch's loader) served by a
    gpuload loader over the same dataset, batch sampler and torch arguments, delivering on the
    shard's device (else ``template``'s, else gpuload's default). gpuload's options come from
    ``template`` and then ``options`` (``cache_size=...``, ``cache_scope=...``, ...).

    When nothing about the batches changed (one process, same device, no options), ``template``
    itself goes under the shard, with whatever it has placed or warmed already.
    """
    if not isinstance(shard, DataLoaderShard):
        raise TypeError(
            f"serve_from_gpuload takes the DataLoaderShard Accelerate prepares, got a {type(shard).__name__} "
            "(dispatch_batches=True makes a DataLoaderDispatcher, which gpuload does not serve)"
        )
    if unknown := sorted(set(options) - set(GPULOAD_OPTIONS) - {"device"}):
        raise TypeError(
            f"serve_from_gpuload: unknown gpuload option(s) {unknown}; gpuload's are {list(GPULOAD_OPTIONS)}")
    base = shard.base_dataloader
    device = shard.device if shard.device is not None else options.get("device", getattr(template, "device", None))
    if (
        template is not None and not options and base.dataset is template.dataset
        and base._index_sampler is template._index_sampler
        and (device is None or torch.device(device) == template.device)
    ):
        return GpuloadShard.adopt(shard, template)
    chosen = {name: getattr(template, name) for name in GPULOAD_OPTIONS} if template is not None else {}
    chosen.update(options)
    chosen["device"] = device
    loader = gpuload.DataLoader(
        base.dataset, **_batching(base), **{name: getattr(base, name) for name in _TORCH_OPTIONS}, **chosen
    )
    return GpuloadShard.adopt(shard, loader)


def _batching(base: torch.utils.data.DataLoader) -> dict[str, Any]:
    """The arguments that make ``base``'s batches: its BatchSampler's own arguments when it is
    torch's (gpuload's fast path and ``set_batch_size`` keep working), else the batch sampler."""
    if isinstance(base.dataset, IterableDataset):
        return {"batch_size": base.batch_size, "drop_last": base.drop_last}
    batch_sampler = base.batch_sampler
    if batch_sampler is None:  # no automatic batching: the sampler yields what each item is
        return {"batch_size": None, "sampler": base.sampler}
    if type(batch_sampler) is BatchSampler:
        return {"batch_size": batch_sampler.batch_size, "sampler": batch_sampler.sampler,
                "drop_last": batch_sampler.drop_last}
    return {"batch_sampler": batch_sampler}


def _give_seedable_samplers_their_generator(loader: gpuload.DataLoader) -> None:
    """Accelerate's SeedableRandomSampler makes its generator at its first ``iter()`` (and seeds
    it at every one); made now, as that would make it, it exists from the start, so a resumed
    epoch finds the generators that the saved one had."""
    sampler: Any = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    while sampler is not None:
        if isinstance(sampler, SeedableRandomSampler) and sampler.generator is None:
            sampler.generator = torch.Generator(device=torch.get_default_device())
            sampler.generator.manual_seed(sampler.initial_seed)
        sampler = getattr(sampler, "sampler", None) or getattr(sampler, "batch_sampler", None)


def _split_by_its_sampler(loader: gpuload.DataLoader, num_processes: int, process_index: int) -> bool:
    """Whether ``loader``'s sampler is torch's DistributedSampler over exactly these processes."""
    sampler = loader.sampler
    return (
        num_processes > 1 and isinstance(sampler, DistributedSampler)
        and sampler.num_replicas == num_processes and sampler.rank == process_index
    )
