"""The torch reference against direct torch implementations of each op, plus op validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuload import transforms as T
from gpuload.transforms import reference
from gpuload.transforms.reference import grayscale


def _images(n, h, w, seed=0, c=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g)


def _run(ops, batch, seed=0, epoch=0, indices=None):
    n = len(batch)
    idx = torch.arange(n) if indices is None else torch.as_tensor(indices)
    params = T.sample_params(ops, seed, epoch, idx, T.reference.batch_sizes(batch))
    return T.apply_reference(params, batch), params


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: T.RandomResizedCrop(0), "positive"),
        (lambda: T.RandomResizedCrop(8, scale=(0.9, 0.1)), "min <= max"),
        (lambda: T.RandomResizedCrop(8, ratio=(0.0, 1.0)), "ratios must be > 0"),
        (lambda: T.Resize("big"), "int or"),
        (lambda: T.RandomCrop(8, padding=(1, 2, 3)), "padding is an int"),
        (lambda: T.RandomCrop(8, fill=300), "0-255"),
        (lambda: T.RandomHorizontalFlip(p=1.5), "probability"),
        (lambda: T.ColorJitter(brightness=-1), ">= 0"),
        (lambda: T.ToDtype(torch.int32), "float16, torch.bfloat16"),
        (lambda: T.Normalize((0.5, 0.5), (0.2,)), "same lengths"),
        (lambda: T.Normalize((0.5,), (0.0,)), "> 0"),
        (lambda: T.RandomErasing(value="random"), "not supported"),
        (lambda: T.RandomResizedCrop(True),
         r"^RandomResizedCrop\(size=True\): size must be an int or \(height, width\)$"),
        (lambda: T.RandomResizedCrop(8, scale="ab"), r"^RandomResizedCrop\(scale='ab'\): scale must be a \(min, max\) "
                                                     r"pair of numbers$"),
        (lambda: T.RandomResizedCrop(8, scale=(0, 0)),
         r"^RandomResizedCrop\(scale=\(0.0, 0.0\)\): max scale must be > 0$"),
        (lambda: T.Resize(0), r"^Resize\(size=0\): size must be positive$"),
        (lambda: T.RandomCrop(8, padding=(1, -2)), r"^RandomCrop\(padding=\(1, -2\)\): paddings must be ints >= 0$"),
        (lambda: T.RandomCrop(8, fill=(0, 0, 0)), r"^RandomCrop\(fill=\(0, 0, 0\)\): fill is one number \(0-255\)$"),
        (lambda: T.ToDtype(scale=1), r"^ToDtype\(scale=1\): scale is True or False$"),
        (lambda: T.Normalize("ab", (0.5,)), r"^Normalize\(mean='ab', std=\(0.5,\)\): mean and std are sequences of "
                                            r"numbers, one per channel$"),
        (lambda: T.Normalize((0.5,), (0.5,), value_range=100), r"^Normalize\(value_range=100\): use None"),
        (lambda: T.RandomErasing(scale=(0.1, 2.0)), r"^RandomErasing\(scale=\(0.1, 2.0\)\): scale is within \[0, 1\]$"),
        (lambda: T.RandomErasing(ratio=(0, 1)), r"^RandomErasing\(ratio=\(0, 1\)\): ratios must be > 0$"),
        (lambda: T.RandomErasing(value=float("nan")), r"^RandomErasing\(value=nan\): value is finite number\(s\)$"),
        (lambda: T.RandomErasing(value=()), r"^RandomErasing\(value=\(\)\): value is finite number\(s\)$"),
    ],
)
def test_ops_reject_bad_arguments_with_the_value(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_ops_repr_and_normalisation():
    assert repr(T.RandomResizedCrop(224)) == (
        "RandomResizedCrop(size=(224, 224), scale=(0.08, 1.0), ratio=(0.75, 1.3333333333333333))"
    )
    assert T.RandomCrop(8, padding=(1, 2)).padding == (1, 2, 1, 2)
    assert T.ColorJitter(brightness=0.4).brightness == (0.6, 1.4)
    assert T.ColorJitter(contrast=2).contrast == (0.0, 3.0)
    assert hash(T.Normalize([0.5], [0.5])) == hash(T.Normalize((0.5,), (0.5,)))
    assert T.ColorJitter(brightness=None, contrast=(1.0, 1.0)).brightness is None  # none and (1, 1): no jitter
    assert T.ColorJitter(contrast=(1.0, 1.0)).contrast is None
    assert T.validate_pipeline(T.RandomHorizontalFlip()) == (T.RandomHorizontalFlip(),)  # one op is a list of one


def test_a_checked_pipeline_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's steps each validate the list they are given: the loader's, checked once."""
    from gpuload.transforms import ops as ops_module

    checks = []
    real = ops_module._check_normalize_scale
    monkeypatch.setattr(ops_module, "_check_normalize_scale", lambda *args: checks.append(1) or real(*args))
    checked = T.validate_pipeline([T.RandomHorizontalFlip(), T.ToDtype(), T.Normalize((0.5,), (0.5,))])
    assert len(checks) == 1
    assert T.validate_pipeline(checked) is checked and len(checks) == 1
    assert checked == (T.RandomHorizontalFlip(), T.ToDtype(), T.Normalize((0.5,), (0.5,)))
    assert T.validate_pipeline(list(checked)) == checked and len(checks) == 2  # a list of the user's: checked


