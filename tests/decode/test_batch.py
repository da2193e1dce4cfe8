"""gpuload.decode: pixel parity with PIL, EXIF orientation, ROIs, bad files, backend choice.

Tolerances against PIL (libjpeg-turbo), per image:
- CPU backends (DALI's CPU decoder is libjpeg-turbo too): mean |diff| <= 0.5, max <= 4.
  Measured on this machine: 0 and 0 for every JPEG kind (bit-exact).
- DALI mixed (nvJPEG, fancy upsampling on): mean |diff| <= 1.0, max <= 24 (IDCT and chroma
  upsampling rounding differ on the GPU). gpu-marked; measured numbers are printed.
"""

from __future__ import annotations

import io
import threading

import image_fixtures as F
import numpy as np
import pytest
import torch

from gpuload.decode import (
    BatchDecoder,
    DecodeResult,
    ImageDecodeError,
    cpu,
    decode_batch,
    headers,
    peek_size,
    resolve_backend,
)
from gpuload.decode import batch as batch_module
from gpuload.decode._dali import dali_installed

CPU_MEAN_TOL, CPU_MAX_TOL = 0.5, 4
GPU_MEAN_TOL, GPU_MAX_TOL = 1.0, 24

requires_dali = pytest.mark.skipif(not dali_installed(), reason="needs nvidia.dali (DALI), which is not installed here")

# DALI and torchvision join where installed; test_torchvision_backend says so where torchvision
# is not, the tests marked requires_dali where DALI is not.
CPU_BACKENDS = ((["dali-cpu"] if dali_installed() else []) + ["pil"]
                + (["torchvision"] if cpu.torchvision_available() else []))

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=CPU_BACKENDS)
def decoder(request: pytest.FixtureRequest) -> BatchDecoder:
    """One decoder per backend for the whole module: DALI pipelines are built once."""
    return BatchDecoder("cpu", backend=request.param, max_batch=8)


def decode_one(decoder: BatchDecoder, data: bytes, name: str = "x.jpg", **kw) -> torch.Tensor:
    result = decoder.decode([data], [name], [0], **kw)
    assert result.kept_positions == [0]
    return result.images[0]


def assert_close_to_pil(image: torch.Tensor, data: bytes, mean_tol: float, max_tol: int) -> tuple[float, int]:
    reference = F.pil_reference(data)
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    mean, worst = F.diff_stats(image, reference)
    assert mean <= mean_tol and worst <= max_tol, f"mean |diff| {mean:.3f}, max {worst}"
    return mean, worst


@pytest.mark.parametrize("kind", sorted(F.JPEG_KINDS))
def test_jpeg_kinds_match_pil(decoder: BatchDecoder, kind: str) -> None:
    data = F.jpeg(kind)
    image = decode_one(decoder, data)
    assert image.shape == (3, F.HEIGHT, F.WIDTH)
    assert_close_to_pil(image, data, CPU_MEAN_TOL, CPU_MAX_TOL)


def test_a_batch_of_every_kind_matches_pil_in_order(decoder: BatchDecoder) -> None:
    kinds = sorted(F.JPEG_KINDS)
    encoded = [F.jpeg(k) for k in kinds]
    result = decoder.decode(encoded, kinds, list(range(100, 100 + len(kinds))))
    assert result.kept_positions == list(range(len(kinds))) and result.skipped == []
    for image, data in zip(result.images, encoded):
        assert_close_to_pil(image, data, CPU_MEAN_TOL, CPU_MAX_TOL)


def test_grayscale_jpeg_becomes_three_equal_channels(decoder: BatchDecoder) -> None:
    image = decode_one(decoder, F.jpeg("grayscale"))
    assert image.shape[0] == 3
    assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P"])
def test_png_modes_decode_to_rgb_like_pil(decoder: BatchDecoder, mode: str) -> None:
    data = F.png(mode)
    image = decode_one(decoder, data, "x.png")
    assert image.shape == (3, F.HEIGHT, F.WIDTH)
    # PNG is lossless: alpha is dropped, grey is replicated, palettes are expanded, exactly.
    assert torch.equal(image, F.pil_reference(data))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(decoder: BatchDecoder, orientation: int) -> None:
    stored = decode_one(decoder, F.jpeg_with_orientation(1))  # same pixels, upright as stored
    image = decode_one(decoder, F.jpeg_with_orientation(orientation))
    expected = F.upright(stored, orientation)
    assert image.shape == expected.shape
    assert F.diff_stats(image, expected) == (0.0, 0)


