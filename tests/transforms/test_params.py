"""Counter-based parameters: pure functions of (seed, epoch, index, op), torchvision's bounds."""

from __future__ import annotations

import pytest
import torch

from gpuload import transforms as T
from gpuload.transforms.params import _GOLDEN, _M1, _M2, _mix64_int, mix64, uniform

OPS = [
    T.RandomResizedCrop(24),
    T.RandomHorizontalFlip(),
    T.ColorJitter(0.4, 0.4, 0.4),
    T.ToDtype(torch.float32),
    T.RandomErasing(p=0.7),
]


def _params(indices, sizes, seed=7, epoch=0, ops=OPS):
    return T.sample_params(ops, seed, epoch, torch.tensor(indices), sizes)


def test_mix64_is_bit_exact_splitmix64():
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 123456789]
    signed = [v - 2**64 if v >= 2**63 else v for v in values]
    got = mix64(torch.tensor(signed, dtype=torch.int64)).tolist()
    assert [g % 2**64 for g in got] == [_mix64_int(v) for v in values]


def test_uniform_is_splitmix64_of_its_coordinates():
    """Each number, worked out with Python ints: the wrapping uint64 arithmetic is exact, for
    indices near 2**63 too (so the stream stays what earlier versions drew)."""
    indices = [0, 1, 49_999, 2**40 + 7, 2**63 - 1]
    seed, epoch, op_pos, slots = 2**62 + 5, 3, 4, 3
    key = _mix64_int(_mix64_int(_mix64_int(seed + _GOLDEN) ^ (epoch * _M1)) ^ (op_pos * _M2))
    expected = []
    for index in indices:
        per_sample = _mix64_int(index * _GOLDEN + key)
        expected.append([(_mix64_int(per_sample ^ (k * _GOLDEN % 2**64)) >> 11) * 2.0**-53
                         for k in range(1, slots + 1)])
    assert uniform(seed, epoch, torch.tensor(indices), op_pos, slots).tolist() == expected


def test_uniform_is_in_unit_interval_and_looks_uniform():
    u = uniform(0, 0, torch.arange(20000), 0, 3)
    assert u.shape == (20000, 3) and u.dtype == torch.float64
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.03


def test_same_sample_same_params_in_any_batch_or_order():
    sizes = {i: (30 + i % 7, 40 + i % 5) for i in range(64)}
    whole = _params(list(range(64)), [sizes[i] for i in range(64)])
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:20].tolist()
    part = _params(perm, [sizes[i] for i in perm])
    for k in range(len(OPS)):
        for name, tensor in part.per_op[k].items():
            assert torch.equal(tensor, whole.per_op[k][name][perm]), (OPS[k], name)


def test_epoch_and_seed_change_params():
    idx, sizes = list(range(32)), [(64, 64)] * 32
    a, b, c = _params(idx, sizes), _params(idx, sizes, epoch=1), _params(idx, sizes, seed=8)
    for other in (b, c):
        assert not torch.equal(a.per_op[0]["top"], other.per_op[0]["top"])
        assert not torch.equal(a.per_op[2]["brightness"], other.per_op[2]["brightness"])


def test_index_tensor_device_or_dtype_does_not_matter():
    a = T.sample_params(OPS, 3, 2, torch.arange(8, dtype=torch.int32), [(50, 60)] * 8)
    b = T.sample_params(OPS, 3, 2, list(range(8)), torch.tensor([[50, 60]] * 8))
    assert torch.equal(a.per_op[0]["left"], b.per_op[0]["left"])


@pytest.mark.parametrize("h, w", [(100, 100), (37, 211), (300, 41), (1, 1), (5, 2)])
def test_random_resized_crop_boxes_are_inside_and_within_bounds(h, w):
    op = T.RandomResizedCrop(16, scale=(0.2, 0.9), ratio=(0.5, 2.0))
    p = T.sample_params([op], 1, 0, torch.arange(4000), [(h, w)] * 4000).per_op[0]
    top, left, ch, cw = p["top"], p["left"], p["height"], p["width"]
    assert bool((top >= 0).all() and (left >= 0).all())
    assert bool((top + ch <= h).all() and (left + cw <= w).all() and (ch > 0).all() and (cw > 0).all())


def test_random_resized_crop_area_and_ratio_are_drawn_as_torchvision():
    # Every try fits a 100x100 image here, so the first try is taken: area uniform, ratio
    # log-uniform.
    op = T.RandomResizedCrop(16, scale=(0.2, 0.9), ratio=(0.9, 1.1))
    p = T.sample_params([op], 1, 0, torch.arange(4000), [(100, 100)] * 4000).per_op[0]
    area = (p["height"] * p["width"]).double() / 100**2
    ratio = p["width"].double() / p["height"]
    assert float(area.min()) >= 0.2 - 0.02 and float(area.max()) <= 0.9 + 0.02
    assert float(ratio.min()) >= 0.9 - 0.03 and float(ratio.max()) <= 1.1 + 0.03
    assert abs(float(area.mean()) - 0.55) < 0.02
    assert 0.4 < float((ratio > 1).double().mean()) < 0.6
    # the left/top offsets are uniform over the free room
    room = (100 - p["width"]).double()
    assert abs(float((p["left"] / room.clamp(min=1)).mean()) - 0.5) < 0.03


