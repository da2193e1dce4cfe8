"""The ``nvjpeg`` backend (torchvision's batched nvJPEG decoder, for CUDA machines without DALI).

On the CPU the backend runs with ``torchvision.io.decode_jpeg(list, device="cpu")``, which
takes the same arguments as the CUDA call and gives libjpeg-turbo's pixels: everything gpuload
adds around the decoder (JPEG/other split, EXIF orientation, ROI crop, bisecting a rejected
batch, telling a failing device from a bad file, the pixel limit) is checked here. The `gpu`
tests hold the real nvJPEG decode to the tolerance of DALI's mixed decoder.
"""

from __future__ import annotations

import image_fixtures as F
import pytest
import torch

from gpuload.decode import BatchDecoder, DecodeDeviceError, ImageDecodeError, cpu
from gpuload.decode import batch as batch_module
from gpuload.decode._nvjpeg import NvjpegDecoder, upright
from gpuload.decode.headers import peek_header

pytestmark = pytest.mark.skipif(not cpu.torchvision_available(), reason="torchvision is not installed")

CPU_MEAN_TOL, CPU_MAX_TOL = 0.5, 4
GPU_MEAN_TOL, GPU_MAX_TOL = 1.0, 24  # DALI mixed's tolerance (tests/decode/test_batch.py)


@pytest.fixture
def nvjpeg(monkeypatch: pytest.MonkeyPatch) -> BatchDecoder:
    """The nvjpeg backend on the CPU: resolve_backend lets it through for the test."""
    real = batch_module.resolve_backend
    monkeypatch.setattr(
        batch_module, "resolve_backend",
        lambda device, backend="auto": "nvjpeg" if backend == "nvjpeg" else real(device, backend),
    )
    return BatchDecoder("cpu", backend="nvjpeg", max_batch=8)


