"""The batched torch path against the reference: a seeded fuzz over op lists, batch shapes,
output dtypes and layouts, plus its place in backend choice.

The batched path promises the reference's results bit for bit (same float32 operations in the
same order, the same bilinear kernel on the same windows), so the fuzz compares with
``torch.equal``: a stricter bar than the kernels' one-ulp tolerance.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuload import transforms as T
from gpuload.transforms import _kernels, apply, batched, geometry
from gpuload.transforms.reference import apply_reference, batch_sizes
from gpuload.transforms.windows import decode_windows, params_in_windows

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _images(n: int, c: int, h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g)


def _random_geometry(rng: random.Random) -> list[T.Op]:
    ops: list[T.Op] = []
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(["rrc", "resize", "center", "random", "flip", "flip"])
        size = (rng.randint(4, 24), rng.randint(4, 24))
        if kind == "rrc":
            ops.append(T.RandomResizedCrop(size, scale=(rng.uniform(0.05, 0.5), 1.0)))
        elif kind == "resize":
            ops.append(T.Resize(rng.randint(5, 20) if rng.random() < 0.5 else size))
        elif kind == "center":
            ops.append(T.CenterCrop(size))
        elif kind == "random":
            padding = rng.choice([0, rng.randint(1, 5), (rng.randint(0, 3), rng.randint(0, 3))])
            ops.append(T.RandomCrop(size, padding=padding, fill=rng.choice([0, 0, 17, 99.5])))
        else:
            ops.append(T.RandomHorizontalFlip(p=rng.choice([0.5, 1.0])))
    if rng.random() < 0.5:  # most real lists end with a fixed size
        ops.append(T.CenterCrop((rng.randint(4, 20), rng.randint(4, 20))))
    return ops


def _random_values(rng: random.Random, channels: int) -> list[T.Op]:
    ops: list[T.Op] = []
    if rng.random() < 0.25:
        ops.append(T.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4))
    if rng.random() < 0.8:
        scale = rng.random() < 0.8
        ops.append(T.ToDtype(rng.choice([torch.float32, torch.float16, torch.bfloat16]), scale=scale))
        if rng.random() < 0.7:
            mean, std = MEAN[:channels], STD[:channels]
            if scale:
                ops.append(T.Normalize(mean, std))
            else:
                ops.append(T.Normalize([m * 255 for m in mean], [s * 255 for s in std], value_range=255))
        if rng.random() < 0.3:
            ops.append(T.RandomErasing(p=0.7, value=rng.choice([0, 1.5])))
    if rng.random() < 0.3:
        ops.append(T.ToChannelsLast())
    return ops


def _random_batch(rng: random.Random, channels: int, seed: int):
    n = rng.randint(1, 9)
    h, w = rng.randint(6, 40), rng.randint(6, 40)
    layout = rng.choice(["contiguous", "channels_last", "sliced", "list", "list"])
    if layout == "list":
        images = [_images(1, channels, rng.randint(6, 40), rng.randint(6, 40), seed + k)[0] for k in range(n)]
        if seed % 2:  # as decoders give them: HWC memory seen as CHW (channels-last strides)
            images = [image.permute(1, 2, 0).contiguous().permute(2, 0, 1) for image in images]
        return images, layout
    batch = _images(n, channels, h, w, seed)
    if layout == "channels_last":
        batch = batch.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        batch = _images(n, channels, h + 3, w + 2, seed)[:, :, 2 : 2 + h, 1 : 1 + w]
    return batch, layout


def _fuzz_case(seed: int):
    """A valid (ops, batch, params) drawn from ``seed``: lists the reference can run."""
    rng = random.Random(seed)
    while True:
        channels = rng.choice([3, 3, 1])
        ops = _random_geometry(rng) + _random_values(rng, channels)
        batch, layout = _random_batch(rng, channels, seed)
        indices = torch.tensor(rng.sample(range(10_000), len(batch)))
        try:
            params = T.sample_params(ops, seed, rng.randint(0, 3), indices, batch_sizes(batch))
            params.output_size()
        except ValueError:  # a crop larger than a padded image, or outputs of several sizes
            continue
        return ops, batch, params, layout


@pytest.mark.parametrize("seed", range(120))
def test_fuzz_equals_the_reference_bit_for_bit(seed: int) -> None:
    ops, batch, params, layout = _fuzz_case(seed)
    expected = apply_reference(params, batch)
    got = batched.run(params, batch)
    if got is None:  # the geometries the per-sample map cannot express, and only those
        assert geometry.geometry_plan(params, params.sizes[0]) is None
        return
    context = f"ops={list(ops)} layout={layout}"
    assert got.dtype == expected.dtype and got.shape == expected.shape, context
    assert got.is_contiguous(memory_format=torch.channels_last) == expected.is_contiguous(
        memory_format=torch.channels_last
    ) or got.shape[-2:] == (1, 1), context
    assert torch.equal(got, expected), context


def test_the_fuzz_reaches_every_path() -> None:
    """The fuzz's cases cover the gather and resize paths, fills, lists and the fallback."""
    seen = set()
    for seed in range(120):
        _, batch, params, layout = _fuzz_case(seed)
        plan = geometry.geometry_plan(params, params.sizes[0])
        if plan is None:
            seen.add("fallback")
            continue
        table, _ = plan
        seen.add("resize" if bool((table[:, 2:4] != table[:, 4:6]).any()) else "gather")
        box = table[:, 8:12]
        if bool((box[:, 0] > 0).any() or (box[:, 1] < params.output_size()[0]).any()):
            seen.add("fill")
        seen.add(layout)
    assert seen >= {"fallback", "resize", "gather", "fill", "list", "channels_last", "sliced"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cifar_augmentation_equals_the_reference(dtype: torch.dtype) -> None:
    ops = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToDtype(dtype), T.Normalize(MEAN, STD)]
    batch = _images(64, 3, 32, 32, seed=1)
    params = T.sample_params(ops, 7, 2, torch.arange(100, 164), batch_sizes(batch))
    assert torch.equal(batched.run(params, batch), apply_reference(params, batch))