@pytest.mark.parametrize(
    "ops, message",
    [
        ([T.ToDtype(), T.RandomHorizontalFlip()], "before colour"),
        ([T.Normalize((0.5,), (0.5,))], "needs floats"),
        ([T.ToDtype(), T.ColorJitter(0.1)], "put ColorJitter before"),
        ([T.ToDtype(), T.ToDtype()], "more than one ToDtype"),
        ([T.ToDtype(), T.Normalize((123.7, 116.3, 103.5), (58.4, 57.1, 57.4))], "value_range=255"),
        (["flip"], "not a gpuload transform"),
        ("flip", r"^transforms='flip' is not a list of transforms \(it is a str\)"),
        ([T.RandomErasing(), T.ToDtype()], r"comes before ToDtype\(.*\): put RandomErasing after ToDtype$"),
    ],
)
def test_pipeline_order_errors_say_what_to_change(ops, message):
    with pytest.raises((ValueError, TypeError), match=message):
        T.validate_pipeline(ops)


# ------------------------------------------------------------------------------- semantics


def test_random_resized_crop_is_interpolate_on_the_crop_window():
    batch = _images(6, 37, 53)
    out, params = _run([T.RandomResizedCrop((17, 23)), T.ToDtype(torch.float32, scale=False)], batch)
    p = params.per_op[0]
    for k in range(6):
        t, left, h, w = (int(p[name][k]) for name in ("top", "left", "height", "width"))
        window = batch[k : k + 1, :, t : t + h, left : left + w].float()
        expected = F.interpolate(window, size=(17, 23), mode="bilinear", align_corners=False)[0]
        torch.testing.assert_close(out[k], expected, rtol=0, atol=1e-4)


def test_uint8_output_rounds_like_torchvision():
    batch = _images(3, 20, 30)
    out, _ = _run([T.Resize((13, 7))], batch)
    expected = F.interpolate(batch.float(), size=(13, 7), mode="bilinear", align_corners=False)
    assert out.dtype == torch.uint8
    assert torch.equal(out, expected.round().clamp(0, 255).to(torch.uint8))


def test_flip_crop_normalize_against_direct_torch():
    batch = _images(8, 12, 16)
    ops = [
        T.CenterCrop((10, 12)),
        T.RandomHorizontalFlip(p=0.5),
        T.ToDtype(torch.float32),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ]
    out, params = _run(ops, batch)
    flips = params.per_op[1]["flip"]
    assert 0 < int(flips.sum()) < 8
    crop = batch[:, :, 1:11, 2:14].float() / 255
    crop = torch.where(flips.view(-1, 1, 1, 1), crop.flip(-1), crop)
    mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (crop - mean) / std, rtol=0, atol=1e-6)


def test_normalize_value_range_255_equals_dividing_by_255():
    batch = _images(2, 8, 8)
    mean255, std255 = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
    a, _ = _run([T.ToDtype(), T.Normalize(mean255, std255, value_range=255)], batch)
    b, _ = _run([T.ToDtype(), T.Normalize([m / 255 for m in mean255], [s / 255 for s in std255])], batch)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_random_crop_padding_uses_fill():
    batch = torch.full((64, 1, 4, 4), 200, dtype=torch.uint8)
    out, params = _run([T.RandomCrop(4, padding=3, fill=7)], batch)
    p = params.per_op[0]
    for k in range(64):
        t, left = int(p["top"][k]), int(p["left"][k])
        rows = torch.arange(4).view(-1, 1) + t
        cols = torch.arange(4).view(1, -1) + left
        inside = (rows >= 0) & (rows < 4) & (cols >= 0) & (cols < 4)
        assert torch.equal(out[k, 0], torch.where(inside, 200, 7).to(torch.uint8))


