"""gpuload.decode._dali: a DALI pipeline that cannot be built is one device error, raised once;
never a bad file, never a batch decoded sample by sample by PIL instead. DALI runs here on the CPU."""

from __future__ import annotations

import pytest
import torch

import image_fixtures as F
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