_CROPS_AND_FLIPS = st.lists(
    st.one_of(
        st.builds(
            lambda size, pad, fill: T.RandomCrop(size, padding=pad, fill=fill),
            st.tuples(st.integers(4, 20), st.integers(4, 20)),
            st.one_of(st.integers(0, 5), st.tuples(st.integers(0, 4), st.integers(0, 4)),
                      st.tuples(*[st.integers(0, 4)] * 4)),
            st.sampled_from([0, 0, 17, 255, 99.5]),
        ),
        st.builds(lambda size: T.CenterCrop(size), st.tuples(st.integers(4, 24), st.integers(4, 24))),
        st.builds(lambda p: T.RandomHorizontalFlip(p), st.sampled_from([0.0, 0.5, 1.0])),
    ),
    max_size=4,
)
_VALUES = st.sampled_from([
    [],
    [T.ToChannelsLast()],
    [T.ToDtype(torch.float32)],
    [T.ToDtype(torch.float32, scale=False)],
    [T.ToDtype(torch.float16), T.Normalize(MEAN, STD)],
    [T.ToDtype(torch.bfloat16), T.Normalize(MEAN, STD), T.ToChannelsLast()],
    [T.ToDtype(torch.float32), T.Normalize(MEAN, STD), T.RandomErasing(p=0.5)],
    [T.ColorJitter(brightness=0.3), T.ToDtype(torch.float32)],
])


