"""torch.distributed.checkpoint (DCP) with gpuload loaders: 2 gloo ranks save model (DDP),
optimizer and loader mid-epoch with ``dcp.save``; 2 new processes ``dcp.load`` them and finish
the run with exactly the batches and losses of an uninterrupted run (each rank's cache on its
own, and one copy split over the ranks). The same checkpoint taken up at other world sizes
(gpuload.elastic): exactly where the DistributedSampler order allows (1 rank; 4 ranks with half
the batch), else a ResumeError that says which world sizes and batch sizes would do. The
state's keys and version are those the README documents.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.data as tud
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.resume import STATE_VERSION, ResumeError

sys.path.insert(0, str(Path(__file__).parent))
import ranks_job

BATCH, STOP_AT, EPOCHS = 8, 3, 2  # the save: 3 batches into epoch 1 (7 batches a rank an epoch)
SCOPES = ("rank", "world")
README = Path(__file__).parents[2] / "gpuload" / "docs" / "resume.md"  # the page documenting resume

pytestmark = [
    pytest.mark.slow,  # two spawns of 2 processes that import torch, DDP over gloo
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP in one process
]


class Training:
    """Model and optimizer as one DCP ``Stateful`` (torch's state_dict helpers: DDP's prefix
    dropped, the optimizer's state made before its first step so a fresh one can be loaded)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def loader(data: tud.Dataset, scope: str, **sampler_options: Any) -> gpuload.DataLoader:
    sampler = DistributedSampler(data, shuffle=True, seed=ranks_job.SEED, **sampler_options)
    return gpuload.DataLoader(data, BATCH, sampler=sampler, device="cpu", cache_scope=scope)


def training() -> Training:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(7, 1, dtype=torch.float64))
    return Training(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))


def run_epochs(run: Training, batches: gpuload.DataLoader, epochs: range, stop_at: int | None = None) -> list:
    """Train ``epochs``; each batch's labels and loss (stopping ``stop_at`` batches into the last)."""
    seen = []
    for epoch in epochs:
        batches.sampler.set_epoch(epoch)
        for step, (_, features, labels, _) in enumerate(batches):
            loss = ((run.model(features).squeeze(1) - labels.double()) ** 2).mean() * 1e-3
            run.optimizer.zero_grad()
            loss.backward()
            run.optimizer.step()
            seen.append([labels.tolist(), loss.item()])
            if stop_at is not None and epoch == epochs[-1] and step + 1 == stop_at:
                break  # the loader's position: the batches handed to the loop
    return seen


def run_rank(rank: int, world: int, init_file: str, out_dir: str, phase: str, checkpoints: str) -> None:
    """``phase`` "save": an uninterrupted run, then one stopped mid-epoch and saved with DCP into
    ``checkpoints``; "load": new processes load the checkpoint and finish the run."""
    with ranks_job.gloo_job(rank, world, init_file, None):
        data = ranks_job.dataset()
        found: dict[str, Any] = {}
        for scope in SCOPES:
            checkpoint = str(Path(checkpoints, f"checkpoint-{scope}"))
            if phase == "save":
                found[f"whole/{scope}"] = run_epochs(training(), loader(data, scope), range(EPOCHS))
                run, batches = training(), loader(data, scope)
                found[f"before/{scope}"] = run_epochs(run, batches, range(EPOCHS), stop_at=STOP_AT)
                dcp.save({"training": run, "loader": batches}, checkpoint_id=checkpoint)
            else:
                run, batches = training(), loader(data, scope)
                dcp.load({"training": run, "loader": batches}, checkpoint_id=checkpoint)
                found[f"after/{scope}"] = run_epochs(run, batches, range(EPOCHS - 1, EPOCHS))
                found[f"path/{scope}"] = batches.stats.path
            dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Every rank's findings, saved and then restarted (two jobs of 2 gloo processes, the second
    new processes that know only the checkpoints)."""
    folder = tmp_path_factory.mktemp("dcp")
    found: list[dict] = [{}, {}]
    for phase in ("save", "load"):
        (folder / phase).mkdir()
        for seen, phase_found in zip(found, ranks_job.findings(run_rank, 2, folder / phase, phase, str(folder))):
            seen.update(phase_found)
    return folder, found


@pytest.mark.parametrize("scope", SCOPES)
def test_restarted_ranks_resume_to_the_uninterrupted_batches_and_losses(ranks, scope: str) -> None:
    _, found = ranks
    per_epoch = -(-ranks_job.NUM_SAMPLES // 2 // BATCH)  # 52 samples a rank: 7 batches
    for rank, seen in enumerate(found):
        whole, before, after = seen[f"whole/{scope}"], seen[f"before/{scope}"], seen[f"after/{scope}"]
        assert len(whole) == EPOCHS * per_epoch and len(before) == per_epoch + STOP_AT, rank
        assert before == whole[: len(before)], rank
        assert after == whole[len(before):], rank  # labels and loss of every batch after the restart
    assert found[0][f"path/{scope}"].startswith("sharded-") is (scope == "world")


def epoch_order(world: int) -> list[int]:
    """Epoch 1's whole order as DistributedSampler deals it (padded for ``world`` ranks)."""
    sampler = DistributedSampler(range(ranks_job.NUM_SAMPLES), num_replicas=1, rank=0, shuffle=True,
                                 seed=ranks_job.SEED)
    sampler.set_epoch(EPOCHS - 1)
    order = list(sampler)
    return order + order[: -len(order) % world]


