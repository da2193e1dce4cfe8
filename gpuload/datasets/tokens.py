"""TokenWindows: a flat array of token ids cut into next-token windows, as LLM pretraining reads it.

Item ``i`` is ``(x, y)``: ``x = tokens[o : o + seq_len]`` and ``y = tokens[o + 1 : o + seq_len + 1]``
as int64, where ``o`` is window ``i``'s first token. It is a plain map-style Dataset, so torch's
DataLoader serves it unchanged; ``gpuload.DataLoader`` recognises it and keeps only the flat
token buffer in its cache (``gpuload.sources.tokens``), never the expanded windows.

Files: raw token files (``.bin`` without a header; ``dtype=`` says their width), ``.npy``, and
the shards of llm.c and the nanoGPT speedrun repositories: 256 int32 header values (magic,
version, token count), then the tokens (magic 20240520 version 1: uint16, GPT-2; magic 20240801
version 7: uint32, Llama 3).
"""

from __future__ import annotations

import glob as globbing
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["HEADER_FORMATS", "Shard", "TokenFileError", "TokenWindows", "read_shard", "shard_paths", "write_shard"]

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
#: Shard header magic -> (version, token dtype), as llm.c's ``dev/data/data_common.py`` writes them.
HEADER_FORMATS: dict[int, tuple[int, np.dtype]] = {
    20240520: (1, np.dtype(np.uint16)),  # GPT-2 tokens (also modded-nanogpt's fineweb shards)
    20240801: (7, np.dtype(np.uint32)),  # Llama 3 tokens
}

TokenSource = str | os.PathLike | Sequence[str | os.PathLike] | np.ndarray | torch.Tensor


class TokenFileError(ValueError):
    """A token file (or array) that cannot be read as the tokens it claims to hold."""


@dataclass(frozen=True)
class Shard:
    """One shard's tokens (a memmap, array or CPU tensor) and what names it in errors."""

    name: str
    tokens: np.ndarray | torch.Tensor
    path: str | None = None
    size: int = -1  # the file's bytes when opened (-1: not a file)
    mtime_ns: int = -1

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


_TORCH_TO_NUMPY = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.uint16: np.uint16,
                   torch.int32: np.int32, torch.uint32: np.uint32, torch.int64: np.int64}


def _dtype(value: Any) -> np.dtype:
    """``value`` (a numpy or torch dtype, or its name) as an integer numpy dtype."""
    if isinstance(value, torch.dtype):
        if value not in _TORCH_TO_NUMPY:
            raise TypeError(f"dtype={value} cannot hold token ids; use an integer dtype (uint16, uint32, int32, int64)")
        value = _TORCH_TO_NUMPY[value]
    try:
        dtype = np.dtype(value)
    except TypeError as error:
        raise TypeError(f"dtype={value!r} is not a dtype; token ids take uint16, uint32, int32 or int64") from error
    if dtype.kind not in "iu":
        raise TypeError(f"dtype={dtype} cannot hold token ids; use an integer dtype (uint16, uint32, int32, int64)")
    return dtype


def write_shard(path: str | os.PathLike, tokens: Any, magic: int = 20240520) -> Path:
    """Write ``tokens`` as an llm.c / nanoGPT-speedrun shard (256 int32 header, then the ids).

    ``magic`` picks the format (20240520: uint16, 20240801: uint32); ids that the format's
    dtype cannot hold raise a :class:`TokenFileError` naming the file.
    """
    version, dtype = HEADER_FORMATS[magic]
    ids = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).reshape(-1)
    _check_range(ids, dtype, str(path))
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (magic, version, ids.size)
    path = Path(path)
    with open(path, "wb") as file:
        file.write(header.tobytes())
        file.write(ids.astype(dtype, copy=False).tobytes())
    return path


def _check_range(ids: np.ndarray | torch.Tensor, dtype: np.dtype, name: str) -> None:
    """Fail when ``dtype`` cannot hold every id of ``ids`` (or an id is negative)."""
    if len(ids) == 0:
        return
    if isinstance(ids, torch.Tensor):
        low, high = (int(v) for v in torch.aminmax(ids))
    else:
        low, high = int(ids.min()), int(ids.max())
    info = np.iinfo(dtype)
    if low < 0:
        raise TokenFileError(f"{name}: token id {low} is negative; token ids are >= 0")
    if high > info.max:
        raise TokenFileError(
            f"{name}: token id {high} does not fit dtype {dtype} (at most {info.max}); use a wider dtype"
        )