@settings(max_examples=150, deadline=None)
@given(
    geometry_ops=_CROPS_AND_FLIPS,
    value_ops=_VALUES,
    shape=st.tuples(st.integers(1, 9), st.sampled_from([1, 3]), st.integers(4, 24), st.integers(4, 24)),
    layout=st.sampled_from(["contiguous", "channels_last", "sliced", "expanded"]),
    seed=st.integers(0, 2**31),
)
def test_crops_and_flips_as_windows_equal_the_reference(geometry_ops, value_ops, shape, layout, seed) -> None:
    """The window gather (no per-pixel indices) over pads, fills, flip probabilities, output
    dtypes and batch layouts; the per-pixel gather is never used when the map is a window."""
    n, c, h, w = shape
    batch = _images(n, c, h + 2, w + 3, seed % 1000)
    batch = {
        "contiguous": batch[:, :, :h, :w].contiguous(),
        "channels_last": batch[:, :, :h, :w].contiguous(memory_format=torch.channels_last),
        "sliced": batch[:, :, 1 : 1 + h, 2 : 2 + w],
        "expanded": batch[:1, :, :h, :w].expand(n, c, h, w),
    }[layout]
    value_ops = [op for op in value_ops if not isinstance(op, T.Normalize)] if c == 1 else value_ops
    try:
        params = T.sample_params([*geometry_ops, *value_ops], seed, 1, torch.arange(n) * 3, batch_sizes(batch))
        params.output_size()
    except ValueError:  # a crop larger than the padded image
        return
    expected = apply_reference(params, batch)
    plan = geometry.geometry_plan(params, params.sizes[0])
    windows = plan is not None and geometry.crop_windows(plan[0], params.output_size(), (h, w)) is not None
    real_gather = batched._gather

    def per_pixel_gather(*args):
        assert not windows, "a window map went through the per-pixel gather"
        return real_gather(*args)

    batched._gather = per_pixel_gather
    try:
        got = batched.run(params, batch)
    finally:
        batched._gather = real_gather
    if plan is None:  # crops with different fills: the reference's
        assert got is None
        return
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert got.is_contiguous(memory_format=torch.channels_last) == expected.is_contiguous(
        memory_format=torch.channels_last
    ) or got.shape[-2:] == (1, 1) or got.shape[1] == 1


@pytest.mark.parametrize("jitter", [False, True])
def test_decoder_shaped_images_equal_the_reference(jitter: bool) -> None:
    """HWC images seen as CHW (what DALI and PIL give): the canvas takes their layout (no
    transposing copy per image), the output is still the reference's, in its layout."""
    ops = [T.RandomResizedCrop(20), T.RandomHorizontalFlip(),
           *([T.ColorJitter(0.4, 0.4, 0.4)] if jitter else []), T.ToDtype(torch.float16), T.Normalize(MEAN, STD)]
    hwc = [_images(1, 3, 24 + 5 * k, 40 - 3 * k, seed=k)[0].permute(1, 2, 0).contiguous() for k in range(9)]
    images = [image.permute(2, 0, 1) for image in hwc]
    params = T.sample_params(ops, 4, 0, torch.arange(9), batch_sizes(images))
    assert bool(params.per_op[1]["flip"].any()) and not bool(params.per_op[1]["flip"].all())
    expected = apply_reference(params, images)
    got = batched.run(params, images)
    assert got.is_contiguous() and expected.is_contiguous() and torch.equal(got, expected)
    assert batched._canvas_format(images) == torch.channels_last


def test_decoded_windows_give_what_whole_images_give() -> None:
    """The image path's case: each image only its crop window (ROI decoding), sizes all differ."""
    ops = [T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToDtype(torch.float16), T.Normalize(MEAN, STD)]
    whole = [_images(1, 3, 30 + 3 * k, 41 - 2 * k, seed=k)[0] for k in range(8)]
    sizes = [tuple(image.shape[-2:]) for image in whole]
    indices = torch.arange(8) * 5
    windows = decode_windows(ops, 3, 1, indices, sizes)
    parts = [image[:, y : y + h, x : x + w] for image, (y, x, h, w) in zip(whole, windows)]
    got, backend = T.transform_batch(ops, parts, 3, 1, indices, windows=windows, image_sizes=sizes)
    expected = apply_reference(T.sample_params(ops, 3, 1, indices, sizes), whole)
    assert backend == "batched" and torch.equal(got, expected)


