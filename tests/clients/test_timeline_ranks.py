"""HF Trainer's ``TimelineCallback`` on 2 CPU processes (gloo, set up by Accelerate itself, the
model wrapped in DDP): rank 1's dataset reads slowly (a straggler's disk), rank 0's do not. Every
rank's logs name rank 1 and its dataset reads, gathered once every ``every_n_steps`` steps, never
per step."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, default_collate

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "distributed")]
import ranks_job  # noqa: E402
from test_timeline_callbacks import TinyForHF  # noqa: E402

pytestmark = pytest.mark.slow  # a spawn of 2 processes that import torch and Transformers

transformers = pytest.importorskip("transformers", reason="HF Transformers is a test dependency")

RANKS_DEADLINE_S = 480  # the job takes under a minute on a busy machine: past this, it hangs
SLOW_RANK = 1
SAMPLES, BATCH, EVERY_N = 32, 2, 2  # 8 optimizer steps per rank: 4 gathers


class Reads(Dataset):
    """(x, label) pairs; every read sleeps ``sleep_s``."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.sleep_s)
        return {"x": torch.full((4,), float(index)), "labels": torch.tensor(index % 2)}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1", "GPULOAD_TIMELINE": "on"})
    torch.set_num_threads(1)
    import gpuload.integrations.transformers as hf

    gathers: list[int] = []  # the global step of each gather
    gather = hf.gather_waits

    class Callback(hf.TimelineCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            before = len(gathers)
            hf.gather_waits = lambda timeline: (gathers.append(state.global_step), gather(timeline))[1]
            try:
                super().on_step_end(args, state, control, **kwargs)
            finally:
                hf.gather_waits = gather
            assert len(gathers) - before <= 1

    class Trainer(hf.GpuloadTrainerMixin, transformers.Trainer):
        pass

    args = transformers.TrainingArguments(
        output_dir=str(Path(out_dir, f"out{rank}")), per_device_train_batch_size=BATCH, num_train_epochs=1,
        logging_steps=4, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
        disable_tqdm=True, dataloader_pin_memory=False,
    )
    callback = Callback(every_n_steps=EVERY_N)
    trainer = Trainer(model=TinyForHF(), args=args, train_dataset=Reads(0.05 if rank == SLOW_RANK else 0.0),
                      data_collator=default_collate, callbacks=[callback])
    assert trainer.args.world_size == world
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "gpuload_slowest_rank" in entry]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "gathers": gathers, "steps": trainer.state.global_step, "logged": logged, "summary": callback.summary,
    }))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return ranks_job.spawned(run_rank, 2, tmp_path_factory.mktemp("hf-timeline"), RANKS_DEADLINE_S)


def test_every_rank_logs_the_straggler_and_its_stage(ranks: list[dict]) -> None:
    for rank, found in enumerate(ranks):
        assert found["logged"], (rank, found)
        for entry in found["logged"]:
            assert entry["gpuload_slowest_rank"] == SLOW_RANK, (rank, entry)
            assert entry["gpuload_slowest_rank_stage"] == "read", (rank, entry)
            assert 50 < entry["gpuload_slowest_rank_wait_percent"] <= 100, (rank, entry)
        assert "slowest rank 1 of 2" in found["summary"] and "dataset reads" in found["summary"], found["summary"]


def test_the_ranks_gather_every_n_steps_never_per_step(ranks: list[dict]) -> None:
    for rank, found in enumerate(ranks):
        assert found["steps"] == SAMPLES // (2 * BATCH), found
        assert found["gathers"] == list(range(EVERY_N, found["steps"] + 1, EVERY_N)), (rank, found["gathers"])
