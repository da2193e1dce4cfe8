"""The job's memory plan: the training step, the prefetch slots and the cache on one card.

``dataset_size`` says how big a dataset is; ``step_memory`` estimates a training step's peak
on fake tensors; ``plan`` shares the card between them and recommends a batch size;
``oom_retry`` (opt-in) reruns a step that ran out of memory on smaller pieces of its batch.
Importing this package imports neither the fake-tensor machinery nor MemTracker: tracing
loads them on first use.
"""

from gpuload.job.dataset_size import DatasetShape, dataset_shape, estimate_dataset
from gpuload.job.oom_retry import BatchSizeLoweredWarning, OOMRetry
from gpuload.job.plan import JobPlan, plan_from_step, plan_job
from gpuload.job.step_memory import StepMemory, StepTrace, StepTracer, estimate_step_memory

__all__ = [
    "BatchSizeLoweredWarning",
    "DatasetShape",
    "JobPlan",
    "OOMRetry",
    "StepMemory",
    "StepTrace",
    "StepTracer",
    "dataset_shape",
    "estimate_dataset",
    "estimate_step_memory",
    "plan_from_step",
    "plan_job",
]
