"""Exact mid-epoch resume: batches before a checkpoint + batches after loading it = an uninterrupted run."""

from __future__ import annotations

import base64
import io
import pickle
import warnings

import pytest
import torch
import torch.utils.data as tud
from counting import Counted
from equivalence import assert_same
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload import transforms as T
from gpuload.datasets import make_sample_image_folder
from gpuload.resume import ResumeError

EPOCHS = 3


def images_uint8(n: int = 40) -> tud.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return tud.TensorDataset(torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=g), torch.arange(n))


AUGMENT = [T.RandomCrop(10, padding=2), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True)]


def run(make, epochs: int, stop: tuple[int, int] | None = None, set_epoch: bool = False):
    """Batches of ``epochs`` epochs; with ``stop=(e, k)``: only up to batch k of epoch e, then
    the loader's state (saved after that batch) as bytes."""
    loader = make()
    batches = []
    for epoch in range(epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        for k, batch in enumerate(loader):
            batches.append(batch)
            if stop == (epoch, k):
                buffer = io.BytesIO()
                torch.save(loader.state_dict(), buffer)
                return batches, buffer.getvalue()
    return batches, None


def resume(make, saved: bytes, from_epoch: int, epochs: int, set_epoch: bool = False):
    loader = make()
    loader.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    batches = []
    for epoch in range(from_epoch, epochs):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        batches.extend(loader)
    return batches


def assert_resumes_exactly(make, stops, epochs: int = EPOCHS, set_epoch: bool = False) -> None:
    whole, _ = run(make, epochs, set_epoch=set_epoch)
    for stop in stops:
        before, saved = run(make, epochs, stop, set_epoch=set_epoch)
        after = resume(make, saved, stop[0], epochs, set_epoch=set_epoch)
        assert len(before) + len(after) == len(whole), stop
        for ours, theirs in zip(before + after, whole):
            assert_same(ours, theirs)


STOPS = [(0, 0), (0, 3), (1, 5), (1, 6), (2, 2)]  # (1, 6): the last batch of an epoch


def seeded(**keywords):
    return lambda: gpuload.DataLoader(generator=torch.Generator().manual_seed(7), **keywords)


@pytest.mark.parametrize("drop_last", [False, True])
def test_arrays_shuffled_resume_exactly(drop_last: bool) -> None:
    data = images_uint8(30)
    assert_resumes_exactly(seeded(dataset=data, batch_size=4, shuffle=True, drop_last=drop_last), STOPS)


def test_arrays_with_transforms_resume_with_the_same_augmentation() -> None:
    make = seeded(dataset=images_uint8(30), batch_size=4, shuffle=True, transforms=AUGMENT)
    assert_resumes_exactly(make, STOPS)


def test_streamed_arrays_resume_exactly_though_prefetched_ahead() -> None:
    make = seeded(dataset=images_uint8(30), batch_size=4, shuffle=True, cache="off", prefetch_depth=3)
    assert_resumes_exactly(make, STOPS)


@pytest.mark.parametrize("workers", [0, 2])
def test_sample_cache_filling_or_full_resumes_exactly(workers: int) -> None:
    make = seeded(dataset=Counted(), batch_size=4, shuffle=True, cache="host", num_workers=workers)
    assert_resumes_exactly(make, [(0, 2), (1, 3), (2, 7)])


@pytest.mark.parametrize("workers", [0, 2])
def test_torchs_path_resumes_exactly(workers: int) -> None:
    make = seeded(dataset=Counted(), batch_size=4, shuffle=True, num_workers=workers, prefetch_depth=2)
    assert_resumes_exactly(make, [(0, 2), (1, 7), (2, 0)])


def test_distributed_sampler_with_set_epoch_resumes_exactly() -> None:
    data = images_uint8(30)

    def make():
        sampler = tud.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        return gpuload.DataLoader(data, batch_size=4, sampler=sampler)

    assert_resumes_exactly(make, [(0, 1), (1, 3), (2, 2)], set_epoch=True)


def test_global_generator_epochs_resume_exactly_when_the_training_restores_it() -> None:
    data = images_uint8(30)

    def make():
        return gpuload.DataLoader(data, batch_size=4, shuffle=True)  # no generator: torch's global one

    torch.manual_seed(5)
    whole, _ = run(make, EPOCHS)
    torch.manual_seed(5)
    before, saved = run(make, EPOCHS, (1, 2))
    rng = torch.get_rng_state()  # what a training checkpoint saves beside the loader's state
    torch.manual_seed(123)  # a new process
    torch.set_rng_state(rng)
    after = resume(make, saved, 1, EPOCHS)
    for ours, theirs in zip(before + after, whole, strict=True):
        assert_same(ours, theirs)


def test_image_folder_with_transforms_resumes_exactly(tmp_path) -> None:
    folder = make_sample_image_folder(tmp_path, num_images=18, num_classes=3, seed=2)
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    make = seeded(dataset=folder, batch_size=4, shuffle=True, transforms=ops, device="cpu")
    assert_resumes_exactly(make, [(0, 1), (1, 4)])


def test_a_checkpoint_at_an_epochs_end_continues_with_the_next_epoch() -> None:
    make = seeded(dataset=images_uint8(30), batch_size=5, shuffle=True)
    whole, _ = run(make, EPOCHS)
    loader = make()
    first = list(loader)  # the epoch ran to its StopIteration
    saved = loader.state_dict()
    assert saved["finished"] and saved["batches"] == 6
    resumed = make()
    resumed.load_state_dict(saved)
    rest = [batch for _ in range(EPOCHS - 1) for batch in resumed]
    for ours, theirs in zip(first + rest, whole, strict=True):
        assert_same(ours, theirs)


def test_resuming_reads_nothing_before_the_position() -> None:
    data = Counted(40)
    make = seeded(dataset=data, batch_size=4, shuffle=True)
    _, saved = run(make, 1, (0, 8))
    data.reads = 0
    loader = make()
    loader.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    iterator = iter(loader)
    assert len(iterator) == 1
    next(iterator)
    assert data.reads == 4  # only the one batch left


def test_the_state_is_small_plain_and_pickles() -> None:
    loader = gpuload.DataLoader(images_uint8(1000), batch_size=10, shuffle=True,
                                generator=torch.Generator().manual_seed(0))
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["batches"] == 7 and not state["finished"]
    assert len(pickle.dumps(state)) < 32 * 1024  # random states, not the epoch's 1000 indices
    copy = pickle.loads(pickle.dumps(state))
    assert copy["signature"] == state["signature"]


def test_a_state_from_other_arguments_is_refused_naming_what_differs() -> None:
    data = images_uint8(30)
    state = gpuload.DataLoader(data, batch_size=4).state_dict()
    with pytest.raises(ResumeError, match="batch_size: saved 4, now 5"):
        gpuload.DataLoader(data, batch_size=5).load_state_dict(state)
    with pytest.raises(ResumeError, match="dataset_length"):
        gpuload.DataLoader(images_uint8(31), batch_size=4).load_state_dict(state)
    with pytest.raises(ResumeError, match="transforms"):
        gpuload.DataLoader(data, batch_size=4, transforms=AUGMENT).load_state_dict(state)


class Stream(tud.IterableDataset):
    """An iterable dataset that saves its own position."""

    def __init__(self, n: int = 23) -> None:
        self.n, self.position = n, 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield torch.tensor([self.position - 1])
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_stateful_iterable_dataset_continues_from_its_own_state() -> None:
    whole = [b for _ in range(2) for b in gpuload.DataLoader(Stream(), batch_size=4, prefetch_depth=2)]
    loader = gpuload.DataLoader(Stream(), batch_size=4, prefetch_depth=2)  # kept in the loop: exact state
    iterator = iter(loader)
    before = [next(iterator) for _ in range(3)]
    saved = pickle.loads(pickle.dumps(loader.state_dict()))
    resumed = gpuload.DataLoader(Stream(), batch_size=4, prefetch_depth=2)
    resumed.load_state_dict(saved)
    after = list(resumed) + list(resumed)
    for ours, theirs in zip(before + after, whole, strict=True):
        assert_same(ours, theirs)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_stateful_stream_saved_after_its_partial_last_batch_resumes_as_an_empty_epoch(workers: int) -> None:
    """torch's fetcher ran the stream to its end filling the last batch of 2, so the dataset's
    saved state is the one after the end (reset): the resumed epoch is empty, as torchdata's
    StatefulDataLoader resumes it, and the next one whole (read by a worker: replayed)."""
    def make() -> gpuload.DataLoader:
        return gpuload.DataLoader(Stream(10), batch_size=4, num_workers=workers)

    whole = [b.flatten().tolist() for _ in range(2) for b in make()]
    loader = make()
    iterator = iter(loader)
    before = [next(iterator).flatten().tolist() for _ in range(3)]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    assert state["stream_ended"] is (workers == 0) and not state["finished"]
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b.flatten().tolist() for b in resumed]
    assert rest == []
    assert before + rest + [b.flatten().tolist() for b in resumed] == whole
    assert resumed.state_dict()["epoch"] == 1