@pytest.mark.parametrize("orientation", [6, 3])
def test_exif_orientation_on_444(decoder: BatchDecoder, orientation: int) -> None:
    stored = decode_one(decoder, F.jpeg_with_orientation(1, subsampling=0))
    image = decode_one(decoder, F.jpeg_with_orientation(orientation, subsampling=0))
    assert torch.equal(image, F.upright(stored, orientation))


@pytest.mark.skipif(not cpu.torchvision_available(), reason="torchvision is not installed")
def test_torchvision_backend_matches_pil() -> None:
    decoder = BatchDecoder("cpu", backend="torchvision")
    for data in [F.jpeg("baseline-420"), F.jpeg("grayscale"), F.jpeg_with_orientation(6), F.png("RGBA")]:
        assert_close_to_pil(decode_one(decoder, data), data, CPU_MEAN_TOL, CPU_MAX_TOL)


def test_peek_size_reads_upright_size_from_the_header() -> None:
    assert peek_size(F.jpeg("baseline-420")) == (F.HEIGHT, F.WIDTH)
    assert peek_size(F.jpeg_with_orientation(6)) == (F.WIDTH, F.HEIGHT)
    assert peek_size(F.jpeg_with_orientation(3)) == (F.HEIGHT, F.WIDTH)
    assert peek_size(F.png("RGBA")) == (F.HEIGHT, F.WIDTH)


# --- ROIs ----------------------------------------------------------------------------------


def test_roi_decode_equals_crop_of_full_decode(decoder: BatchDecoder) -> None:
    encoded = [F.jpeg("baseline-420"), F.jpeg("progressive-444"), F.jpeg_with_orientation(6), F.png("RGBA")]
    rois = [(10, 21, 100, 120), (0, 0, 64, 64), (37, 50, 90, 150), (3, 5, 200, 150)]
    full = decoder.decode(encoded, ["a", "b", "c", "d"], [0, 1, 2, 3])
    part = decoder.decode(encoded, ["a", "b", "c", "d"], [0, 1, 2, 3], rois=rois)
    assert part.roi == ("decoder" if decoder.backend.startswith("dali") else "crop")
    assert full.roi == "none"
    for whole, window, (y0, x0, h, w) in zip(full.images, part.images, rois):
        assert window.shape == (3, h, w)
        mean, worst = F.diff_stats(window, whole[:, y0 : y0 + h, x0 : x0 + w])
        assert mean <= CPU_MEAN_TOL and worst <= CPU_MAX_TOL, (mean, worst)