@pytest.mark.parametrize("values", [
    [],
    [T.ToDtype(torch.float16), T.Normalize(MEAN, STD)],
    [T.ToDtype(torch.bfloat16), T.Normalize(MEAN, STD), T.ToChannelsLast()],
    [T.ToDtype(torch.float32, scale=False), T.ToChannelsLast()],
    [T.ToDtype(torch.float32, scale=False), T.Normalize((120.0, 110.0, 100.0), (60.0, 50.0, 70.0))],
])
@pytest.mark.parametrize("hwc", [False, True])
def test_a_random_crops_value_ops_run_per_image_into_the_output(monkeypatch: pytest.MonkeyPatch, values,
                                                                  hwc: bool) -> None:
    """On a CPU, a random crop's value ops (those alike for every sample) finish each canvas
    as it is resized, into the output: no whole-batch pass runs, and the output is the
    reference's, bit for bit and in its layout (a uint8 output, without ToDtype, rounded)."""
    ops = [T.RandomResizedCrop(20), T.RandomHorizontalFlip(), *values]
    images = [_images(1, 3, 24 + 5 * k, 40 - 3 * k, seed=k)[0] for k in range(9)]
    if hwc:  # DALI's HWC decodes, viewed as CHW
        images = [image.permute(1, 2, 0).contiguous().permute(2, 0, 1) for image in images]
    params = T.sample_params(ops, 4, 0, torch.arange(9), batch_sizes(images))
    expected = apply_reference(params, images)

    def batch_pass(*args, **kwargs):
        raise AssertionError("the value ops ran on the whole batch")

    monkeypatch.setattr(batched.reference, "apply_value_ops", batch_pass)
    got = batched.run(params, images)
    assert got.dtype == expected.dtype and got.stride() == expected.stride() and torch.equal(got, expected)


