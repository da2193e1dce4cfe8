"""The fused CuPy kernel: its per-sample map and constants (CPU), its source (NVRTC), and its
output against the torch reference (gpu-marked).

Tolerances against the reference: float32 within 1e-4 (after Normalize, on values of order 1:
both compute bilinear in float32, in a different order); float16 and bfloat16 within one unit
in the last place of their rounding of that float32 (rtol 2**-10 and 2**-7); uint8 within 1
(a bilinear value that sits on .5 can round either way) and equal for at least 99% of pixels.
"""

from __future__ import annotations

import pytest
import torch

from gpuload import transforms as T
from gpuload.transforms import _kernels, geometry
from gpuload.transforms.reference import batch_sizes

GEOMETRIES = {
    "rrc_flip": [T.RandomResizedCrop((17, 23)), T.RandomHorizontalFlip()],
    "resize_center": [T.Resize(19), T.CenterCrop(16)],
    "flip_crop_resize_pad": [
        T.RandomHorizontalFlip(), T.CenterCrop((30, 28)), T.RandomResizedCrop(20),
        T.RandomHorizontalFlip(), T.RandomCrop(18, padding=3), T.CenterCrop((22, 15)),
    ],
    "no_resize_pad": [T.RandomCrop((20, 24), padding=(2, 5), fill=9), T.RandomHorizontalFlip()],
    "upscale": [T.CenterCrop(5), T.Resize((31, 17)), T.RandomHorizontalFlip(p=1.0)],
}


def _batch(n, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)


def _emulated_launch(device, batch, geom, fill, constants, erase, out_dtype, channels_last,
                     out_size, channels, staging=None):
    """``_kernels._launch`` with the kernel's arithmetic written in torch ops (CPU)."""
    a, b, values = constants
    oh, ow = out_size
    images = list(batch.unbind(0)) if isinstance(batch, torch.Tensor) else list(batch)
    outs = []
    for k, image in enumerate(images):
        wy0, wx0, wh, ww, ch, cw, oy, ox, by0, by1, bx0, bx1, flip = geom[k].tolist()
        y = torch.arange(oh).view(-1, 1).expand(oh, ow)
        x = torch.arange(ow).view(1, -1).expand(oh, ow)
        xs = ow - 1 - x if flip else x
        valid = (y >= by0) & (y < by1) & (xs >= bx0) & (xs < bx1)

        def index(dst, scale, size):
            real = (scale * (dst.float() + 0.5) - 0.5).clamp(min=0)
            i = torch.minimum(real.floor().long(), torch.tensor(size - 1))
            lam = (real - i).clamp(0, 1)
            return i, i + (i < size - 1).long(), lam

        y0, y1, ly = index(y + oy, torch.tensor(wh / ch, dtype=torch.float32), wh)
        x0, x1, lx = index(xs + ox, torch.tensor(ww / cw, dtype=torch.float32), ww)
        img = image.float()
        r0, r1 = ((y0 + wy0).clamp(0, img.shape[1] - 1), (y1 + wy0).clamp(0, img.shape[1] - 1))
        c0, c1 = ((x0 + wx0).clamp(0, img.shape[2] - 1), (x1 + wx0).clamp(0, img.shape[2] - 1))
        px = ((img[:, r0, c0] * (1 - lx) + img[:, r0, c1] * lx) * (1 - ly)
              + (img[:, r1, c0] * (1 - lx) + img[:, r1, c1] * lx) * ly)
        px = torch.where(valid, px, torch.tensor(fill))
        v = a.view(-1, 1, 1) * px + b.view(-1, 1, 1)
        for e in range(erase.shape[1] // 5):
            on, t, left, h, w = erase[k, 5 * e : 5 * e + 5].tolist()
            if on:
                inside = (y >= t) & (y < t + h) & (x >= left) & (x < left + w)
                v = torch.where(inside, values[e].view(-1, 1, 1), v)
        outs.append(v)
    out = torch.stack(outs)
    out = out.round().clamp(0, 255).to(torch.uint8) if out_dtype == torch.uint8 else out.to(out_dtype)
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


@pytest.fixture
def emulated(monkeypatch):
    """``_kernels.run`` on the CPU, with the launch emulated: tests the orchestration and the
    per-sample map without a GPU."""
    monkeypatch.setattr(_kernels, "_launch", _emulated_launch)

    def run(params, batch):
        out = _kernels.run(params, batch, torch.device("cpu"))
        assert out is not None
        return out

    return run


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_fused_map_reproduces_the_reference_geometry(name, emulated):
    ops = GEOMETRIES[name] + [T.ToDtype(torch.float32, scale=False)]
    batch = _batch(24, 33, 41, seed=len(name))
    params = T.sample_params(ops, 11, 0, torch.arange(24), batch_sizes(batch))
    expected = T.apply_reference(params, batch)
    torch.testing.assert_close(emulated(params, batch), expected, rtol=0, atol=2e-3)


def test_fused_constants_reproduce_normalize_and_erasing(emulated):
    ops = [T.RandomResizedCrop(12), T.ToDtype(), T.RandomErasing(p=0.9, value=0.25),
           T.Normalize((0.4, 0.5, 0.6), (0.2, 0.3, 0.25)), T.RandomErasing(p=0.9, value=(1.0, 2.0, 3.0))]
    batch = _batch(30, 20, 20)
    params = T.sample_params(ops, 1, 0, torch.arange(30), batch_sizes(batch))
    torch.testing.assert_close(emulated(params, batch), T.apply_reference(params, batch), rtol=0, atol=1e-4)


def test_unfusable_geometry_is_reported():
    batch = _batch(4, 10, 10)
    for ops in ([T.Resize(8), T.Resize(6)], [T.RandomCrop(12, padding=2), T.Resize(6)],
                [T.Resize(8), T.RandomCrop(9, padding=2, fill=5), T.CenterCrop(12)]):
        params = T.sample_params(ops, 0, 0, torch.arange(4), batch_sizes(batch))
        assert geometry.geometry_plan(params, batch_sizes(batch)) is None, ops


def _nvrtc_compile(source: str) -> None:
    from cupy.cuda import compiler

    program = compiler._NVRTCProgram(source, "gpuload_transform.cu")
    program.compile(("--std=c++14", "-arch=compute_80"))


@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels_last", [False, True])
def test_kernel_source_compiles_with_nvrtc(in_dtype, out_dtype, channels_last):
    cupy = pytest.importorskip("cupy")
    try:
        from cupy.cuda import compiler

        compiler._NVRTCProgram  # noqa: B018 - a private CuPy helper; skip if it moved
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - depends on the CuPy install
        pytest.skip(f"NVRTC is not usable here ({exc}): a CUDA build of torch brings NVRTC")
    _nvrtc_compile(_kernels.kernel_source(in_dtype, out_dtype, channels_last))


# --------------------------------------------------------------------------- on a GPU


PIPELINES = {
    "train_f32": [T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToDtype(torch.float32),
                  T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))],
    "train_f16_cl": [T.RandomResizedCrop((17, 29)), T.RandomHorizontalFlip(), T.ToDtype(torch.float16),
                     T.Normalize((0.5,), (0.25,)), T.RandomErasing(p=0.7), T.ToChannelsLast()],
    "train_bf16_jitter": [T.RandomResizedCrop(20), T.ColorJitter(0.4, 0.4, 0.4),
                          T.ToDtype(torch.bfloat16), T.Normalize((0.5,), (0.25,)), T.ToChannelsLast()],
    "eval_u8": [T.Resize(21), T.CenterCrop(19)],
    "pad_crop_f32_cl": [T.RandomCrop(28, padding=4, fill=3), T.RandomHorizontalFlip(),
                        T.ToDtype(torch.float32, scale=False), T.ToChannelsLast()],
}