def test_headers_read_before_are_not_read_again(decoder: BatchDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = [F.jpeg("baseline-420"), F.png("RGBA")]
    known = [headers.peek_header(data) for data in encoded]
    rois = [(10, 21, 100, 120), (3, 5, 200, 150)]
    expected = decoder.decode(encoded, ["a", "b"], [0, 1], rois=rois)

    def no_second_read(data: bytes):
        raise AssertionError("a header given to decode was read again")

    monkeypatch.setattr(batch_module, "peek_header", no_second_read)
    got = decoder.decode(encoded, ["a", "b"], [0, 1], rois=rois, headers=known)
    assert all(torch.equal(a, b) for a, b in zip(got.images, expected.images))
    with pytest.raises(ValueError, match="one header"):
        decoder.decode(encoded, ["a", "b"], [0, 1], headers=known[:1])


@requires_dali
@pytest.mark.parametrize("rois", [None, [(10, 21, 100, 120), (3, 5, 200, 150), (0, 0, 64, 64)]])
def test_dali_hands_out_hwc_images_as_chw_views_when_asked(rois) -> None:
    """channels_last=True: the same pixels, as (3, H, W) views of HWC memory (no transpose)."""
    encoded = [F.jpeg("baseline-420"), F.png("RGBA"), F.jpeg_with_orientation(6)]
    plain = BatchDecoder("cpu", backend="dali-cpu", max_batch=4).decode(encoded, ["a", "b", "c"], [0, 1, 2], rois=rois)
    hwc = BatchDecoder("cpu", backend="dali-cpu", max_batch=4, channels_last=True).decode(
        encoded, ["a", "b", "c"], [0, 1, 2], rois=rois
    )
    for a, b in zip(plain.images, hwc.images):
        assert a.is_contiguous() and b.stride(0) == 1 and b.permute(1, 2, 0).is_contiguous()
        assert torch.equal(a, b)


def test_roi_is_clipped_to_the_image(decoder: BatchDecoder) -> None:
    data = F.jpeg("baseline-444")
    whole = decode_one(decoder, data)
    window = decode_one(decoder, data, rois=[(-10, F.WIDTH - 30, 50, 100)])
    assert window.shape == (3, 40, 30)
    assert F.diff_stats(window, whole[:, :40, F.WIDTH - 30 :])[1] <= CPU_MAX_TOL


def test_roi_outside_the_image_is_a_clear_error(decoder: BatchDecoder) -> None:
    with pytest.raises(ValueError, match=r"sample index 7 \('far.jpg'\) does not overlap its 251x203"):
        decoder.decode([F.jpeg("baseline-420")], ["far.jpg"], [7], rois=[(300, 0, 10, 10)])


# --- bad files -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_name", sorted(F.corrupt_inputs()))
def test_bad_file_raises_naming_file_index_and_backend(decoder: BatchDecoder, bad_name: str) -> None:
    good = F.jpeg("baseline-420")
    encoded = [good, F.corrupt_inputs()[bad_name], good]
    names = ["ok1.jpg", f"/data/{bad_name}", "ok2.jpg"]
    with pytest.raises(ImageDecodeError) as caught:
        decoder.decode(encoded, names, [40, 41, 42])
    error = caught.value
    assert (error.index, error.name, error.backend) == (41, f"/data/{bad_name}", decoder.backend)
    assert error.reason
    message = str(error)
    assert f"/data/{bad_name}" in message and "sample index 41" in message
    assert decoder.backend in message and "on_error='skip'" in message


def test_skip_keeps_the_good_samples_of_a_batch_and_counts_the_bad(decoder: BatchDecoder) -> None:
    bad = F.corrupt_inputs()
    good = [F.jpeg("baseline-420"), F.jpeg("progressive-422"), F.png("RGB")]
    encoded = [good[0], bad["truncated.jpg"], good[1], bad["not-an-image.jpg"], bad["empty.jpg"], good[2]]
    names = [f"f{k}" for k in range(len(encoded))]
    result = decoder.decode(encoded, names, [10, 11, 12, 13, 14, 15], on_error="skip")
    assert isinstance(result, DecodeResult)
    assert result.kept_positions == [0, 2, 5]
    assert [(index, name) for index, name, _ in result.skipped] == [(11, "f1"), (13, "f3"), (14, "f4")]
    assert all(reason for _, _, reason in result.skipped)
    assert "empty" in result.skipped[2][2]
    for image, data in zip(result.images, good):
        assert_close_to_pil(image, data, CPU_MEAN_TOL, CPU_MAX_TOL)
    assert result.backend == decoder.backend


def test_raise_reports_the_first_bad_sample_and_how_many_more(decoder: BatchDecoder) -> None:
    bad = F.corrupt_inputs()
    encoded = [F.jpeg("baseline-420"), bad["header-only.jpg"], bad["truncated.jpg"]]
    with pytest.raises(ImageDecodeError, match=r"sample index 5: .*\(1 more sample\(s\) in this batch failed too\)"):
        decoder.decode(encoded, ["a", "b", "c"], [4, 5, 6])


def test_decoder_still_works_after_a_bad_batch(decoder: BatchDecoder) -> None:
    with pytest.raises(ImageDecodeError):
        decoder.decode([F.corrupt_inputs()["truncated.jpg"]], ["t"], [0])
    data = F.jpeg("baseline-422")
    assert_close_to_pil(decode_one(decoder, data), data, CPU_MEAN_TOL, CPU_MAX_TOL)


def test_garbled_data_is_decoded_or_reported_never_a_crash(decoder: BatchDecoder) -> None:
    result = decoder.decode([F.garbled_jpeg(), F.jpeg("baseline-420")], ["g", "ok"], [0, 1], on_error="skip")
    assert 1 in result.kept_positions
    assert len(result.kept_positions) + len(result.skipped) == 2


def test_bad_roi_header_is_reported_like_a_bad_file(decoder: BatchDecoder) -> None:
    bad = F.corrupt_inputs()["not-an-image.jpg"]
    result = decoder.decode(
        [bad, F.jpeg("baseline-420")], ["bad", "ok"], [3, 4], rois=[(0, 0, 8, 8), (0, 0, 8, 8)], on_error="skip"
    )
    assert result.kept_positions == [1] and result.skipped[0][:2] == (3, "bad")
    assert result.images[0].shape == (3, 8, 8)


@requires_dali
def test_dali_falls_back_to_pil_for_formats_dali_cannot_read() -> None:
    # DALI has no GIF decoder; PIL has. The sample is kept and counted.
    gif = F.encode(F.photo(), "GIF")
    result = BatchDecoder("cpu", backend="dali-cpu").decode([gif, F.jpeg("baseline-420")], ["a.gif", "b"], [0, 1])
    assert result.kept_positions == [0, 1] and result.fallback_decoded == 1
    assert torch.equal(result.images[0], F.pil_reference(gif))


# --- backend choice, reuse, arguments --------------------------------------------------------


@requires_dali
def test_backend_resolution() -> None:
    assert resolve_backend(CPU, "auto") == "dali-cpu"
    assert resolve_backend(CPU, "dali") == "dali-cpu"
    assert resolve_backend(CPU, "pil") == "pil"
    assert resolve_backend(torch.device("cuda", 0), "auto") == "dali-mixed"
    with pytest.raises(ValueError, match="backend='dali-mixed' decodes on a GPU but the device is cpu"):
        resolve_backend(CPU, "dali-mixed")
    with pytest.raises(ValueError, match="backend='nvjpeg' decodes on a GPU but the device is cpu"):
        resolve_backend(CPU, "nvjpeg")
    with pytest.raises(ValueError, match="backend='jpeg' is not one of"):
        resolve_backend(CPU, "jpeg")


def test_backend_resolution_without_dali(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuload.decode._dali as dali_module

    monkeypatch.setattr(dali_module, "dali_installed", lambda: False)
    expected = "torchvision" if cpu.torchvision_available() else "pil"
    assert resolve_backend(CPU, "auto") == expected
    on_gpu = "nvjpeg" if cpu.torchvision_available() else "pil"
    assert resolve_backend(torch.device("cuda", 0), "auto") == on_gpu
    monkeypatch.setattr(cpu, "torchvision_available", lambda: False)
    assert resolve_backend(torch.device("cuda", 0), "auto") == "pil"
    with pytest.raises(ValueError, match="backend='nvjpeg' needs torchvision"):
        resolve_backend(torch.device("cuda", 0), "nvjpeg")
    with pytest.raises(ValueError, match="backend='dali' needs nvidia.dali"):
        resolve_backend(CPU, "dali")
    with pytest.raises(ValueError, match="backend='dali-cpu' needs nvidia.dali, which is not installed"):
        resolve_backend(CPU, "dali-cpu")
    assert decode_batch([F.jpeg("baseline-420")], ["a"], [0], device="cpu", backend="pil").backend == "pil"


@pytest.fixture
def dali_cannot_import(monkeypatch: pytest.MonkeyPatch) -> type[Exception]:
    """DALI is installed but its import fails at run time; returns DaliUnavailable."""
    import gpuload.decode._dali as dali_module

    def broken() -> None:
        raise dali_module.DaliUnavailable("nvidia.dali could not be imported (pretend)")

    monkeypatch.setattr(dali_module, "_import_dali", broken)
    return dali_module.DaliUnavailable


@requires_dali
def test_auto_warns_and_falls_back_when_dali_cannot_import(dali_cannot_import: type[Exception]) -> None:
    decoder = BatchDecoder("cpu", backend="auto")
    assert decoder.backend == "dali-cpu"
    with pytest.warns(UserWarning, match="decoding with (pil|torchvision) instead"):
        result = decoder.decode([F.jpeg("baseline-420")], ["a"], [0])
    assert result.backend == decoder.backend and decoder.backend in ("pil", "torchvision")


@requires_dali
def test_a_dali_backend_asked_for_by_name_does_not_fall_back(dali_cannot_import: type[Exception]) -> None:
    decoder = BatchDecoder("cpu", backend="dali-cpu")
    with pytest.raises(dali_cannot_import, match="pretend"):
        decoder.decode([F.jpeg("baseline-420")], ["a"], [0])
    assert decoder.backend == "dali-cpu"


@requires_dali
def test_dali_pipeline_is_built_once_and_handles_smaller_and_larger_batches() -> None:
    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=4)
    data = F.jpeg("baseline-420")
    decoder.decode([data] * 4, list("abcd"), [0, 1, 2, 3])
    dali = decoder._dali[False]
    pipe = dali._pipe
    for n in (1, 3, 4):
        assert len(decoder.decode([data] * n, ["x"] * n, list(range(n))).images) == n
    assert dali._pipe is pipe
    assert len(decoder.decode([data] * 6, ["x"] * 6, list(range(6))).images) == 6
    assert dali._pipe_batch == 6


@requires_dali
def test_concurrent_calls_are_serialized() -> None:
    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=2)
    data = [F.jpeg("baseline-420"), F.jpeg("grayscale")]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(3):
                result = decoder.decode(data, ["a", "b"], [0, 1])
                assert_close_to_pil(result.images[1], data[1], CPU_MEAN_TOL, CPU_MAX_TOL)
        except BaseException as error:  # collected for the main thread
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


