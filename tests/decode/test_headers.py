"""gpuload.decode.headers: sizes and orientations read like PIL reads them, and the pixel limit."""

from __future__ import annotations

import io
from functools import lru_cache

import image_fixtures as F
import pytest
from PIL import Image

from gpuload.decode import headers
from gpuload.decode.headers import (
    FOLLOW_PIL,
    HeaderTable,
    PixelLimitError,
    check_pixels,
    default_max_pixels,
    peek_header,
    resolve_max_pixels,
    set_default_max_pixels,
)


def pil_says(data: bytes) -> tuple[int, int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return image.size[0], image.size[1], image.getexif().get(0x0112, 1)


@lru_cache(maxsize=1)
def every_kind() -> dict[str, bytes]:
    kinds = {k: F.jpeg(k) for k in F.JPEG_KINDS}
    kinds.update({f"jpeg-exif-{o}": F.jpeg_with_orientation(o) for o in range(1, 9)})
    kinds.update({f"png-{m}": F.png(m) for m in ("RGB", "RGBA", "L", "LA", "P")})
    kinds.update({f"png-exif-{o}": F.png_with_orientation(o) for o in (1, 3, 6, 8)})
    kinds.update({"gif": F.encode(F.photo(), "GIF"), "bmp": F.encode(F.photo(), "BMP")})
    return kinds


@pytest.mark.parametrize("name", sorted(every_kind()))
def test_header_matches_pil(name: str) -> None:
    data = every_kind()[name]
    header = peek_header(data)
    assert (header.width, header.height, header.orientation) == pil_says(data)


def test_formats_and_upright_size() -> None:
    assert peek_header(F.jpeg("baseline-420")).format == "JPEG"
    assert peek_header(F.png("RGB")).format == "PNG"
    assert peek_header(F.encode(F.photo(), "GIF")).format == "GIF"  # read by PIL
    assert peek_header(F.jpeg_with_orientation(6)).upright == (F.WIDTH, F.HEIGHT)
    assert peek_header(F.jpeg_with_orientation(3)).upright == (F.HEIGHT, F.WIDTH)


def test_a_jpeg_head_is_enough() -> None:
    data = F.jpeg_with_orientation(6)
    assert peek_header(data[:2048]).upright == (F.WIDTH, F.HEIGHT)


@pytest.mark.parametrize("bad", [b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"not an image at all"])
def test_unreadable_headers_raise(bad: bytes) -> None:
    with pytest.raises((ValueError, OSError)):  # OSError: PIL.UnidentifiedImageError
        peek_header(bad)


def test_the_bomb_is_read_from_its_header() -> None:
    bomb = F.bomb_jpeg()
    assert len(bomb) < 1000
    header = peek_header(bomb)
    assert (header.width, header.height, header.pixels) == (20000, 20000, 400_000_000)
    with pytest.raises(Image.DecompressionBombError):  # what PIL does with it
        Image.open(io.BytesIO(bomb))


def test_check_pixels_rejects_over_the_limit_and_names_the_claim() -> None:
    with pytest.raises(PixelLimitError, match=r"20000x20000 = 400,000,000 pixels, over the limit of 89,478,485"):
        check_pixels(F.bomb_jpeg())
    assert check_pixels(F.jpeg("baseline-420")).pixels == F.WIDTH * F.HEIGHT
    with pytest.raises(PixelLimitError, match="over the limit of 1,000"):
        check_pixels(F.jpeg("baseline-420"), max_pixels=1000)
    assert check_pixels(F.bomb_jpeg(), max_pixels=None) is None  # no limit: nothing read


def test_the_default_follows_pil_until_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headers, "_default_limit", FOLLOW_PIL)
    assert default_max_pixels() == Image.MAX_IMAGE_PIXELS
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10**9)
    assert default_max_pixels() == 10**9
    check_pixels(F.bomb_jpeg())  # 4e8 is under PIL's raised limit
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert default_max_pixels() is None
    set_default_max_pixels(5000)
    assert default_max_pixels() == 5000 and resolve_max_pixels("default") == 5000
    with pytest.raises(PixelLimitError):
        check_pixels(F.jpeg("baseline-420"))
    set_default_max_pixels(None)
    assert default_max_pixels() is None
    set_default_max_pixels(FOLLOW_PIL)
    assert default_max_pixels() is None  # PIL's, which this test set to None


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "many"])
def test_bad_limits_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        resolve_max_pixels(bad)  # type: ignore[arg-type]
    if not isinstance(bad, str):
        with pytest.raises(ValueError):
            set_default_max_pixels(bad)  # type: ignore[arg-type]


