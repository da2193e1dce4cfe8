"""A loaded state's every key is checked (gpuload.state_format, gpuload.resume.load_state): an
impossible value is a ResumeError naming the key, never a batch served twice, an empty epoch or
a bare TypeError; a state of the loader itself always loads."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import gpuload
from gpuload.resume import ResumeError


def loader() -> gpuload.DataLoader:
    data = tud.TensorDataset(torch.arange(30))  # 8 batches of 4 (the last of 2)
    return gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))


def saved(batches: int = 2) -> dict[str, Any]:
    source = loader()
    iterator = iter(source)
    for _ in range(batches):
        next(iterator)
    return source.state_dict()


# key (a dotted key is inside "random") -> a value no loader of this kind saves there
IMPOSSIBLE: dict[str, Any] = {
    "version": 0,
    "signature": "batch_size=4",
    "epoch": "1",
    "batches": -1,
    "finished": "no",
    "transform_seed": 1.5,
    "random": None,
    "random.generators": ["not base64!"],
    "random.global": "AAAA",
    "random.samplers": "none",
    "random.distributed_epoch": -2,
    "random.worker_seed_drawn": None,
    "batch_size": 0,
    "epoch_batch_size": True,
    "cuts": [[3, 12, 2]],  # a cut after batch 3 of a state 2 batches in
    "sampler_started": 1,
    "out_of_order": {"prefix": 1, "others": [0]},
    "dataset": {"position": 3},  # this dataset has no state of its own
    "dataset_iterator": {"position": 3},  # a map-style dataset has no stream
    "stream_ended": True,  # nor a stream that ends
    "distributed": {"num_replicas": 0, "seed": 0, "shuffle": True, "drop_last": False},
}


def with_value(state: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    state = json.loads(json.dumps(state))  # a deep copy, as a state read from a JSON file
    if key.startswith("random."):
        state["random"][key.split(".", 1)[1]] = value
    else:
        state[key] = value
    return state


def test_every_key_a_state_holds_has_an_impossible_value_tested() -> None:
    state = saved()
    keys = set(state) | {f"random.{key}" for key in state["random"]}
    assert keys == set(IMPOSSIBLE)


@pytest.mark.parametrize("key", IMPOSSIBLE)
def test_an_impossible_value_is_a_resume_error_naming_its_key(key: str) -> None:
    state = with_value(saved(), key, IMPOSSIBLE[key])
    with pytest.raises(ResumeError, match=key.split(".")[-1]):
        loader().load_state_dict(state)


@pytest.mark.parametrize("batches", [-1, 9, 99])
def test_a_position_outside_the_epoch_is_refused(batches: int) -> None:
    """-1 would serve a batch twice, 9 or 99 an empty epoch (the epoch has 8)."""
    with pytest.raises(ResumeError, match="'batches'"):
        loader().load_state_dict(with_value(saved(), "batches", batches))


@pytest.mark.parametrize(("key", "value"), [("epoch", "1"), ("epoch", 1.0), ("epoch", -2), ("batches", "2"),
                                            ("batches", True), ("transform_seed", "0")])
def test_a_number_of_another_type_or_range_is_refused(key: str, value: Any) -> None:
    with pytest.raises(ResumeError, match=f"'{key}' is {value!r}"):
        loader().load_state_dict(with_value(saved(), key, value))


def test_keys_that_contradict_each_other_are_refused() -> None:
    before_any = loader().state_dict()
    assert before_any["epoch"] == -1 and before_any["finished"]
    with pytest.raises(ResumeError, match="'epoch'.*only before the first epoch"):
        loader().load_state_dict(with_value(before_any, "finished", False))
    with pytest.raises(ResumeError, match="'sampler_started'.*only before an epoch's first batch"):
        loader().load_state_dict(with_value(saved(), "sampler_started", False))
    with pytest.raises(ResumeError, match="'out_of_order'.*as many places as the batches done"):
        loader().load_state_dict(with_value(saved(), "out_of_order", {"prefix": 1, "others": []}))
    with pytest.raises(ResumeError, match=r"'cuts\[0\]'.*count their samples"):
        loader().load_state_dict(with_value(saved(), "cuts", [[1, 5, 2]]))  # 1 batch of 4 is 4 samples


def test_a_generator_state_of_another_kind_is_refused() -> None:
    state = saved()
    state["random"]["generators"] = [state["random"]["global"][:100]]
    with pytest.raises(ResumeError, match=r"'random.generators\[0\]'"):
        loader().load_state_dict(state)


@pytest.mark.parametrize("batches", [0, 1, 7, 8])
def test_every_position_the_loader_saves_loads_and_goes_on_from_there(batches: int) -> None:
    whole = [batch[0].tolist() for batch in loader()]
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(saved(batches))))
    assert [batch[0].tolist() for batch in resumed] == whole[batches:]


@pytest.mark.parametrize(("key", "value", "named"), [
    ("cuts", "3", "'cuts'"), ("cuts", [[1, 2]], r"'cuts\[0\]'"), ("out_of_order", [1], "'out_of_order'"),
    ("out_of_order", {"prefix": -1, "others": []}, "'out_of_order.prefix'"), ("distributed", "x", "'distributed'"),
    ("random.generators", "abc", "'random.generators'"), ("random.samplers", [{"seed": 1}],
                                                          r"'random.samplers\[0\]'.*no sampler with state_dict"),
    ("batches", 40, "'batches' is 40"),
])
def test_each_malformed_value_names_where_it_is(key: str, value: Any, named: str) -> None:
    with pytest.raises(ResumeError, match=named):
        loader().load_state_dict(with_value(saved(), key, value))


def test_a_cut_beyond_the_epochs_samples_or_batches_of_a_batch_sampler_of_its_own_are_refused() -> None:
    state = with_value(saved(8), "cuts", [[8, 32, 1]])  # 8 batches of 4: the last had 2
    with pytest.raises(ResumeError, match="'cuts' put 32 samples done in an epoch of 30"):
        loader().load_state_dict(state)

    class Batches(tud.BatchSampler):
        pass

    def own_batches() -> gpuload.DataLoader:
        return gpuload.DataLoader(tud.TensorDataset(torch.arange(30)),
                                  batch_sampler=Batches(tud.SequentialSampler(range(30)), 4, False))

    source = own_batches()
    next(iter(source))
    state = source.state_dict()
    assert state["batches"] == 1 and state["epoch_batch_size"] is None  # batch_size=None: batches of its own
    with pytest.raises(ResumeError, match="not cut by torch's BatchSampler"):
        own_batches().load_state_dict(with_value(state, "cuts", [[1, 1, 2]]))
    with pytest.raises(ResumeError, match="'batches' is 9, but epoch 0 of this loader has 8 batches"):
        own_batches().load_state_dict(with_value(state, "batches", 9))


def test_a_stream_that_ended_after_its_epoch_ended_is_refused() -> None:
    with pytest.raises(ResumeError, match="'stream_ended'.*only inside an epoch"):
        loader().load_state_dict(with_value(loader().state_dict(), "stream_ended", True))