@requires_dali
def test_decode_batch_shares_a_decoder_and_reports_the_backend() -> None:
    data = F.jpeg("baseline-420")
    first = decode_batch([data], ["a"], [0], device="cpu")
    second = decode_batch([data, data], ["a", "b"], [0, 1], device="cpu")
    assert first.backend == second.backend == "dali-cpu"
    assert torch.equal(first.images[0], second.images[1])
    assert decode_batch([], [], [], device="cpu").images == []


def test_argument_errors() -> None:
    decoder = BatchDecoder("cpu", backend="pil")
    with pytest.raises(ValueError, match="got 1 images, 2 names, 1 indices"):
        decoder.decode([b"x"], ["a", "b"], [0])
    with pytest.raises(ValueError, match="on_error='ignore' is not one of"):
        decoder.decode([F.jpeg("grayscale")], ["a"], [0], on_error="ignore")
    with pytest.raises(ValueError, match="a ROI is"):
        decoder.decode([F.jpeg("grayscale")], ["a"], [0], rois=[(0, 0, 4)])


# --- GPU: DALI's mixed (nvJPEG) decoder --------------------------------------------------------


@requires_dali
@pytest.mark.gpu
def test_mixed_decoder_matches_pil_on_every_kind() -> None:
    decoder = BatchDecoder("cuda", backend="auto", max_batch=16)
    assert decoder.backend == "dali-mixed"
    kinds = sorted(F.JPEG_KINDS)
    encoded = [F.jpeg(k) for k in kinds] + [F.jpeg_with_orientation(o) for o in range(1, 9)]
    names = kinds + [f"exif-{o}" for o in range(1, 9)]
    result = decoder.decode(encoded, names, list(range(len(encoded))))
    assert result.backend == "dali-mixed" and result.kept_positions == list(range(len(encoded)))
    for name, image, data in zip(names, result.images, encoded):
        assert image.device.type == "cuda"
        mean, worst = assert_close_to_pil(image, data, GPU_MEAN_TOL, GPU_MAX_TOL)
        print(f"dali-mixed vs PIL {name}: mean |diff| {mean:.3f}, max {worst}")
    rois = [(10, 20, 100, 120)] * len(encoded)
    part = decoder.decode(encoded, names, list(range(len(encoded))), rois=rois)
    assert part.roi == "decoder"
    for whole, window in zip(result.images, part.images):
        mean, worst = F.diff_stats(window, whole[:, 10:110, 20:140])
        assert mean <= GPU_MEAN_TOL and worst <= GPU_MAX_TOL, (mean, worst)


