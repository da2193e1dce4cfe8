"""loader.set_batch_size(n): the rest of the epoch is its sample order cut at the new size (no
sample skipped or repeated), on every path, and a state saved after a change resumes exactly."""

from __future__ import annotations

import io
import time
import warnings

import image_fixtures as F
import pytest
import torch
import torch.utils.data as tud
from counting import Counted
from equivalence import assert_same

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageFolder

SEED = 7


def images_uint8(n: int = 30) -> tud.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return tud.TensorDataset(torch.randint(0, 256, (n, 3, 6, 6), dtype=torch.uint8, generator=g), torch.arange(n))


def photo_folder(root, n: int = 14) -> ImageFolder:
    """``n`` real photographs (crops of the fixture photo) in two class folders."""
    photo = F.photo()
    for k in range(n):
        folder = root / f"class{k % 2}"
        folder.mkdir(exist_ok=True)
        crop = photo.crop((3 * k, 2 * k, 3 * k + 40, 2 * k + 36))
        (folder / f"{k:02d}.jpg").write_bytes(F.encode(crop, quality=90))
    return ImageFolder(root)


def seeded(**keywords):
    return lambda: gpuload.DataLoader(generator=torch.Generator().manual_seed(SEED), **keywords)


def torch_orders(dataset, epochs: int, **keywords) -> list[list[int]]:
    """Each epoch's sample order from torch's own DataLoader with the same generator."""
    loader = tud.DataLoader(dataset, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(SEED),
                            **keywords)
    orders = []
    for _ in range(epochs):
        orders.append([int(i) for i in torch.cat([torch.as_tensor(b).view(-1) for b in (ids(x) for x in loader)])])
    return orders


def ids(batch) -> torch.Tensor:
    """The dataset indices of a batch (labels of the arrays, Counted's names)."""
    if isinstance(batch, dict):
        return torch.tensor([int(name[1:]) for name in batch["name"]])
    return batch[1]


def run(make, changes: dict[tuple[int, int], int], epochs: int = 2, stop: tuple[int, int] | None = None):
    """Batches of ``epochs`` epochs, calling ``set_batch_size(n)`` after batch k of epoch e for
    each ``(e, k): n``; with ``stop``, also the state saved after that batch (and its change)."""
    loader = make()
    batches: list[list] = []
    for epoch in range(epochs):
        batches.append([])
        for k, batch in enumerate(loader):
            batches[-1].append(batch)
            if (epoch, k) in changes:
                loader.set_batch_size(changes[(epoch, k)])
            if stop == (epoch, k):
                buffer = io.BytesIO()
                torch.save(loader.state_dict(), buffer)
                return batches, buffer.getvalue()
    return batches, None


def resume(make, saved: bytes, from_epoch: int, epochs: int = 2) -> list:
    loader = make()
    loader.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    return [batch for _ in range(from_epoch, epochs) for batch in loader]


def sizes(epoch: list) -> list[int]:
    return [len(ids(batch)) for batch in epoch]


def expected_sizes(total: int, size: int, changes: dict[int, int], drop_last: bool) -> list[int]:
    """Batch sizes of one epoch of ``total`` samples begun at ``size``, changed to ``changes[k]``
    after batch k: the rest cut at the new size, a short last batch left out with drop_last."""
    out, done = [], 0
    while done < total:
        take = min(size, total - done)
        if take < size and drop_last:
            break
        out.append(take)
        done += take
        size = changes.get(len(out) - 1, size)
    return out


CHANGES = {(0, 1): 7, (0, 3): 3, (1, 0): 5}  # bigger, then smaller, then again in the next epoch


def assert_order_kept(make, dataset, drop_last: bool = False, epochs: int = 2, **torch_keywords) -> list[list]:
    """Each epoch's samples, over the changes, are torch's epoch order (``torch_keywords``: the
    loader's arguments that change how torch draws it, e.g. persistent workers)."""
    batches, _ = run(make, CHANGES, epochs)
    orders = torch_orders(dataset, epochs, **torch_keywords)
    total = len(orders[0])
    expected = [expected_sizes(total, 4, {1: 7, 3: 3}, drop_last), expected_sizes(total, 3, {0: 5}, drop_last)]
    for epoch, order in enumerate(orders):
        assert sizes(batches[epoch]) == expected[epoch]
        got = torch.cat([ids(batch) for batch in batches[epoch]]).tolist()
        assert got == order[: len(got)] and len(got) == sum(expected[epoch])  # no skip, no repeat
    return batches


def assert_resumes_after_changes(make, stops, epochs: int = 2) -> None:
    whole, _ = run(make, CHANGES, epochs)
    flat = [batch for epoch in whole for batch in epoch]
    for stop in stops:
        before, saved = run(make, CHANGES, epochs, stop)
        later = {key: size for key, size in CHANGES.items() if key > stop}
        after = resume_with_changes(make, saved, stop, later, epochs)
        ours = [batch for epoch in before for batch in epoch] + after
        assert len(ours) == len(flat), stop
        for a, b in zip(ours, flat):
            assert_same(a, b)