def test_random_resized_crop_fallback_is_torchvision_center_crop():
    # scale far beyond 1 never fits: every sample takes the fallback.
    op = T.RandomResizedCrop(8, scale=(5.0, 6.0), ratio=(0.75, 1.3333))
    for (h, w), (eh, ew) in {(100, 20): (27, 20), (20, 100): (20, 27), (50, 60): (50, 60)}.items():
        p = T.sample_params([op], 0, 0, torch.arange(3), [(h, w)] * 3).per_op[0]
        exp_h = int(round(w / 0.75)) if w / h < 0.75 else (h if w / h <= 1.3333 else h)
        exp_w = int(round(h * 1.3333)) if w / h > 1.3333 else w
        assert (exp_h, exp_w) == (eh, ew)
        assert p["height"].tolist() == [eh] * 3 and p["width"].tolist() == [ew] * 3
        assert p["top"].tolist() == [(h - eh) // 2] * 3 and p["left"].tolist() == [(w - ew) // 2] * 3


def test_flip_probability_and_jitter_ranges():
    ops = [T.RandomHorizontalFlip(p=0.3), T.ColorJitter(brightness=0.5, contrast=(0.9, 1.1))]
    p = T.sample_params(ops, 5, 0, torch.arange(5000), [(8, 8)] * 5000)
    assert abs(float(p.per_op[0]["flip"].double().mean()) - 0.3) < 0.03
    jit = p.per_op[1]
    assert 0.5 <= float(jit["brightness"].min()) and float(jit["brightness"].max()) <= 1.5
    assert 0.9 <= float(jit["contrast"].min()) and float(jit["contrast"].max()) <= 1.1
    assert torch.equal(jit["saturation"], torch.ones(5000))
    orders = {tuple(o) for o in jit["order"].tolist()}
    assert len(orders) == 6 and all(sorted(o) == [0, 1, 2] for o in orders)


def test_random_erasing_boxes_fit_and_follow_p():
    op = T.RandomErasing(p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3))
    p = T.sample_params([T.ToDtype(), op], 2, 0, torch.arange(4000), [(32, 48)] * 4000).per_op[1]
    on = p["apply"]
    assert abs(float(on.double().mean()) - 0.5) < 0.04
    assert bool((p["top"][on] + p["height"][on] <= 32).all())
    assert bool((p["left"][on] + p["width"][on] <= 48).all())
    area = (p["height"][on] * p["width"][on]).double() / (32 * 48)
    assert float(area.min()) > 0.01 and float(area.max()) < 0.36


def test_center_crop_offsets_match_torchvision_rounding_and_padding():
    p = T.sample_params([T.CenterCrop((4, 10))], 0, 0, [0, 1], [(7, 6), (9, 16)]).per_op[0]
    # (7-4)/2 = 1.5 rounds to 2 (half to even), (9-4)/2 = 2.5 rounds to 2; 10 > 6 pads 2 left
    assert p["top"].tolist() == [round(1.5), round(2.5)] == [2, 2]
    assert p["left"].tolist() == [-2, 3]


def test_random_crop_offsets_cover_padding_and_errors_name_the_sample():
    p = T.sample_params([T.RandomCrop(8, padding=2)], 0, 0, torch.arange(3000), [(8, 8)] * 3000)
    assert set(p.per_op[0]["top"].tolist()) == {-2, -1, 0, 1, 2}
    with pytest.raises(ValueError, match="sample 11 is 5x9"):
        T.sample_params([T.RandomCrop(8)], 0, 0, [10, 11], [(9, 9), (5, 9)])


def test_resize_shorter_side_follows_torchvision():
    p = T.sample_params([T.Resize(256)], 0, 0, [0, 1, 2], [(375, 500), (500, 333), (256, 256)])
    assert p.output_sizes.tolist() == [[256, int(256 * 500 / 375)], [int(256 * 500 / 333), 256], [256, 256]]
    with pytest.raises(ValueError, match="different sizes"):
        p.output_size()


def test_image_sizes_must_match_indices():
    with pytest.raises(ValueError, match="2 image sizes for 3 indices"):
        T.sample_params(OPS, 0, 0, [0, 1, 2], [(8, 8), (8, 8)])


def test_image_sizes_must_be_positive():
    with pytest.raises(ValueError, match="image sizes must be positive, got 0"):
        T.sample_params(OPS, 0, 0, [0, 1], [(8, 8), (0, 8)])


def test_an_op_without_a_sampler_is_named():
    class Sharpen(T.Op):
        """An Op subclass gpuload has no parameter sampler for."""

    with pytest.raises(TypeError, match="no parameter sampler for .*Sharpen"):
        T.sample_params([Sharpen()], 0, 0, [0], [(8, 8)])