@requires_dali
@pytest.mark.gpu
def test_mixed_decoder_reports_bad_files_and_keeps_the_rest() -> None:
    decoder = BatchDecoder("cuda", backend="dali-mixed", max_batch=4)
    bad = F.corrupt_inputs()
    encoded = [F.jpeg("baseline-420"), bad["truncated.jpg"], bad["not-an-image.jpg"], F.jpeg("grayscale")]
    result = decoder.decode(encoded, ["a", "b", "c", "d"], [0, 1, 2, 3], on_error="skip")
    assert result.kept_positions == [0, 3] and [s[0] for s in result.skipped] == [1, 2]
    with pytest.raises(ImageDecodeError, match="sample index 1"):
        decoder.decode(encoded, ["a", "b", "c", "d"], [0, 1, 2, 3])


# --- the pixel limit (decompression bombs) ----------------------------------------------------


def test_a_bomb_is_a_bad_file_named_with_its_index(decoder: BatchDecoder) -> None:
    encoded = [F.jpeg("baseline-420"), F.bomb_jpeg(), F.png("RGB")]
    with pytest.raises(ImageDecodeError,
                       match=r"'bomb.jpg', sample index 8: .*20000x20000.*decompression bomb") as caught:
        decoder.decode(encoded, ["a.jpg", "bomb.jpg", "c.png"], [7, 8, 9])
    assert caught.value.backend == decoder.backend
    result = decoder.decode(encoded, ["a.jpg", "bomb.jpg", "c.png"], [7, 8, 9], on_error="skip")
    assert result.kept_positions == [0, 2] and result.skipped[0][:2] == (8, "bomb.jpg")
    assert result.fallback_decoded == 0  # PIL never saw it either