def taken_up_at(folder: Path, world: int, rank: int, batch_size: int = BATCH) -> list[int]:
    """The labels one rank of ``world`` reads after loading the 2-rank checkpoint (no process
    group: DCP loads in one process, and the sampler is told its rank)."""
    data = ranks_job.dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=ranks_job.SEED)
    batches = gpuload.DataLoader(data, batch_size, sampler=sampler, device="cpu")
    dcp.load({"loader": batches}, checkpoint_id=str(folder / "checkpoint-rank"))
    batches.sampler.set_epoch(EPOCHS - 1)
    return [label for _, _, labels, _ in batches for label in labels.tolist()]


def test_the_checkpoint_is_taken_up_exactly_at_other_world_sizes(ranks) -> None:
    """Saved 3 batches of 8 into epoch 1 on 2 ranks: the first 48 samples of the epoch's order.
    1 rank (6 batches of 8) and 4 ranks with batches of 6 (2 batches) go on from sample 48."""
    folder, found = ranks
    done = STOP_AT * BATCH * 2
    order = epoch_order(2)
    interleaved = [label for pair in zip(*(
        [label for labels, _ in found[r]["after/rank"] for label in labels] for r in range(2))) for label in pair]
    assert interleaved == order[done:]  # the restarted 2 ranks: the rest of the order, dealt out in turn
    assert taken_up_at(folder, 1, 0) == epoch_order(1)[done:]
    four = epoch_order(4)
    for rank in range(4):
        assert taken_up_at(folder, 4, rank, batch_size=6) == four[done + rank :: 4]


def test_a_world_size_no_batch_ends_at_says_what_would(ranks) -> None:
    folder, _ = ranks
    with pytest.raises(ResumeError, match=re.escape("first 48 samples")) as caught:
        taken_up_at(folder, 5, 0)
    message = str(caught.value)
    assert "world size 5" in message and "at batch size 8: world size 1, 2, 3, 6" in message
    assert "epoch's end" in message


def test_an_order_from_another_seed_is_refused(ranks) -> None:
    folder, _ = ranks
    data = ranks_job.dataset()
    batches = gpuload.DataLoader(data, BATCH, device="cpu", sampler=DistributedSampler(
        data, num_replicas=2, rank=0, shuffle=True, seed=ranks_job.SEED + 1))
    with pytest.raises(ResumeError, match="seed: saved 7, now 8"):
        dcp.load({"loader": batches}, checkpoint_id=str(folder / "checkpoint-rank"))


def test_the_state_has_the_keys_and_version_the_readme_documents() -> None:
    data = ranks_job.dataset()
    state = loader(data, "rank", num_replicas=2, rank=0).state_dict()
    section = README.read_text().split("## What a state holds", 1)[1].split("\n#", 1)[0]
    documented = re.findall(r"^- `(\w+)`", section, flags=re.MULTILINE)
    assert documented == list(state), "README's list of state keys differs from state_dict()"
    assert f"version {STATE_VERSION}" in section and state["version"] == STATE_VERSION
    assert state["distributed"] == {"num_replicas": 2, "seed": ranks_job.SEED, "shuffle": True, "drop_last": False}


def test_the_readme_snippet_saves_and_takes_up_the_position(tmp_path, monkeypatch) -> None:
    """The README's DCP block, run exactly, as the one rank of a gloo group: the loaded loader
    goes on with the 4th batch of the epoch."""
    [snippet] = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
                 if "dcp.save(" in block]
    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        dataset = ranks_job.dataset()
        scope = {"gpuload": gpuload, "dataset": dataset, "model": torch.nn.Linear(7, 1)}
        exec(snippet, scope)
        expected = list(tud.DataLoader(dataset, 8, sampler=DistributedSampler(dataset, seed=0)))[3]
        assert all(torch.equal(a, b) for a, b in zip(next(iter(scope["loader"])), expected))
    finally:
        dist.destroy_process_group()
