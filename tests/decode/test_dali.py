"""gpuload.decode._dali: a DALI pipeline that cannot be built is one device error, raised once;
never a bad file, never a batch decoded sample by sample by PIL instead. DALI runs here on the CPU."""

from __future__ import annotations

import image_fixtures as F
import pytest
import torch

from gpuload.decode import BatchDecoder, DecodeDeviceError
from gpuload.decode._dali import DaliDecoder, DaliError, dali_installed

pytestmark = pytest.mark.skipif(not dali_installed(), reason="needs nvidia.dali (DALI), which is not installed here")


@pytest.fixture
def unbuildable(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every DALI pipeline's build fails, with a text that names neither memory nor CUDA; the
    list counts the builds tried."""
    from nvidia.dali.pipeline import Pipeline

    tried: list[int] = []

    def build(self) -> None:  # type: ignore[no-untyped-def]
        tried.append(1)
        raise RuntimeError("[/opt/dali/dali/operators/decoder/image_decoder.cc:88] Assert on "
                           "\"backend_ != nullptr\" failed: no decoder backend could be created")

    monkeypatch.setattr(Pipeline, "build", build)
    return tried


def test_a_build_failure_is_a_device_error_of_the_decoder(unbuildable: list[int]) -> None:
    decoder = DaliDecoder(torch.device("cpu"), max_batch=4)
    with pytest.raises(DaliError, match=r"DALI could not build its dali-cpu decoding pipeline \(batch size 2\): "
                                        r".*no decoder backend could be created; no file is to blame") as caught:
        decoder.decode([F.jpeg("baseline-420")] * 2)
    assert caught.value.device and len(unbuildable) == 1


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_build_failure_stops_the_batch_once_instead_of_decoding_it_with_pil(unbuildable: list[int],
                                                                            on_error: str) -> None:
    decoder = BatchDecoder("cpu", backend="dali-cpu", max_batch=4)
    encoded = [F.jpeg("baseline-420"), F.jpeg("grayscale"), F.png("RGB"), F.jpeg("progressive-420")]
    with pytest.raises(DecodeDeviceError, match=r"decoder dali-cpu failed while decoding a batch of 4 starting "
                                                r"with 'a'.*could not build") as caught:
        decoder.decode(encoded, ["a", "b", "c", "d"], [0, 1, 2, 3], on_error=on_error)
    assert isinstance(caught.value.__cause__, DaliError) and len(unbuildable) == 1


def test_after_a_build_failure_a_working_dali_builds_again(monkeypatch: pytest.MonkeyPatch,
                                                          unbuildable: list[int]) -> None:
    decoder = DaliDecoder(torch.device("cpu"), max_batch=2)
    with pytest.raises(DaliError):
        decoder.decode([F.jpeg("baseline-420")])
    monkeypatch.undo()  # the build works again
    (image,) = decoder.decode([F.jpeg("baseline-420")])
    assert image.shape == (3, F.HEIGHT, F.WIDTH)


def test_bad_arguments_to_the_decoder_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match="^max_batch must be at least 1, got 0$"):
        DaliDecoder(torch.device("cpu"), max_batch=0)
    plain = DaliDecoder(torch.device("cpu"), max_batch=2)
    assert plain.decode([]) == []
    jpeg = F.jpeg("baseline-420")
    with pytest.raises(ValueError, match=r"^this DALI decoder was built with roi=False; do not pass rois=$"):
        plain.decode([jpeg], rois=[(0, 0, 4, 4)])
    windowed = DaliDecoder(torch.device("cpu"), max_batch=2, roi=True)
    with pytest.raises(ValueError, match=r"^this DALI decoder was built with roi=True; pass rois=$"):
        windowed.decode([jpeg])
    with pytest.raises(ValueError, match=r"^1 ROIs for 2 images; pass one per image$"):
        windowed.decode([jpeg, jpeg], rois=[(0, 0, 4, 4)])


def test_a_failed_run_names_the_last_lines_dali_logged() -> None:
    from gpuload.decode._dali import _dali_error

    failure = RuntimeError("Critical error in pipeline:\nError in thread 0: [/opt/dali/x.cc:1] encountered:\n"
                           "Unrecognized image format\nCurrent pipeline object is no longer valid.")
    error = _dali_error(failure, ["one", "two", "three", "four"])
    assert str(error) == "Unrecognized image format (DALI logged: two; three; four)"
    assert error.device is False and error.__cause__ is failure
    from gpuload.decode._dali import _build_error

    built = _build_error(RuntimeError("no decoder backend"), ["libnvjpeg.so.12 not found"], "dali-mixed", 8)
    assert str(built).startswith("DALI could not build its dali-mixed decoding pipeline (batch size 8): no decoder "
                                 "backend (DALI logged: libnvjpeg.so.12 not found); no file is to blame.")
    assert built.device is True


def test_a_dali_that_does_not_import_is_unavailable_with_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from gpuload.decode import _dali

    monkeypatch.setitem(sys.modules, "nvidia.dali.fn", None)  # importing it raises ModuleNotFoundError
    with pytest.raises(_dali.DaliUnavailable, match=r"^nvidia.dali could not be imported \(ModuleNotFoundError: "
                       r"import of nvidia.dali.fn halted; None in sys.modules\); "
                       r"install gpuload\[cuda13\] \(or gpuload\[cuda12\]\), or decode with backend='torchvision' "
                       r"or backend='pil'$"):
        _dali._import_dali()
    broken = type(sys)("gpuload_test_no_spec")
    broken.__spec__ = None
    monkeypatch.setitem(sys.modules, "nvidia.dali", broken)  # find_spec raises ValueError for it
    assert dali_installed() is False