def read_shard(path: str | os.PathLike, dtype: Any = None) -> Shard:
    """Open one token file as a read-only memmap (nothing read yet): a headered shard, ``.npy``,
    or a raw file of ``dtype`` ids. Every inconsistency raises a :class:`TokenFileError`
    naming the file."""
    name = os.fspath(path)
    try:
        stat = os.stat(name)
    except OSError as error:
        raise TokenFileError(f"{name}: cannot open token file ({error.strerror})") from error
    if name.endswith(".npy"):
        try:
            array = np.load(name, mmap_mode="c")
        except (ValueError, OSError) as error:
            raise TokenFileError(f"{name}: not a readable .npy file ({error})") from error
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise TokenFileError(
                f"{name}: a token .npy holds a 1-D integer array; this one is {array.dtype} of shape {array.shape}"
            )
        tokens: np.ndarray = array
        if dtype is not None and _dtype(dtype) != array.dtype:
            raise TokenFileError(f"{name}: holds {array.dtype} ids, not the dtype={_dtype(dtype)} asked for")
    else:
        tokens = _read_bin(name, stat.st_size, dtype)
    if len(tokens) == 0:
        raise TokenFileError(f"{name}: the shard holds no tokens")
    return Shard(name, tokens, name, stat.st_size, stat.st_mtime_ns)