def resume_with_changes(make, saved: bytes, stop: tuple[int, int], changes, epochs: int) -> list:
    """The batches after ``stop`` from a loader that loaded ``saved``, making the changes the
    uninterrupted run made after that point."""
    loader = make()
    loader.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    out = []
    for epoch in range(stop[0], epochs):
        start = stop[1] + 1 if epoch == stop[0] else 0
        for k, batch in enumerate(loader, start=start):
            out.append(batch)
            if (epoch, k) in changes:
                loader.set_batch_size(changes[(epoch, k)])
    return out


STOPS = [(0, 1), (0, 2), (0, 4), (1, 0), (1, 2)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_arrays_in_the_loop_keep_the_epochs_order(drop_last: bool) -> None:
    data = images_uint8()
    make = seeded(dataset=data, batch_size=4, shuffle=True, drop_last=drop_last)
    assert_order_kept(make, data, drop_last)
    assert_resumes_after_changes(make, STOPS)


def test_arrays_prefetched_ahead_drop_what_was_made_with_the_old_size() -> None:
    data = images_uint8()
    make = seeded(dataset=data, batch_size=4, shuffle=True, cache="off", prefetch_depth=4)
    loader = make()
    iterator = iter(loader)
    first = next(iterator)
    # the prefetcher runs ahead with batches of 4 (each 4 x (108 + 8) bytes); then the change
    ahead = 4 * 4 * (3 * 6 * 6 + 8)
    deadline = time.monotonic() + 30
    while loader._prefetcher.stats.bytes_copied < ahead and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader._prefetcher.stats.bytes_copied >= ahead
    loader.set_batch_size(6)
    rest = list(iterator)
    assert [len(b[1]) for b in rest] == [6, 6, 6, 6, 2]
    got = torch.cat([first[1], *[b[1] for b in rest]]).tolist()
    assert got == torch_orders(data, 1)[0]
    assert_order_kept(make, data)
    assert_resumes_after_changes(make, STOPS)


@pytest.mark.parametrize("workers", [0, 2])
def test_sample_cache_keeps_the_epochs_order(workers: int) -> None:
    data = Counted(30)
    make = seeded(dataset=data, batch_size=4, shuffle=True, cache="host", num_workers=workers)
    assert_order_kept(make, data)
    assert_resumes_after_changes(make, [(0, 2), (1, 0)])


class IntIndices(Counted):
    """Counted that insists on Python ints, as torch's fetcher hands them to ``__getitem__``."""

    def __getitem__(self, index):
        assert type(index) is int, type(index)
        return super().__getitem__(index)


@pytest.mark.parametrize("persistent", [False, True])
def test_torchs_workers_keep_the_epochs_order(persistent: bool) -> None:
    data = IntIndices(30)
    workers = {"num_workers": 2, "persistent_workers": True} if persistent else {}
    make = seeded(dataset=data, batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent)
    assert_order_kept(make, data, **workers)
    assert_resumes_after_changes(make, [(0, 2), (1, 1)])


def test_image_folder_keeps_the_epochs_order(tmp_path) -> None:
    folder = photo_folder(tmp_path)
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    make = seeded(dataset=folder, batch_size=4, shuffle=True, transforms=ops, device="cpu")
    unchanged = [b for _ in range(1) for b in make()]
    loader = make()
    batches = []
    for k, batch in enumerate(loader):
        batches.append(batch)
        if k == 0:
            loader.set_batch_size(5)
        if k == 1:
            loader.set_batch_size(2)
    assert [len(b[1]) for b in batches] == [4, 5, 2, 2, 1]
    # each sample's augmentation is a function of (seed, epoch, index): the same images, re-cut
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.cat([b[0] for b in unchanged]))
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.cat([b[1] for b in unchanged]))
    assert_resumes_after_changes(make, [(0, 1), (1, 0)])
    # without transforms the images are the files decoded: torch's own loader over the folder
    # gives the epoch's order
    plain = seeded(dataset=folder, batch_size=4, shuffle=True, device="cpu")()
    decoded = []
    for k, batch in enumerate(plain):
        decoded.append(batch[0])
        if k == 0:
            plain.set_batch_size(3)
    assert [len(images) for images in decoded] == [4, 3, 3, 3, 1]
    theirs = tud.DataLoader(folder, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    assert torch.equal(torch.cat(decoded), torch.cat([images for images, _ in theirs]))


def test_len_and_later_epochs_follow_the_new_size() -> None:
    make = seeded(dataset=images_uint8(30), batch_size=4, shuffle=True)
    loader = make()
    assert len(loader) == 8
    iterator = iter(loader)
    next(iterator), next(iterator)
    loader.set_batch_size(10)
    assert loader.batch_size == 10 and len(loader) == 3  # a whole epoch at the new size
    assert len(iterator) == 2 + 3  # this epoch: 2 done, then 22 samples in 10, 10, 2
    assert len(list(iterator)) == 3
    assert [len(b[1]) for b in loader] == [10, 10, 10]


def test_a_change_before_the_first_epoch_or_after_loading_a_state() -> None:
    data = images_uint8(30)
    loader = seeded(dataset=data, batch_size=4, shuffle=True)()
    loader.set_batch_size(8)
    assert [len(b[1]) for b in loader] == [8, 8, 8, 6]
    # a change right after load_state_dict re-cuts the loaded epoch at its position
    _, saved = run(seeded(dataset=data, batch_size=4, shuffle=True), {}, 1, stop=(0, 2))
    resumed = seeded(dataset=data, batch_size=4, shuffle=True)()
    resumed.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
    resumed.set_batch_size(9)
    rest = list(resumed)
    assert [len(b[1]) for b in rest] == [9, 9]
    assert torch.cat([b[1] for b in rest]).tolist() == torch_orders(data, 1)[0][12:]


def test_what_cannot_change_its_batch_size_says_why() -> None:
    data = images_uint8(10)
    own = gpuload.DataLoader(data, batch_sampler=tud.BatchSampler(tud.SequentialSampler(data), 3, False))
    with pytest.raises(ValueError, match="mutually exclusive with batch_size"):
        own.set_batch_size(4)
    with pytest.raises(ValueError, match="batch_size=None"):
        gpuload.DataLoader(data, batch_size=None).set_batch_size(4)

    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(ValueError, match="IterableDataset"):
        gpuload.DataLoader(Stream(), batch_size=2).set_batch_size(4)
    loader = gpuload.DataLoader(data, batch_size=3)
    for bad in (0, -1, 2.0, True, "4", 2**31):
        with pytest.raises(ValueError, match="positive integer"):
            loader.set_batch_size(bad)
    with pytest.raises(ValueError, match="should not be set after DataLoader is initialized.*set_batch_size"):
        loader.batch_size = 5
    assert loader.batch_size == 3 and [len(b[0]) for b in loader] == [3, 3, 3, 1]


def test_the_state_keeps_the_size_and_a_loader_built_otherwise_is_refused() -> None:
    data = images_uint8(30)
    make = seeded(dataset=data, batch_size=4, shuffle=True)
    loader = make()
    list(loader)
    loader.set_batch_size(6)
    state = loader.state_dict()
    assert state["signature"]["batch_size"] == 4 and state["batch_size"] == 6
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.batch_size == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [len(b[1]) for b in resumed] == [6] * 5
    with pytest.raises(gpuload.resume.ResumeError, match="batch_size: saved 4, now 6"):
        seeded(dataset=data, batch_size=6, shuffle=True)().load_state_dict(state)


def test_a_sampler_of_keys_that_are_not_integers_is_re_cut_as_lists() -> None:
    class Keyed(tud.Dataset):
        def __getitem__(self, key: str):
            return torch.tensor([ord(key)])

        def __len__(self) -> int:
            return 26

    keys = [chr(ord("a") + k) for k in range(26)]
    sampler = tud.SubsetRandomSampler(keys, generator=torch.Generator().manual_seed(SEED))
    loader = gpuload.DataLoader(Keyed(), batch_size=4, sampler=sampler)
    batches = []
    for k, batch in enumerate(loader):
        batches.append(batch.view(-1))
        if k == 1:
            loader.set_batch_size(10)
    assert [len(b) for b in batches] == [4, 4, 10, 8]
    sampler.generator.manual_seed(SEED)
    assert torch.cat(batches).tolist() == [ord(key) for key in sampler]


@pytest.mark.parametrize("keywords", [{}, {"cache": "off", "prefetch_depth": 2},
                                      {"dataset": Counted(30), "cache": "host"}],
                         ids=["in-place", "prefetched", "sample-cache"])
@pytest.mark.parametrize("batch_size", [4, 5])  # a shorter last batch, or a full one at the epoch's end
def test_a_change_after_an_epochs_last_batch_leaves_nothing_to_cut(keywords: dict, batch_size: int) -> None:
    """Nothing of the epoch is left: it ends there (no empty batch), and the next one is cut at
    the new size."""
    keywords = {"dataset": images_uint8(30), **keywords}
    loader = seeded(batch_size=batch_size, shuffle=True, **keywords)()
    iterator, got = iter(loader), []
    for k, batch in enumerate(iterator):
        got.append(len(ids(batch)))
        if k == len(iterator) - 1:
            loader.set_batch_size(7)
    assert got == expected_sizes(30, batch_size, {}, False) and len(iterator) == len(got)
    assert [len(ids(batch)) for batch in loader] == [7, 7, 7, 7, 2]


def test_a_change_before_the_first_batch_keeps_the_global_generators_later_epochs() -> None:
    data = tud.TensorDataset(torch.arange(30))
    torch.manual_seed(5)
    built = gpuload.DataLoader(data, batch_size=3, shuffle=True, device="cpu")  # torch's global generator
    expected = [batch for _ in range(3) for batch in built]
    torch.manual_seed(5)
    changed = gpuload.DataLoader(data, batch_size=4, shuffle=True, device="cpu")
    iterator = iter(changed)
    changed.set_batch_size(3)  # before the sampler drew the epoch's order
    got = list(iterator) + [batch for _ in range(2) for batch in changed]
    assert [b[0].tolist() for b in got] == [b[0].tolist() for b in expected]