def test_an_iterable_dataset_without_state_is_replayed_to_its_position() -> None:
    class Plain(tud.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = gpuload.DataLoader(Plain(), batch_size=3)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = gpuload.DataLoader(Plain(), batch_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == [[3, 4, 5], [6, 7, 8], [9]]
        fresh_state = gpuload.DataLoader(Plain(), batch_size=3).state_dict()
        gpuload.DataLoader(Plain(), batch_size=3).load_state_dict(fresh_state)


def test_a_replay_that_ends_early_says_so() -> None:
    class Shrinking(tud.IterableDataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self):
            return iter(range(self.n))

    loader = gpuload.DataLoader(Shrinking(10), batch_size=3)
    iterator = iter(loader)
    next(iterator), next(iterator)
    resumed = gpuload.DataLoader(Shrinking(2), batch_size=3)
    resumed.load_state_dict(loader.state_dict())
    with pytest.raises(ResumeError, match="ended after 1 batches"):
        iter(resumed)


def test_persistent_workers_resume_exactly_from_their_first_epoch() -> None:
    make = seeded(dataset=Counted(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    assert_resumes_exactly(make, [(0, 3), (1, 2)])


# -- what cannot be restored is said; what can be is restored exactly -------------------------


class PrivateShuffle(tud.Sampler):
    """A sampler with a random generator of its own under a name of its own, and no state_dict."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.rng).tolist())


class SavedShuffle(PrivateShuffle):
    """The same sampler, saving and restoring its generator itself."""

    def state_dict(self) -> dict:
        return {"rng": self.rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.set_state(state["rng"])


def test_a_sampler_with_its_own_state_dict_under_a_batch_sampler_resumes_exactly() -> None:
    data = images_uint8(30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_resumes_exactly(lambda: gpuload.DataLoader(data, batch_size=4, sampler=SavedShuffle(30, 1)), STOPS)


def test_a_sampler_with_a_generator_gpuload_cannot_save_is_named_once() -> None:
    data = images_uint8(30)
    loader = gpuload.DataLoader(data, batch_size=4, sampler=PrivateShuffle(30, 1))
    iterator = iter(loader)
    next(iterator)
    with pytest.warns(RuntimeWarning, match=r"PrivateShuffle keeps a random generator of its own \(rng\).*"
                                            r"state_dict\(\)/load_state_dict\(\)"):
        state = loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # once per loader
    with pytest.warns(RuntimeWarning, match="PrivateShuffle"):
        gpuload.DataLoader(data, batch_size=4, sampler=PrivateShuffle(30, 1)).load_state_dict(state)


@pytest.mark.parametrize("dataset", ["arrays", "samples"])
def test_a_state_saved_before_the_first_batch_keeps_the_global_generators_later_epochs(dataset: str) -> None:
    data = images_uint8(30) if dataset == "arrays" else Counted(30)

    def make():
        return gpuload.DataLoader(data, batch_size=4, shuffle=True)  # no generator: torch's global one

    torch.manual_seed(5)
    uninterrupted = make()
    whole = [batch for _ in range(EPOCHS) for batch in uninterrupted]
    torch.manual_seed(5)
    loader = make()
    before = list(loader)
    iter(loader)  # epoch 1 begun, no batch taken
    saved, rng = loader.state_dict(), torch.get_rng_state()
    torch.manual_seed(123)  # a new process, the training's checkpoint restored
    torch.set_rng_state(rng)
    resumed = make()
    resumed.load_state_dict(saved)
    after = [batch for _ in range(1, EPOCHS) for batch in resumed]
    for ours, theirs in zip(before + after, whole, strict=True):
        assert_same(ours, theirs)


@pytest.mark.parametrize("keywords", [{}, {"cache": "off", "prefetch_depth": 2}, {"num_workers": 2}],
                         ids=["arrays", "prefetched", "workers"])
def test_len_of_a_resumed_epochs_iterator_stays_fixed(keywords: dict) -> None:
    data = images_uint8(30) if not keywords.get("num_workers") else Counted(30)
    make = seeded(dataset=data, batch_size=4, shuffle=True, **keywords)
    _, saved = run(make, 1, (0, 2))
    loader = make()
    loader.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    iterator = iter(loader)
    lengths = [len(iterator)]
    for _ in iterator:
        lengths.append(len(iterator))
    assert lengths == [len(loader) - 3] * (len(loader) - 2)  # the batches left, as it began


def test_a_distributed_samplers_seed_is_part_of_the_state() -> None:
    data = images_uint8(30)

    def make(seed: int):
        sampler = tud.DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=seed)
        return gpuload.DataLoader(data, batch_size=4, sampler=sampler)

    loader = make(0)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ResumeError, match="sampler_seed: saved 0, now 1"):
        make(1).load_state_dict(state)
    make(0).load_state_dict(state)


def test_a_state_that_is_not_one_is_one_clear_error() -> None:
    data = images_uint8(30)
    with pytest.raises(ResumeError, match="takes the dict that gpuload.DataLoader.state_dict.. returned, not NoneType"):
        gpuload.DataLoader(data, batch_size=4).load_state_dict(None)
    state = gpuload.DataLoader(data, batch_size=4).state_dict()
    del state["signature"]
    with pytest.raises(ResumeError, match="lacks signature"):
        gpuload.DataLoader(data, batch_size=4).load_state_dict(state)


def test_a_generator_passed_or_not_is_refused_at_load_state_dict() -> None:
    data = images_uint8(30)
    loader = seeded(dataset=data, batch_size=4, shuffle=True)()
    next(iter(loader))  # mid-epoch: the generators are set only at the next iter()
    state = loader.state_dict()
    unseeded = gpuload.DataLoader(data, batch_size=4, shuffle=True)
    with pytest.raises(ResumeError, match=r"1 random generator\(s\).*this loader has 0"):
        unseeded.load_state_dict(state)


def test_a_state_of_another_version_is_refused_naming_both() -> None:
    data = images_uint8(30)
    state = gpuload.DataLoader(data, batch_size=4).state_dict()
    state["version"] = 0
    with pytest.raises(ResumeError, match="loader state version 0 is not 1"):
        gpuload.DataLoader(data, batch_size=4).load_state_dict(state)


def test_generator_states_saved_as_tensors_or_lists_resume_exactly() -> None:
    """States saved before generator states became base64 text held them as tensors (a list
    after a trip through JSON); they load as the text does."""
    make = seeded(dataset=images_uint8(30), batch_size=4, shuffle=True)
    whole, _ = run(make, 2)
    before, saved = run(make, 2, (0, 2))
    state = torch.load(io.BytesIO(saved), weights_only=False)
    random = state["random"]
    random["generators"] = [torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
                            for text in random["generators"]]
    random["global"] = list(base64.b64decode(random["global"]))
    loader = make()
    loader.load_state_dict(state)
    after = [batch for _ in range(2) for batch in loader]
    assert len(before) + len(after) == len(whole)
    for ours, theirs in zip(before + after, whole):
        assert_same(ours, theirs)


SPLIT = tud.TensorDataset(torch.arange(48))


def split_loader(world: int, batch_size: int | None = 3, drop_last: bool = False) -> gpuload.DataLoader:
    """Rank 0 of ``world`` ranks of a DistributedSampler over 48 samples (no process group)."""
    sampler = DistributedSampler(SPLIT, num_replicas=world, rank=0, shuffle=True, seed=3, drop_last=drop_last)
    return gpuload.DataLoader(SPLIT, batch_size, sampler=sampler, device="cpu")


def state_after(loader: gpuload.DataLoader, batches: int) -> dict:
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.state_dict()


def test_a_state_of_a_sampler_that_drops_the_last_samples_otherwise_is_refused() -> None:
    state = state_after(split_loader(2), 1)
    with pytest.raises(ResumeError, match="orders the epoch differently: drop_last: saved False, now True"):
        split_loader(4, drop_last=True).load_state_dict(state)


def test_a_state_at_an_epochs_end_loads_at_another_world_size() -> None:
    loader = split_loader(2)
    list(loader)
    loader_at_4 = split_loader(4)
    loader_at_4.load_state_dict(loader.state_dict())
    assert loader_at_4.state_dict()["distributed"]["num_replicas"] == 4
    assert [batch[0].tolist() for batch in loader_at_4] == [batch[0].tolist() for batch in split_loader(4)]


def test_a_state_after_a_batch_size_change_loads_at_its_own_world_size_only() -> None:
    loader = split_loader(2)
    iterator = iter(loader)
    next(iterator)
    loader.set_batch_size(6)
    next(iterator)
    with pytest.raises(ResumeError, match=r"batch size changed \(set_batch_size\); resume it at that world size"):
        split_loader(4).load_state_dict(loader.state_dict())


def test_another_world_size_needs_torchs_batch_sampler() -> None:
    with pytest.raises(ResumeError, match="needs torch's BatchSampler over the DistributedSampler"):
        split_loader(4, batch_size=None).load_state_dict(state_after(split_loader(2), 1))


@pytest.mark.parametrize("world, ways", [(3, "(at world size 3: batch size 1, 2)"), (4, "(no world size fits)")])
def test_a_world_size_no_batch_ends_at_names_the_batch_sizes_that_would(world: int, ways: str) -> None:
    """1 batch of 3 on 2 ranks: 6 samples taken, which batches of 4 at 3 or 4 ranks do not end at."""
    with pytest.raises(ResumeError, match="the first 6 samples") as caught:
        split_loader(world, batch_size=4).load_state_dict(state_after(split_loader(2), 1))
    assert ways in str(caught.value)