def test_the_limit_is_a_keyword_of_the_decoder_and_of_each_call(decoder: BatchDecoder) -> None:
    data = F.jpeg("baseline-420")
    with pytest.raises(ImageDecodeError, match="over the limit of 50,000"):
        decoder.decode([data], ["x"], [0], max_pixels=50_000)
    small = BatchDecoder("cpu", backend=decoder.backend, max_pixels=50_000)
    assert small.decode([data], ["x"], [0], on_error="skip").skipped[0][0] == 0
    assert len(small.decode([data], ["x"], [0], max_pixels=None).images) == 1
    with pytest.raises(ImageDecodeError, match="over the limit"):
        decode_batch([F.bomb_jpeg()], ["b"], [0], device="cpu", backend=decoder.backend)
    with pytest.raises(ValueError, match="max_pixels=0"):
        BatchDecoder("cpu", backend="pil", max_pixels=0)


def test_the_module_default_applies_where_no_keyword_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuload.decode import headers

    monkeypatch.setattr(headers, "_default_limit", headers.FOLLOW_PIL)
    decoder = BatchDecoder("cpu", backend="pil")
    data = F.jpeg("grayscale")
    assert len(decoder.decode([data], ["x"], [0]).images) == 1
    headers.set_default_max_pixels(1000)
    with pytest.raises(ImageDecodeError, match="over the limit of 1,000"):
        decoder.decode([data], ["x"], [0])


# --- 16-bit PNG --------------------------------------------------------------------------------


def test_16_bit_rgb_png_rounds_to_8_bits_and_pil_truncates(decoder: BatchDecoder) -> None:
    data, samples = F.png16_rgb()
    image = decode_one(decoder, data, "x.png").permute(1, 2, 0).numpy().astype(int)
    rounded, high_byte = np.rint(samples / 257.0).astype(int), (samples >> 8).astype(int)
    if decoder.backend == "pil":  # PIL opens it as 8-bit RGB: the high byte
        assert (image == high_byte).all()
    else:  # DALI and torchvision see 16 bits and round
        assert (image == rounded).all()
    assert np.abs(rounded - high_byte).max() == 1  # the documented difference