def _read_bin(name: str, size: int, dtype: Any) -> np.ndarray:
    magic = None
    if size >= HEADER_BYTES:
        header = np.fromfile(name, dtype="<i4", count=HEADER_INTS)
        magic = int(header[0])
    if magic in HEADER_FORMATS:
        version, token_dtype = HEADER_FORMATS[magic]
        if int(header[1]) != version:
            raise TokenFileError(
                f"{name}: shard version {int(header[1])} with magic {magic}; this format is version {version}"
            )
        count = int(header[2])
        expected = HEADER_BYTES + count * token_dtype.itemsize
        if count < 0 or expected != size:
            raise TokenFileError(
                f"{name}: the header says {count} tokens of {token_dtype} ({expected} bytes with the header) "
                f"but the file has {size} bytes; it is truncated or not a token shard"
            )
        if dtype is not None and _dtype(dtype) != token_dtype:
            raise TokenFileError(
                f"{name}: the header (magic {magic}) says {token_dtype} ids, not dtype={_dtype(dtype)}"
            )
        if count == 0:
            raise TokenFileError(f"{name}: the shard holds no tokens (header count 0)")
        return np.memmap(name, dtype=token_dtype, mode="c", offset=HEADER_BYTES, shape=(count,))
    if dtype is None:
        known = ", ".join(f"{m} ({v[1]})" for m, v in HEADER_FORMATS.items())
        found = f"magic {magic}" if magic is not None else f"only {size} bytes, no header"
        raise TokenFileError(
            f"{name}: not a token shard ({found}; known magics: {known}); for a raw token file "
            "(nanoGPT's train.bin) pass dtype=, e.g. dtype='uint16'"
        )
    token_dtype = _dtype(dtype)
    if size == 0:
        raise TokenFileError(f"{name}: the shard holds no tokens (empty file)")
    if size % token_dtype.itemsize:
        raise TokenFileError(
            f"{name}: {size} bytes is not a whole number of {token_dtype} ids; is dtype={token_dtype} right?"
        )
    return np.memmap(name, dtype=token_dtype, mode="c", shape=(size // token_dtype.itemsize,))


def _from_array(array: np.ndarray | torch.Tensor, dtype: Any) -> Shard:
    name = f"the {type(array).__name__} of tokens"
    if array.ndim != 1:
        raise TokenFileError(f"{name}: token ids are a 1-D array; got shape {tuple(array.shape)}")
    if isinstance(array, torch.Tensor):
        if array.dtype.is_floating_point or array.dtype.is_complex or array.dtype == torch.bool:
            raise TokenFileError(f"{name}: has dtype {array.dtype}; token ids are integers")
        array = array.detach()
        if array.device.type != "cpu":
            array = array.cpu()
    elif array.dtype.kind not in "iu":
        raise TokenFileError(f"{name}: has dtype {array.dtype}; token ids are integers")
    if len(array) == 0:
        raise TokenFileError(f"{name}: holds no tokens")
    if dtype is not None:
        wanted = _dtype(dtype)
        _check_range(array, wanted, name)
        if isinstance(array, torch.Tensor):
            array = array.numpy()
        array = np.ascontiguousarray(array, dtype=wanted)
    elif not isinstance(array, np.memmap) and (isinstance(array, torch.Tensor) or array.dtype.kind == "i"):
        # negative ids in memory are caught here; a memmap is not read whole just to check it
        _check_range(array, np.dtype(np.int64), name)
    if array.dtype in (np.uint64, torch.uint64):
        raise TokenFileError(f"{name}: uint64 ids are not supported; pass dtype='int64' (or narrower) to convert them")
    return Shard(name, array)


def shard_paths(source: Any) -> list[str] | None:
    """The token files ``source`` names (a path, a glob of shards, a list of paths), sorted for a
    glob; None when it names none (an array). ``gpuload plan`` reads a glob as this does."""
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if any(ch in name for ch in "*?["):
            found = sorted(globbing.glob(name))
            if not found:
                raise TokenFileError(f"{name}: no token files match this pattern")
            return found
        return [name]
    if isinstance(source, (list, tuple)) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
        return [os.fspath(p) for p in source]
    return None


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token ids cut into windows of ``seq_len + 1``: item ``i`` is ``(x, y)``, int64, ``y`` = ``x``
    shifted by one token.

    ``source``: a token file, a list of files or a glob of shards, a 1-D NumPy array or memmap,
    or a 1-D tensor. ``stride`` (default ``seq_len``: every token used once per epoch) is the
    step between window starts. A window never crosses a shard boundary unless
    ``concatenate=True`` joins the shards into one stream. ``dtype``: the id width of raw
    ``.bin`` files (required for them), or a width to store arrays in (checked to hold them).
    """

    def __init__(
        self,
        source: TokenSource,
        seq_len: int,
        *,
        stride: int | None = None,
        dtype: Any = None,
        concatenate: bool = False,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int (tokens per input window)")
        stride = seq_len if stride is None else stride
        if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride <= 0:
            raise ValueError(f"stride={stride!r} must be a positive int (tokens between window starts)")
        self.seq_len, self.stride, self.concatenate = int(seq_len), int(stride), bool(concatenate)
        self.shards, self.token_dtype = open_shards(source, dtype, "TokenWindows")
        lengths = [len(shard) for shard in self.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self.shard_starts[-1])
        spans = [(0, self.num_tokens, "the concatenated shards")] if concatenate else [
            (int(self.shard_starts[i]), lengths[i], shard.name) for i, shard in enumerate(self.shards)
        ]
        window = self.seq_len + 1
        counts = []
        for _, length, name in spans:
            if length < window:
                raise TokenFileError(
                    f"{name}: {length} tokens is shorter than one window (seq_len + 1 = {window}); "
                    "use a smaller seq_len" + ("" if concatenate else ", or concatenate=True to join the shards")
                )
            if self.stride > length:
                raise TokenFileError(f"{name}: stride={self.stride} is larger than the shard ({length} tokens)")
            counts.append((length - window) // self.stride + 1)
        #: First token of each span (shard) and the first window index in it.
        self.span_starts = torch.tensor([start for start, _, _ in spans], dtype=torch.long)
        self.window_starts = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.long)
        self._length = int(self.window_starts[-1])
        self._joined: torch.Tensor | None = None

    def __len__(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes of the flat token buffer (what a cache holds), not of the expanded windows."""
        return self.num_tokens * torch.empty((), dtype=self.token_dtype).element_size()

    def offsets(self, indices: torch.Tensor) -> torch.Tensor:
        """First token (in the flat buffer of all shards) of each window in ``indices`` (int64,
        in ``[0, len)``), computed for all at once."""
        if len(self.span_starts) == 1:
            return indices * self.stride
        span = torch.searchsorted(self.window_starts, indices, right=True) - 1
        return self.span_starts[span] + (indices - self.window_starts[span]) * self.stride

    def tokens(self) -> torch.Tensor:
        """The flat token buffer as a 1-D CPU tensor: the one shard's memory itself (a memmap is
        not read), or the shards joined into one host copy."""
        if self._joined is None:
            self._joined = joined_tokens(self.shards)
        return self._joined

    def check_unchanged(self) -> None:
        """Fail, naming the file, when a shard file changed size or was rewritten since it was
        opened: its memmap (or a cache of it) would serve other tokens than the file holds."""
        check_unchanged(self.shards, "TokenWindows")

    def window(self, index: int) -> np.ndarray | torch.Tensor:
        """The ``seq_len + 1`` ids of window ``index`` as stored (no widening)."""
        length = self._length
        if not -length <= index < length:
            raise IndexError(f"window index {index} is out of range for {length} windows")
        index %= length
        start = int(self.offsets(torch.tensor([index]))[0])
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        local = start - int(self.shard_starts[shard])
        end = local + self.seq_len + 1
        if end <= len(self.shards[shard]):
            return self.shards[shard].tokens[local:end]
        return self.tokens()[start : start + self.seq_len + 1]  # concatenated: across a shard edge

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(index, torch.Tensor):
            index = int(index)
        ids = self.window(index)
        wide = widen(_as_tensor(ids).reshape(1, -1))[0]
        return wide[:-1], wide[1:]

    def __repr__(self) -> str:
        shards = f"{len(self.shards)} shards" if len(self.shards) > 1 else self.shards[0].name
        return (
            f"TokenWindows({shards}: {self.num_tokens} {str(self.token_dtype).replace('torch.', '')} tokens, "
            f"{self._length} windows of seq_len={self.seq_len}, stride={self.stride})"
        )


def check_unchanged(shards: Sequence[Shard], dataset: str) -> None:
    """Fail, naming the file, when a shard file changed size or was rewritten since it was
    opened; ``dataset`` names the class to build anew."""
    for shard in shards:
        if shard.path is None:
            continue
        try:
            stat = os.stat(shard.path)
        except OSError as error:
            raise TokenFileError(
                f"{shard.path}: the token file went away since it was opened ({error.strerror})"
            ) from error
        if stat.st_size != shard.size or stat.st_mtime_ns != shard.mtime_ns:
            raise TokenFileError(
                f"{shard.path}: the token file changed since it was opened ({shard.size} -> {stat.st_size} "
                f"bytes, or rewritten); build a new {dataset} (and DataLoader) for it"
            )


def _dtype_of(shard: Shard) -> torch.dtype:
    tokens = shard.tokens
    if isinstance(tokens, torch.Tensor):
        return tokens.dtype
    return {np.dtype(np.uint16): torch.uint16, np.dtype(np.uint32): torch.uint32}.get(
        tokens.dtype, None
    ) or torch.from_numpy(np.empty(0, dtype=tokens.dtype)).dtype


def open_shards(source: Any, dtype: Any, dataset: str) -> tuple[list[Shard], torch.dtype]:
    """The shards ``source`` names (files, a glob, a 1-D array or tensor) opened, and their one
    token dtype; ``dataset`` names the class taking them in errors."""
    paths = shard_paths(source)
    if paths is not None:
        shards = [read_shard(path, dtype) for path in paths]
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        shards = [_from_array(source, dtype)]
    else:
        raise TypeError(
            f"{dataset} takes a token file, a list or glob of shard files, a 1-D numpy array or "
            f"memmap, or a 1-D tensor; got {type(source).__name__}"
        )
    dtypes = {_dtype_of(shard) for shard in shards}
    if len(dtypes) > 1:
        listed = ", ".join(map(str, dtypes))
        more = " ..." if len(shards) > 4 else ""
        names = "shards: " + ", ".join(shard.name for shard in shards[:4]) + more
        raise TokenFileError(f"the shards hold ids of different dtypes ({listed}); {names}")
    return shards, dtypes.pop()


def joined_tokens(shards: Sequence[Shard]) -> torch.Tensor:
    """The shards' tokens as one 1-D CPU tensor: the one shard's memory itself (a memmap is not
    read), or several joined into one host copy."""
    if len(shards) == 1:
        return _as_tensor(shards[0].tokens)
    return torch.cat([_as_tensor(shard.tokens) for shard in shards])


def _as_tensor(tokens: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``tokens`` as a CPU tensor over the same memory (a memmap too: nothing is read or copied)."""
    if isinstance(tokens, torch.Tensor):
        return tokens
    with warnings.catch_warnings():
        # A read-only array (a user's memmap) is never written through this view.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(tokens)


# The masks that undo a signed view's sign extension when widening to int64.
_MASKS = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}
_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32}


def signed_view(ids: torch.Tensor) -> torch.Tensor:
    """uint16/uint32 ``ids`` as their same-width signed bit pattern (what gather kernels take),
    others as they are; ``widen(result.view(ids.dtype))`` reads them back."""
    signed = _SIGNED.get(ids.dtype)
    return ids if signed is None else ids.view(signed)


def widen(ids: torch.Tensor) -> torch.Tensor:
    """Token ids of any integer dtype as a new int64 tensor, on their device. uint16/uint32 are widened
    through their same-width signed bit pattern and a mask (torch lacks most unsigned kernels)."""
    signed = _SIGNED.get(ids.dtype)
    source = ids if signed is None else ids.view(signed)
    # always a new contiguous tensor: x and y of a batch never share memory (``y.view(-1)`` works)
    wide = source.to(torch.int64, copy=True, memory_format=torch.contiguous_format)
    return wide if signed is None else wide.bitwise_and_(_MASKS[signed])
