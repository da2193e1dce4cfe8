"""Token windows: the flat token buffer is cached, and a batch is one gather of its windows.

``detect`` recognises a :class:`gpuload.TokenWindows` served with the default collate_fn. The
cache holds the flat buffer of token ids (``num_tokens x itemsize`` bytes, never the windows,
which overlap when ``stride < seq_len + 1``). At the first epoch the cache plan places it:

- on a CUDA device, in the device tier when the buffer fits the budget (``TieredArrayStore``
  over :class:`TokenRows`: the buffer viewed, without a copy, as rows of a few hundred tokens,
  so the store's per-row bookkeeping stays small, 9 bytes per row, for billions of tokens): a
  batch gathers the rows its windows span, then on the device one index computation
  ``offsets[:, None] + arange(seq_len + 1)`` (offsets within the rows) and one gather cut the
  windows, and the ids are widened to int64;
- else on the host: the buffer in RAM (a memmapped file read once when the host budget holds
  it, else its pages as the OS caches them), each batch's windows gathered straight into the
  prefetcher's pinned slot, copied as the token dtype and widened on the device;
- on a CPU device, the buffer itself, in place (no copy); with ``cache="off"`` too, through the
  prefetcher's slots only when ``prefetch_depth`` asks for it.

uint16 and uint32 ids move as the same-width signed bit pattern (torch lacks their gather
kernels) and are widened with a mask. Nothing runs per window in Python.

Ranks of a torch.distributed job each keep the whole buffer (``cache_scope`` node/world is not
split, see :data:`PER_RANK_REASON`): token data is small next to the device (10B uint16 tokens
are 20 GB) and a split would make every step a collective moving ``batch x (seq_len + 1)`` ids
per rank, where a per-rank copy moves nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import default_collate, default_convert

from gpuload.cache import CachePlan, Store, TieredArrayStore, format_bytes
from gpuload.cache.array_store import gatherable
from gpuload.datasets.tokens import TokenWindows, widen
from gpuload.device import device_memory, host_memory
from gpuload.distributed.split_store import decline_split, split_context
from gpuload.prefetch import Fill, TensorSpec, default_depth
from gpuload.sampling import in_range
from gpuload.sources import Indices, Schedule, Setup, Source, Work
from gpuload.sources.placed_arrays import staged_copier
from gpuload.transfer import to_device

__all__ = ["PER_RANK_REASON", "TokenRows", "TokenSource", "buffer_stats", "detect", "row_tokens"]

PER_RANK_REASON = (
    "token windows keep a whole copy of the token buffer per rank: it is small next to the device "
    "(ids, not windows), and a copy split over ranks would make every batch a collective exchanging "
    "batch x (seq_len + 1) ids"
)
_CLOSED = "this gpuload.DataLoader was closed; iterate a new loader instead"


def row_tokens(seq_len: int, num_tokens: int) -> int:
    """Tokens per row of the row store: the power of two at most half a window, at least 256
    (all of them when fewer)."""
    return min(max(256, 1 << (((seq_len + 1) // 2).bit_length() - 1)), num_tokens)


class TokenRows:
    """The flat buffer as ``(rows, row_tokens)`` for a row store (a view: no copy) and its tail.

    A window of ``seq_len + 1`` tokens starting anywhere spans at most ``span`` consecutive
    rows. ``row_tokens`` is the power of two at most half a window (at least 256), so a batch
    gathers at most 2x its windows' tokens, and the store keeps 9 bytes per row (10B tokens at
    seq_len 1024: 176 MiB of host bookkeeping, against 90 GiB with one row per token). The last
    ``num_tokens % row_tokens`` tokens do not fill a row and are kept apart (``tail``).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.row_tokens = row_tokens(seq_len, tokens.numel())
        self.full_rows = tokens.numel() // self.row_tokens
        self.rows = tokens[: self.full_rows * self.row_tokens].view(self.full_rows, self.row_tokens)
        self.tail = tokens[self.full_rows * self.row_tokens :]
        self.span = (seq_len + self.row_tokens - 1) // self.row_tokens + 1
        self.reach = torch.arange(self.span, dtype=torch.long)

    def rows_of(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows each window spans, ``(batch, span)`` clamped to the full rows, and where the
        tail row stands in (None when no window reaches it)."""
        rows = (offsets // self.row_tokens)[:, None] + self.reach
        beyond = rows >= self.full_rows
        if self.tail.numel() and bool(beyond.any()):
            return rows.clamp_(max=self.full_rows - 1), beyond
        return rows.clamp_(max=self.full_rows - 1), None


def buffer_stats(notes: dict[str, Any], store: TieredArrayStore | None) -> dict[str, Any]:
    """``loader.stats.extra`` of a source caching a flat token buffer: its notes, and its store's
    counters and plan when it has one."""
    found: dict[str, Any] = {"tokens": dict(notes)}
    if store is not None:
        found["cache"] = store.stats.as_dict()
        found["cache_plan"] = store.plan.describe()
    return found


def detect(setup: Setup) -> TokenSource | None:
    """A TokenSource for a :class:`TokenWindows` (not a subclass that changes its items) served
    with torch's default collation, else None (torch's path serves it as any dataset)."""
    dataset = setup.dataset
    if not isinstance(dataset, TokenWindows) or type(dataset).__getitem__ is not TokenWindows.__getitem__:
        return None
    if not setup.map_style or setup.collate_fn not in (default_collate, default_convert) or setup.transforms:
        return None
    if setup.worker_code:
        return None  # a worker_init_fn asks for worker processes: torch's path runs it
    sample = dataset[0]
    template = setup.collate_fn([sample]) if setup.batched else setup.collate_fn(sample)
    leaves, spec = tree_flatten(template)  # default_collate of one unbatched (x, y) stacks them: one leaf
    if len(leaves) != 2 or not all(isinstance(leaf, torch.Tensor) and leaf.dtype == torch.int64 for leaf in leaves):
        return None
    return TokenSource(setup, dataset, spec)


class TokenSource(Source):
    """Batches of ``(x, y)`` windows gathered from the cached flat token buffer."""

    def __init__(self, setup: Setup, dataset: TokenWindows, spec: Any) -> None:
        super().__init__(setup)
        self.dataset = dataset
        self.spec = spec
        self.window = torch.arange(dataset.seq_len + 1, dtype=torch.long)
        self.store: TieredArrayStore | None = None
        self.rows: TokenRows | None = None  # the store's view of the buffer
        self.tail: torch.Tensor | None = None  # the tail row, padded, on the device
        self.window_device: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None  # host or in-place buffer (signed view)
        self.staged = False  # batches go through the prefetcher's pinned slots
        self.notes: dict[str, Any] = {}

    # -- placement ---------------------------------------------------------------------

    def _placed(self) -> bool:
        return self.store is not None or self.buffer is not None

    def _place(self) -> None:
        setup, dataset = self.setup, self.dataset
        device, settings = setup.device, setup.settings
        tokens = dataset.tokens()
        nbytes = dataset.nbytes
        self.notes = {"token_bytes": nbytes, "tokens": dataset.num_tokens, "windows": len(dataset)}
        if split_context(settings, device) is not None:
            decline_split(settings, PER_RANK_REASON, stacklevel=6)
            self.notes["cache_scope"] = "rank: " + PER_RANK_REASON
        if settings.mode.value == "off":  # batches gathered from the source (on a CPU device too)
            self.buffer, self.staged, self.path = gatherable(tokens), True, "host-gather"
            return
        if device.type == "cpu":
            self.buffer, self.staged, self.path = gatherable(tokens), False, "device-gather"
            return
        rows = TokenRows(tokens, dataset.seq_len)
        row_bytes = rows.row_tokens * tokens.element_size()
        plan = settings.array_plan(
            row_bytes, rows.full_rows, device_memory(device), host_memory(), device=device, owner=setup.owner
        )
        self.notes["cache_plan"] = plan.describe()
        self.notes["row_tokens"] = rows.row_tokens
        if plan.device_samples > 0:
            self.place_rows(rows, plan)
            return
        if plan.host_samples >= rows.full_rows and len(dataset.shards) == 1 and dataset.shards[0].path is not None:
            tokens = tokens.clone()  # the file read once into the host tier (several shards are joined already)
            self.path = "host-gather (host tier)"
        else:
            self.path = "host-gather"
            if plan.host_samples < rows.full_rows:
                self.notes["cache"] = (
                    f"the token buffer ({format_bytes(nbytes)}) fits no cache tier; read from the source"
                )
        self.buffer, self.staged = gatherable(tokens), True

    def place_rows(self, rows: TokenRows, plan: CachePlan) -> None:
        """Serve from a row store placed by ``plan`` (device tier first), the tail row beside it."""
        device = self.setup.device
        self.store = TieredArrayStore(rows.rows, plan, device, owner=self.setup.owner, staging=self.setup.staging)
        self.rows = rows
        tail = torch.zeros(rows.row_tokens, dtype=rows.rows.dtype)
        tail[: rows.tail.numel()] = rows.tail
        self.tail = gatherable(tail).to(device)
        self.window_device = self.window.to(device)
        tail_bytes = tail.numel() * tail.element_size() if device.type != "cpu" else 0
        self.h2d_bytes += self.store.stats.device_bytes + tail_bytes
        whole = self.store.stats.device_samples == rows.full_rows
        self.path, self.staged = ("device-gather" if whole else f"tiered ({plan.kind})"), False

    def begin_epoch(self) -> None:
        self.dataset.check_unchanged()
        if not self._placed():
            self._place()
        elif self.store is not None:
            self.store.shrink_to_reserve(self.setup.settings.keepable)

    def warm(self, progress: bool) -> None:
        self.dataset.check_unchanged()
        if not self._placed():
            self._place()

    # -- batches -----------------------------------------------------------------------

    def _offsets(self, indices: Any, checked: bool) -> torch.Tensor:
        """The first token of each window in ``indices`` (checked as torch's fetch checks them)."""
        if not self._placed():
            raise RuntimeError(_CLOSED)
        windows = indices if checked else in_range(indices, len(self.dataset))
        if windows.numel() == 0:
            raise IndexError("list index out of range")  # torch collates an empty list, which fails so
        return self.dataset.offsets(windows)

    def _flat(self, indices: Any, checked: bool) -> tuple[torch.Tensor, int]:
        """The token positions of the windows ``indices``, flat, and the window count."""
        offsets = self._offsets(indices, checked)
        return (offsets[:, None] + self.window).reshape(-1), offsets.numel()

    def _from_store(self, indices: Any, checked: bool, copy: Any) -> tuple[torch.Tensor, int]:
        """The windows' ids (signed view) on the device: their rows gathered from the store (rows
        in host memory copied by ``copy``, the loader's staging), then the windows cut from the
        rows by one gather on the device."""
        rows, store, tail, window, device = self.rows, self.store, self.tail, self.window_device, self.setup.device
        if rows is None or store is None or tail is None or window is None:  # closed meanwhile by another thread
            raise RuntimeError(_CLOSED)
        offsets = self._offsets(indices, checked)
        count = offsets.numel()
        row_index, beyond = rows.rows_of(offsets)
        gathered = store.gather(row_index.reshape(-1), copy=staged_copier(copy))
        block = gatherable(gathered).view(count, rows.span, rows.row_tokens)
        start, *tail_rows = to_device([offsets % rows.row_tokens, *([] if beyond is None else [beyond])], device,
                                      self.setup.staging)
        if tail_rows:  # windows reaching into the tail, which fills no whole row
            block = torch.where(tail_rows[0][:, :, None], tail, block)
        ids = block.view(count, -1).gather(1, start[:, None] + window)
        return ids, count

    def _batch(self, ids: torch.Tensor, count: int) -> Any:
        """``(x, y)`` int64 on the device, in the collated structure, from ``count`` windows of ids."""
        block = ids.view(self.dataset.token_dtype).view(count, -1)  # the buffer's signed view back
        x, y = widen(block[:, :-1]), widen(block[:, 1:])
        if not self.setup.batched:
            x, y = x[0], y[0]
        return tree_unflatten([x, y], self.spec)

    def _gather_here(self, indices: Any, checked: bool, copy: Any) -> tuple[Any, int]:
        if self.store is not None:
            ids, count = self._from_store(indices, checked, copy)
        elif self.buffer is not None and self.buffer.device != self.setup.device:  # host buffer, loop's thread
            count = torch.as_tensor(indices).numel()
            ids = copy(self._fill(indices))  # through the loader's staging, which counts the bytes
        else:  # the buffer in place, or none: closed meanwhile by another thread, which _flat names
            flat, count = self._flat(indices, checked)
            buffer = self.buffer
            if buffer is None:  # closed by another thread after _flat's check
                raise RuntimeError(_CLOSED)
            ids = buffer.index_select(0, flat)
        return self._batch(ids, count), count

    def _fill(self, indices: Any) -> Fill:
        flat, count = self._flat(indices, False)
        buffer = self.buffer
        if buffer is None:  # closed after _flat's check
            raise RuntimeError(_CLOSED)

        def gather_into(slot: torch.Tensor) -> None:
            torch.index_select(buffer, 0, flat, out=slot)

        return Fill(TensorSpec((flat.numel(),), buffer.dtype), gather_into)

    def schedule(self, indices: Indices) -> Schedule:
        """Host buffers run ahead, their windows staged (on a CPU device only when
        ``prefetch_depth`` asks: in place there); the device tier is served in the loop."""
        row = (self.dataset.seq_len + 1) * (self.buffer.element_size() if self.buffer is not None else 8)
        return Schedule(lambda ahead: self._work(indices, ahead), ahead=self.staged, ahead_on_cpu=False,
                        depth=default_depth(row * (self.setup.batch_size or 1)))

    def _work(self, request: Indices, ahead: bool) -> Work:
        indices = request.batches(ahead)
        if not ahead:
            return Work(indices, lambda index: self._gather_here(index, request.in_range, request.copy_now))
        drawn = list(indices)
        fills = (self._fill(index) for index in drawn)
        counts = iter([torch.as_tensor(index).numel() for index in drawn])

        def finish(ids: torch.Tensor) -> tuple[Any, int]:
            count = next(counts)
            return self._batch(ids, count), count

        return Work(fills, finish)

    # -- memory and counters -----------------------------------------------------------

    def cache_store(self) -> Store | None:
        """The row store of the token buffer (None when the buffer is served without one)."""
        return self.store

    def stats(self) -> dict[str, Any]:
        return buffer_stats(self.notes, self.store)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store, self.rows, self.tail, self.window_device = None, None, None, None
        self.buffer, self.staged = None, False
