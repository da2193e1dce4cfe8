"""Plan a training job's GPU memory before running it: the step, gpuload's prefetch slots, the cache.

Run: python examples/plan_job.py          (torchvision's ResNet-50 when it is installed, else a small CNN)
     python examples/plan_job.py --small  (the small CNN defined here)

It prints three plans from one trace: the batch size recommended for ImageNet, a fixed batch of
256, and ImageNet-100. Runs on any machine: the card is pretended (device_memory="80GiB") and the
training step is traced on fake tensors, so nothing is allocated and no GPU is needed. On the
shared 2-core CPU machine the tests run on (load average 8 to 13 when measured) it takes about
20 s for ResNet-50 (14 to 25 s; 8 to 9 s of it tracing four batch sizes) and about 12 s with
--small (10 to 14 s).
"""

import sys
import time

import torch
from torch import nn

import gpuload
from gpuload.job import DatasetShape


def small_cnn() -> nn.Module:
    """Four conv stages and a classifier: a stand-in for a real model when torchvision is absent."""
    layers, channels = [], 3
    for width in (64, 128, 256, 512):
        layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 1000))


def choose_model():
    if "--small" not in sys.argv:
        try:
            from torchvision.models import resnet50

            return resnet50, "torchvision ResNet-50"
        except ImportError:
            print("# torchvision is not installed: planning the small CNN defined here instead "
                  "(pip install 'gpuload[torchvision]' for ResNet-50)")
    return small_cnn, "a small CNN (defined in this example)"


factory, name = choose_model()
imagenet = DatasetShape(1_281_167, 3 * 224 * 224 + 8, "ImageNet-1k at 224x224, uint8 + int64 label")
sample = torch.empty(3, 224, 224)  # one input as the model takes it (the loop converts uint8 to float)

started = time.perf_counter()
plan = gpuload.plan_job(factory, sample, optimizer="adamw", dataset=imagenet, device_memory="80GiB",
                        host_memory="256GiB")
print(f"# {name}, AdamW, ImageNet, the batch size recommended; planned in {time.perf_counter() - started:.1f} s")
print(plan.describe(), end="\n\n")

# Other choices from the same estimate, without tracing again: a fixed batch size, a smaller dataset.
print(f"# {name}, AdamW, ImageNet, batch size 256")
print(plan.replan(256).describe(), end="\n\n")
imagenet100 = DatasetShape(126_689, imagenet.bytes_per_sample, "ImageNet-100 at 224x224")
print(f"# {name}, AdamW, ImageNet-100, the batch size recommended")
print(plan.replan(dataset=imagenet100).describe())
