"""An image folder through gpuload: batch decoding, transforms on the device, the image cache.

Run: python examples/train_images.py [FOLDER]

FOLDER is read as root/<class>/<images>. Without one, the example writes 512 sample JPEGs
(26 MB) to a temporary folder and removes it at the end. It shows the image cache's decision,
warm() decoding every image once, then two epochs of RandomResizedCrop + flip + normalize on
the loader's device. About 140 s on the shared 2-core CPU machine the tests run on (load
average 7 when measured; mostly decoding 512 JPEGs on the CPU).
"""

import sys
import tempfile

import torch
from torch import nn

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageFolder, make_sample_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def train(folder: ImageFolder) -> None:
    loader = gpuload.DataLoader(
        folder, batch_size=64, shuffle=True, on_error="skip",
        transforms=[T.RandomResizedCrop(128), T.RandomHorizontalFlip(), T.ToDtype(torch.float32),
                    T.Normalize(MEAN, STD)],
        cache="device",  # keep decoded images (GPU memory, or host memory on a CPU): later epochs skip decoding
    )
    loader.warm()  # decode every image into the cache now, with a progress bar
    print(loader.stats.extra["image_cache_decision"])

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, len(folder.classes)),
    ).to(loader.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        for images, labels in loader:  # float32 N,3,128,128 and int64, already on loader.device
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.3f}; {loader.stats}")
    print("cache:", {k: loader.stats.extra["cache"][k] for k in ("mode", "entries", "bytes", "hits", "complete")})
    loader.close()


if len(sys.argv) > 1:
    train(ImageFolder(sys.argv[1]))
else:
    with tempfile.TemporaryDirectory(prefix="gpuload-images-") as scratch:  # removed at the end
        train(make_sample_image_folder(scratch, num_images=512, num_classes=10))