def test_a_bomb_in_a_format_only_pil_reads_is_caught_by_pils_check() -> None:
    data = bytearray(F.encode(F.photo().resize((8, 8)), "BMP"))
    data[18:26] = (30000).to_bytes(4, "little") + (30000).to_bytes(4, "little")  # BITMAPINFOHEADER size
    with pytest.raises(PixelLimitError, match="PIL: .*exceeds limit"):
        check_pixels(bytes(data))


def test_the_header_table_reads_each_header_once() -> None:
    table = HeaderTable(3)
    data = F.jpeg_with_orientation(6)
    assert table.get(1) is None
    first = table.read(1, data)
    assert first == peek_header(data)
    # Kept: the file's bytes are not parsed again (garbage would raise if they were).
    assert table.read(1, b"not an image at all") == first == table.get(1)
    png = table.read(2, F.png("RGB"))
    assert png.format == "PNG" and table.get(2) == png and table.get(1).format == "JPEG"


def test_the_header_table_keeps_no_unreadable_header_and_no_stray_position() -> None:
    table = HeaderTable(2)
    with pytest.raises((ValueError, OSError)):  # OSError: PIL.UnidentifiedImageError
        table.read(0, b"not an image at all")
    assert table.get(0) is None
    data = F.jpeg("baseline-420")
    assert table.read(5, data) == peek_header(data) and table.get(5) is None  # outside: read, not kept


def test_the_header_tables_batch_lookup_finds_what_get_finds() -> None:
    table = HeaderTable(3)
    table.read(0, F.jpeg_with_orientation(6))
    table.read(2, F.png("RGB"))
    for positions in ([2, 1, 0, 2], [0, 5], [-1, 0], []):
        assert table.kept(positions) == [table.get(p) for p in positions]
    assert table.kept([2, 1, 0])[1] is None and table.kept([0])[0].format == "JPEG"


def test_jpeg_fill_bytes_and_markers_without_a_length_are_stepped_over() -> None:
    jpeg = F.jpeg_with_orientation(6)
    expected = peek_header(jpeg)
    assert expected.orientation == 6
    padded = jpeg[:2] + b"\xff\x01" + b"\xff\xff" + jpeg[2:]  # a TEM marker, then a fill byte
    assert headers._jpeg_header(padded) == expected
    with pytest.raises(headers._Unparsed, match="^JPEG segments out of step$"):
        headers._jpeg_header(jpeg[:2] + b"\x00\x00" + jpeg[2:])


def test_an_exif_block_without_a_readable_orientation_means_upright() -> None:
    import struct

    assert headers._exif_orientation(b"II*\x00") == 1  # too short
    assert headers._exif_orientation(b"XX*\x00\x08\x00\x00\x00") == 1  # no byte order
    assert headers._exif_orientation(b"II*\x00" + struct.pack("<I", 4096)) == 1  # IFD past the end
    other_tag = b"II*\x00" + struct.pack("<IH", 8, 1) + struct.pack("<HHII", 0x010F, 2, 4, 0)  # Make, no orientation
    assert headers._exif_orientation(other_tag) == 1
    rotated = b"II*\x00" + struct.pack("<IH", 8, 1) + struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0)
    assert headers._exif_orientation(rotated) == 6


def test_follow_pil_takes_pils_limit_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    assert repr(FOLLOW_PIL) == "FOLLOW_PIL"
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1234)
    assert resolve_max_pixels(FOLLOW_PIL) == 1234
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert resolve_max_pixels(FOLLOW_PIL) is None
