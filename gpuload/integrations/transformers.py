"""HF Transformers' ``Trainer`` reading from gpuload: train, evaluate, resume mid-epoch.

``Trainer`` builds torch's DataLoader from its arguments and prepares it with Accelerate.
:class:`GpuloadTrainerMixin` keeps all of that (its sampler, collator, batch size, Accelerate's
sharding over processes, its seedable sampler) and only swaps the loader under Accelerate's
shard for a gpuload one (:func:`gpuload.integrations.accelerate.serve_from_gpuload`), which
delivers batches on ``args.device``: Trainer's own move to the device then copies nothing.

Resume: at each checkpoint the mixin writes the train loader's exact position
(``state_dict()``) into the checkpoint folder, one file per process; on
``train(resume_from_checkpoint=...)`` mid-epoch it loads that position instead of Accelerate's
``skip_first_batches`` (which would rebuild torch's loader and read the skipped batches' indices
again): the rest of the epoch, and the epochs after it, are those of an uninterrupted run.

    class MyTrainer(GpuloadTrainerMixin, Trainer):
        pass

    trainer = MyTrainer(model=model, args=args, train_dataset=data, eval_dataset=held_out,
                        gpuload_options={"cache_size": "8GiB"})
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from gpuload.distributed.rank_waits import gather_waits
from gpuload.integrations.accelerate import (
    GPULOAD_OPTIONS,
    GpuloadShard,
    serve_from_gpuload,
)
from gpuload.resume import ResumeError
from gpuload.timeline import Timeline, timeline_of

if TYPE_CHECKING:  # the mixin's methods call Trainer's (it comes after the mixin in the class's bases)
    from transformers import Trainer as _MixedInto
else:
    _MixedInto = object

__all__ = ["LOADER_STATE_FILE", "GpuloadTrainerMixin", "SaveLoaderState", "TimelineCallback"]

#: The train loader's position in a checkpoint folder, per process (``{process}``: its index).
LOADER_STATE_FILE = "gpuload_loader_{process}.pt"


class SaveLoaderState(TrainerCallback):
    """Writes the train loader's ``state_dict()`` into each checkpoint folder the Trainer saves."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataloader")
        if not isinstance(loader, GpuloadShard):
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(loader.state_dict(), os.path.join(folder, LOADER_STATE_FILE.format(process=args.process_index)))


