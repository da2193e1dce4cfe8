"""HF Accelerate's ``Accelerator.prepare`` with a gpuload loader (one CPU process; two gloo
processes in tests/clients/test_accelerate_ranks.py).

Plain ``accelerator.prepare(gpuload_loader)`` rebuilds the loader as torch's class from torch's
arguments (the class is bound when Accelerate is imported; only torch's keyword arguments
travel): no object-level hook reaches it except the ``_is_accelerate_prepared`` flag. The
supported way is ``gpuload.integrations.accelerate``: ``prepare(accelerator, ...)`` (or
``prepare_data_loader``) gives Accelerate's own shard of the loader, served by gpuload, marked
prepared, so that ``accelerator.prepare`` keeps it.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from equivalence import assert_same, assert_same_epochs
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import gpuload

accelerate = pytest.importorskip("accelerate", reason="HF Accelerate is a test dependency: pip install -e '.[test]'")
import accelerate.data_loader  # noqa: F811 (the submodule, after the importorskip)
from accelerate.utils import DataLoaderConfiguration

from gpuload.integrations.accelerate import GpuloadShard, prepare, prepare_data_loader
from gpuload.resume import ResumeError

pytestmark = pytest.mark.slow  # importing Accelerate alone takes seconds


def shuffled(loader_class: type, **options) -> TorchDataLoader:
    data = TensorDataset(torch.arange(30, dtype=torch.float32).unsqueeze(1), torch.arange(30))
    return loader_class(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0), **options)


def serves_from_gpuload(prepared: object) -> bool:
    return isinstance(getattr(prepared, "base_dataloader", None), gpuload.DataLoader)


def test_plain_prepare_of_an_unmarked_loader_still_builds_torchs() -> None:
    """Why the integration exists: Accelerate builds ``accelerate.data_loader.DataLoader``
    (torch's) from torch's arguments; nothing of gpuload survives (if this starts failing,
    Accelerate gained a hook and the README should say so)."""
    prepared = accelerate.Accelerator(cpu=True).prepare(shuffled(gpuload.DataLoader, cache_scope="rank"))
    assert type(prepared.base_dataloader) is torch.utils.data.DataLoader


@pytest.mark.parametrize("use_seedable_sampler", [False, True])
def test_prepare_keeps_a_gpuload_loader_with_accelerates_batches(use_seedable_sampler: bool) -> None:
    config = DataLoaderConfiguration(use_seedable_sampler=use_seedable_sampler)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    theirs = accelerator.prepare(shuffled(TorchDataLoader))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, ours = prepare(accelerator, model, optimizer, shuffled(gpuload.DataLoader))
    assert serves_from_gpuload(ours) and isinstance(ours, gpuload.DataLoader) and type(ours) is GpuloadShard
    assert ours in accelerator._dataloaders and accelerator.prepare(ours) is ours  # kept as it is
    assert_same_epochs(ours, theirs, epochs=3)


def test_gpuload_options_travel_and_batches_land_on_the_accelerators_device() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    loader = shuffled(gpuload.DataLoader, cache="off", prefetch_depth=0, cache_scope="rank")
    ours = prepare_data_loader(accelerator, loader)
    assert ours.base_dataloader is loader  # one process, same device: the loader itself
    assert (ours.cache, ours.prefetch_depth, ours.cache_scope) == ("off", 0, "rank")
    batch = next(iter(ours))
    assert batch[0].device == accelerator.device


def test_a_loader_that_accelerate_shards_is_rebuilt_with_its_options() -> None:
    """split_batches with 2 pretended processes: Accelerate's BatchSamplerShard under a new
    gpuload loader that keeps the options; the batches are Accelerate's for torch's loader."""
    data = shuffled(TorchDataLoader).dataset
    shards = {}
    for name, loader_class, options in (("theirs", TorchDataLoader, {}),
                                        ("ours", gpuload.DataLoader, {"cache_size": "1MiB", "prefetch_depth": 0})):
        loader = loader_class(data, batch_size=4, shuffle=False, **options)
        shard = accelerate.data_loader.prepare_data_loader(loader, num_processes=2, process_index=1, split_batches=True)
        if name == "ours":
            from gpuload.integrations.accelerate import serve_from_gpuload

            shard = serve_from_gpuload(shard, loader)
            assert shard.base_dataloader is not loader
            assert (shard.cache_size, shard.prefetch_depth) == ("1MiB", 0)
            assert type(shard.base_dataloader.batch_sampler).__name__ == "BatchSamplerShard"
        shards[name] = shard
    assert_same_epochs(shards["ours"], shards["theirs"], epochs=2)
    assert [b[1].tolist() for b in shards["ours"]][:2] == [[2, 3], [6, 7]]


def test_dispatch_batches_is_refused_with_the_fix() -> None:
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    with pytest.raises(ValueError, match=r"dispatch_batches=False"):
        prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))
    with pytest.raises(TypeError, match="gpuload.DataLoader"):
        prepare_data_loader(accelerator, shuffled(TorchDataLoader))


def test_save_state_and_load_state_resume_mid_epoch_exactly(tmp_path) -> None:
    """``accelerator.save_state`` stores the gpuload loader's exact position (one file per
    process, not Accelerate's shared dl_state_dict.bin); a new Accelerator and loader after
    ``load_state`` go on with the same batches."""
    def run() -> tuple[accelerate.Accelerator, GpuloadShard]:
        accelerator = accelerate.Accelerator(cpu=True)
        return accelerator, prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))

    accelerator, ours = run()
    whole = [list(ours) for _ in range(2)]
    accelerator, ours = run()
    epoch = iter(ours)
    first = [next(epoch) for _ in range(3)]
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, resumed = run()
    accelerator.load_state(str(tmp_path / "ckpt"))
    rest = [list(resumed), list(resumed)]
    assert_same(first + rest[0], whole[0])
    assert_same(rest[1], whole[1])
    assert sorted(path.name for path in (tmp_path / "ckpt").glob("*loader*")) == ["gpuload_loader_0_0.pt"]
    assert not (tmp_path / "ckpt" / "dl_state_dict.bin").exists()


def test_a_checkpoint_without_this_processs_position_is_refused(tmp_path) -> None:
    """Saved by 2 processes (pretended: the other's file), or without gpuload's files: a
    ResumeError naming what is missing; Accelerate's one dl_state_dict.bin of an earlier
    gpuload still loads in one process."""
    accelerator = accelerate.Accelerator(cpu=True)
    ours = prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))
    epoch = iter(ours)
    first = [next(epoch) for _ in range(2)]
    folder = tmp_path / "ckpt"
    accelerator.save_state(str(folder))
    position = folder / "gpuload_loader_0_0.pt"
    (folder / "gpuload_loader_0_1.pt").write_bytes(position.read_bytes())
    accelerator = accelerate.Accelerator(cpu=True)
    resumed = prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))
    with pytest.raises(ResumeError, match="for 2 processes, but this job has 1"):
        accelerator.load_state(str(folder))
    (folder / "gpuload_loader_0_1.pt").unlink()
    position.rename(folder / "dl_state_dict.bin")
    accelerator.load_state(str(folder))
    assert_same(first + list(resumed), list(prepare_data_loader(accelerate.Accelerator(cpu=True),
                                                                shuffled(gpuload.DataLoader))))
    (folder / "dl_state_dict.bin").unlink()
    with pytest.raises(ResumeError, match="holds no position of gpuload loader 0 for this process"):
        accelerator.load_state(str(folder))


def test_positions_of_a_distributed_sampler_are_taken_up_at_another_number_of_processes(tmp_path) -> None:
    """A loader split by torch's DistributedSampler saved the same point of the epoch's order on
    every process (pretended: 2 processes' files, the sampler over 2 replicas): one process takes
    it up (gpuload.elastic) from sample 2 batches x 4 x 2 replicas = 16 of the epoch's order."""
    from torch.utils.data.distributed import DistributedSampler

    data = shuffled(TorchDataLoader).dataset

    def loader(replicas: int) -> gpuload.DataLoader:
        return gpuload.DataLoader(data, batch_size=4, sampler=DistributedSampler(data, replicas, 0, seed=3))

    accelerator = accelerate.Accelerator(cpu=True)
    ours = prepare_data_loader(accelerator, loader(2))
    epoch = iter(ours)
    next(epoch), next(epoch)
    folder = tmp_path / "ckpt"
    accelerator.save_state(str(folder))
    (folder / "gpuload_loader_0_1.pt").write_bytes((folder / "gpuload_loader_0_0.pt").read_bytes())
    accelerator = accelerate.Accelerator(cpu=True)
    resumed = prepare_data_loader(accelerator, loader(1))
    accelerator.load_state(str(folder))
    order = list(DistributedSampler(data, 1, 0, seed=3))
    assert [label for batch in resumed for label in batch[1].tolist()] == order[16:]


def test_a_prepared_loader_pickles() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    ours = prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is GpuloadShard and serves_from_gpuload(copy)
    assert len(list(copy)) == len(ours)


def readme_snippet(marker: str) -> str:
    """The docs' one python block that contains ``marker`` (gpuload/docs/drop-in.md; the test runs
    exactly that text)."""
    readme = (Path(__file__).parents[2] / "gpuload" / "docs" / "drop-in.md").read_text()
    [block] = [block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL) if marker in block]
    return block


def test_the_readme_snippet_runs_and_serves_from_gpuload() -> None:
    dataset = TensorDataset(torch.randn(200, 3), torch.randn(200, 1))
    model = torch.nn.Linear(3, 1)
    scope = {"gpuload": gpuload, "dataset": dataset, "model": model,
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(readme_snippet("from gpuload.integrations.accelerate import prepare"), scope)
    loader = scope["loader"]
    assert type(loader) is GpuloadShard and loader.cache_size == "8GiB"
    assert loader.base_dataloader.stats.batches == 4  # the snippet's loop ran the epoch from gpuload


def test_what_the_integration_does_not_take_is_refused_naming_it() -> None:
    from gpuload.integrations.accelerate import serve_from_gpuload

    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(TypeError, match=r"^prepare_data_loader takes a gpuload.DataLoader, got a DataLoader; pass "
                       "other loaders to accelerator.prepare$"):
        prepare_data_loader(accelerator, shuffled(TorchDataLoader))
    with pytest.raises(ValueError, match=r"^device_placement should be a list with 2 elements \(the number of "
                       r"objects passed\)$"):
        prepare(accelerator, torch.nn.Linear(1, 1), shuffled(gpuload.DataLoader), device_placement=[True])
    with pytest.raises(TypeError, match=r"^serve_from_gpuload takes the DataLoaderShard Accelerate prepares, got a "
                       r"DataLoader \(dispatch_batches=True"):
        serve_from_gpuload(shuffled(TorchDataLoader))
    shard = accelerator.prepare(shuffled(TorchDataLoader))
    with pytest.raises(TypeError, match=r"^serve_from_gpuload: unknown gpuload option\(s\) \['cache_sise'\]"):
        serve_from_gpuload(shard, cache_sise="1GiB")


def test_a_prepared_loader_prepared_again_and_loaders_without_torchs_batch_sampler() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    ours = prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))
    assert prepare_data_loader(accelerator, ours) is ours  # already Accelerate's: kept
    data = TensorDataset(torch.arange(12, dtype=torch.float32))
    unbatched = prepare_data_loader(accelerator, gpuload.DataLoader(data, batch_size=None))
    assert serves_from_gpuload(unbatched) and [b[0].item() for b in unbatched] == list(range(12))
    pairs = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 2, False)

    class Pairs:  # a batch sampler of the user's own: gpuload takes it as it is
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(pairs)

        def __len__(self) -> int:
            return len(pairs)

    own = prepare_data_loader(accelerator, gpuload.DataLoader(data, batch_sampler=Pairs()))
    assert serves_from_gpuload(own) and [b[0].tolist() for b in own] == [[2 * i, 2 * i + 1] for i in range(6)]


def test_an_iterable_dataset_keeps_its_batch_size() -> None:
    class Counting(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.arange(10))

    accelerator = accelerate.Accelerator(cpu=True)
    ours = prepare_data_loader(accelerator, gpuload.DataLoader(Counting(), batch_size=4))
    assert serves_from_gpuload(ours) and [b.tolist() for b in ours] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_an_accelerator_on_xla_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a TPU Accelerate wraps the loader in torch_xla's MpDeviceLoader, which gpuload cannot serve."""
    from accelerate.utils import DistributedType

    accelerator = accelerate.Accelerator(cpu=True)
    monkeypatch.setattr(type(accelerator), "distributed_type", property(lambda _: DistributedType.XLA))
    with pytest.raises(ValueError, match=r"^gpuload.integrations.accelerate does not run on XLA devices \(TPU\)"):
        prepare_data_loader(accelerator, shuffled(gpuload.DataLoader))
