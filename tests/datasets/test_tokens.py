"""TokenWindows: every file format, windows within shards, and one clear error per bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gpuload
from gpuload.datasets.tokens import HEADER_BYTES, TokenFileError, TokenWindows, write_shard


def _ids(n: int, high: int = 65535, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, size=n).astype(np.int64)


def _expected(ids: np.ndarray, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.from_numpy(ids[start : start + seq_len + 1].astype(np.int64))
    return window[:-1], window[1:]


def _assert_item(ds: TokenWindows, i: int, ids: np.ndarray, start: int) -> None:
    x, y = ds[i]
    ex, ey = _expected(ids, start, ds.seq_len)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x, ex) and torch.equal(y, ey)


def test_exported_from_the_package() -> None:
    assert gpuload.TokenWindows is TokenWindows
    assert gpuload.datasets.TokenWindows is TokenWindows


def test_speedrun_shard_uint16(tmp_path: Path) -> None:
    ids = _ids(1000)
    path = write_shard(tmp_path / "fineweb_train_000001.bin", ids)
    header = np.fromfile(path, dtype=np.int32, count=3)
    assert header.tolist() == [20240520, 1, 1000] and path.stat().st_size == HEADER_BYTES + 2000
    ds = TokenWindows(path, 64)
    assert ds.token_dtype == torch.uint16 and ds.nbytes == 2000
    assert len(ds) == (1000 - 65) // 64 + 1
    for i in (0, 1, len(ds) - 1, -1):
        _assert_item(ds, i, ids, (i % len(ds)) * 64)


def test_llama3_shard_uint32(tmp_path: Path) -> None:
    ids = _ids(500, high=128_000)
    path = write_shard(tmp_path / "llama.bin", ids, magic=20240801)
    ds = TokenWindows(path, 10, stride=7)
    assert ds.token_dtype == torch.uint32 and len(ds) == (500 - 11) // 7 + 1
    _assert_item(ds, 5, ids, 35)


def test_raw_bin_needs_dtype_and_reads_it(tmp_path: Path) -> None:
    ids = _ids(300)
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    with pytest.raises(TokenFileError, match=r"train\.bin: not a token shard.*pass dtype="):
        TokenWindows(path, 8)
    ds = TokenWindows(path, 8, dtype="uint16")
    _assert_item(ds, 3, ids, 24)
    ds32 = TokenWindows(_write_raw(tmp_path / "w.bin", ids, np.int32), 8, dtype=np.int32)
    assert ds32.token_dtype == torch.int32
    _assert_item(ds32, 2, ids, 16)


def _write_raw(path: Path, ids: np.ndarray, dtype: type) -> Path:
    ids.astype(dtype).tofile(path)
    return path


def test_npy_array_memmap_and_tensor_sources(tmp_path: Path) -> None:
    ids = _ids(400)
    np.save(tmp_path / "t.npy", ids.astype(np.uint16))
    memmap = np.memmap(_write_raw(tmp_path / "m.bin", ids, np.uint16), dtype=np.uint16, mode="r")
    for source in (tmp_path / "t.npy", str(tmp_path / "t.npy"), ids.astype(np.uint16), memmap,
                   torch.from_numpy(ids), torch.from_numpy(ids.astype(np.int32))):
        ds = TokenWindows(source, 16, stride=5)
        _assert_item(ds, 7, ids, 35)
        _assert_item(ds, len(ds) - 1, ids, (len(ds) - 1) * 5)


def test_array_stored_in_a_narrower_dtype(tmp_path: Path) -> None:
    ids = _ids(200)
    ds = TokenWindows(ids, 9, dtype=np.uint16)
    assert ds.token_dtype == torch.uint16 and ds.nbytes == 400
    _assert_item(ds, 4, ids, 36)


def test_windows_never_cross_shards_unless_concatenated(tmp_path: Path) -> None:
    a, b = _ids(100, seed=1), _ids(70, seed=2)
    paths = [write_shard(tmp_path / "s_000.bin", a), write_shard(tmp_path / "s_001.bin", b)]
    ds = TokenWindows(paths, 20)
    per_shard = [(100 - 21) // 20 + 1, (70 - 21) // 20 + 1]
    assert len(ds) == sum(per_shard)
    for i in range(per_shard[0]):
        _assert_item(ds, i, a, 20 * i)
    for j in range(per_shard[1]):
        _assert_item(ds, per_shard[0] + j, b, 20 * j)
    by_glob = TokenWindows(str(tmp_path / "s_*.bin"), 20)
    assert len(by_glob) == len(ds) and torch.equal(by_glob[per_shard[0]][0], ds[per_shard[0]][0])
    joined = TokenWindows(paths, 20, concatenate=True)
    both = np.concatenate([a, b])
    assert len(joined) == (170 - 21) // 20 + 1
    _assert_item(joined, 4, both, 80)  # tokens 80..100: crosses into the second shard
    # the flat buffer the loader caches is the shards' tokens, joined
    assert torch.equal(joined.tokens().to(torch.int64), torch.from_numpy(both))


def test_torch_dataloader_serves_it_unchanged(tmp_path: Path) -> None:
    ids = _ids(1000)
    ds = TokenWindows(write_shard(tmp_path / "a.bin", ids), 32)
    x, y = next(iter(DataLoader(ds, batch_size=4)))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[1], torch.from_numpy(ids[32:64])) and torch.equal(y[1], torch.from_numpy(ids[33:65]))


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True, "8"])
def test_bad_seq_len(seq_len: object) -> None:
    with pytest.raises(ValueError, match=r"seq_len=.* must be a positive int"):
        TokenWindows(_ids(100), seq_len)  # type: ignore[arg-type]


@pytest.mark.parametrize("stride", [0, -1, 1.5])
def test_bad_stride(stride: object) -> None:
    with pytest.raises(ValueError, match=r"stride=.* must be a positive int"):
        TokenWindows(_ids(100), 8, stride=stride)  # type: ignore[arg-type]


def test_stride_and_seq_len_longer_than_a_shard(tmp_path: Path) -> None:
    short = write_shard(tmp_path / "short.bin", _ids(30))
    long = write_shard(tmp_path / "long.bin", _ids(300))
    with pytest.raises(TokenFileError, match=r"short\.bin: 30 tokens is shorter than one window \(seq_len \+ 1 = 41\)"):
        TokenWindows([long, short], 40)
    TokenWindows([long, short], 40, concatenate=True)  # joined, the windows fit
    with pytest.raises(TokenFileError, match=r"short\.bin: stride=31 is larger than the shard \(30 tokens\)"):
        TokenWindows([long, short], 10, stride=31)


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    good = write_shard(tmp_path / "good.bin", _ids(100))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(data[:-6])
    with pytest.raises(TokenFileError,
                       match=r"truncated\.bin: the header says 100 tokens of uint16 .* but the file has"):
        TokenWindows(truncated, 8)
    wrong_magic = tmp_path / "magic.bin"
    header = np.frombuffer(data[:HEADER_BYTES], dtype=np.int32).copy()
    header[0] = 12345
    wrong_magic.write_bytes(header.tobytes() + data[HEADER_BYTES:])
    with pytest.raises(TokenFileError, match=r"magic\.bin: not a token shard \(magic 12345"):
        TokenWindows(wrong_magic, 8)
    version = tmp_path / "version.bin"
    header[0], header[1] = 20240520, 2
    version.write_bytes(header.tobytes() + data[HEADER_BYTES:])
    with pytest.raises(TokenFileError, match=r"version\.bin: shard version 2 with magic 20240520"):
        TokenWindows(version, 8)
    empty = write_shard(tmp_path / "empty.bin", np.zeros(0, dtype=np.uint16))
    with pytest.raises(TokenFileError, match=r"empty\.bin: the shard holds no tokens"):
        TokenWindows([good, empty], 8)
    raw_empty = tmp_path / "raw_empty.bin"
    raw_empty.write_bytes(b"")
    with pytest.raises(TokenFileError, match=r"raw_empty\.bin: the shard holds no tokens"):
        TokenWindows(raw_empty, 8, dtype="uint16")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(TokenFileError, match=r"odd\.bin: 3 bytes is not a whole number of uint16 ids"):
        TokenWindows(odd, 1, dtype="uint16")
    with pytest.raises(TokenFileError,
                       match=r"good\.bin: the header \(magic 20240520\) says uint16 ids, not dtype=uint32"):
        TokenWindows(good, 8, dtype="uint32")
    with pytest.raises(TokenFileError, match=r"missing\.bin: cannot open token file"):
        TokenWindows(tmp_path / "missing.bin", 8)
    with pytest.raises(TokenFileError, match=r"nothing_\*\.bin: no token files match"):
        TokenWindows(str(tmp_path / "nothing_*.bin"), 8)
    np.save(tmp_path / "floats.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(TokenFileError, match=r"floats\.npy: a token \.npy holds a 1-D integer array"):
        TokenWindows(tmp_path / "floats.npy", 2)


def test_ids_that_the_dtype_cannot_hold(tmp_path: Path) -> None:
    big = np.array([1, 2, 70_000, 3] * 10, dtype=np.int64)
    with pytest.raises(TokenFileError, match=r"token id 70000 does not fit dtype uint16"):
        TokenWindows(big, 4, dtype="uint16")
    with pytest.raises(TokenFileError, match=r"shard\.bin: token id 70000 does not fit dtype uint16"):
        write_shard(tmp_path / "shard.bin", big)
    with pytest.raises(TokenFileError, match=r"token id -1 is negative"):
        TokenWindows(torch.tensor([0, 1, -1, 2, 3, 4]), 2)
    with pytest.raises(TokenFileError, match=r"has dtype torch.float32; token ids are integers"):
        TokenWindows(torch.zeros(10), 2)
    with pytest.raises(TokenFileError, match=r"token ids are a 1-D array; got shape \(2, 5\)"):
        TokenWindows(np.zeros((2, 5), dtype=np.int64), 2)
    with pytest.raises(TypeError, match="TokenWindows takes a token file"):
        TokenWindows(12, 2)  # type: ignore[arg-type]


def test_a_file_that_changes_is_caught(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "grows.bin", _ids(100))
    ds = TokenWindows(path, 8)
    ds.check_unchanged()
    write_shard(path, _ids(120))
    with pytest.raises(TokenFileError,
                       match=r"grows\.bin: the token file changed since it was opened \(1224 -> 1264 bytes"):
        ds.check_unchanged()


def test_index_out_of_range() -> None:
    ds = TokenWindows(_ids(100), 9)
    with pytest.raises(IndexError, match="window index 11 is out of range for 11 windows"):
        ds[11]


def test_uint64_ids_need_a_conversion() -> None:
    ids = np.arange(100, dtype=np.uint64)
    with pytest.raises(TokenFileError, match="uint64 ids are not supported; pass dtype='int64'"):
        TokenWindows(ids, 8)
    _assert_item(TokenWindows(ids, 8, dtype="int64"), 2, ids.astype(np.int64), 16)


def test_dtype_as_torch_dtype_or_name() -> None:
    ids = _ids(100)
    for dtype in (torch.uint16, "uint16", np.uint16):
        assert TokenWindows(ids, 8, dtype=dtype).token_dtype == torch.uint16
    with pytest.raises(TypeError, match="dtype=torch.float32 cannot hold token ids"):
        TokenWindows(ids, 8, dtype=torch.float32)


def test_more_bad_sources_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(TypeError,
                       match=r"^dtype='tokens' is not a dtype; token ids take uint16, uint32, int32 or int64$"):
        TokenWindows(_ids(100), 8, dtype="tokens")
    with pytest.raises(TypeError, match=r"^dtype=float32 cannot hold token ids; use an integer dtype"):
        TokenWindows(_ids(100), 8, dtype="float32")
    (tmp_path / "broken.npy").write_bytes(b"\x93NUMPY not really")
    with pytest.raises(TokenFileError, match=rf"^{tmp_path / 'broken.npy'}: not a readable \.npy file \("):
        TokenWindows(str(tmp_path / "broken.npy"), 8)
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(TokenFileError, match=rf"^{tmp_path / 'ids.npy'}: holds uint16 ids, not the dtype=uint32 "
                       "asked for$"):
        TokenWindows(str(tmp_path / "ids.npy"), 8, dtype="uint32")
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.int64))
    with pytest.raises(TokenFileError, match=rf"^{tmp_path / 'empty.npy'}: the shard holds no tokens$"):
        TokenWindows(str(tmp_path / "empty.npy"), 8)
    with pytest.raises(TokenFileError, match=r"has dtype float64; token ids are integers$"):
        TokenWindows(np.zeros(100), 8)
    with pytest.raises(TokenFileError, match=r"holds no tokens$"):
        TokenWindows(np.zeros(0, dtype=np.int64), 8)
    tensor = TokenWindows(torch.arange(100, dtype=torch.int32), 8, dtype="uint16")
    assert tensor.token_dtype == torch.uint16 and tensor[1][0].tolist() == list(range(8, 16))
    with pytest.raises(TokenFileError, match=r"^the shards hold ids of different dtypes \(.*\); shards: "):
        TokenWindows([write_shard(tmp_path / "a.bin", _ids(100)),
                      write_shard(tmp_path / "b.bin", _ids(100, high=70000), magic=20240801)], 8)


def test_a_shard_list_names_four_files_then_dots(tmp_path: Path) -> None:
    paths = [write_shard(tmp_path / f"s{i}.bin", _ids(100, seed=i)) for i in range(5)]
    paths.append(write_shard(tmp_path / "wide.bin", _ids(100, high=70000), magic=20240801))
    with pytest.raises(TokenFileError, match=r"shards: .*s0\.bin, .*s1\.bin, .*s2\.bin, .*s3\.bin \.\.\.$"):
        TokenWindows(paths, 8)


def test_a_file_that_goes_away_is_caught_and_a_tensor_index_works(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "gone.bin", _ids(100))
    ds = TokenWindows(path, 8)
    x, _ = ds[torch.tensor(2)]
    assert torch.equal(x, ds[2][0])
    Path(path).unlink()
    with pytest.raises(TokenFileError, match=r"gone\.bin: the token file went away since it was opened \(No such file"):
        ds.check_unchanged()


@pytest.mark.gpu
def test_token_ids_on_the_gpu_are_read_from_a_host_copy() -> None:
    ids = _ids(100)
    ds = TokenWindows(torch.from_numpy(ids).cuda(), 8)
    _assert_item(ds, 3, ids, 24)
    assert ds.tokens().device.type == "cpu"