class GpuloadTrainerMixin(_MixedInto):
    """Mix in before ``transformers.Trainer``: its train, eval and test loaders are gpuload's.

    ``gpuload_options``: gpuload's own options for every loader (each of
    ``gpuload.integrations.accelerate.GPULOAD_OPTIONS``: ``cache``, ``cache_size``,
    ``cache_dir``, ``transforms``, ...); batches are always delivered on ``args.device``. Eval
    loaders are kept per eval dataset, so its cache is placed once, not at every evaluation.
    """

    def __init__(self, *args: Any, gpuload_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(gpuload_options or {})
        if unknown := sorted(set(options) - set(GPULOAD_OPTIONS)):
            raise TypeError(f"gpuload_options: unknown option(s) {unknown}; gpuload's are {list(GPULOAD_OPTIONS)}")
        if not hasattr(super(), "get_resumed_dataloader"):
            raise ImportError(
                "GpuloadTrainerMixin resumes through Trainer.get_resumed_dataloader, which this transformers "
                "release lacks; upgrade transformers (pip install -U transformers), or mix it in before Trainer"
            )
        super().__init__(*args, **kwargs)
        self.gpuload_options = options
        self._gpuload_eval_loaders: dict[int, GpuloadShard] = {}
        self._gpuload_checkpoint: str | None = None
        self.add_callback(SaveLoaderState())

    def get_train_dataloader(self) -> GpuloadShard:
        return serve_from_gpuload(super().get_train_dataloader(), **self.gpuload_options)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> GpuloadShard:
        prepared = super().get_eval_dataloader(eval_dataset)  # torch's, prepared (kept by Trainer or new)
        kept = self._gpuload_eval_loaders.get(id(prepared.dataset))
        if kept is not None and kept.dataset is prepared.dataset and kept.total_batch_size == prepared.total_batch_size:
            return kept
        served = serve_from_gpuload(prepared, **self.gpuload_options)
        self._gpuload_eval_loaders[id(prepared.dataset)] = served
        return served

    def get_test_dataloader(self, test_dataset: Any) -> GpuloadShard:
        return serve_from_gpuload(super().get_test_dataloader(test_dataset), **self.gpuload_options)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        # a folder, or None for False, "" or None (True was replaced by the last checkpoint above)
        self._gpuload_checkpoint = (resume_from_checkpoint
                                    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint else None)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_resumed_dataloader(self, dataloader: GpuloadShard, num_batches: int) -> GpuloadShard:
        """``dataloader`` at the position saved in the checkpoint being resumed, which must be
        ``num_batches`` into its epoch (what the Trainer's step count says)."""
        if not isinstance(dataloader, GpuloadShard):
            return super().get_resumed_dataloader(dataloader, num_batches)
        checkpoint = self._gpuload_checkpoint
        path = os.path.join(str(checkpoint), LOADER_STATE_FILE.format(process=self.args.process_index))
        if checkpoint is None or not os.path.isfile(path):
            raise ResumeError(
                f"resuming {num_batches} batches into an epoch, but {path} (the gpuload loader's position) is "
                "missing: the checkpoint was not saved by a Trainer with GpuloadTrainerMixin. Resume from one "
                "that was, or pass ignore_data_skip=True to start the epoch over"
            )
        state = torch.load(path, weights_only=False)
        if state["finished"] or state["batches"] != num_batches:
            raise ResumeError(
                f"{path} holds a loader position {state['batches']} batches into epoch {state['epoch']}"
                f"{' (ended)' if state['finished'] else ''}, but the Trainer resumes {num_batches} batches "
                "into its epoch: the loader state and the checkpoint do not belong together"
            )
        dataloader.load_state_dict(state)
        return dataloader


class TimelineCallback(TrainerCallback):
    """Adds where the step waits to each of the Trainer's logs: ``gpuload_wait_percent`` (the share
    of step time the loop waited, over the loader's recent steps) and ``gpuload_top_stage`` (the
    stage most of the loader's time went to), in ``trainer.state.log_history`` and the ``logs``
    the callbacks after it see; ``summary`` keeps the latest verdict line. ``loader``: the gpuload
    loader to watch; default the Trainer's train loader (also under Accelerate's shard), which
    records only with its timeline on (``gpuload_options={"timeline_steps": 1000}`` or
    ``GPULOAD_TIMELINE=on``; off by default).

    Under torch.distributed (several processes) it also gathers every rank's wait share and top
    stage every ``every_n_steps`` optimizer steps (one small collective at the end of the same step
    on every rank, never per step; ``gpuload.distributed.rank_waits``), and each log gets the
    slowest rank as last gathered: ``gpuload_slowest_rank``, ``gpuload_slowest_rank_wait_percent``
    and ``gpuload_slowest_rank_stage``; ``summary`` then ends with that rank.

    ``Trainer(..., callbacks=[TimelineCallback()])`` comes after the ``report_to`` loggers, which
    then miss these values; to have them report them too, put it first:
    ``trainer.callback_handler.callbacks.insert(0, TimelineCallback())``.
    """

    def __init__(self, loader: Any = None, every_n_steps: int = 50) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive int")
        self.loader = loader
        self.every_n_steps = every_n_steps
        self.summary = ""

    def _timeline(self, kwargs: dict[str, Any]) -> Timeline | None:
        return timeline_of(self.loader if self.loader is not None else kwargs.get("train_dataloader"))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if state.global_step % self.every_n_steps or not (
                dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        timeline = self._timeline(kwargs)
        if timeline is not None and timeline.enabled:
            gather_waits(timeline)  # a collective: every rank ends this step; kept as timeline.ranks

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        timeline = self._timeline(kwargs)
        if timeline is None or not timeline.enabled or logs is None:
            return
        found = timeline.verdict()
        self.summary = timeline.summary()
        if found.wait_fraction is None:
            return
        added: dict[str, Any] = {"gpuload_wait_percent": 100 * found.wait_fraction,
                                 "gpuload_top_stage": found.stage or ""}
        slowest = timeline.ranks.slowest if timeline.ranks is not None else None
        if slowest is not None and slowest.wait_fraction is not None:
            added.update(gpuload_slowest_rank=slowest.rank,
                         gpuload_slowest_rank_wait_percent=100 * slowest.wait_fraction,
                         gpuload_slowest_rank_stage=slowest.stage or "")
        logs.update(added)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)  # the entry the Trainer wrote for these logs
