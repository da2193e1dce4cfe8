"""GPU image transforms: write the list once, gpuload runs it as CuPy kernels or torch.

Usage::

    from gpuload import transforms as T
    ops = [T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
           T.ToDtype(torch.bfloat16), T.Normalize(mean, std), T.ToChannelsLast()]

Random parameters are a pure function of (seed, epoch, sample index, op position), so the
same sample gets the same crop on CPU and GPU, in any batch. CuPy is imported only when a
kernel runs (``_kernels.py``).
"""

from gpuload.transforms.apply import (
    OutputPlan,
    apply_transforms,
    choose_backend,
    plan_output,
    transform_batch,
)
from gpuload.transforms.ops import (
    CenterCrop,
    ColorJitter,
    Normalize,
    Op,
    RandomCrop,
    RandomErasing,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToChannelsLast,
    ToDtype,
    validate_pipeline,
)
from gpuload.transforms.params import BatchParams, sample_params
from gpuload.transforms.reference import apply_reference

__all__ = [
    "Op",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomCrop",
    "RandomHorizontalFlip",
    "ColorJitter",
    "ToDtype",
    "Normalize",
    "RandomErasing",
    "ToChannelsLast",
    "validate_pipeline",
    "BatchParams",
    "sample_params",
    "apply_reference",
    "apply_transforms",
    "transform_batch",
    "plan_output",
    "choose_backend",
    "OutputPlan",
]