def test_16_bit_grey_png_rounds_to_8_bits_on_the_cpu_decoders() -> None:
    """PIL opens a 16-bit grey PNG as 16-bit integers: scaled to 8 bits by rounding v / 257,
    as DALI and torchvision do, on all three channels."""
    from PIL import Image

    samples = np.random.default_rng(3).integers(0, 65536, (5, 7), dtype=np.uint16)
    samples[0, :3] = [0, 128, 65535]  # 0, 0.498 -> 0, 255
    encoded = io.BytesIO()
    Image.fromarray(samples).save(encoded, format="PNG")
    expected = torch.from_numpy(np.rint(samples / 257.0).astype(np.uint8)).expand(3, -1, -1)
    assert torch.equal(cpu.pil_decode(encoded.getvalue()), expected)
    if cpu.torchvision_available():
        assert torch.equal(cpu.torchvision_decode(encoded.getvalue()), expected)


def test_a_cpu_decoder_name_other_than_torchvision_or_pil_is_refused() -> None:
    assert cpu.cpu_decoder("pil") is cpu.pil_decode
    with pytest.raises(ValueError, match="no CPU fallback decoder named 'dali-cpu'"):
        cpu.cpu_decoder("dali-cpu")


# --- device failures are not bad files ------------------------------------------------------------

DEVICE_MESSAGES = [
    # DALI 2.x with exec_dynamic, as the pipeline wraps an operator's error
    "Critical error in pipeline:\nError in MIXED operator `nvidia.dali.fn.decoders.image`,\nencountered:\n\n"
    "Can't allocate 129499136 bytes on device 0.\nCurrent pipeline object is no longer valid.",
    "Critical error in pipeline:\nError when executing Mixed operator ImageDecoder encountered:\n"
    "CUDA allocation failed\nCurrent pipeline object is no longer valid.",
    'Critical error in pipeline: Error in thread 0: NVJPEG error "5" : NVJPEG_STATUS_ALLOCATOR_FAILURE a.jpg',
    "Critical error in pipeline:\nencountered:\n\nnvImageCodec failure: '#5'\n"
    "Current pipeline object is no longer valid.",
    "Critical error in pipeline:\nencountered:\n\nCUDA runtime API error cudaErrorIllegalAddress (700):\n"
    "an illegal memory access was encountered",
    "CUDA driver API error CUDA_ERROR_LAUNCH_FAILED (719):\nunspecified launch failure",
]
FILE_MESSAGES = [
    "Critical error in pipeline:\nencountered:\n\nFailed to decode sample #0 : \n"
    "Current pipeline object is no longer valid.",
    "Critical error in pipeline:\nencountered:\n\nnvImageCodec failure: '#3'\n"
    "Current pipeline object is no longer valid.",
    'Critical error in pipeline: NVJPEG error "2" : NVJPEG_STATUS_INVALID_PARAMETER',
]


@pytest.mark.parametrize("message", DEVICE_MESSAGES + FILE_MESSAGES)
def test_device_failures_are_told_from_bad_files_by_their_text(message: str) -> None:
    from gpuload.decode.errors import is_device_failure

    assert is_device_failure(message) == (message in DEVICE_MESSAGES)


