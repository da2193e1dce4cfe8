"""epoch_batches draws the same indices as torch's BatchSampler, at the same moments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler, SubsetRandomSampler

from gpuload.sampling import can_draw_whole_epoch, epoch_batches, epoch_order, in_range


def make(kind: str, n: int, num_samples: int | None, seed: int | None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    if kind == "random":
        return RandomSampler(range(n), num_samples=num_samples, generator=generator)
    if kind == "random-replacement":
        return RandomSampler(range(n), replacement=True, num_samples=num_samples, generator=generator)
    if kind == "subset":
        return SubsetRandomSampler(list(range(0, 2 * n, 2)), generator=generator)
    return SequentialSampler(range(n))


def state(sampler) -> torch.Tensor:
    g = getattr(sampler, "generator", None)
    return torch.get_rng_state() if g is None else g.get_state()


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["random", "random-replacement", "subset", "sequential"]),
    n=st.integers(1, 90),
    num_samples=st.one_of(st.none(), st.integers(1, 200)),
    batch_size=st.integers(1, 40),
    drop_last=st.booleans(),
    seed=st.one_of(st.none(), st.integers(0, 1000)),
    stop_after=st.one_of(st.none(), st.integers(0, 10)),
)
def test_same_batches_and_same_draw_timing(kind, n, num_samples, batch_size, drop_last, seed, stop_after) -> None:
    if kind not in ("random", "random-replacement"):
        num_samples = None
    results = []
    for ours in (True, False):
        torch.manual_seed(1234)
        batch_sampler = BatchSampler(make(kind, n, num_samples, seed), batch_size, drop_last)
        assert can_draw_whole_epoch(batch_sampler)
        iterator = epoch_batches(batch_sampler) if ours else iter(batch_sampler)
        batches = []
        for i, batch in enumerate(iterator):
            if stop_after is not None and i == stop_after:
                break
            batches.append([int(v) for v in batch])
        results.append((batches, state(batch_sampler.sampler)))
    (our_batches, our_state), (their_batches, their_state) = results
    assert our_batches == their_batches
    assert torch.equal(our_state, their_state)


def test_subclassed_samplers_are_left_to_torch() -> None:
    class MySampler(RandomSampler):
        pass

    assert not can_draw_whole_epoch(BatchSampler(MySampler(range(4)), 2, False))
    assert not can_draw_whole_epoch([[0, 1], [2]])


@pytest.mark.parametrize("indices", [range(3, 11), torch.arange(3, 11), torch.arange(3, 11, dtype=torch.int32)])
def test_a_subset_sampler_over_a_range_or_an_integer_tensor_is_drawn_whole_as_torch_draws_it(indices) -> None:
    batches = []
    for ours in (True, False):
        torch.manual_seed(7)
        batch_sampler = BatchSampler(SubsetRandomSampler(indices), 3, False)
        assert can_draw_whole_epoch(batch_sampler)
        iterator = epoch_batches(batch_sampler) if ours else iter(batch_sampler)
        batches.append([[int(v) for v in batch] for batch in iterator])
    assert batches[0] == batches[1]


@pytest.mark.parametrize("indices", [torch.tensor([0.0, 1.0]), torch.tensor([0j, 1j]), ["a", "b"], [0, True]])
def test_a_subset_sampler_over_keys_that_are_not_integers_is_left_to_torch(indices) -> None:
    assert not can_draw_whole_epoch(BatchSampler(SubsetRandomSampler(indices), 1, False))


class _Backwards(Sampler[int]):
    """A sampler torch does not ship: the positions of a dataset, last first."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        return iter(range(self.size - 1, -1, -1))

    def __len__(self) -> int:
        return self.size


def test_the_order_of_another_sampler_is_an_int64_tensor_of_integers_else_a_list() -> None:
    order = epoch_order(_Backwards(4))
    assert order.dtype == torch.int64 and order.tolist() == [3, 2, 1, 0]
    assert epoch_order(SubsetRandomSampler(["a"])) == ["a"]


@pytest.mark.gpu
def test_indices_on_the_gpu_come_back_on_the_host_in_range() -> None:
    flat = in_range(torch.tensor([[1, -1]], device="cuda"), 4)
    assert flat.device.type == "cpu" and flat.tolist() == [1, 3]