def test_a_list_with_two_windows_alike_still_finishes_per_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoded crops of one shape have the same window, (0, 0, h, w) of themselves: such a pair
    in a list must not send the whole batch to the batch canvas and its whole-batch value pass
    (it did: 7 of 40 batches of 128 crops of the bench's photos, 20 epochs, took that path)."""
    ops = [T.RandomResizedCrop(20), T.RandomHorizontalFlip(), T.ToDtype(torch.float16), T.Normalize(MEAN, STD)]
    whole = [_images(1, 3, 30 + 3 * k, 41 - 2 * k, seed=k)[0] for k in range(6)]
    whole[4] = _images(1, 3, *whole[1].shape[-2:], seed=9)[0]  # another image of image 1's shape
    sizes = [tuple(image.shape[-2:]) for image in whole]
    indices = torch.arange(6)
    params = T.sample_params(ops, 3, 1, indices, sizes)
    first = dict(params.per_op[0])
    for name in ("top", "left", "height", "width"):  # image 4's crop box is image 1's
        first[name] = first[name].clone()
        first[name][4] = first[name][1]
    params = dataclasses.replace(params, per_op=(first, *params.per_op[1:]))
    windows = [tuple(row) for row in torch.stack([first["top"], first["left"], first["height"],
                                                  first["width"]], 1).tolist()]
    parts = [image[:, y : y + h, x : x + w] for image, (y, x, h, w) in zip(whole, windows)]
    in_windows = params_in_windows(params, windows)
    table, _ = geometry.geometry_plan(in_windows, in_windows.sizes[0])
    assert ([1, 4], (0, 0, *parts[1].shape[-2:]), (20, 20)) in batched._window_groups(parts, table)  # a pair
    expected = apply_reference(params, whole)

    def batch_pass(*args, **kwargs):
        raise AssertionError("the value ops ran on the whole batch")

    monkeypatch.setattr(batched.reference, "apply_value_ops", batch_pass)
    got = batched.run(in_windows, parts)
    assert got.stride() == expected.stride() and torch.equal(got, expected)


def test_value_ops_with_per_sample_parameters_still_run_on_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ColorJitter draws parameters per sample: its batch keeps the whole-batch value pass."""
    ops = [T.RandomResizedCrop(20), T.ColorJitter(brightness=0.4), T.ToDtype(torch.float16)]
    images = [_images(1, 3, 24 + 5 * k, 40 - 3 * k, seed=k)[0] for k in range(5)]
    params = T.sample_params(ops, 4, 0, torch.arange(5), batch_sizes(images))
    calls = []
    value_ops = batched.reference.apply_value_ops
    monkeypatch.setattr(batched.reference, "apply_value_ops",
                        lambda *args, **kwargs: calls.append(1) or value_ops(*args, **kwargs))
    got = batched.run(params, images)
    monkeypatch.undo()
    assert calls and torch.equal(got, apply_reference(params, images))


@pytest.mark.parametrize("load,usable,threads_expected", [(0.0, 2, 2), (14.0, 2, 2), (0.0, 1, 1)])
def test_per_image_resizes_spread_over_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, load: float, usable: int,
                                                        threads_expected: int) -> None:
    """A random crop's one-resize-per-image runs on as many threads as CPUs are usable (torch's
    own setting 1, as the bench has it on 2 cores), busy or not, in the loop's thread alone on
    one CPU, and gives the reference's result either way."""
    import os
    import threading

    from gpuload import cpu_threads

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: usable)
    monkeypatch.setattr(cpu_threads._own_use, "now", lambda: 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    threads = set()
    bilinear = batched._bilinear
    start = threading.Barrier(threads_expected, timeout=10)  # both runs in flight at once

    def recording(source, *args):
        first_call = threading.get_ident() not in threads
        threads.add(threading.get_ident())
        if first_call and threads_expected > 1:
            start.wait()
        return bilinear(source, *args)

    monkeypatch.setattr(batched, "_bilinear", recording)
    ops = [T.RandomResizedCrop(20), T.RandomHorizontalFlip(), T.ToDtype(torch.float16), T.Normalize(MEAN, STD)]
    images = [_images(1, 3, 24 + 5 * k, 40 - 3 * k, seed=k)[0] for k in range(9)]
    params = T.sample_params(ops, 4, 0, torch.arange(9), batch_sizes(images))
    try:
        got = batched.run(params, images)
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    assert len(threads) == threads_expected
    assert threading.get_ident() in threads  # the caller takes a share, never only waits
    assert torch.equal(got, apply_reference(params, images))


def test_a_uniform_resize_is_one_bilinear_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole-batch work: a Resize that every sample shares calls the bilinear kernel once."""
    calls = []
    bilinear = batched._bilinear
    monkeypatch.setattr(batched, "_bilinear",
                        lambda source, *args: calls.append(len(source)) or bilinear(source, *args))
    ops = [T.Resize((20, 24)), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    batch = _images(16, 3, 32, 32, seed=2)
    params = T.sample_params(ops, 0, 0, torch.arange(16), batch_sizes(batch))
    got = batched.run(params, batch)
    monkeypatch.undo()
    assert calls == [16]
    assert torch.equal(got, apply_reference(params, batch))


def test_unexpressible_geometry_falls_back_to_the_reference() -> None:
    ops = [T.RandomCrop(20, padding=4), T.Resize((12, 12)), T.ToDtype(torch.float32)]
    batch = _images(4, 3, 20, 20, seed=3)
    params = T.sample_params(ops, 0, 0, torch.arange(4), batch_sizes(batch))
    assert batched.run(params, batch) is None
    out, backend = T.transform_batch(ops, batch, 0, 0, torch.arange(4))
    assert backend == "torch" and torch.equal(out, apply_reference(params, batch))


def test_a_batch_with_too_few_images_is_refused_like_the_reference() -> None:
    ops = [T.CenterCrop(8)]
    batch = _images(3, 3, 10, 10, seed=4)
    params = T.sample_params(ops, 0, 0, torch.arange(4), [(10, 10)] * 4)
    with pytest.raises(ValueError, match="3 images but parameters for 4 samples"):
        batched.run(params, batch)


def test_images_with_different_channel_counts_are_refused() -> None:
    images = [_images(1, 3, 10, 10, seed=5)[0], _images(1, 1, 10, 10, seed=6)[0]]
    params = T.sample_params([T.CenterCrop(8)], 0, 0, torch.arange(2), batch_sizes(images))
    with pytest.raises(ValueError, match=r"one channel count, got \[1, 3\]"):
        batched.run(params, images)


def test_an_empty_batch_is_the_reference_empty_batch() -> None:
    ops = [T.CenterCrop(8), T.ToDtype(torch.float16)]
    batch = torch.empty((0, 3, 10, 10), dtype=torch.uint8)
    params = T.sample_params(ops, 0, 0, torch.empty(0, dtype=torch.int64), batch_sizes(batch))
    out, expected = batched.run(params, batch), apply_reference(params, batch)
    assert out.shape == expected.shape and out.dtype == expected.dtype == torch.float16


# ------------------------------------------------------------------------ backend choice


def test_the_cpu_backend_is_the_batched_path() -> None:
    assert apply.choose_backend("cpu")[0] == "batched"
    assert apply.choose_backend("cpu", "torch")[0] == "torch"
    assert apply.choose_backend("cpu", "batched")[0] == "batched"
    ops = [T.RandomCrop(8, padding=2), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    batch = _images(5, 3, 8, 8, seed=5)
    fast, name = T.transform_batch(ops, batch, 1, 0, torch.arange(5))
    slow, ref_name = T.transform_batch(ops, batch, 1, 0, torch.arange(5), backend="torch")
    assert (name, ref_name) == ("batched", "torch") and torch.equal(fast, slow)
    with pytest.raises(ValueError, match="use one of"):
        apply.choose_backend("cpu", "numpy")


def test_a_gpu_without_working_kernels_gets_the_batched_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "available", lambda device: (False, "CuPy cannot run here (test)"))
    monkeypatch.setattr(apply, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name, reason = apply.choose_backend("cuda:0")
    assert name == "batched" and "test" in reason
    assert any("batched torch ops on cuda:0" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(20))
def test_fuzz_on_the_gpu_equals_the_reference_there(seed: int) -> None:
    """Pure torch ops: the fallback of a GPU without kernels, run on device tensors."""
    ops, batch, params, layout = _fuzz_case(seed)
    on_device = batch.cuda() if isinstance(batch, torch.Tensor) else [image.cuda() for image in batch]
    got = batched.run(params, on_device)
    if got is None:
        return
    expected = apply_reference(params, on_device)
    assert got.device.type == "cuda"
    rtol = {torch.float16: 2**-10, torch.bfloat16: 2**-7}.get(got.dtype, 1e-5)
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=1e-4 if got.is_floating_point() else 1)


def test_canvases_of_different_sizes_equal_the_reference() -> None:
    """A shorter-side resize of images of different shapes: each sample has its own canvas."""
    ops = [T.Resize(12), T.CenterCrop(8), T.ToDtype(torch.float32)]
    images = [_images(1, 3, 20, 30, seed=0)[0], _images(1, 3, 30, 20, seed=1)[0], _images(1, 3, 16, 16, seed=2)[0]]
    params = T.sample_params(ops, 0, 0, torch.arange(3), batch_sizes(images))
    table, _ = geometry.geometry_plan(params, params.sizes[0])
    assert len({tuple(row) for row in table[:, 4:6].tolist()}) == 3  # three canvas sizes
    assert torch.equal(batched.run(params, images), apply_reference(params, images))


def test_decode_windows_of_no_images_and_refused_windows() -> None:
    ops = [T.RandomResizedCrop(8), T.ToDtype()]
    assert decode_windows(ops, 0, 0, [], []) == []
    params = T.sample_params(ops, 0, 0, torch.arange(2), [(12, 12)] * 2)
    with pytest.raises(ValueError, match="1 windows for 2 samples"):
        params_in_windows(params, [(0, 0, 12, 12)])
    flip_first = T.sample_params([T.RandomHorizontalFlip(), T.CenterCrop(8)], 0, 0, torch.arange(1), [(12, 12)])
    with pytest.raises(ValueError, match="starts with a crop"):
        params_in_windows(flip_first, [(0, 0, 12, 12)])
