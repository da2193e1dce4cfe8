"""Resume as torchdata's StatefulDataLoader (0.11.0) tests it, rewritten for gpuload.DataLoader.

The cases of torchdata's ``test/stateful_dataloader/test_state_dict.py`` that describe what a user
moving from ``StatefulDataLoader`` relies on: iterable datasets with and without their own state,
with and without workers (persistent or not), map-style datasets with torch's and stateful
samplers, a state taken before the first batch, at an epoch's end and over several epochs, and
``in_order=False``. torchdata's internal state keys and its ``snapshot_every_n_steps`` are not
gpuload's; the differences that remain are listed in the README (resume).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.utils.data as tud

import gpuload
from gpuload.resume import _packed, _unpacked


def identity(x):
    return x


class CountingStream(tud.IterableDataset):
    """Each worker's share of ``range(sum(sizes))``; its own state is the position, which
    ``__iter__`` resets (and takes from a loaded state), as torchdata's GeneratorIterable."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.resume_at: int | None = None

    def _share(self) -> range:
        info = tud.get_worker_info()
        sizes = self.sizes if info is not None else [sum(self.sizes)]
        worker = info.id if info is not None else 0
        start = sum(sizes[:worker])
        return range(start, start + sizes[worker])

    def __iter__(self):
        self.done = 0  # set only here: the main process's copy of a dataset read by workers has none
        if self.resume_at is not None:
            self.done, self.resume_at = self.resume_at, None
        return self._values(self._share()[self.done:])

    def _values(self, values: range):
        for value in values:
            self.done += 1
            yield value
        self.done = 0  # a state at the epoch's end starts the next one whole (torchdata's convention)

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["done"]


class CountingStreamNoState(CountingStream):
    """The same stream without a state of its own."""

    state_dict = load_state_dict = None  # type: ignore[assignment]

    def __iter__(self):
        yield from self._share()