@pytest.fixture
def broken_dali_run(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Script the real DALI CPU pipeline's runs: each call pops the next entry, raising
    ``RuntimeError(entry)`` where it is a message and running for real where it is None (or
    when the script is empty)."""
    from gpuload.decode._dali import DaliDecoder

    script: list[str | None] = []
    real = DaliDecoder._run

    def run(pipe, stream):  # type: ignore[no-untyped-def]
        message = script.pop(0) if script else None
        if message is not None:
            raise RuntimeError(message)
        return real(pipe, stream)

    monkeypatch.setattr(DaliDecoder, "_run", staticmethod(run))
    return script


@requires_dali
@pytest.mark.parametrize("which", range(len(DEVICE_MESSAGES)))
def test_a_dali_device_failure_raises_even_with_skip_and_decodes_nothing_on_the_cpu(
    broken_dali_run: list, which: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuload.decode import DecodeDeviceError

    pil_calls = []
    monkeypatch.setattr(cpu, "pil_decode", lambda *a: pil_calls.append(a) or F.pil_reference(a[0]))
    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=4)
    broken_dali_run.extend([DEVICE_MESSAGES[which], "not run again"])
    encoded = [F.jpeg("baseline-420"), F.jpeg("grayscale")]
    with pytest.raises(DecodeDeviceError,
                       match="decoder dali-cpu failed while decoding a batch of 2 starting with 'a'") as caught:
        decoder.decode(encoded, ["a", "b"], [0, 1], on_error="skip")
    assert broken_dali_run == ["not run again"]  # no retry one by one
    assert pil_calls == []  # and no CPU decoding
    assert caught.value.out_of_memory == (which < 4)  # the first four are allocation failures
    broken_dali_run.clear()  # the device recovers: the pipeline is rebuilt and works
    assert decoder.decode(encoded, ["a", "b"], [0, 1]).kept_positions == [0, 1]


@requires_dali
def test_a_device_failure_found_while_bisecting_raises_too(broken_dali_run: list) -> None:
    from gpuload.decode import DecodeDeviceError

    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=4)
    broken_dali_run.extend([FILE_MESSAGES[0], None, DEVICE_MESSAGES[0]])  # batch, first alone, second alone
    with pytest.raises(DecodeDeviceError, match="a batch of 1 starting with 'b'.*Can't allocate"):
        decoder.decode([F.jpeg("grayscale"), F.jpeg("baseline-420")], ["a", "b"], [0, 1], on_error="skip")


@requires_dali
def test_a_file_error_still_bisects_and_names_the_file() -> None:
    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=4)
    bad = F.corrupt_inputs()["truncated.jpg"]
    result = decoder.decode([F.jpeg("grayscale"), bad], ["a", "bad.jpg"], [0, 1], on_error="skip")
    assert result.kept_positions == [0] and result.skipped[0][:2] == (1, "bad.jpg")
    assert "DALI:" in result.skipped[0][2]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, needs", [("dali-mixed", "nvidia.dali"), ("nvjpeg", "torchvision")])
def test_gpu_decoders_output_is_ordered_on_the_callers_stream(backend: str, needs: str) -> None:
    """Decoded under torch.cuda.stream(s) (DALI's run bound to torch's current stream), the
    images are ready for work queued on s."""
    pytest.importorskip(needs, reason=f"the {backend} backend needs {needs}")
    decoder = BatchDecoder("cuda", backend=backend, max_batch=4)
    data = F.jpeg("baseline-444")
    expected = decoder.decode([data], ["a"], [0]).images[0].sum(dtype=torch.int64)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        images = decoder.decode([data] * 4, list("abcd"), [0, 1, 2, 3]).images
        total = torch.stack(images).sum(dtype=torch.int64)
    side.synchronize()
    assert int(total) == 4 * int(expected)


@requires_dali
def test_a_dali_without_stream_bound_runs_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvidia.dali import Pipeline

    import gpuload.decode._dali as dali_module

    def run(self, **pipeline_inputs):  # type: ignore[no-untyped-def]  # DALI < 1.44's signature
        raise AssertionError("not called")

    monkeypatch.setattr(Pipeline, "run", run)
    with pytest.raises(dali_module.DaliUnavailable, match="too old: .*since 1.44"):
        dali_module.DaliDecoder(CPU)
    with pytest.warns(UserWarning, match="too old"):
        result = BatchDecoder("cpu", backend="auto").decode([F.jpeg("grayscale")], ["g"], [0])
    assert result.backend in ("torchvision", "pil")


@requires_dali
def test_a_failed_dali_run_leaves_no_reference_cycle_holding_the_pipeline() -> None:
    """A dead pipeline kept for the garbage collector could be destroyed in a forked worker,
    where DALI's destructor hangs; it must be freed at once, by reference counting."""
    import gc
    import weakref

    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=2)
    decoder.decode([F.jpeg("grayscale")], ["g"], [0])
    pipe = weakref.ref(decoder._dali[False]._pipe)
    gc.disable()
    try:
        result = decoder.decode([F.corrupt_inputs()["truncated.jpg"]], ["t"], [0], on_error="skip")
        del result
        assert pipe() is None
    finally:
        gc.enable()