def test_variable_size_list_input_and_mismatch_error():
    images = [_images(1, h, w, seed=h)[0] for h, w in [(30, 40), (41, 29), (64, 64)]]
    out, _ = _run([T.Resize(32), T.CenterCrop(24)], images)
    assert out.shape == (3, 3, 24, 24)
    for k, im in enumerate(images):
        alone, _ = _run([T.Resize(32), T.CenterCrop(24)], [im], indices=[k])
        assert torch.equal(out[k], alone[0])
    with pytest.raises(ValueError, match="different sizes"):
        _run([T.Resize(32)], images)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_and_channels_last(dtype):
    batch = _images(4, 20, 22)
    ops = [T.RandomResizedCrop(16), T.ToDtype(dtype), T.ToChannelsLast()]
    out, _ = _run(ops, batch)
    ref32, _ = _run([T.RandomResizedCrop(16), T.ToDtype(torch.float32)], batch)
    assert out.dtype == dtype and out.shape == (4, 3, 16, 16)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert torch.equal(out, ref32.to(dtype))
    assert T.plan_output(ops) == T.OutputPlan(dtype, True, (16, 16))


def test_color_jitter_factor_one_is_identity():
    batch = _images(5, 9, 11)
    ops = [T.ColorJitter(brightness=(1, 1), contrast=(1, 1), saturation=(1, 1)), T.ToDtype(scale=False)]
    out, _ = _run(ops, batch)
    assert torch.equal(out, batch.float())


def test_color_jitter_formulas():
    batch = _images(3, 6, 7)
    x = batch.float()
    for ops, expect in [
        ([T.ColorJitter(brightness=(1.5, 1.5))], (x * 1.5).clamp(0, 255)),
        ([T.ColorJitter(saturation=(0.0, 0.0))], grayscale(x).expand(-1, 3, -1, -1)),
        ([T.ColorJitter(contrast=(0.0, 0.0))],
         grayscale(x).mean(dim=(1, 2, 3), keepdim=True).expand_as(x)),
    ]:
        out, _ = _run(ops + [T.ToDtype(scale=False)], batch)
        torch.testing.assert_close(out, expect, rtol=0, atol=1e-4)


def test_contrast_does_not_depend_on_the_thread_count():
    # gpuload.cpu_threads lowers torch's threads on a busy machine: a batch must come out the same.
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (1, 3, 1000, 1000), dtype=torch.uint8)
    ops = [T.ColorJitter(contrast=(0.5, 0.5)), T.ToDtype(scale=False)]
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 8):
            torch.set_num_threads(count)
            outs.append(_run(ops, batch)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_color_jitter_order_is_per_sample():
    batch = _images(40, 5, 5)
    ops = [T.ColorJitter(brightness=(1.8, 1.8), saturation=(0.3, 0.3)), T.ToDtype(scale=False)]
    out, params = _run(ops, batch)
    order = params.per_op[0]["order"]
    x = batch.float()

    def b(t):
        return (t * 1.8).clamp(0, 255)

    def s(t):
        return (0.3 * t + 0.7 * grayscale(t)).clamp(0, 255)

    b_first = (order == 0).nonzero()[:, 1] < (order == 2).nonzero()[:, 1]
    assert 0 < int(b_first.sum()) < 40
    expect = torch.where(b_first.view(-1, 1, 1, 1), s(b(x)), b(s(x)))
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-3)


def _color_jitter_by_rows(x, p):
    """ColorJitter as it was written before the sync-free rewrite: rows picked by nonzero()."""
    x = x.clone()
    order = p["order"]
    factors = [p[name].to(torch.float32) for name in ("brightness", "contrast", "saturation")]
    for step in range(3):
        for kind in range(3):
            rows = (order[:, step] == kind).nonzero()[:, 0]
            if len(rows):
                x[rows] = T.reference._ADJUST[kind](x[rows], factors[kind][rows].view(-1, 1, 1, 1))
    return x


@pytest.mark.parametrize("channels", [1, 3])
def test_color_jitter_without_host_sync_equals_the_row_indexed_version(channels):
    """The masked (torch.where) jitter gives bit-identical results to the nonzero() one."""
    ops = [T.ColorJitter(brightness=0.9, contrast=0.9, saturation=0.9)]
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        n = 1 + seed * 7
        x = torch.rand((n, channels, 9, 13), generator=g) * 255
        x[:, :, 0, 0] = 255.0  # saturated pixels: the clamps matter
        params = T.sample_params(ops, seed, 0, torch.arange(n), [(9, 13)] * n).per_op[0]
        before = x.clone()
        out = T.reference.color_jitter(x, params, None)
        assert torch.equal(x, before)  # the input is not modified
        assert torch.equal(out, _color_jitter_by_rows(x, params))