def inject(decoder: BatchDecoder, call) -> list[int]:  # type: ignore[no-untyped-def]
    """Replace the decode call of ``decoder``'s nvJPEG stage; returns the batch sizes it saw."""
    sizes: list[int] = []

    def wrapped(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        sizes.append(len(buffers))
        return call(buffers, device)

    decoder._nvjpeg = NvjpegDecoder(decoder.device, wrapped)
    return sizes


def real_call(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(buffers, mode=ImageReadMode.RGB, device=device)


def test_jpegs_match_pil_and_other_formats_go_to_the_cpu(nvjpeg: BatchDecoder) -> None:
    kinds = sorted(F.JPEG_KINDS)
    encoded = [F.jpeg(k) for k in kinds] + [F.png("RGBA"), F.png("L")]
    sizes = inject(nvjpeg, real_call)
    result = nvjpeg.decode(encoded, kinds + ["a.png", "b.png"], list(range(len(encoded))))
    assert result.backend == "nvjpeg" and result.kept_positions == list(range(len(encoded)))
    assert sizes == [len(kinds)]  # one batched call, JPEGs only
    assert result.cpu_decoded == 2 and result.fallback_decoded == 0
    for image, data in zip(result.images, encoded):
        mean, worst = F.diff_stats(image, F.pil_reference(data))
        assert mean <= CPU_MEAN_TOL and worst <= CPU_MAX_TOL


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_from_the_header(nvjpeg: BatchDecoder, orientation: int) -> None:
    stored = nvjpeg.decode([F.jpeg_with_orientation(1)], ["s"], [0]).images[0]
    image = nvjpeg.decode([F.jpeg_with_orientation(orientation)], ["o"], [0]).images[0]
    assert torch.equal(image, F.upright(stored, orientation))


def test_upright_follows_the_exif_table() -> None:
    image = torch.arange(2 * 3 * 4, dtype=torch.uint8).view(2, 3, 4)
    for orientation in range(1, 9):
        assert torch.equal(upright(image, orientation).contiguous(), F.upright(image, orientation))


def test_rois_are_cropped_in_upright_coordinates(nvjpeg: BatchDecoder) -> None:
    encoded = [F.jpeg("baseline-420"), F.jpeg_with_orientation(6), F.png("RGB")]
    rois = [(10, 21, 100, 120), (37, 50, 90, 150), (3, 5, 200, 150)]
    whole = nvjpeg.decode(encoded, ["a", "b", "c"], [0, 1, 2])
    part = nvjpeg.decode(encoded, ["a", "b", "c"], [0, 1, 2], rois=rois)
    assert part.roi == "crop"
    for full, window, (y0, x0, h, w) in zip(whole.images, part.images, rois):
        assert window.is_contiguous() and torch.equal(window, full[:, y0 : y0 + h, x0 : x0 + w])


def test_a_rejected_batch_is_bisected_and_the_bad_file_named(nvjpeg: BatchDecoder) -> None:
    bad = F.corrupt_inputs()["truncated.jpg"]
    encoded = [F.jpeg("baseline-420"), bad, F.jpeg("grayscale")]

    def strict(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if any(b.numel() == len(bad) for b in buffers):  # as nvJPEG: no partial results
            raise RuntimeError("Error while decoding JPEG images: Failed to decode jpeg stream: 2")
        return real_call(buffers, device)

    sizes = inject(nvjpeg, strict)
    with pytest.raises(ImageDecodeError, match=r"'t.jpg', sample index 41: nvjpeg: .*Failed to decode") as caught:
        nvjpeg.decode(encoded, ["a", "t.jpg", "c"], [40, 41, 42])
    assert caught.value.backend == "nvjpeg"
    sizes.clear()
    result = nvjpeg.decode(encoded, ["a", "t.jpg", "c"], [40, 41, 42], on_error="skip")
    assert sizes == [3, 1, 1, 1] and result.kept_positions == [0, 2]
    assert "PIL:" in result.skipped[0][2]  # PIL had its say too


def test_a_jpeg_nvjpeg_rejects_but_pil_reads_is_kept(nvjpeg: BatchDecoder) -> None:
    cmyk = F.encode(F.photo().convert("CMYK"), "JPEG", quality=90)

    def no_cmyk(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if any(b.numel() == len(cmyk) for b in buffers):
            raise RuntimeError("Error while decoding JPEG images: Unknown chroma subsampling")
        return real_call(buffers, device)

    inject(nvjpeg, no_cmyk)
    result = nvjpeg.decode([cmyk, F.jpeg("grayscale")], ["cmyk.jpg", "g"], [0, 1])
    assert result.kept_positions == [0, 1] and result.fallback_decoded == 1
    assert torch.equal(result.images[0], F.pil_reference(cmyk))


@pytest.mark.parametrize(
    "message",
    [
        "Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 GiB",
        "Error while decoding JPEG images: Failed to decode batch: 5",
        "Error while decoding JPEG images: Failed to synchronize CUDA stream: 700",
        "CUDA error: an illegal memory access was encountered",
    ],
)
def test_device_failures_raise_whatever_on_error_says(nvjpeg: BatchDecoder, message: str) -> None:
    def failing(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise RuntimeError(message)

    sizes = inject(nvjpeg, failing)
    with pytest.raises(DecodeDeviceError, match="decoder nvjpeg failed") as caught:
        nvjpeg.decode([F.jpeg("grayscale"), F.jpeg("baseline-420")], ["a", "b"], [0, 1], on_error="skip")
    assert sizes == [2]  # no bisecting, no CPU decode
    assert caught.value.out_of_memory == ("out of memory" in message or message.endswith(": 5"))


def test_torch_out_of_memory_is_a_device_failure_by_type(nvjpeg: BatchDecoder) -> None:
    def failing(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise torch.cuda.OutOfMemoryError("allocation refused")

    inject(nvjpeg, failing)
    with pytest.raises(DecodeDeviceError):
        nvjpeg.decode([F.jpeg("grayscale")], ["a"], [0], on_error="skip")


def test_a_torch_accelerator_error_is_a_device_failure_by_type(nvjpeg: BatchDecoder) -> None:
    """torch's AcceleratorError (a CUDA error raised as its own type) is the device's fault
    whatever its text says: no bisecting, no CPU decode."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None:
        pytest.skip(f"torch {torch.__version__} has no AcceleratorError")

    def failing(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise accelerator_error("the launch timed out and was terminated")

    sizes = inject(nvjpeg, failing)
    with pytest.raises(DecodeDeviceError, match="launch timed out"):
        nvjpeg.decode([F.jpeg("grayscale"), F.jpeg("baseline-420")], ["a", "b"], [0, 1], on_error="skip")
    assert sizes == [2]


def test_bombs_and_empty_files_never_reach_the_decoder(nvjpeg: BatchDecoder) -> None:
    sizes = inject(nvjpeg, real_call)
    result = nvjpeg.decode(
        [F.bomb_jpeg(), b"", F.jpeg("grayscale")], ["bomb.jpg", "e.jpg", "g"], [0, 1, 2], on_error="skip"
    )
    assert sizes == [1] and result.kept_positions == [2]
    assert "20000x20000" in result.skipped[0][2] and "empty" in result.skipped[1][2]


def test_the_calling_stream_is_drained_before_the_decoder_writes_out_of_stream_order(monkeypatch) -> None:
    """torchvision's nvJPEG allocates its outputs on the current stream and writes them on its
    own, without waiting: the calling stream (the prefetcher's side stream) must have finished
    what it queued before the decode call, or its memory, freed and handed out again, is
    written under work still running. A recording stand-in for the stream and the decoder."""
    log: list[tuple[str, ...]] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def synchronize(self) -> None:
            log.append(("drained", str(self.device)))

    def current_stream(device=None):  # type: ignore[no-untyped-def]
        log.append(("asked", str(device)))
        return Stream(device)

    def decode_call(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        log.append(("decode", str(device)))
        return real_call(buffers, torch.device("cpu"))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    cuda1 = torch.device("cuda", 1)
    decoder = NvjpegDecoder(cuda1, decode_call)
    data = F.jpeg("baseline-420")
    for _ in range(2):
        (image,) = decoder.decode([data], [peek_header(data)])
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert torch.equal(image, real_call([encoded], torch.device("cpu"))[0])
    assert log == [("asked", "cuda:1"), ("drained", "cuda:1"), ("decode", "cuda:1")] * 2


def test_a_cpu_target_asks_no_stream() -> None:
    calls: list[str] = []

    def decode_call(buffers: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(str(device))
        return real_call(buffers, device)

    data = F.jpeg("grayscale")
    NvjpegDecoder(torch.device("cpu"), decode_call).decode([data], [peek_header(data)])
    assert calls == ["cpu"]


# --- GPU: the real nvJPEG ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_nvjpeg_matches_pil_within_the_mixed_decoders_tolerance() -> None:
    decoder = BatchDecoder("cuda", backend="nvjpeg", max_batch=16)
    kinds = sorted(F.JPEG_KINDS)
    encoded = [F.jpeg(k) for k in kinds] + [F.jpeg_with_orientation(o) for o in range(1, 9)] + [F.png("RGBA")]
    names = kinds + [f"exif-{o}" for o in range(1, 9)] + ["rgba.png"]
    result = decoder.decode(encoded, names, list(range(len(encoded))))
    assert result.backend == "nvjpeg" and result.kept_positions == list(range(len(encoded)))
    assert result.cpu_decoded == 1
    for name, image, data in zip(names, result.images, encoded):
        assert image.device.type == "cuda" and image.dtype == torch.uint8
        mean, worst = F.diff_stats(image, F.pil_reference(data))
        print(f"nvjpeg vs PIL {name}: mean |diff| {mean:.3f}, max {worst}")
        assert mean <= GPU_MEAN_TOL and worst <= GPU_MAX_TOL, (name, mean, worst)
    rois = [(10, 20, 100, 120)] * len(encoded)
    part = decoder.decode(encoded, names, list(range(len(encoded))), rois=rois)
    for whole, window in zip(result.images, part.images):
        assert torch.equal(window, whole[:, 10:110, 20:140])


@pytest.mark.gpu
def test_nvjpeg_pixels_survive_work_still_queued_on_the_calling_stream() -> None:
    """torchvision's reproducer (pytorch/vision PR 9606): memory the calling stream freed while
    work still queued on it writes there (behind a spin of ~50 ms) is handed to the decoder's
    outputs; without draining the stream first, that late write lands on the decoded pixels."""
    decoder = BatchDecoder("cuda", backend="nvjpeg", max_batch=4)
    encoded = [F.jpeg("baseline-420")] * 4
    want = [F.pil_reference(data) for data in encoded]
    stream = torch.cuda.Stream()
    cycles = 50_000_000
    with torch.cuda.stream(stream):
        for _ in range(3):
            scratch = [torch.empty(image.numel(), dtype=torch.uint8, device="cuda") for image in want]
            torch.cuda._sleep(cycles)
            for block in scratch:
                block.fill_(0)  # queued behind the spin: runs after the decode if nothing waits
            del scratch
            result = decoder.decode(encoded, ["a", "b", "c", "d"], [0, 1, 2, 3])
            torch.cuda.current_stream().synchronize()
            for image, reference in zip(result.images, want):
                mean, worst = F.diff_stats(image, reference)
                assert mean <= GPU_MEAN_TOL and worst <= GPU_MAX_TOL, (mean, worst)


@pytest.mark.gpu
def test_nvjpeg_reports_bad_files_and_keeps_the_rest_on_the_gpu() -> None:
    decoder = BatchDecoder("cuda", backend="nvjpeg", max_batch=4)
    bad = F.corrupt_inputs()
    encoded = [F.jpeg("baseline-420"), bad["truncated.jpg"], F.bomb_jpeg(), F.jpeg("grayscale")]
    result = decoder.decode(encoded, ["a", "t", "bomb", "d"], [0, 1, 2, 3], on_error="skip")
    assert [s[0] for s in result.skipped] == [1, 2] or [s[0] for s in result.skipped] == [2]
    assert 0 in result.kept_positions and 3 in result.kept_positions
    assert all(image.device.type == "cuda" for image in result.images)