class RandomStream(tud.IterableDataset):
    """An iterator over ``samples`` drawing each from torch's global generator; its state holds
    the position and the global generator's state (torchdata's DummyIteratorIterableDataset)."""

    def __init__(self, size: int) -> None:
        self.size, self.i = size, 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.i >= self.size:
            raise StopIteration
        self.i += 1
        return int(torch.randint(1000, (1,)))

    def state_dict(self) -> dict:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class Draws:
    """An iterator over ``samples`` that draws each from torch's global generator, with its own
    state (position and the global generator's state): torchdata's DummyIterator."""

    def __init__(self, samples: list[int]) -> None:
        self.samples, self.i = samples, 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.i >= len(self.samples):
            raise StopIteration
        self.i += 1
        return self.samples[int(torch.randint(len(self.samples), (1,)))]

    def state_dict(self) -> dict:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class DrawingStream(tud.IterableDataset):
    """An iterable dataset without a state of its own whose ``__iter__`` returns a stateful
    iterator per worker share (torchdata's DummyIterableDataset)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self):
        info = tud.get_worker_info()
        sizes = self.sizes if info is not None else [sum(self.sizes)]
        worker = info.id if info is not None else 0
        start = sum(sizes[:worker])
        return Draws(list(range(start, start + sizes[worker])))


class Windowed(tud.IterableDataset):
    """Its own iterator, whose window ``__iter__`` sets afresh (torchdata's CountIterCallsIter):
    a state loaded before ``__iter__`` would be overwritten by it."""

    def __init__(self, length: int) -> None:
        self.length, self.iter_calls = length, 0

    def __iter__(self):
        self.iter_calls += 1
        info = tud.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        share = self.length // workers
        self.window = [share * worker, share * (worker + 1)]
        return self

    def __next__(self) -> int:
        if self.window[0] >= self.window[1]:
            raise StopIteration
        self.window[0] += 1
        return self.window[0] - 1

    def state_dict(self) -> dict:
        return {"window": list(self.window), "iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict) -> None:
        self.window = list(state["window"])


class Records(tud.Dataset):
    """torchdata's DummyMapDataset without its random reads."""

    def __init__(self, size: int) -> None:
        self.data = [{"id": i, "strcol": f"strcol_{i}", "listcol": [i, i + 1, i + 2]} for i in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return self.data[i]


class CountingSampler(tud.Sampler):
    """A sampler whose iterator keeps its own position (torchdata's DummySampler)."""

    def __init__(self, size: int) -> None:
        self.size, self.i = size, 0

    def __iter__(self):
        start, self.i = self.i, 0
        for index in range(start, self.size):
            self.i = index + 1
            yield index

    def __len__(self) -> int:
        return self.size

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def _stream_loader(dataset: tud.IterableDataset, num_workers: int, pw: bool = False, **kwargs) -> gpuload.DataLoader:
    return gpuload.DataLoader(dataset, num_workers=num_workers, collate_fn=identity, persistent_workers=pw,
                              device="cpu", **kwargs)


def _interrupted(make, interrupt: int) -> tuple[list, list, dict]:
    """(batches before the state, batches after it, the state) of one uninterrupted epoch."""
    loader = make()
    iterator = iter(loader)
    before = [next(iterator) for _ in range(interrupt)]
    state = loader.state_dict()
    return before, list(iterator), state


def _resumed(make, state: dict) -> list:
    loader = make()
    loader.load_state_dict(state)
    return list(loader)


@pytest.mark.parametrize("interrupt", [0, 1, 10])
@pytest.mark.parametrize("num_workers,pw", [(0, False), (3, False), (3, True)])
def test_stream_with_own_state(num_workers: int, pw: bool, interrupt: int) -> None:
    """A position set in ``__iter__`` survives (its state is loaded after ``__iter__``); read by
    workers, ``state_dict()`` does not ask the main process's copy, and the epoch is replayed."""
    def make():
        return _stream_loader(CountingStream([0, 100, 37]), num_workers, pw)

    expected = list(make())
    before, after, state = _interrupted(make, interrupt)
    assert before + after == expected
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gpuload")
        assert _resumed(make, state) == after


@pytest.mark.parametrize("interrupt", [0, 1, 10])
@pytest.mark.parametrize("num_workers", [0, 3])
def test_stream_without_state_is_replayed(num_workers: int, interrupt: int) -> None:
    def make():
        return _stream_loader(CountingStreamNoState([0, 100, 37]), num_workers, batch_size=7)

    before, after, state = _interrupted(make, interrupt)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gpuload")
        assert _resumed(make, state) == after


@pytest.mark.parametrize("interrupt", [0, 1, 10])
def test_stream_saving_the_global_generator(interrupt: int) -> None:
    """The dataset's saved global generator is the one its next draws use: torch's base-seed
    draw for the resumed epoch's iterator comes before the dataset's state is loaded."""
    torch.manual_seed(5)
    before, after, state = _interrupted(lambda: _stream_loader(RandomStream(40), 0), interrupt)
    torch.manual_seed(123)  # another live stream: the dataset's state sets it
    assert _resumed(lambda: _stream_loader(RandomStream(40), 0), state) == after


@pytest.mark.parametrize("interrupt", [0, 1, 10])
@pytest.mark.parametrize("num_workers", [0, 3])
def test_stream_whose_iterator_has_its_own_state(num_workers: int, interrupt: int) -> None:
    """Without workers the iterator's own state is saved and loaded into the resumed epoch's
    iterator; with workers the epoch is replayed from its saved seeds."""
    def make():
        return _stream_loader(DrawingStream([0, 100, 37]), num_workers, batch_size=7)

    torch.manual_seed(3)
    _, after, state = _interrupted(make, interrupt)
    torch.manual_seed(99)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gpuload")
        assert _resumed(make, state) == after


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_that_sets_its_window_in_iter(num_workers: int) -> None:
    """torchdata's TestStateInitializationDataset: 70 samples, a state, the last 30 resumed."""
    make = lambda: _stream_loader(Windowed(100), num_workers)  # noqa: E731
    loader = make()
    iterator = iter(loader)
    data = [value for _ in range(70) for value in next(iterator)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    iterator = iter(resumed)
    data += [value for _ in range(30) for value in next(iterator)]
    assert sorted(data) == list(range(100))


@pytest.mark.parametrize("pw", [False, True])
def test_stream_checkpoint_at_epoch_end(pw: bool) -> None:
    """A state at an epoch's end starts the next epoch whole (with persistent workers too: the
    previous epoch's dataset state is never what is saved)."""
    def make():
        return _stream_loader(CountingStream([0, 100, 37]), 3, pw, batch_size=4)

    loader = make()
    expected = list(loader)
    state = loader.state_dict()
    assert list(loader) == expected
    loader = make()
    iterator = iter(loader)
    next(iterator), next(iterator)
    loader.load_state_dict(state)
    assert list(loader) == expected


def test_stream_state_between_epochs_no_workers() -> None:
    def make():
        return _stream_loader(CountingStream([137]), 0)

    loader = make()
    list(loader)
    state = loader.state_dict()
    expected = list(loader)
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == expected


def test_state_before_the_first_batch_of_a_loaded_stream() -> None:
    """A state taken after load_state_dict and before iter() is the loaded one."""
    make = lambda: _stream_loader(CountingStream([30]), 0)  # noqa: E731
    _, after, state = _interrupted(make, 7)
    loader = make()
    loader.load_state_dict(state)
    again = loader.state_dict()
    assert again["dataset"] == state["dataset"]
    assert _resumed(make, again) == after


def test_state_before_the_first_batch_of_a_loaded_stream_iterator() -> None:
    """A state taken after load_state_dict and before iter() holds the loaded state of the
    iterator ``__iter__`` returns (the dataset itself has none)."""
    def make() -> gpuload.DataLoader:
        return _stream_loader(DrawingStream([30]), 0)

    _, after, state = _interrupted(make, 7)
    loader = make()
    loader.load_state_dict(state)
    again = loader.state_dict()
    assert again["dataset_iterator"]["i"] == state["dataset_iterator"]["i"] == 7
    assert _resumed(make, again) == after


@pytest.mark.parametrize("interrupt", [0, 1, 10])
@pytest.mark.parametrize("num_workers,pw", [(0, False), (3, True)])
def test_map_random_sampler_with_generator(num_workers: int, pw: bool, interrupt: int) -> None:
    def make():
        sampler = tud.RandomSampler(range(100), generator=torch.Generator().manual_seed(13))
        return gpuload.DataLoader(Records(100), batch_size=7, sampler=sampler, num_workers=num_workers,
                                  persistent_workers=pw, collate_fn=identity, device="cpu")

    _, after, state = _interrupted(make, interrupt)
    assert _resumed(make, state) == after


@pytest.mark.parametrize("interrupt", [0, 1, 10])
def test_map_stateful_sampler(interrupt: int) -> None:
    def make():
        return gpuload.DataLoader(Records(100), batch_size=7, sampler=CountingSampler(100),
                                  collate_fn=identity, device="cpu")

    _, after, state = _interrupted(make, interrupt)
    assert _resumed(make, state) == after


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_shuffle_over_epochs(num_workers: int) -> None:
    """Two epochs, a state, two more in a new loader: the four epochs of one loader (torchdata's
    TestMultiEpochSDL; the global generator is the loader's, set by the seed)."""
    def make():
        return gpuload.DataLoader(Records(20), batch_size=3, shuffle=True, num_workers=num_workers,
                                  collate_fn=identity, device="cpu")

    torch.manual_seed(0)
    loader = make()
    seen = [batch for _ in range(2) for batch in loader]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    seen += [batch for _ in range(2) for batch in resumed]
    torch.manual_seed(0)
    whole = make()
    assert seen == [batch for _ in range(4) for batch in whole]


def test_map_end_of_epoch_states() -> None:
    """A state after the last batch but before the epoch's StopIteration resumes an empty rest;
    one after it, a whole next epoch (torchdata's TestEndOfEpochBehavior)."""
    def make():
        return gpuload.DataLoader(Records(10), batch_size=1, shuffle=True, collate_fn=identity, device="cpu")

    loader = make()
    for _ in loader:
        inside = loader.state_dict()
    outside = loader.state_dict()
    assert _resumed(make, inside) == []
    assert len(_resumed(make, outside)) == 10


class SlowFirst(tud.Dataset):
    """Index 0 is slow, so workers with ``in_order=False`` hand later batches over first."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i == 0:
            import time
            time.sleep(1.0)
        return i


@pytest.mark.parametrize("prefetch_depth", [None, 2])
def test_out_of_order_workers_resume_exactly(prefetch_depth: int | None) -> None:
    """``in_order=False`` with workers (torchdata's TestOutOfOrderWithCheckpointing): the slow
    sample 0 is still in flight after 4 batches; the resumed epoch gives exactly the rest,
    every sample once (also when batches were made ahead of the loop)."""
    def make():
        return gpuload.DataLoader(SlowFirst(), num_workers=2, in_order=False, device="cpu",
                                  prefetch_depth=prefetch_depth)

    loader = make()
    output = []
    for i, batch in enumerate(loader):
        output.append(int(batch))
        if i == 3:
            state = loader.state_dict()
            break
    assert 0 not in output  # the slow sample was still in flight
    assert json.loads(json.dumps(state))["out_of_order"] == state["out_of_order"]
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    iterator = iter(resumed)
    assert len(iterator) == 6
    output += [int(batch) for batch in iterator]
    assert len(output) == 10 and sorted(output) == list(range(10))


def test_out_of_order_resumed_twice() -> None:
    """A state taken inside a resumed out-of-order epoch holds the places of both parts."""
    def make():
        return gpuload.DataLoader(SlowFirst(), num_workers=2, in_order=False, device="cpu")

    loader = make()
    iterator = iter(loader)
    output = [int(next(iterator)) for _ in range(3)]
    second = make()
    second.load_state_dict(loader.state_dict())
    iterator = iter(second)
    output += [int(next(iterator)) for _ in range(3)]
    third = make()
    third.load_state_dict(second.state_dict())
    output += [int(batch) for batch in third]
    assert sorted(output) == list(range(10))


def test_the_places_done_out_of_order_are_kept_as_a_prefix_and_the_others() -> None:
    """The first batches handed over in a row are one number; the state stays small however long the epoch."""
    delivered = {0, 1, 2, 5, 7}
    assert _packed(delivered) == {"prefix": 3, "others": [5, 7]}
    assert _unpacked(_packed(delivered)) == delivered
    assert _packed(set(range(10_000))) == {"prefix": 10_000, "others": []}
    assert _packed(None) is None and _unpacked(None) is None


def test_out_of_order_epoch_refuses_set_batch_size() -> None:
    loader = gpuload.DataLoader(Records(12), batch_size=2, num_workers=2, in_order=False, collate_fn=identity,
                                device="cpu")
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ValueError, match="in_order=False"):
        loader.set_batch_size(3)
    assert loader.batch_size == 2


def test_in_order_state_has_no_out_of_order_places() -> None:
    loader = gpuload.DataLoader(Records(10), num_workers=2, in_order=True, collate_fn=identity, device="cpu")
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["out_of_order"] is None


@pytest.mark.parametrize("kind", ["stream", "map"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_goes_through_json(kind: str, num_workers: int) -> None:
    """torchdata's TestJsonSerDe: the state survives json.dumps/json.loads (a shuffled map-style
    loader with a generator too: the generators' states are text)."""
    def make():
        if kind == "stream":
            return _stream_loader(CountingStream([0, 100, 37]), num_workers)
        sampler = tud.RandomSampler(range(100), generator=torch.Generator().manual_seed(1))
        return gpuload.DataLoader(Records(100), sampler=sampler, num_workers=num_workers, collate_fn=identity,
                                  device="cpu")

    loader = make()
    list(loader)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    text = json.dumps(loader.state_dict())
    after = list(iterator)
    assert _resumed(make, json.loads(text)) == after


def test_out_of_order_stream_under_workers_warns_that_its_replay_is_not_exact() -> None:
    """An iterable dataset read by workers is replayed; with in_order=False which batches the
    replay drops depends on the workers' timing: said at state_dict() and load_state_dict()."""
    def make():
        return _stream_loader(CountingStreamNoState([0, 10, 10]), 2, in_order=False)

    loader = make()
    iterator = iter(loader)
    next(iterator)
    with pytest.warns(RuntimeWarning, match="in_order=False"):
        state = loader.state_dict()
    with pytest.warns(RuntimeWarning, match="in_order=False"):
        make().load_state_dict(state)


def test_a_place_not_told_is_said_not_guessed(monkeypatch) -> None:
    """If torch's iterator ever stops showing which task it handed over, the batches still come,
    and a state of that epoch says it is not exact (never a silent guess)."""
    from gpuload.sources import torch_fetch

    class Blind:
        """torch's iterator without its ``_task_info``."""

        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            return next(self.inner)

    real_init = torch_fetch.HandedOver.__init__
    monkeypatch.setattr(torch_fetch.HandedOver, "__init__",
                        lambda self, inner, places, note: real_init(self, Blind(inner), places, note))
    loader = gpuload.DataLoader(Records(6), num_workers=2, in_order=False, collate_fn=identity, device="cpu")
    iterator = iter(loader)
    next(iterator)
    with pytest.warns(RuntimeWarning, match="did not tell"):
        state = loader.state_dict()
    assert state["out_of_order"] is None
    assert len(list(iterator)) == 5