def test_random_erasing_region_holds_the_value():
    batch = _images(50, 16, 16)
    ops = [T.ToDtype(), T.Normalize((0.5,), (0.25,)), T.RandomErasing(p=0.8, value=(1.0, 2.0, 3.0))]
    out, params = _run(ops, batch)
    p = params.per_op[2]
    plain = (batch.float() / 255 - 0.5) / 0.25
    assert 20 < int(p["apply"].sum()) < 50
    for k in range(50):
        mask = torch.zeros(16, 16, dtype=torch.bool)
        if bool(p["apply"][k]):
            t, left, h, w = (int(p[n][k]) for n in ("top", "left", "height", "width"))
            mask[t : t + h, left : left + w] = True
        expect = torch.where(mask, torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1), plain[k])
        torch.testing.assert_close(out[k], expect, rtol=0, atol=1e-6)


def test_apply_transforms_is_deterministic_and_batch_independent():
    batch = _images(10, 24, 24)
    ops = [T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ColorJitter(0.3, 0.3, 0.3), T.ToDtype()]
    idx = torch.arange(100, 110)
    a = T.apply_transforms(ops, batch, seed=3, epoch=1, indices=idx)
    b = T.apply_transforms(ops, batch[4:7], seed=3, epoch=1, indices=idx[4:7])
    assert torch.equal(a[4:7], b)
    c = T.apply_transforms(ops, batch, seed=3, epoch=2, indices=idx)
    assert not torch.equal(a, c)
    out, backend = T.transform_batch(ops, batch, 3, 1, idx)
    assert backend == "batched" and torch.equal(out, a)


def test_apply_without_cupy_backend_falls_back_or_raises():
    with pytest.raises(RuntimeError, match="backend='cupy'"):
        T.apply_transforms([T.ToDtype()], _images(1, 4, 4), 0, 0, [0], backend="cupy")
    with pytest.raises(ValueError, match="backend="):
        T.apply_transforms([T.ToDtype()], _images(1, 4, 4), 0, 0, [0], backend="gpu")


def test_bad_batches_are_rejected():
    with pytest.raises(TypeError, match="uint8"):
        T.apply_transforms([T.ToDtype()], torch.zeros(2, 3, 4, 4), 0, 0, [0, 1])
    with pytest.raises(TypeError, match=r"batch\[1\]"):
        T.apply_transforms([T.ToDtype()], [_images(1, 4, 4)[0], torch.zeros(4, 4)], 0, 0, [0, 1])


def test_grey_images_work():
    batch = _images(3, 10, 10, c=1)
    out = T.apply_transforms(
        [T.RandomResizedCrop(8), T.ColorJitter(0.5, 0.5, 0.5), T.ToDtype(), T.Normalize((0.5,), (0.5,))],
        batch, 0, 0, [0, 1, 2],
    )
    assert out.shape == (3, 1, 8, 8) and out.dtype == torch.float32


def test_plan_output_gives_size_layout_and_shape_before_any_data():
    crop = T.plan_output([T.RandomResizedCrop((12, 10)), T.ToDtype(torch.float16), T.ToChannelsLast()])
    assert crop.memory_format == torch.channels_last and crop.shape(5) == (5, 3, 12, 10)
    fixed = T.plan_output([T.Resize((9, 7))])
    assert fixed == T.OutputPlan(torch.uint8, False, (9, 7)) and fixed.memory_format == torch.contiguous_format
    shorter_side = T.plan_output([T.Resize(16)])
    assert shorter_side.size is None
    with pytest.raises(ValueError, match="pass input_size"):
        shorter_side.shape(2)
    for size, expected in [((20, 40), (16, 32)), ((40, 20), (32, 16))]:  # what the images give
        plan = T.plan_output([T.Resize(16)], input_size=size)
        out = T.apply_transforms([T.Resize(16)], _images(1, *size, c=1), 0, 0, [0])
        assert plan.shape(1, channels=1) == tuple(out.shape) == (1, 1, *expected)


def test_parameters_for_another_number_of_images_are_refused():
    params = T.sample_params([T.ToDtype()], 0, 0, [0, 1, 2], [(4, 4)] * 3)
    with pytest.raises(ValueError, match="2 images but parameters for 3 samples"):
        reference.apply_reference(params, _images(2, 4, 4))


@pytest.mark.parametrize(
    "op, message",
    [
        (T.Normalize((0.5, 0.5), (0.5, 0.5)), "has 2 means for 3-channel images"),
        (T.RandomErasing(p=1.0, value=(1.0, 2.0)), "has 2 values for 3-channel images"),
    ],
)
def test_per_channel_values_must_match_the_channels(op, message):
    with pytest.raises(ValueError, match=message):
        T.apply_transforms([T.ToDtype(), op], _images(2, 6, 6), 0, 0, [0, 1])