def _assert_parity(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.device == ref.device
    assert out.is_contiguous(memory_format=torch.channels_last) == ref.is_contiguous(
        memory_format=torch.channels_last
    )
    if out.dtype == torch.uint8:
        diff = (out.int() - ref.int()).abs()
        assert int(diff.max()) <= 1 and float((diff == 0).double().mean()) >= 0.99
        return
    rtol = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-5}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-4 if rtol < 1e-3 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("shape", [(1, 31, 45), (7, 64, 48), (16, 33, 33)])
def test_kernel_matches_reference_on_uniform_batches(name, shape):
    ops = PIPELINES[name]
    n, h, w = shape
    batch = _batch(n, h, w, seed=n).cuda()
    idx = torch.arange(n) + 1000
    out, backend = T.transform_batch(ops, batch, 5, 2, idx, backend="cupy")
    ref = T.apply_transforms(ops, batch, 5, 2, idx, backend="torch")
    assert backend == "cupy"
    _assert_parity(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_kernel_matches_reference_on_variable_size_lists(name):
    ops = PIPELINES[name]
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).cuda()
              for h, w in [(29, 40), (61, 37), (32, 32), (45, 90)]]
    # an HWC image viewed as CHW: non-contiguous strides, as DALI outputs are
    images.append(torch.randint(0, 256, (50, 41, 3), dtype=torch.uint8, generator=g).cuda().permute(2, 0, 1))
    idx = torch.arange(len(images))
    out, backend = T.transform_batch(ops, images, 9, 0, idx, backend="cupy")
    assert backend == "cupy"
    _assert_parity(out, T.apply_transforms(ops, images, 9, 0, idx, backend="torch"))


@pytest.mark.gpu
def test_kernel_runs_on_torchs_current_stream():
    ops = PIPELINES["train_f32"]
    batch = _batch(8, 40, 40).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = T.apply_transforms(ops, batch, 0, 0, torch.arange(8), backend="cupy")
    stream.synchronize()
    _assert_parity(out, T.apply_transforms(ops, batch, 0, 0, torch.arange(8), backend="torch"))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_kernel_path_orchestration_on_cpu(name, emulated):
    """The GPU path's passes (incl. the jitter split) with the launch emulated, vs reference."""
    ops = PIPELINES[name]
    g = torch.Generator().manual_seed(2)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in [(29, 40), (61, 37), (32, 32)]]
    images.append(torch.randint(0, 256, (50, 41, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1))
    params = T.sample_params(ops, 4, 1, torch.arange(4), batch_sizes(images))
    _assert_parity(emulated(params, images), T.apply_reference(params, images))
